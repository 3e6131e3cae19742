"""Counters of a store: per-layer I/O, dispatch, read-ahead and host time.

Hits, misses and evictions live in each layer's ``SlotCache.stats`` (the bookkeeping
shared with the trace simulator); everything the live store adds lives here. The seed
script reads ``store._resident.gpu_fastpath`` / ``gpu_fallback``: ``ResidentSet`` keeps
those names.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import mlx.core as mx


@dataclass
class LayerStats:
    """Per-layer counters beside the slot table's hits and misses."""

    bytes_read: int = 0
    records_read: int = 0
    read_s: float = 0.0  # time the caller waited for demand reads
    device_calls: int = 0  # calls that read no routing on the host (a complete layer's,
    # ids remapped on the device; the device path's, misses filled there)
    host_calls: int = 0  # calls that read the routing on the host (one sync each)
    fastpath: int = 0  # calls with every expert resident
    fallback: int = 0  # calls that loaded misses
    host_s: float = 0.0  # host time of the store's own work per call (planning the misses)
    sync_s: float = 0.0  # host time waiting for the routing to reach the host
    ahead_s: float = 0.0  # host work beside the device's: launching the routing, the
    # deferred policy update, issuing the next layer's read-ahead
    graph_s: float = 0.0  # host time building the expert graph on slot ids
    gap_s: float = 0.0  # from the routing's arrival on the host to the first launch of
    # the call's experts: the device has no routed-expert work queued (at most the
    # shared experts), so this bounds its idle time per host-path call
    prefetched: int = 0  # experts read ahead
    prefetch_used: int = 0  # ... that a later call needed (misses avoided)
    prefetch_on_time: int = 0  # ... that had arrived before they were needed
    prefetch_bytes: int = 0
    predicted: int = 0  # experts a predictor named for this layer
    predicted_right: int = 0  # ... that the layer was then routed to
    routed_after_prediction: int = 0  # distinct experts routed where a prediction was made


def stat_names() -> list[str]:
    return [f.name for f in fields(LayerStats)]


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
    def pending(self) -> int:
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
        """MoE layer calls whose experts were all resident (pure device path)."""
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


def summarize(report: dict[int, dict]) -> dict:
    """Totals over layers of a per-layer report, with the derived rates."""
    rows = list(report.values())
    tot = {k: sum(r[k] for r in rows) for k in rows[0] if k != "slots"}
    calls = tot["device_calls"] + tot["host_calls"]
    lookups = tot["hits"] + tot["misses"]
    tot["hit_rate"] = tot["hits"] / lookups if lookups else 0.0
    tot["host_us_per_call"] = 1e6 * tot["host_s"] / calls if calls else 0.0
    # everything the host does in a layer call: work while the device computes the
    # routing, routing wait, planning, reads, graph
    busy = tot["ahead_s"] + tot["sync_s"] + tot["host_s"] + tot["read_s"] + tot["graph_s"]
    tot["layer_call_us"] = 1e6 * busy / calls if calls else 0.0
    # the host blocked inside a step: for the routing, then for demand reads
    tot["host_wait_us_per_call"] = 1e6 * (tot["sync_s"] + tot["read_s"]) / calls if calls else 0.0
    tot["prefetch_precision"] = (
        tot["prefetch_used"] / tot["prefetched"] if tot["prefetched"] else None
    )
    tot["prediction_precision"] = (
        tot["predicted_right"] / tot["predicted"] if tot["predicted"] else None
    )
    tot["prediction_recall"] = (
        tot["predicted_right"] / tot["routed_after_prediction"]
        if tot["routed_after_prediction"]
        else None
    )
    return tot


class Timeline:
    """Host timestamps of layer-call phases (``request``; ``ahead``: the routing
    launched and the work done while the device computes it; ``routed``, ``read``,
    ``planned``, ``built``), kept while ``on``: one decode step's timeline, for
    ``bench`` and ``benchmarks/speed.py``."""

    def __init__(self):
        self.on = False
        self.events: list[tuple[float, int, str]] = []

    def mark(self, layer: int, phase: str) -> None:
        if self.on:
            self.events.append((time.perf_counter(), layer, phase))

    def record(self) -> None:
        """Start a fresh recording."""
        self.events, self.on = [], True

    def stop(self) -> list[dict]:
        """Stop; the events as ``{t_us, layer, phase}`` from the first."""
        self.on = False
        t0 = self.events[0][0] if self.events else 0.0
        return [
            {"t_us": round(1e6 * (t - t0), 1), "layer": li, "phase": ph}
            for t, li, ph in self.events
        ]
