"""The device path of a decode step's layer call on CUDA: no host synchronisation.

Where the expert files are mapped, page-locked and mapped into the device's address space
(``map_files`` on CUDA), the device itself can serve a small call's misses. One kernel
(``device_plan``'s ``PLAN``) joins the call's graph, before the expert matmuls. Its first
block looks the routed ids up in a slot table kept in device memory, takes slots for the
misses from the store's own policy (its ranking's state lives beside the table: the same
victims as on the host, to the bit), updates the ranking, and lists (expert, slot) to
fill; then every block copies its share of the listed records from the mapped file into
their slots (the store's ``DeviceReader`` routine, which the host path's misses take
too). Its output is the rows' slot ids, so the matmuls, which read them, run after the
copies.

The host never waits: it builds the next layer at once, as stock mlx-lm does. Every row
is the same matmul on the same bytes as in the host path, so outputs stay bit-identical.

The slot table has one owner at a time. A call the device path cannot take (a prompt,
recording, pins that leave too few slots) first brings the layer's table back to the
host's ``SlotCache`` and its policy (``to_host``), and the next device call sends them
over again (``to_device``): the table and the ranking's arrays are copied whole, so
nothing of the policy's order is lost or rebuilt. Counters come back the same way.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from ..ids import DECODE_IDS, SLOT_IDS
from ..io import cuda
from .calls import LayerCall
from .device_plan import (
    EVICTIONS,
    FAILED,
    FREE,
    HITS,
    LATE,
    MISSED_CALLS,
    MISSES,
    N_COUNTERS,
    POINTERS,
    READS,
    arrays_to_table,
    constants,
    layer_arrays,
    scratch_arrays,
    table_to_arrays,
)
from .device_tier import arrays_to_tier, tier_to_arrays
from .plan_kernel import BLOCKS, MAX_EXPERTS, THREADS, plan_constants, plan_kernel
from .pool import LayerPool, device_address
from .slots import SlotCache
from .stats import LayerStats

if TYPE_CHECKING:
    from ..io.device_reader import DeviceReader


class DevicePathError(RuntimeError):
    """The device path found no slot for a miss (its eligibility check was wrong)."""


def _offsets(arrays: dict[str, np.ndarray], start: int = 0) -> tuple[dict[str, int], int]:
    """16-byte aligned offsets of ``arrays`` packed one after the other; the end."""
    out, pos = {}, start
    for name, a in arrays.items():
        out[name] = pos
        pos += (a.nbytes + 15) // 16 * 16
    return out, pos


class DevicePath:
    """Serves small layer calls of cuda pools on the device (see the module's text).

    Args:
        caches, pools, stats: the store's, per layer (each cache's policy a ``Scored``).
        reader: The store's ``DeviceReader``: the mapped files or the swap tier, and
            their copy routine (with a tier, the tier's tables travel with the slot table).
    """

    def __init__(
        self,
        caches: dict[int, SlotCache],
        pools: dict[int, LayerPool],
        stats: dict[int, LayerStats],
        reader: DeviceReader,
    ):
        self.caches, self.pools, self.stats, self.reader = caches, pools, stats, reader
        self.layers = sorted(caches)
        # a bounded tier: the kernel asks for the records beyond it through a request ring
        self.bounded = reader.swap and reader.tier.partial
        self.rows = {li: reader.tier.rows[li] if self.bounded else None for li in self.layers}
        weights = {tuple(c.policy.w) for c in caches.values()}
        assert len(weights) == 1, "one policy for every layer"
        self.weights = weights.pop()
        for li, c in caches.items():
            if c.num_experts > MAX_EXPERTS:
                raise ValueError(
                    f"layer {li}: {c.num_experts} experts exceed the device path's "
                    f"{MAX_EXPERTS}; use device_reads=False"
                )
        # every layer's table and ranking, the constants, then every layer's scratch, in
        # one device buffer
        self._host: dict[int, dict[str, np.ndarray]] = {}
        self._off: dict[int, dict[str, int]] = {}
        self._span: dict[int, tuple[int, int]] = {}
        pos = 0
        for li in self.layers:
            c = caches[li]
            self._host[li] = layer_arrays(c.num_experts, c.capacity, self.rows[li] or 0)
            self._off[li], end = _offsets(self._host[li], pos)
            self._span[li] = (pos, end)
            pos = end
        const = constants(self.weights)
        const_off, pos = _offsets(const, pos)
        scratch = {}  # zeros, as the buffer starts
        for li in self.layers:
            scratch[li], pos = _offsets(scratch_arrays(), pos)
        total = pos
        mx.clear_cache()  # a fresh device buffer, not a recycled managed one
        self._buf = mx.zeros((total,), mx.uint8)
        mx.eval(self._buf)
        self._addr = device_address(self._buf)
        for name, a in const.items():
            cuda.copy_now(
                self._addr + const_off[name], np.ascontiguousarray(a).ctypes.data, a.nbytes
            )
        self._seen = {li: np.zeros(N_COUNTERS, np.int64) for li in self.layers}
        self.on_device: set[int] = set()  # layers whose table the device owns
        self._outputs: dict[int, mx.array] = {}  # each layer's last device-path output
        self._ptrs = {}
        for li in self.layers:
            off = {**self._off[li], **const_off, **scratch[li]}
            addr = [self._addr + off[name] for name in POINTERS]
            self._ptrs[li] = mx.array(np.array(addr, np.uint64))
        mx.eval(list(self._ptrs.values()))
        self.blocks = BLOCKS  # of the kernel (a probe may change it)
        self._kernels = {}  # by copy word: each kernel's variants
        self._calls = {}  # (layer, routed ids): the kernel call's fixed arguments
        self._prev = {li: mx.zeros((1,), SLOT_IDS) for li in self.layers}  # last outputs

    def _call_args(self, layer: int, n: int) -> tuple:
        """The kernel and its copy description for ``n`` ids of ``layer``."""
        meta, word = self.reader.copy_meta(layer)
        if word not in self._kernels:
            self._kernels[word] = plan_kernel(word)
        c = self.caches[layer]
        consts = plan_constants(
            c.num_experts, c.capacity, n, self.weights, self.reader.swap, self.rows[layer]
        )
        args = (self._kernels[word](consts), meta)
        self._calls[layer, n] = args
        return args

    # ------------------------------------------------------------ calls
    def takes(self, layer: int, indices: mx.array) -> bool:
        """Whether the device path can serve a call of ``indices``: a decode step's few
        ids that fit in the slots the pins leave, in a pool that cannot hold every
        expert (one that can is loaded whole by its first call, on the host)."""
        c = self.caches[layer]
        # a trade needs a victim (a slot freed by a failed load is filled on the host
        # first) and a tier that knows where its records are (else the host refuses)
        if self.reader.swap and (self.reader.tier.broken or (c.expert_in < 0).any()):
            return False
        if self.bounded and indices.size > self.reader.ring.entries:
            return False  # more reads than the ring has entries: the host path
        return not c.whole and indices.size <= min(DECODE_IDS, c.capacity - c.pin_count)

    def slots(self, layer: int, indices: mx.array) -> mx.array:
        """The call's slot ids, lazily: misses filled by the device before use."""
        if layer not in self.on_device:
            self.to_device(layer)
        n = indices.size
        kernel, meta = self._calls.get((layer, n)) or self._call_args(layer, n)
        t0 = time.perf_counter()
        (out,) = kernel(
            inputs=[indices, self._ptrs[layer], meta, self._prev[layer]],
            grid=(self.blocks * THREADS, 1, 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[indices.shape],
            output_dtypes=[SLOT_IDS],
        )
        self._prev[layer] = out  # the layer's next call comes after this one
        st = self.stats[layer]
        st.device_kernel_s += time.perf_counter() - t0
        st.device_calls += 1
        st.fastpath += 1  # until the counters say the call missed
        self.caches[layer].stats.calls += 1
        return out

    def hold(self, call: LayerCall, y: mx.array) -> mx.array:
        """Complete a device-path call: keep its output, evaluated before the host takes
        the table back (then the layer's kernels have run and its slots are read: each
        decode step's output depends on the one before)."""
        self._outputs[call.layer] = y
        return y

    # ------------------------------------------------------------ ownership
    def to_device(self, layer: int) -> None:
        """Send ``layer``'s slot table and its policy's ranking state to the device."""
        c, host = self.caches[layer], self._host[layer]
        assert not c.pending, "a layer's reads must land before the device takes its table"
        table_to_arrays(host, c)
        tier = self.reader.tier
        if self.bounded:  # where the tier holds each record, and what its rule ranks by
            tier_to_arrays(host, tier, c, layer)
        elif self.reader.swap:  # where the tier holds each record, handed over too
            host["home"][:] = tier.home[layer]
        self._seen[layer][:] = host["counters"]
        self._copy(layer, cuda.H2D)
        self.on_device.add(layer)

    def to_host(self, layer: int) -> None:
        """Bring ``layer``'s table and ranking state back to its ``SlotCache`` and
        policy, once the device is done with them; its counters go to the stats."""
        if layer not in self.on_device:
            return
        self._evaluate_output(layer)
        self._copy(layer, cuda.D2H)
        host, c = self._host[layer], self.caches[layer]
        arrays_to_table(host, c)
        if self.bounded:
            arrays_to_tier(host, self.reader.tier, c, layer)
        elif self.reader.swap:
            self.reader.tier.placed(layer, host["home"], host["expert_in"])
        held = np.flatnonzero(c.expert_in >= 0)
        self.pools[layer].set_lut(c.expert_in[held], held)
        self.on_device.discard(layer)  # the host owns the table, even if the count raises
        self._count(layer, host["counters"])

    def run_queued(self) -> None:
        """Evaluate every kernel call still queued (before the reader unmaps the files
        they copy from: a graph evaluated later then finds its slots filled)."""
        mx.eval([*self._outputs.values(), *self._prev.values()])

    def collect_counters(self) -> None:
        """Bring every layer's counters to the stats (tables stay on the device); a
        layer's defect is raised once every layer has been counted."""
        error = None
        for li in sorted(self.on_device):
            self._evaluate_output(li)
            ctr = np.zeros(N_COUNTERS, np.int64)
            src = self._addr + self._off[li]["counters"]
            cuda.copy_now(ctr.ctypes.data, src, ctr.nbytes, cuda.D2H)
            try:
                self._count(li, ctr)
            except DevicePathError as e:
                error = error or e
        if error is not None:
            raise error

    def _evaluate_output(self, layer: int) -> None:
        out = self._outputs.pop(layer, None)
        if out is not None:
            mx.eval(out)  # the layer's kernels have run and no queued matmul reads its slots

    def _copy(self, layer: int, kind: int) -> None:
        """Copy ``layer``'s arrays between the host's packed image and the device."""
        lo, hi = self._span[layer]
        image = np.zeros(hi - lo, np.uint8)
        host, off = self._host[layer], self._off[layer]
        if kind == cuda.H2D:
            for name, a in host.items():
                image[off[name] - lo : off[name] - lo + a.nbytes] = a.reshape(-1).view(np.uint8)
            cuda.copy_now(self._addr + lo, image.ctypes.data, image.nbytes)
            return
        cuda.copy_now(image.ctypes.data, self._addr + lo, image.nbytes, cuda.D2H)
        for name, a in host.items():
            a.reshape(-1).view(np.uint8)[:] = image[off[name] - lo : off[name] - lo + a.nbytes]

    def resident(self, layer: int) -> int:
        """Experts resident in ``layer``'s pool as of the counters last brought back."""
        c = self.caches[layer]
        return c.capacity - int(self._seen[layer][FREE])

    def _count(self, layer: int, ctr: np.ndarray) -> None:
        new = ctr.astype(np.int64)
        d = new - self._seen[layer]
        self._seen[layer] = new.copy()
        c, st = self.caches[layer], self.stats[layer]
        c.stats.hits += int(d[HITS])
        c.stats.misses += int(d[MISSES])
        c.stats.evictions += int(d[EVICTIONS])
        st.fastpath -= int(d[MISSED_CALLS])
        st.fallback += int(d[MISSED_CALLS])
        nbytes = self.pools[layer].layout.record_bytes
        st.records_read += int(d[MISSES])  # placed records, read or traded (as the host's)
        st.bytes_read += int(d[MISSES]) * nbytes
        if self.bounded:  # those not read from the files were trades with the tier
            self.reader.tier.traded_bytes += (int(d[MISSES]) - int(d[READS])) * nbytes
        if d[FAILED]:  # counted above first: the stats keep the calls that ran
            raise DevicePathError(
                f"layer {layer}: the device path found no slot (or, with a swap tier, no "
                f"record) for {d[FAILED]} misses "
                "(a defect: please report it); run with device_reads=False meanwhile"
            )
        if d[LATE]:  # the kernel trapped too: this is read only if the device survived
            ring = None
            with contextlib.suppress(RuntimeError):  # (a stopped ring says nothing)
                ring = self.reader.ring.counters() if self.bounded else None
            raise DevicePathError(
                f"layer {layer}: {d[LATE]} blocks of the device path's kernel gave up "
                "waiting for its plan" + (f" or a record from the request ring ({ring})"
                if ring else "") + "; run with device_reads=False"
            )  # fmt: skip
