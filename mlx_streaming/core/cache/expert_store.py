"""``FileExpertStore``: per-layer pools of expert slots filled from an expert directory.

The store joins parts that know nothing of each other: the slot tables and eviction
policy (``slots``, ``policy``), the device arrays (``pool``), the staging rows
(``staging``) and the record reader (``io.reader``). A patched MoE layer makes one call
per layer call, ``request(layer, indices)``, and gets back a ``LayerCall`` holding the
work: the slot ids to use, computed on the device where nothing can miss, or steps that
make the call's experts resident (misses read on the reader's threads straight into
their slots, or through staging, checksummed, and only then marked resident) and name
the rows each step computes. ``LayerCall.done(y)`` completes it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..format import ExpertMeta
from ..io.native import COUNTERS
from ..io.reader import RecordReader
from ..meta import load_meta
from ..options import StreamConfig
from .calls import LayerCall
from .device_path import device_path
from .host_path import HostPath
from .loads import Loader
from .policy import make_policy
from .pool import LayerPool, capacities, default_slots, default_zero_slot, make_pools
from .readers import native_reader
from .recording import RoutingCounts
from .slots import SlotCache
from .stats import LayerStats, ResidentSet, Timeline, stat_names, summarize


class FileExpertStore:
    """Bounded per-layer pools of experts, loaded on demand from an expert directory.

    Args:
        expert_dir: A directory written by ``split_model`` (or ``requantize``), or its
            already parsed ``ExpertMeta``.
        capacity: Slots per MoE layer, clipped to the layer's expert count (the seed's
            name for ``StreamConfig.slots``; default: half the experts, at least top-k).
        layer_caps: ``{layer: slots}`` overriding ``capacity`` for some layers.
        config: The streaming options (``StreamConfig``); the store reads ``policy``,
            ``threads``, ``reader``, ``direct_io``, ``device_reads`` (and ``prefetch``,
            which turns its default off), ``checksums``, ``pool_mode``,
            ``zero_slot``, ``record`` and ``clear_on_evict``.
        **options: Overrides of ``config``'s fields (e.g. ``policy="lru"``; the seed
            passes ``clear_on_evict`` and ``record``).

    ``clear_on_evict``: after a call that evicted experts, release MLX's buffer cache.
    ``record``: count how often each expert is routed to (for ``hot``). ``checksums``: check
    each record's checksum the first time the store reads it (a corrupt file is caught on
    first use; later reads of a checked record skip the hash, which costs about as much
    as a read from the page cache). ``zero_slot``: give each pool with fewer slots than
    its layer has experts an all-zero slot, which masked rows need (default: off the
    CPU). ``reader``: None picks ``native`` for cuda pools when it is installed, else
    ``python``; both read the slots the policy chose.

    Raises:
        ExpertDirError: missing or invalid directory, or a capacity below top-k.
    """

    def __init__(
        self,
        expert_dir: str | ExpertMeta,
        capacity: int | None = None,
        layer_caps: dict | None = None,
        *,
        config: StreamConfig | None = None,
        **options,
    ):
        cfg = (config or StreamConfig()).replace(**options)
        meta = expert_dir if isinstance(expert_dir, ExpertMeta) else load_meta(expert_dir)
        self.meta: ExpertMeta = meta
        self.config = cfg
        self.expert_dir = meta.root
        self.top_k = meta.top_k
        self.clear_on_evict = cfg.clear_on_evict
        self.checksums = cfg.checksums
        self.policy_name = cfg.policy
        if capacity is None:
            capacity = cfg.slots or default_slots(meta)
        caps = capacities(meta, capacity, layer_caps)
        self.caches = {
            li: SlotCache(
                meta.layers[li].num_experts,
                c,
                make_policy(cfg.policy, meta.layers[li].num_experts, c),
            )
            for li, c in caps.items()
        }
        self.stats = {li: LayerStats() for li in caps}
        self.zero_slot = default_zero_slot() if cfg.zero_slot is None else bool(cfg.zero_slot)
        pools = make_pools(meta, caps, cfg.pool_mode and cfg.pool_mode.value, self.zero_slot)
        self._resident = ResidentSet(pools, self.stats)
        self.pool_mode = next(iter(self._resident.pools.values())).mode
        self.reader = RecordReader(threads=cfg.threads or 4, direct=cfg.direct_io)
        for li in caps:
            self.reader.open(li, meta.file(li), meta.layers[li].stride)
        self.routing = RoutingCounts({li: meta.layers[li].num_experts for li in caps})
        self.routing.on = cfg.record
        self.observers: list[Callable] = []  # callables(layer, host_ids) seeing the routing
        self.on_request: Callable[[], None] | None = None  # called at each layer call
        self._pending_hits: list = []  # lazy device counts of device-path lookups
        self.lock = threading.RLock()  # the tables and policies, against the policy thread
        self.timeline = Timeline()  # phases of layer calls, when recording
        want = cfg.reader and cfg.reader.value
        try:
            self.native = native_reader(meta, self._resident.pools, self.pool_mode, cfg, want)
        except BaseException:
            self.reader.close()  # nothing of a store that failed to open stays behind
            raise
        self.reader_name = "python" if self.native is None else "native"
        if cfg.map_files and self.native is None:  # python reader, mlx pools, none built
            self.reader.close()
            raise ValueError("map_files needs the native reader (host or cuda pools)")
        self.host = HostPath(
            self.caches,
            self._resident.pools,
            self.stats,
            self.routing,
            self.observers,
            self.pool_mode,
            self.timeline,
        )
        self.loads = Loader(
            meta,
            self.caches,
            self._resident.pools,
            self.reader,
            self.stats,
            cfg.checksums,
            cfg.clear_on_evict,
            self.host.guard,
            self.lock,
            native=self.native,
        )
        self.host.loads = self.loads
        self.device = None
        if cfg.device_reads or (cfg.device_reads is None and self._device_by_default(cfg)):
            try:
                self.device = device_path(self, cfg.checksums)
            except BaseException:
                self.close()
                raise
        self._resident.settle = self._settle_hits

    def _device_by_default(self, cfg: StreamConfig) -> bool:
        """``device_reads``' default: cuda pools over mapped files, read-ahead off."""
        native = self.native
        return self.pool_mode == "cuda" and bool(native and native.sources) and not cfg.prefetch

    @property
    def layers(self) -> list[int]:
        return sorted(self.caches)

    def capacity(self, layer: int) -> int:
        return self.caches[layer].capacity

    def pool(self, layer: int) -> LayerPool:
        return self._resident.pools[layer]

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
        the ids are remapped on the device and nothing waits. Otherwise the host path
        (``host_path``) reads the routing (one sync, which also brings ``also``, e.g. a
        predictor's guess, to ``call.also``) and starts the misses' reads at once; with
        ``overlap`` the resident experts' rows form a first step that needs no wait;
        ``beside`` (the layer's shared experts) is launched right after the routing, to
        compute while the host plans.
        """
        if self.on_request is not None:  # e.g. a pipeline's watch: this rank progresses
            self.on_request()
        if self.caches[layer].complete and not self.routing.on and not self.observers:
            t0 = time.perf_counter()
            self._note_device_call(layer, indices)
            pool = self.pool(layer)  # slot e holds expert e: the ids are the slots
            call = LayerCall(
                layer, _as_is, slots=indices if pool.identity else pool.device_lut()[indices]
            )
            self.stats[layer].host_s += time.perf_counter() - t0
            return call
        device = self.device
        if device is not None:
            if not self.routing.on and not self.observers and device.takes(layer, indices):
                if layer not in device.on_device:
                    self.loads.settle_started()  # no read left pending in its table
                t0 = time.perf_counter()
                call = LayerCall(layer, device.done, slots=device.slots(layer, indices))
                self.stats[layer].host_s += time.perf_counter() - t0
                return call
            device.to_host(layer)  # every host-path call works on the host's table
        return self.host.call(layer, indices, overlap, also, beside)

    def _note_device_call(self, layer: int, indices: mx.array) -> None:
        """Count a call served without reading the routing (all hits)."""
        st, cache = self.stats[layer], self.caches[layer]
        st.device_calls += 1
        st.fastpath += 1
        cache.stats.calls += 1
        k = indices.shape[-1]
        if indices.size == k:  # one token: its k experts are distinct
            cache.stats.hits += k
        else:
            seen = mx.zeros((cache.num_experts,), mx.int32).at[indices.reshape(-1)].add(1)
            self._pending_hits.append((layer, (seen > 0).sum()))

    def _settle_hits(self) -> None:
        if self.device is not None:
            self.device.settle_stats()
        if self._pending_hits:
            vals = [v for _, v in self._pending_hits]
            mx.eval(vals)
            for (li, _), v in zip(self._pending_hits, vals):
                self.caches[li].stats.hits += int(v.item())
            self._pending_hits.clear()

    # ------------------------------------------------------------ loading
    def prefetch(self, layer: int, experts, limit: int | None = None) -> int:
        """Read ahead experts a coming call of ``layer`` is expected to need, into free
        or evictable slots (never pinned ones, nor ``experts`` themselves). Best effort;
        the next call of the layer settles them. Returns how many were issued."""
        if self.device is not None:
            self.device.to_host(layer)
        return self.loads.prefetch(layer, experts, limit)

    def note_prediction(self, layer: int, predicted: np.ndarray, routed: np.ndarray) -> None:
        """Score a predictor's guess for ``layer`` against the experts it was routed to."""
        st = self.stats[layer]
        st.predicted += len(predicted)
        st.routed_after_prediction += len(routed)
        st.predicted_right += len(np.intersect1d(predicted, routed))

    # ------------------------------------------------------------ pinning / recording
    def pin(self, layer: int, ids) -> None:
        """Load ``ids`` now and never evict them."""
        cache = self.caches[layer]
        ids = np.unique(np.asarray(list(ids), dtype=np.int64))
        if len(ids) and (ids.min() < 0 or ids.max() >= cache.num_experts):
            raise ValueError(
                f"expert ids {ids.tolist()} out of range for layer {layer} "
                f"(0..{cache.num_experts - 1})"
            )
        if self.device is not None:
            self.device.to_host(layer)
        total = cache.pinned.union(ids.tolist())
        if len(total) != cache.num_experts and len(total) > cache.capacity - self.top_k:
            raise ValueError(
                f"pinning {len(total)} experts in layer {layer} leaves fewer than top_k="
                f"{self.top_k} of its {cache.capacity} slots free; pin at most "
                f"{cache.capacity - self.top_k} or raise the capacity"
            )
        self.loads.settle(layer)
        _, misses = cache.split(ids)
        with self.lock:
            placed = cache.reserve(misses, protect=ids)
        self.loads.issue(layer, ids, misses, placed, prefetch=True).wait()
        cache.pinned |= set(ids.tolist())

    def hot(self, layer: int, n: int) -> list[int]:
        """The ``n`` experts of ``layer`` routed to most often while ``record`` was on."""
        return self.routing.hot(layer, n)

    def recorded_layers(self) -> list[int]:
        return self.routing.layers()

    # ------------------------------------------------------------ statistics
    def reset_stats(self) -> None:
        """Zero hit/miss and I/O counters (residency, pins and recordings stay)."""
        if self.device is not None:
            self.device.settle_stats()  # counted so far: not counted again
        self._pending_hits.clear()
        if self.native is not None:
            self.native.counters[:] = 0
        for li in self.caches:
            self.caches[li].stats.__init__()
            self.stats[li].__init__()

    @property
    def hits(self) -> int:
        self._settle_hits()
        return sum(c.stats.hits for c in self.caches.values())

    @property
    def misses(self) -> int:
        self._settle_hits()
        return sum(c.stats.misses for c in self.caches.values())

    def hit_rate(self) -> float:
        h = self.hits
        total = h + self.misses
        return h / total if total else 0.0

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
        """Per-layer counters: hits, misses, evictions, bytes and time read, calls."""
        if self.device is not None:  # residency as the device left it
            for li in self.layers:
                self.device.to_host(li)
        self._settle_hits()
        out = {}
        for li in self.layers:
            c = self.caches[li]
            d = {k: getattr(self.stats[li], k) for k in stat_names()}
            d.update(
                hits=c.stats.hits,
                misses=c.stats.misses,
                evictions=c.stats.evictions,
                slots=c.capacity,
                resident=c.resident,
                pinned=len(c.pinned),
            )
            out[li] = d
        return out

    def totals(self) -> dict:
        """Counters summed over layers, with hit rate, host µs per call, read-ahead and
        prediction precision, and the reader's bandwidth."""
        t = summarize(self.layer_report())
        if self.native is not None:  # bytes over the wall time of its reads
            c = dict(zip(COUNTERS, self.native.counters.sum(0).tolist()))
            t["read_gbps"] = c["bytes"] / c["busy_ns"] if c["busy_ns"] else 0.0
        else:
            t["read_gbps"] = self.reader.stats.gbps()
        t["pool_bytes"] = self.pool_bytes()
        t["mapped_bytes"] = self.native.mapped_bytes if self.native is not None else 0
        return t

    def close(self) -> None:
        """Finish read-aheads, stop the readers, close the files."""
        if self.device is not None:
            mx.synchronize()  # no kernel reads the mappings any more
        for li in self.caches:
            self.loads.settle(li)
        self.loads.close()
        if self.native is not None:
            self.native.close()
        self.reader.close()


def _as_is(call: LayerCall, y: mx.array) -> mx.array:
    return y
