"""``FileExpertStore``: per-layer pools of expert slots filled from an expert directory.

The store joins parts that know nothing of each other, built in dependency order from
the resolved ``Runtime``: the slot tables and eviction policy (``slots``, ``policy``), the
device arrays (``pool``), the one reader (``readers``), the loads (``loads``), and the
paths that serve a call (``host_path``, ``device_path``). A patched MoE layer makes one
request per layer call, ``request(layer, indices)``, and gets back a ``LayerCall`` (plain
data): the slot ids to use where the host has no work, or steps, each made ready by
``step(call, i)``; ``finish(call, y)`` completes it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..format import ExpertMeta
from ..ids import SLOT_IDS_NP
from ..io.tier import tier_totals
from ..io.transfers import id_transfers
from ..mem import HostShare
from ..meta import load_meta
from ..options import StreamConfig, refuse_load_only
from ..runtime import Runtime, resolve
from .calls import LayerCall
from .counts import HitCounts, ResidentSet
from .device_path import DevicePath
from .driver import Driver
from .host_path import HostPath
from .loads import Loader
from .policy import make_policy
from .pool import LayerPool, capacities, default_slots, make_pools
from .readers import open_reader
from .recording import RoutingCounts
from .slots import SlotCache
from .stats import LayerStats, Timeline, stat_names, summarize


class FileExpertStore:
    """Bounded per-layer pools of experts, loaded on demand from an expert directory.

    Args:
        expert_dir: A directory written by ``split_model`` (or ``requantize``), or its
            already parsed ``ExpertMeta``.
        capacity: Slots per MoE layer, clipped to the layer's expert count (the seed's
            name for ``StreamConfig.slots``; default: half the experts, at least top-k).
        layer_caps: ``{layer: slots}`` overriding ``capacity`` for some layers.
        config: The streaming options (``StreamConfig``), resolved once into the
            store's ``runtime`` (``runtime.resolve``: pools, reader, mapping, decode
            path...); the store also reads ``record`` and ``clear_on_evict``.
        runtime: An already resolved ``Runtime`` (``load`` passes the one it printed).
        tick: Called after each layer's work as the store opens (a pipeline's ``Pace.tick``).
        host: This store's share of the host's memory (``mem.HostShare``: a pipeline's
            ranks on one host split it; the trunk's load beside a swap tier, and off
            CUDA an auto tier's KV cache: ``model_builder.host_reserve``).
        **options: Overrides of ``config``'s fields (e.g. ``policy="lru"``; the seed
            passes ``clear_on_evict`` and ``record``).

    ``clear_on_evict``: after a call that evicted experts, release MLX's buffer cache.
    ``record``: count how often each expert is routed to (for ``hot``). A record's
    checksum is checked when first read (``checksums``): a corrupt file fails on first use.

    Raises:
        ExpertDirError: missing or invalid directory, or a capacity below top-k.
        RuntimeChoiceError: an option forced where it cannot run (the message says why).
    """

    def __init__(
        self,
        expert_dir: str | ExpertMeta,
        capacity: int | None = None,
        layer_caps: dict | None = None,
        *,
        config: StreamConfig | None = None,
        runtime: Runtime | None = None,
        tick: Callable[[], None] | None = None,
        host: HostShare | None = None,
        **options,
    ):
        refuse_load_only(options, config, capacity)
        cfg = (config or StreamConfig()).replace(**options)
        meta = expert_dir if isinstance(expert_dir, ExpertMeta) else load_meta(expert_dir)
        self.meta, self.config = meta, cfg
        if capacity is None:
            capacity = default_slots(meta) if cfg.slots is None else cfg.slots
        caps = capacities(meta, capacity, layer_caps)
        rt = self.runtime = runtime or resolve(cfg, meta, slots=caps, host=host)
        self.expert_dir, self.top_k, self.policy_name = meta.root, meta.top_k, rt.policy
        n = {li: meta.layers[li].num_experts for li in caps}
        self.caches = {
            li: SlotCache(n[li], c, make_policy(rt.policy, n[li])) for li, c in caps.items()
        }
        self.stats = {li: LayerStats() for li in caps}
        self.zero_slot = rt.zero_slot
        self.pools = make_pools(meta, caps, rt.pool_mode, rt.zero_slot)
        self.pool_mode = rt.pool_mode
        self.reader, rt = open_reader(rt, cfg, meta, self.pools, tick, host)
        self.runtime = rt
        self.loads = Loader(
            meta, self.caches, self.pools, self.reader, self.stats, cfg.clear_on_evict
        )
        try:
            for li in self.caches if rt.reader == "tier" else ():  # its pools full from load
                self.loads.adopt(li, self.reader.tier.held[li])
                if tick is not None:
                    tick()
        except BaseException:
            self.reader.close()
            raise
        self.routing = RoutingCounts(n, on=cfg.record)
        self.observers: list[Callable] = []  # callables(layer, host_ids) seeing the routing
        self._watches: list[Callable[[], None]] = []  # called at each layer call
        self._driver = Driver()  # one thread drives the store
        self.timeline = Timeline()  # phases of layer calls, when recording
        transfers, why = id_transfers() if rt.pool_mode == "cuda" else (None, "")
        if why:  # the load line says the routing is read the usual way, and why
            rt = self.runtime = rt.revised({"ids": why})
        self.host = HostPath(
            self.caches, self.pools, self.stats, self.loads, self.routing, self.observers,
            self.timeline, transfers,
            late=not rt.prefetch,  # read-ahead guesses from the routing before the graph
        )  # fmt: skip
        self.device = None
        if rt.decode_path == "device":
            try:
                self.device = DevicePath(self.caches, self.pools, self.stats, self.reader)
            except BaseException:
                self.close()
                raise
        self.counts = HitCounts(self.caches, self.stats, self.device)
        self._published: dict = {}  # totals handed to other threads (publish, snapshot)
        self._published_lock = threading.Lock()
        self._resident = ResidentSet(self.pools, self.stats, self.counts)

    def watch(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` at every layer call (e.g. a pipeline's watch: this rank
        progresses)."""
        self._watches.append(fn)

    @property
    def layers(self) -> list[int]:
        return sorted(self.caches)

    def capacity(self, layer: int) -> int:
        return self.caches[layer].capacity

    def pool(self, layer: int) -> LayerPool:
        return self.pools[layer]

    @property
    def record(self) -> bool:
        """Whether routing counts are gathered (the seed turns it off after calibration)."""
        return self.routing.on

    @record.setter
    def record(self, on: bool) -> None:
        self.routing.on = bool(on)

    # ------------------------------------------------------------ the layer call
    def request(
        self,
        layer: int,
        indices: mx.array,
        overlap: bool = True,
        also: mx.array | None = None,
        beside: mx.array | None = None,
    ) -> LayerCall:
        """Plan one call of ``layer`` with routing ``indices`` (expert ids).

        Where every expert of the layer is resident (and nothing records the routing),
        the ids are remapped on the device and nothing waits; so on the device path,
        which plans and fills on the GPU. Otherwise the host path (``host_path``) reads
        the routing (one sync, which also brings ``also``, e.g. a predictor's guess, to
        ``call.also``) and starts the misses' reads at once; with ``overlap`` the
        resident experts' rows form a first step that needs no wait; ``beside`` (the
        layer's shared experts) is launched right after the routing, to compute while
        the host plans.

        Raises:
            RuntimeError: another thread drives this store (``driver.Driver``: a race
                that would corrupt its tables), or this call re-enters it.
        """
        self._driver.enter("request")  # not a context manager: the hot path
        try:
            return self._request(layer, indices, overlap, also, beside)
        finally:
            self._driver.leave()

    def _request(self, layer, indices, overlap, also, beside) -> LayerCall:
        for fn in self._watches:
            fn()
        t0 = time.perf_counter()
        watched = self.routing.on or self.observers
        if self.caches[layer].complete and not watched:
            self.timeline.mark(layer, "request", "resident")
            self.counts.resident_call(layer, indices)
            pool = self.pools[layer]  # slot e holds expert e: the ids are the slots
            slots = indices if pool.identity else pool.device_lut()[indices]
            self.stats[layer].host_s += time.perf_counter() - t0
            self.timeline.mark(layer, "planned", "resident")
            return LayerCall(layer, "resident", slots=slots)
        device = self.device
        if device is not None:
            if not watched and layer not in device.on_device:
                self.loads.finish_open()  # no read pending in its table (nor a slot it frees)
            if not watched and device.takes(layer, indices):
                self.timeline.mark(layer, "request", "device")
                call = LayerCall(layer, "device", slots=device.slots(layer, indices))
                st, dt = self.stats[layer], time.perf_counter() - t0
                st.host_s, st.device_s = st.host_s + dt, st.device_s + dt
                st.device_path_calls += 1
                self.timeline.mark(layer, "planned", "device")
                return call
            device.to_host(layer)  # every host-path call works on the host's table
        return self.host.call(layer, indices, overlap, also, beside)

    def step(self, call: LayerCall, i: int):
        """Step ``i`` of a host-path call, its experts resident (reads waited for, or an
        expert-major group loaded): ``(rows, slot of every row)``."""
        self._driver.enter("step")
        try:
            return self.host.step(call, i)
        finally:
            self._driver.leave()

    def finish(self, call: LayerCall, y: mx.array) -> mx.array:
        """Complete ``call`` with its output; returns it."""
        if call.path == "host":  # commits its loads (the other paths only keep y)
            self._driver.enter("finish")
            try:
                return self.host.finish(call, y)
            finally:
                self._driver.leave()
        self.timeline.mark(call.layer, "built", call.path)
        if call.path == "device":
            return self.device.hold(call, y)
        return y

    def ids(self, slots: np.ndarray) -> mx.array:
        """Slot ids made on the host, as a device array (on CUDA through shared host
        memory, not a host-made MLX buffer, which MLX may first move to managed memory)."""
        transfers = self.host.transfers
        if transfers is None:
            return mx.array(slots.astype(SLOT_IDS_NP))
        return transfers.to_device(slots)

    # ------------------------------------------------------------ loading
    def prefetch(self, layer: int, experts, limit: int | None = None) -> int:
        """Read ahead experts a coming call of ``layer`` is expected to need, into free
        or evictable slots (never pinned ones, nor ``experts`` themselves). Best effort;
        the next call of the layer finishes them. Returns how many were issued."""
        self._driver.enter("prefetch")  # not a context manager: each call with read-ahead
        try:
            self._table_to_host(layer)
            return self.loads.prefetch(layer, experts, limit)
        finally:
            self._driver.leave()

    def _table_to_host(self, layer: int) -> None:
        """Outside a layer call: the device path's queued kernels run first (they post to
        the request ring whose entries a bounded tier's reads reuse; a call's routing read
        has run them already), then ``layer``'s table comes back to the host."""
        if self.device is not None:
            self.device.run_queued()
            self.device.to_host(layer)

    def note_prediction(self, layer: int, predicted: np.ndarray, routed: np.ndarray) -> None:
        """Score a predictor's guess for ``layer`` against the experts it was routed to."""
        st = self.stats[layer]
        st.predicted += len(predicted)
        st.routed_after_prediction += len(routed)
        st.predicted_right += len(np.intersect1d(predicted, routed))

    # ------------------------------------------------------------ pinning / recording
    def pin(self, layer: int, ids) -> None:
        """Load ``ids`` now and never evict them."""
        with self._driver.held("pin"):
            cache = self.caches[layer]
            ids = np.unique(np.asarray(list(ids), dtype=np.int64))
            if len(ids) and (ids.min() < 0 or ids.max() >= cache.num_experts):
                raise ValueError(
                    f"expert ids {ids.tolist()} out of range for layer {layer} "
                    f"(0..{cache.num_experts - 1})"
                )
            total = cache.pinned.union(ids.tolist())
            if not cache.whole and len(total) > cache.capacity - self.top_k:
                raise ValueError(
                    f"pinning {len(total)} experts in layer {layer} leaves fewer than top_k="
                    f"{self.top_k} of its {cache.capacity} slots free; pin at most "
                    f"{cache.capacity - self.top_k} or raise the capacity"
                )
            self._table_to_host(layer)
            self.loads.pin(layer, ids)
            cache.pinned |= set(ids.tolist())

    def hot(self, layer: int, n: int) -> list[int]:
        """The ``n`` experts of ``layer`` routed to most often while ``record`` was on."""
        return self.routing.hot(layer, n)

    def recorded_layers(self) -> list[int]:
        return self.routing.layers()

    # ------------------------------------------------------------ statistics
    def reset_stats(self) -> None:
        """Zero hit/miss and I/O counters (residency, pins and recordings stay)."""
        self.counts.drop()
        self.reader.reset_counters()
        for li in self.caches:
            self.caches[li].stats.__init__()
            self.stats[li].__init__()

    @property
    def hits(self) -> int:
        self.counts.collect()
        return sum(c.stats.hits for c in self.caches.values())

    @property
    def misses(self) -> int:
        self.counts.collect()
        return sum(c.stats.misses for c in self.caches.values())

    def hit_rate(self) -> float:
        h, m = self.hits, self.misses
        return h / (h + m) if h + m else 0.0

    @property
    def fastpath_calls(self) -> int:
        return self._resident.gpu_fastpath

    @property
    def fallback_calls(self) -> int:
        return self._resident.gpu_fallback

    def resident_count(self) -> int:
        return sum(c.resident for c in self.caches.values())

    def pinned_count(self) -> int:
        return sum(len(c.pinned) for c in self.caches.values())

    def pool_bytes(self) -> int:
        return self._resident.nbytes

    def layer_report(self) -> dict[int, dict]:
        """Per-layer counters: hits, misses, evictions, bytes and time read, calls (the
        slot tables stay where they are). Call it on the thread that runs the model; other
        threads read ``snapshot()``."""
        self.counts.collect()
        on_device = self.device.on_device if self.device is not None else set()
        out = {}
        for li in self.layers:
            c = self.caches[li]
            d = {k: getattr(self.stats[li], k) for k in stat_names()}
            d.update(
                hits=c.stats.hits,
                misses=c.stats.misses,
                evictions=c.stats.evictions,
                slots=c.capacity,
                resident=self.device.resident(li) if li in on_device else c.resident,
                pinned=len(c.pinned),
            )
            out[li] = d
        return out

    def publish(self) -> dict:
        """Take the counters (``totals``) for ``snapshot`` to hand to other threads; call
        it on the thread that runs the model, between calls (the server does after each
        request)."""
        t = self.totals()
        with self._published_lock:
            self._published = t
        return t

    def snapshot(self) -> dict:
        """The counters as last published (``publish``): safe from any thread, touches
        neither MLX nor the slot tables; empty before the first publication."""
        with self._published_lock:
            return dict(self._published)

    def totals(self) -> dict:
        """Counters summed over layers, with hit rate, host µs per call, read-ahead and
        prediction precision, the reader's bandwidth, and the swap tier's."""
        t = summarize(self.layer_report())
        t["read_gbps"], t["pool_bytes"] = self.reader.read_gbps(), self.pool_bytes()
        t["mapped_bytes"] = getattr(self.reader, "mapped_bytes", 0)
        return {**t, **tier_totals(self.reader, t["bytes_read"])}

    def close(self) -> None:
        """Finish read-aheads and the device path's queued plans, stop the reader."""
        with self._driver.held("close"):
            for li in self.caches:
                self.loads.finish_read_aheads(li)
            try:
                if self.device is not None:
                    self.device.run_queued()
            finally:  # a device that failed (a kernel's trap) still lets go of the files
                self.reader.close()
