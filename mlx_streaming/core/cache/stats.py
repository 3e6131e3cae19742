"""Counters of a store: per-layer I/O, dispatch, read-ahead and host time.

Hits, misses and evictions live in each layer's ``SlotCache.stats`` (the bookkeeping
shared with the trace simulator); everything the live store adds lives here (the counts
kept on the device: ``counts``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields


@dataclass
class LayerStats:
    """Per-layer counters beside the slot table's hits and misses."""

    bytes_read: int = 0
    records_read: int = 0
    read_s: float = 0.0  # time the caller waited for demand reads
    demand_s: float = 0.0  # time demand reads were in flight: from a call's issue to its
    # wait's end (one layer's at a time: the storage's busy time, read-ahead aside)
    device_calls: int = 0  # calls that read no routing on the host (a complete layer's,
    # ids remapped on the device; the device path's, misses filled there)
    host_calls: int = 0  # calls that read the routing on the host (one sync each)
    fastpath: int = 0  # calls with every expert resident
    fallback: int = 0  # calls that loaded misses
    host_s: float = 0.0  # host time of the store's own work per call (planning the misses)
    device_path_calls: int = 0  # calls the device path served (plans and fills on the GPU)
    device_s: float = 0.0  # ... of host_s, in those calls: their whole host cost in the
    # store (no routing read, no read, and their expert graph is built outside it)
    device_kernel_s: float = 0.0  # ... of device_s: MLX building the plan kernel's op
    sync_s: float = 0.0  # host time waiting for the routing to reach the host
    ahead_s: float = 0.0  # host work beside the device's: launching the routing, the
    # deferred policy update, issuing the next layer's read-ahead
    graph_s: float = 0.0  # host time building the expert graph on slot ids (for a late
    # call, while the device computes the routing)
    gap_s: float = 0.0  # from the routing's arrival on the host to the first launch of
    # the call's experts: the device has no routed-expert work queued (at most the
    # shared experts), so this bounds its idle time per host-path call
    prefetched: int = 0  # experts read ahead
    prefetch_used: int = 0  # ... that a later call needed (misses avoided)
    prefetch_on_time: int = 0  # ... that had arrived before they were needed
    prefetch_bytes: int = 0
    prefetch_failed: int = 0  # experts read ahead whose read failed (retried on demand)
    predicted: int = 0  # experts a predictor named for this layer
    predicted_right: int = 0  # ... that the layer was then routed to
    routed_after_prediction: int = 0  # distinct experts routed where a prediction was made


def per_call_us(seconds: float, calls: int) -> float | None:
    """Host µs per call (None where there was no call)."""
    return round(1e6 * seconds / calls, 1) if calls else None


def stat_names() -> list[str]:
    return [f.name for f in fields(LayerStats)]


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
    launched and the work done while the device computes it; ``routed``; ``grouped``:
    the routing counted and grouped, before the loads begin; ``planned``: the loads
    begun; ``read``; ``built``) and the call's path (``host``, ``device``, ``resident``),
    kept while ``on``: one decode step's timeline, for ``bench`` and
    ``benchmarks/speed.py``."""

    def __init__(self):
        self.on = False
        self.events: list[tuple[float, int, str, str]] = []

    def mark(self, layer: int, phase: str, path: str = "host") -> None:
        if self.on:
            self.events.append((time.perf_counter(), layer, phase, path))

    def start(self) -> None:
        """Start a fresh timeline (``stop`` returns it)."""
        self.events, self.on = [], True

    def stop(self) -> list[dict]:
        """Stop; the events as ``{t_us, layer, phase, path}`` from the first."""
        self.on = False
        t0 = self.events[0][0] if self.events else 0.0
        return [
            {"t_us": round(1e6 * (t - t0), 1), "layer": li, "phase": ph, "path": pa}
            for t, li, ph, pa in self.events
        ]
