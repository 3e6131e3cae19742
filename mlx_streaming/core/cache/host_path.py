"""The host path of a layer call: the routing read on the host, the misses loaded by
the store's ``Loader``, the rows computed in steps.

One host synchronisation per call reads the routing (on CUDA a decode step's through
page-locked host memory the device reads, ``io.transfers``, as is a read-ahead
predictor's guess); the layer's shared experts are launched after it, apart, and compute
while the host plans. While the device computes the routing, the host applies the
previous call's policy update. Then the misses start loading at once, while the expert
graph is built (launched once they have landed); with overlap, the resident experts' rows
form a first step that needs no wait.
A call with more distinct experts than slots runs expert-major: one group of experts at
a time, each read at most once per call.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..ids import DECODE_IDS
from ..io.transfers import IdTransfers
from .calls import LayerCall, Step
from .loads import Loader, Ticket
from .pool import LayerPool
from .recording import RoutingCounts
from .slots import SlotCache
from .stats import LayerStats, Timeline


def distinct(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_counts=True)``, cheaper for a decode step's few ids."""
    if ids.size > DECODE_IDS:
        return np.unique(ids, return_counts=True)
    flat = ids.ravel().tolist()
    u = sorted(set(flat))
    if len(u) == len(flat):
        counts = np.ones(len(u), np.int64)
    else:
        counts = np.array([flat.count(e) for e in u], np.int64)
    return np.array(u, dtype=ids.dtype), counts


def member(values: np.ndarray, ids: np.ndarray, size: int) -> np.ndarray:
    """``np.isin(values, ids)`` for ids below ``size``, by a table (cheaper); a decode
    step's few values by a set (up to ``DECODE_IDS``)."""
    if values.size <= DECODE_IDS:
        want = set(ids.tolist())
        return np.array([v in want for v in values.ravel().tolist()], bool).reshape(values.shape)
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
        loads: Loader,
        routing: RoutingCounts,
        observers: list[Callable],
        timeline: Timeline,
        transfers: IdTransfers | None,
        late: bool = True,
    ):
        self.caches, self.pools, self.stats, self.loads = caches, pools, stats, loads
        self.routing, self.observers, self.timeline = routing, observers, timeline
        self.transfers = transfers  # cuda pools: a decode step's ids through shared memory
        self._previous: int | None = None  # the layer last served
        self.late = late  # one-step calls on host pools may be planned at finish
        self._tickets: dict[int, Ticket] = {}  # per layer: its call's load, until waited

    def call(
        self,
        layer: int,
        indices: mx.array,
        overlap: bool = True,
        also: mx.array | None = None,
        beside: mx.array | None = None,
    ) -> LayerCall:
        """Launch the routing (with ``also``), then read it, start the misses' reads and
        plan the steps; ``beside`` computes after the routing, in its own launch, while
        the host plans. A call that is sure to be one step of every row on a host pool
        (no overlap split, no guess, at most as many rows as unpinned slots) is planned
        late: its graph is built on the pool's table (``call.slots``) while the device
        computes the routing, and ``finish`` plans it and fills the table before the
        launch."""
        t0 = time.perf_counter()
        self.timeline.mark(layer, "request")
        cache, st = self.caches[layer], self.stats[layer]
        transfers = self.transfers
        done = transfers.start(indices) if transfers is not None else None
        guess = transfers.start(also, 1) if transfers is not None and also is not None else None
        wanted = [indices if done is None else done]
        wanted += [] if also is None else [also if guess is None else guess]
        mx.async_eval(wanted)  # the device computes the routing while the host works
        if beside is not None:  # apart: the routing's wait does not include it
            mx.async_eval(beside)
        if self._previous is not None:
            self.loads.flush(self._previous)
        self._previous = layer
        st.ahead_s += time.perf_counter() - t0
        self.timeline.mark(layer, "ahead")
        pool = self.pools[layer]
        if (
            self.late
            and pool.mode == "host"
            and not overlap
            and also is None
            and indices.size + cache.pin_count <= cache.capacity
        ):
            return LayerCall(layer, "host", slots=pool.device_lut()[indices], routing=indices)
        call = LayerCall(layer, "host")
        self._plan(call, indices, wanted, done, also, guess, overlap)
        return call

    def _plan(self, call: LayerCall, indices, wanted, done, also, guess, overlap) -> None:
        """Read the routing (the call's one host synchronisation), start the misses'
        reads, plan the steps."""
        layer, t1 = call.layer, time.perf_counter()
        cache, st, transfers = self.caches[layer], self.stats[layer], self.transfers
        # mx.eval first: it raises what the graph's evaluation raised (a lost pipeline
        # peer), where a numpy conversion would not (MLX 0.32)
        mx.eval(wanted)
        host = np.array(indices) if done is None else transfers.read(indices)
        t0 = time.perf_counter()  # host time counts the store's own work, not the wait
        self.timeline.mark(layer, "routed")
        st.sync_s += t0 - t1
        st.host_calls += 1
        for obs in self.observers:
            obs(layer, host)
        experts, counts = distinct(host)
        if self.routing.on:
            self.routing.add(layer, experts, counts)
        self.loads.finish_read_aheads(layer, experts)
        groups = cache.groups(experts, counts)
        self.timeline.mark(layer, "grouped")  # then the loads begin: policy, trades, reads
        call.host_ids, call.routed_at = host, t0
        if also is not None:
            call.also = np.array(also) if guess is None else transfers.read(also, 1)
        if len(groups) == 1:
            self._one_group(call, groups[0], overlap)
        else:  # expert-major: each group loaded before its step; steps reuse slots
            call.steps = [Step(member(host, g, cache.num_experts), group=g) for g in groups]
            call.evaluate_each = True
        st.host_s += time.perf_counter() - t0
        self.timeline.mark(layer, "planned")

    def _one_group(self, call: LayerCall, experts: np.ndarray, overlap: bool) -> None:
        """The steps of a call whose experts fit. The misses' reads start now. With
        ``overlap`` (and some experts resident) the resident rows form a first step that
        does not wait for them; otherwise one step runs every row, its graph built on the
        reserved slots while the reads land (``finish`` waits before the launch)."""
        t0 = time.perf_counter()
        ticket = self._tickets[call.layer] = self.loads.begin(call.layer, experts)
        call.misses = len(ticket.misses)
        call.reads_at = t0 if call.misses else None
        if overlap and 0 < call.misses < len(experts):
            miss = member(call.host_ids, ticket.misses, self.caches[call.layer].num_experts)
            call.steps = [Step(~miss), Step(miss, after_reads=True)]
        else:
            call.steps = [Step()]
            call.wait_at_launch = True

    def step(self, call: LayerCall, i: int) -> tuple[np.ndarray | None, np.ndarray]:
        """Step ``i``'s rows and the slot of every row, once its experts are resident (or
        reserved, for a step launched after the reads: see ``finish``)."""
        s, pool, host = call.steps[i], self.pools[call.layer], call.host_ids
        if s.group is not None:
            t0 = time.perf_counter()
            loaded = self.loads.fetch(call.layer, s.group)
            dt = time.perf_counter() - t0
            call.misses += loaded
            call.waited_s += dt
            if loaded:  # reads were in flight (as a one-group call counts them)
                self.stats[call.layer].demand_s += dt
            return s.rows, pool.slots_of(host)
        if s.after_reads:
            self.wait(call)
            return s.rows, pool.slots_of(host)
        placed = self._tickets[call.layer].placed if call.wait_at_launch else ()
        # the misses' slots are reserved (resident once they land)
        return s.rows, pool.slots_of(host, {e: slot for e, slot, _ in placed})

    def wait(self, call: LayerCall) -> None:
        """Wait for the misses' reads of ``call`` (a one-group call) and commit them; once
        per call (a second wait is a bug in the caller and raises)."""
        t0 = time.perf_counter()
        ticket = self._tickets.pop(call.layer, None)
        if ticket is None:
            raise RuntimeError(f"layer {call.layer}: no reads to wait for (waited twice?)")
        ticket.wait()
        t1 = time.perf_counter()
        call.waited_s += t1 - t0
        if call.reads_at is not None:
            self.stats[call.layer].demand_s += t1 - call.reads_at
        self.timeline.mark(call.layer, "read")

    def finish(self, call: LayerCall, y: mx.array) -> mx.array:
        """Plan a late call (its graph ``y`` is built, not launched); wait for the
        misses' reads if they are still landing; count the call, start its output on
        the device, track it."""
        if call.routing is not None:  # late: the routing is read and the table filled now
            indices, call.routing = call.routing, None
            self._plan(call, indices, [indices], None, None, None, overlap=False)
            if call.steps != [Step()]:  # request's test for a late call promises one step
                raise RuntimeError(f"layer {call.layer}: a late call planned {call.steps}")
        if call.wait_at_launch:
            self.wait(call)
        t0 = time.perf_counter()
        st = self.stats[call.layer]
        if call.misses:
            st.fallback += 1
        else:
            st.fastpath += 1
        launched(call)
        mx.async_eval(y)  # the device starts on it while the next layer is built
        self.timeline.mark(call.layer, "built")
        st.gap_s += call.launched_at - call.routed_at
        self.loads.outputs.track(call.layer, y)
        st.host_s += time.perf_counter() - t0
        return y


def launched(call: LayerCall) -> None:
    """Note that expert work of ``call`` was just handed to the device."""
    if call.launched_at is None:
        call.launched_at = time.perf_counter()
