"""``FileExpertStore``: per-layer pools of expert slots filled from an expert directory.

The store joins three parts that know nothing of each other: the slot tables and eviction
policy (``slots``, ``policy``), the device arrays (``pool``) and the record reader
(``io.reader``). A patched MoE layer asks it to make a group of experts resident
(``fetch``); the store reads the misses, checks their checksums, writes them into the
slots it reserved and only then marks them resident.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import mlx.core as mx
import numpy as np
import xxhash

from ..format import ExpertDirError, ExpertMeta, load_meta, record_checksum
from ..io.reader import RecordReader, aligned_buffer
from .policy import make_policy
from .pool import LayerPool
from .slots import SlotCache

STAGING_BYTES = 256 << 20  # largest staging batch (device mode, O_DIRECT)


class ExpertChecksumError(ExpertDirError):
    """A record read from disk does not match its checksum."""


@dataclass
class LayerStats:
    """Per-layer I/O and dispatch counters (hits and misses live in ``SlotCache.stats``)."""

    bytes_read: int = 0
    records_read: int = 0
    read_s: float = 0.0
    verify_s: float = 0.0
    device_calls: int = 0  # calls that read no routing on the host (layer complete)
    host_calls: int = 0  # calls that read the routing on the host (one sync each)
    fastpath: int = 0  # calls with every expert resident
    fallback: int = 0  # calls that loaded misses


class ResidentSet:
    """The device pools of every layer, with the dispatch counters the seed script reads
    as ``store._resident.gpu_fastpath`` / ``gpu_fallback``."""

    def __init__(self, pools: dict[int, LayerPool], stats: dict[int, LayerStats]):
        self.pools = pools
        self._stats = stats

    @property
    def gpu_fastpath(self) -> int:
        """MoE layer calls whose experts were all resident (pure device path)."""
        return sum(s.fastpath for s in self._stats.values())

    @property
    def gpu_fallback(self) -> int:
        """MoE layer calls that needed host work to load misses."""
        return sum(s.fallback for s in self._stats.values())

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools.values())


class FileExpertStore:
    """Bounded per-layer pools of experts, loaded on demand from an expert directory.

    Args:
        expert_dir: A directory written by ``split_model`` (or ``requantize``).
        capacity: Slots per MoE layer (clipped to the layer's expert count).
        layer_caps: ``{layer: slots}`` overriding ``capacity`` for some layers.
        clear_on_evict: After a call that evicted experts, release MLX's buffer cache
            (``mx.clear_cache``) so freed staging buffers go back to the system.
        record: Count how often each expert is routed to (for ``hot``); forces the
            routing to be read on the host even where no miss is possible.
        policy: Eviction policy name (``lru``...).
        threads: ``pread`` threads.
        direct_io: Bypass the page cache (O_DIRECT / F_NOCACHE).
        verify: Check each record's checksum when it is read.
        pool_mode: ``host`` (read straight into unified memory) or ``device`` (staging
            buffer and device copies); default by backend (see ``pool.default_mode``).

    Raises:
        ExpertDirError: missing or invalid directory, or a capacity below top-k.
    """

    def __init__(self, expert_dir, capacity: int = 8, layer_caps: dict | None = None,
                 clear_on_evict: bool = False, record: bool = False, *,
                 policy: str = "lru", threads: int = 4, direct_io: bool = False,
                 verify: bool = True, pool_mode: str | None = None):
        self.meta: ExpertMeta = load_meta(expert_dir)
        self.expert_dir = self.meta.root
        self.top_k = self.meta.top_k
        self.clear_on_evict = clear_on_evict
        self.record = record
        self.verify = verify
        self.policy_name = policy
        caps = self._capacities(capacity, layer_caps)
        self.caches = {li: SlotCache(self.meta.layers[li].num_experts, c, make_policy(policy))
                       for li, c in caps.items()}
        self.stats = {li: LayerStats() for li in caps}
        self._resident = ResidentSet(
            {li: LayerPool(self.meta.layers[li], c, pool_mode) for li, c in caps.items()},
            self.stats)
        self.reader = RecordReader(threads=threads, direct=direct_io)
        for li in caps:
            self.reader.open(li, self.meta.file(li), self.meta.layers[li].stride)
        self._counts = {li: np.zeros(self.meta.layers[li].num_experts, np.int64) for li in caps}
        self._pending_hits: list = []  # lazy device counts of device-path lookups
        self._staging = aligned_buffer(0)
        self.observers: list = []  # callables(layer, host_ids) seeing host-read routing

    # ------------------------------------------------------------ set-up
    def _capacities(self, capacity, layer_caps) -> dict[int, int]:
        _check_count("capacity", capacity)
        caps = {}
        layer_caps = {int(k): v for k, v in (layer_caps or {}).items()}
        unknown = sorted(set(layer_caps) - set(self.meta.layers))
        if unknown:
            raise ExpertDirError(f"layer_caps names layers {unknown} that are not MoE layers of "
                                 f"{self.expert_dir} (MoE layers: {list(self.meta.moe_layers)})")
        for li, lay in self.meta.layers.items():
            c = layer_caps.get(li, capacity)
            _check_count(f"slots for layer {li}", c)
            if c < self.top_k:
                src = "layer_caps" if li in layer_caps else "capacity"
                raise ExpertDirError(
                    f"{src} of {c} slots for layer {li} is below top_k={self.top_k}: each token "
                    f"needs {self.top_k} experts resident at once; use at least {self.top_k}"
                )
            caps[li] = min(int(c), lay.num_experts)
        return caps

    @property
    def layers(self) -> list[int]:
        return sorted(self.caches)

    def capacity(self, layer: int) -> int:
        return self.caches[layer].capacity

    def pool(self, layer: int) -> LayerPool:
        return self._resident.pools[layer]

    # ------------------------------------------------------------ runtime
    def device_path(self, layer: int) -> bool:
        """True when a call needs no host routing: every expert resident, not recording."""
        return self.caches[layer].complete and not self.record and not self.observers

    def note_device_call(self, layer: int, indices: mx.array) -> None:
        """Count a call served without reading the routing (all hits)."""
        st, cache = self.stats[layer], self.caches[layer]
        st.device_calls += 1
        st.fastpath += 1
        cache.stats.calls += 1
        k = indices.shape[-1]
        if indices.size == k:  # one token: its k experts are distinct
            cache.stats.hits += k
        else:
            E = cache.num_experts
            seen = mx.zeros((E,), mx.int32).at[indices.reshape(-1)].add(1)
            self._pending_hits.append((layer, (seen > 0).sum()))

    def _settle_hits(self) -> None:
        if self._pending_hits:
            vals = [v for _, v in self._pending_hits]
            mx.eval(vals)
            for (li, _), v in zip(self._pending_hits, vals):
                self.caches[li].stats.hits += int(v.item())
            self._pending_hits.clear()

    def plan(self, layer: int, host_ids: np.ndarray) -> list[np.ndarray]:
        """Distinct experts of one call's routing, in groups that each fit the pool."""
        st = self.stats[layer]
        st.host_calls += 1
        for obs in self.observers:
            obs(layer, host_ids)
        experts, counts = np.unique(host_ids, return_counts=True)
        if self.record:
            self._counts[layer][experts] += counts
        return self.caches[layer].groups(experts, counts)

    def fetch(self, layer: int, experts: np.ndarray) -> int:
        """Make distinct ``experts`` resident (they must fit); count the lookup.

        Returns the number of misses loaded. On a read or checksum error nothing is
        marked resident and the exception propagates.
        """
        cache = self.caches[layer]
        _, misses = cache.split(experts)
        load = misses
        if cache.capacity >= cache.num_experts:  # room for all: load the whole layer once
            load = cache.split(np.arange(cache.num_experts))[1]
        evicted = self._load(layer, load, protect=set(experts.tolist()))
        cache.access(experts, len(misses))
        if evicted and self.clear_on_evict:
            mx.clear_cache()
        return len(misses)

    def end_call(self, layer: int, misses: int) -> None:
        """Count a host-path call as fast (all resident) or fallback (loaded misses)."""
        if misses:
            self.stats[layer].fallback += 1
        else:
            self.stats[layer].fastpath += 1

    def _staging_rows(self, n: int, stride: int) -> np.ndarray:
        if self._staging.size < n * stride:
            self._staging = aligned_buffer(n * stride)
        return self._staging[: n * stride].reshape(n, stride)

    def _load(self, layer: int, misses: np.ndarray, protect: set) -> int:
        """Read ``misses`` into reserved slots; returns how many experts were evicted."""
        if len(misses) == 0:
            return 0
        cache = self.caches[layer]
        placed = cache.reserve(np.sort(misses), protect)
        lay = self.meta.layers[layer]
        batch = max(1, min(len(placed), STAGING_BYTES // lay.stride))
        try:
            for i in range(0, len(placed), batch):
                part = placed[i:i + batch]
                ids, slots = [e for e, _, _ in part], [s for _, s, _ in part]
                if self.pool(layer).mode == "host" and not self.reader.direct:
                    self._load_direct(layer, ids, slots)
                else:
                    self._load_staged(layer, ids, slots)
        except BaseException:
            cache.abort(placed)  # no slot stays marked resident with bad or partial data
            raise
        cache.commit(placed)
        return sum(1 for _, _, v in placed if v >= 0)

    def _count_read(self, layer: int, t0: float, nbytes: int, n: int) -> None:
        st = self.stats[layer]
        st.read_s += time.perf_counter() - t0
        st.bytes_read += nbytes
        st.records_read += n

    def _load_direct(self, layer: int, ids: list[int], slots: list[int]) -> None:
        """Scatter-read records straight into their slot rows (unified memory)."""
        pool, lay = self.pool(layer), self.meta.layers[layer]
        gaps = np.zeros((len(ids), pool.gap_bytes()), dtype=np.uint8)
        iov = [pool.record_iovecs(s, gaps[i]) for i, s in enumerate(slots)]
        t0 = time.perf_counter()
        nbytes = self.reader.submit_scatter(layer, ids, iov, lay.record_bytes).result()
        self._count_read(layer, t0, nbytes, len(ids))
        if self.verify and lay.checksums:
            t0 = time.perf_counter()
            for e, vecs in zip(ids, iov):
                h = xxhash.xxh3_64()
                for v in vecs:
                    h.update(v)
                self._check(layer, e, h.hexdigest())
            self.stats[layer].verify_s += time.perf_counter() - t0
        pool.set_lut(ids, slots)
        pool.writes += len(ids)

    def _load_staged(self, layer: int, ids: list[int], slots: list[int]) -> None:
        """Read records into an aligned staging buffer, then into the pool."""
        pool, lay = self.pool(layer), self.meta.layers[layer]
        buf = self._staging_rows(len(ids), lay.stride)
        t0 = time.perf_counter()
        nbytes = self.reader.read(layer, ids, buf)
        self._count_read(layer, t0, nbytes, len(ids))
        if self.verify and lay.checksums:
            t0 = time.perf_counter()
            for row, e in enumerate(ids):
                self._check(layer, e, record_checksum(memoryview(buf[row])[: lay.record_bytes]))
            self.stats[layer].verify_s += time.perf_counter() - t0
        if pool.mode == "host":  # O_DIRECT on unified memory: copy parts into the slots
            for p in lay.parts:
                dst = pool._host[p.name]
                for row, s in enumerate(slots):
                    dst[s] = buf[row, p.offset:p.offset + p.nbytes]
            pool.set_lut(ids, slots)
            pool.writes += len(ids)
        else:
            pool.write(ids, slots, buf)
            mx.eval(pool.state())  # the staging buffer is reused by the next batch

    def _check(self, layer: int, expert: int, got: str) -> None:
        want = self.meta.layers[layer].checksums[expert]
        if got != want:
            raise ExpertChecksumError(
                f"expert {expert} of layer {layer} in {self.meta.file(layer)} fails its "
                f"checksum ({got} != {want}): the file is corrupt; split the model again"
            )

    # ------------------------------------------------------------ pinning / recording
    def pin(self, layer: int, ids) -> None:
        """Load ``ids`` now and never evict them."""
        cache = self.caches[layer]
        ids = np.unique(np.asarray(list(ids), dtype=np.int64))
        if len(ids) and (ids.min() < 0 or ids.max() >= cache.num_experts):
            raise ValueError(f"expert ids {ids.tolist()} out of range for layer {layer} "
                             f"(0..{cache.num_experts - 1})")
        total = cache.pinned.union(ids.tolist())
        if len(total) != cache.num_experts and len(total) > cache.capacity - self.top_k:
            raise ValueError(
                f"pinning {len(total)} experts in layer {layer} leaves fewer than top_k="
                f"{self.top_k} of its {cache.capacity} slots free; pin at most "
                f"{cache.capacity - self.top_k} or raise the capacity"
            )
        _, misses = cache.split(ids)
        self._load(layer, misses, protect=set(ids.tolist()) | cache.pinned)
        cache.pinned |= set(ids.tolist())

    def unpin(self, layer: int, ids=None) -> None:
        cache = self.caches[layer]
        cache.pinned = set() if ids is None else cache.pinned - set(ids)

    def hot(self, layer: int, n: int) -> list[int]:
        """The ``n`` experts of ``layer`` routed to most often while ``record`` was on."""
        c = self._counts[layer]
        order = np.argsort(-c, kind="stable")
        return [int(e) for e in order[:n] if c[e] > 0]

    def recorded_layers(self) -> list[int]:
        return [li for li, c in sorted(self._counts.items()) if c.any()]

    def routing_counts(self, layer: int) -> np.ndarray:
        return self._counts[layer].copy()

    # ------------------------------------------------------------ statistics
    def reset_stats(self) -> None:
        """Zero hit/miss and I/O counters (residency, pins and recordings stay)."""
        self._pending_hits.clear()
        for li in self.caches:
            self.caches[li].stats.__init__()
            self.stats[li] = LayerStats()
        self._resident._stats = self.stats

    @property
    def hits(self) -> int:
        self._settle_hits()
        return sum(c.stats.hits for c in self.caches.values())

    @property
    def misses(self) -> int:
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
        self._settle_hits()
        out = {}
        for li in self.layers:
            c = self.caches[li]
            d = {f.name: getattr(self.stats[li], f.name) for f in fields(LayerStats)}
            d.update(hits=c.stats.hits, misses=c.stats.misses, evictions=c.stats.evictions,
                     slots=c.capacity, resident=c.resident, pinned=len(c.pinned))
            out[li] = d
        return out

    def totals(self) -> dict:
        rep = self.layer_report().values()
        keys = ["bytes_read", "records_read", "read_s", "verify_s", "device_calls",
                "host_calls", "fastpath", "fallback", "hits", "misses", "evictions"]
        return {k: sum(r[k] for r in rep) for k in keys}

    def close(self) -> None:
        self.reader.close()


def _check_count(what: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ExpertDirError(f"{what} must be a positive integer, got {v!r}")
