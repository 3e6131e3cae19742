"""The host path of a layer call: the routing read on the host, the misses loaded by
the store's ``Loader``, the rows computed in steps.

One host synchronisation per call reads the routing (on CUDA a decode step's through
mapped memory, ``io.mapped``, as is a read-ahead predictor's guess); the layer's shared
experts are launched after it, apart, and compute while the host plans. While the device
computes the routing, the host applies the previous call's policy update. Then the
misses start loading at once, on the reader's threads, while the expert graph is built
(launched once they have landed); with overlap, the resident experts' rows form a first
step that needs no wait. A call with more distinct experts than slots runs expert-major:
one group of experts at a time, each read at most once per call. Outputs that read a
pool written behind MLX's back (host and cuda modes) are tracked and evaluated before
the pool is next written.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..io.mapped import mapped_transfers
from .calls import LayerCall
from .loads import Loader
from .pool import LayerPool
from .recording import RoutingCounts
from .slots import SlotCache
from .stats import LayerStats, Timeline

TRACK_EVAL_BYTES = 1 << 20  # outputs larger than this are evaluated, not held
SMALL_CALL = 64  # routed rows up to which Python sets beat np.unique (a decode step)


def distinct(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_counts=True)``, cheaper for a decode step's few ids."""
    if ids.size > SMALL_CALL:
        return np.unique(ids, return_counts=True)
    flat = ids.ravel().tolist()
    u = sorted(set(flat))
    if len(u) == len(flat):
        counts = np.ones(len(u), np.int64)
    else:
        counts = np.array([flat.count(e) for e in u], np.int64)
    return np.array(u, dtype=ids.dtype), counts


def member(values: np.ndarray, ids: np.ndarray, size: int) -> np.ndarray:
    """``np.isin(values, ids)`` for ids below ``size``, by a table (cheaper)."""
    table = np.zeros(size, bool)
    table[ids] = True
    return table[values]


class HostPath:
    """Serves layer calls whose routing the host must read."""

    def __init__(
        self,
        caches: dict[int, SlotCache],
        pools: dict[int, LayerPool],
        stats: dict[int, LayerStats],
        routing: RoutingCounts,
        observers: list[Callable],
        mode: str,
        timeline: Timeline,
    ):
        self.caches, self.pools, self.stats = caches, pools, stats
        self.timeline = timeline
        self.routing, self.observers, self.mode = routing, observers, mode
        self.loads: Loader | None = None  # set by the store (the loader guards with us)
        self._readers: dict[int, list] = {li: [] for li in caches}  # lazy outputs per layer
        self._previous: int | None = None  # the layer last served
        # cuda pools: a decode step's routing read through mapped memory (io.mapped)
        self.mapped = mapped_transfers() if mode == "cuda" else None

    def call(
        self,
        layer: int,
        indices: mx.array,
        overlap: bool = True,
        also: mx.array | None = None,
        beside: mx.array | None = None,
    ) -> LayerCall:
        """Read the routing (with ``also``), start the misses' reads, plan the steps;
        ``beside`` computes after the routing, in its own launch, while the host plans."""
        t0 = time.perf_counter()
        self.timeline.mark(layer, "request")
        cache, st = self.caches[layer], self.stats[layer]
        mapped = self.mapped
        done = mapped.start(indices) if mapped is not None else None
        guess = mapped.start(also, 1) if mapped is not None and also is not None else None
        wanted = [indices if done is None else done]
        wanted += [] if also is None else [also if guess is None else guess]
        mx.async_eval(wanted)  # the device computes the routing while the host works
        if beside is not None:  # apart: the routing's wait does not include it
            mx.async_eval(beside)
        if self._previous is not None:
            self.loads.flush(self._previous)
        self._previous = layer
        t1 = time.perf_counter()
        st.ahead_s += t1 - t0
        self.timeline.mark(layer, "ahead")
        # the one host synchronisation of this layer call; mx.eval first: it raises
        # what the graph's evaluation raised (a lost pipeline peer), where a numpy
        # conversion would not (MLX 0.32)
        mx.eval(wanted)
        host = np.array(indices) if done is None else self.mapped.read(indices)
        t0 = time.perf_counter()  # host time counts the store's own work, not the wait
        self.timeline.mark(layer, "routed")
        st.sync_s += t0 - t1
        st.host_calls += 1
        for obs in self.observers:
            obs(layer, host)
        experts, counts = distinct(host)
        if self.routing.on:
            self.routing.add(layer, experts, counts)
        self.loads.settle(layer, experts)
        groups = cache.groups(experts, counts)
        call = LayerCall(layer, self.complete, host_ids=host, settle=len(groups) > 1)
        call.routed_at = t0
        if also is not None:
            call.also = np.array(also) if guess is None else mapped.read(also, 1)
        if len(groups) == 1:
            call.plan = self._one_group(call, groups[0], overlap)
        else:
            call.plan = self._expert_major(call, groups)
        st.host_s += time.perf_counter() - t0 - call.waited_s
        self.timeline.mark(layer, "planned")
        return call

    def _one_group(self, call: LayerCall, experts: np.ndarray, overlap: bool):
        """The steps. The misses' reads start now, on the reader's threads. With
        ``overlap`` (and some experts resident) the resident rows form a first step that
        does not wait for them; otherwise one step runs every row, its graph built while
        the reads land (``before_launch`` waits for them)."""
        pool, host = self.pools[call.layer], call.host_ids
        cache = self.caches[call.layer]
        split = overlap and 0 < int((cache.slot_of[experts] < 0).sum()) < len(experts)
        ticket = self.loads.begin(call.layer, experts)
        call.misses = len(ticket.misses)
        if not split and pool.mode == "mlx":  # its writes make new arrays: wait first
            self._wait(call, ticket)
            return iter([(None, pool.slots_of(host))])
        if not split:  # host and cuda pools are written in place: build, then wait
            slots = pool.slots_of(host)
            for e, s, _ in ticket.placed:  # the misses' slots, reserved (resident on wait)
                slots[host == e] = s
            call.before_launch = lambda: self._wait(call, ticket)
            return iter([(None, slots)])

        def steps():
            miss = member(host, ticket.misses, cache.num_experts)
            yield ~miss, pool.slots_of(host)  # resident rows: nothing to wait for
            self._wait(call, ticket)
            yield miss, pool.slots_of(host)

        return steps()

    def _wait(self, call: LayerCall, ticket) -> None:
        t0 = time.perf_counter()
        ticket.wait()
        call.waited_s += time.perf_counter() - t0
        self.timeline.mark(call.layer, "read")

    def _expert_major(self, call: LayerCall, groups: list[np.ndarray]):
        """More distinct experts than slots: one group at a time, each expert read at
        most once per call; rows computed exactly as in one shot."""
        pool, host = self.pools[call.layer], call.host_ids
        for g in groups:
            t0 = time.perf_counter()
            call.misses += self.loads.fetch(call.layer, g)
            call.waited_s += time.perf_counter() - t0
            yield member(host, g, self.caches[call.layer].num_experts), pool.slots_of(host)

    def complete(self, call: LayerCall, y: mx.array) -> mx.array:
        """Wait for the misses' reads if they are still landing; count the call,
        start its output on the device, track it."""
        if call.before_launch is not None:
            call.before_launch()
        t0 = time.perf_counter()
        st = self.stats[call.layer]
        if call.misses:
            st.fallback += 1
        else:
            st.fastpath += 1
        call.launched()
        mx.async_eval(y)  # the device starts on it while the next layer is built
        st.gap_s += call.launched_at - call.routed_at
        self._track_output(call.layer, y)
        st.host_s += time.perf_counter() - t0
        return y

    def _track_output(self, layer: int, y: mx.array) -> None:
        """Remember a lazy output that reads ``layer``'s pool: it is evaluated before the
        pool is next written behind MLX's back (host and cuda modes)."""
        if self.mode == "mlx":
            return
        if y.nbytes > TRACK_EVAL_BYTES:  # a long prompt's output: settle it now rather
            mx.eval(y)  # than hold its buffer until the pool is next written
            return
        readers = self._readers[layer]
        readers.append(y)
        if len(readers) > 8:  # calls that wrote nothing: settle the older ones
            mx.eval(readers[:-1])
            del readers[:-1]

    def guard(self, layer: int) -> None:
        """Evaluate the outputs still reading ``layer``'s pool (before it is written)."""
        if self._readers[layer]:
            mx.eval(self._readers[layer])  # already evaluated in the usual flow: free
            self._readers[layer].clear()
