"""Counts kept on the device, brought to the store's stats: the hits of calls served with
every expert resident, the device path's counters, and the view the seed script reads as
``store._resident.gpu_fastpath`` / ``gpu_fallback`` (``ResidentSet`` keeps those names).
Built by the store above the paths whose counters it collects."""

from __future__ import annotations

import mlx.core as mx

from .stats import LayerStats

PENDING = 64  # lazy hit counts held before they are folded in


class HitCounts:
    """Hits counted on the device, brought to the slot tables' stats: those of calls
    served with every expert resident (a prompt chunk's distinct experts, counted by a
    small launch of their own) and the device path's counters (``device.collect_counters``)."""

    def __init__(self, caches: dict, stats: dict[int, LayerStats], device=None):
        self.caches, self.stats, self.device = caches, stats, device
        self._pending: list[tuple[int, mx.array]] = []

    def resident_call(self, layer: int, indices: mx.array) -> None:
        """Count a call served without reading the routing (all hits)."""
        st, cache = self.stats[layer], self.caches[layer]
        st.device_calls += 1
        st.fastpath += 1
        cache.stats.calls += 1
        k = indices.shape[-1]
        if indices.size == k:  # one token: its k experts are distinct
            cache.stats.hits += k
            return
        seen = mx.zeros((cache.num_experts,), mx.int32).at[indices.reshape(-1)].add(1)
        n = (seen > 0).sum()
        mx.async_eval(n)  # computed beside the call: folding it in later waits for nothing
        self._pending.append((layer, n))
        if len(self._pending) >= PENDING:
            self._fold()

    def collect(self) -> None:
        """Bring every count to the stats."""
        if self.device is not None:
            self.device.collect_counters()
        self._fold()

    @property
    def uncollected(self) -> int:
        """Counts computed on the device, not yet brought to the stats."""
        return len(self._pending)

    def drop(self) -> None:
        """Forget what is not yet counted (the stats are being reset)."""
        if self.device is not None:
            self.device.collect_counters()  # counted so far: not counted again
        self._pending.clear()

    def _fold(self) -> None:
        if self._pending:
            vals = [v for _, v in self._pending]
            mx.eval(vals)
            for (li, _), v in zip(self._pending, vals):
                self.caches[li].stats.hits += int(v.item())
            self._pending.clear()


class ResidentSet:
    """The device pools of every layer, with the dispatch counters the seed script reads
    as ``store._resident.gpu_fastpath`` / ``gpu_fallback``."""

    def __init__(self, pools: dict, stats: dict[int, LayerStats], counts: HitCounts):
        self.pools, self.stats, self.counts = pools, stats, counts

    @property
    def gpu_fastpath(self) -> int:
        """MoE layer calls whose experts were all resident: nothing loaded (either path)."""
        self.counts.collect()
        return sum(s.fastpath for s in self.stats.values())

    @property
    def gpu_fallback(self) -> int:
        """MoE layer calls that loaded misses."""
        self.counts.collect()
        return sum(s.fallback for s in self.stats.values())

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools.values())
