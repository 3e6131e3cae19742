"""The device path of a decode step's layer call on CUDA: no host synchronisation.

Where the expert files are mapped, page-locked and mapped into the device's address space
(``map_files`` on CUDA), the device itself can serve a small call's misses. Two kernels
join the call's graph, before the expert matmuls:

* ``plan`` (``device_plan``: one block) looks the routed ids up in a slot table kept in
  device memory, takes slots for the misses from the store's own policy (its ranking's
  state lives beside the table: the same victims as on the host, to the bit), updates
  the ranking, and outputs the rows' slot ids and the list of (expert, slot) to fill;
* ``fill`` (the whole device) copies each listed record's parts from the mapped file into
  its slot, then passes the slot ids on, so that the matmuls, which read them, run after.

The host never waits: it builds the next layer at once, as stock mlx-lm does. Every row
is the same matmul on the same bytes as in the host path, so outputs stay bit-identical.

The slot table has one owner at a time. A call the device path cannot take (a prompt,
recording, pins that leave too few slots) first brings the layer's table back to the
host's ``SlotCache`` and its policy (``to_host``), and the next device call sends them
over again (``to_device``): the table and the ranking's arrays are copied whole, so
nothing of the policy's order is lost or rebuilt. Counters come back the same way.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..io import cuda
from .calls import LayerCall
from .device_plan import (
    EVICTIONS,
    FAILED,
    FREE,
    HITS,
    MAX_EXPERTS,
    MAX_IDS,
    MISSED_CALLS,
    MISSES,
    N_COUNTERS,
    PLAN,
    POINTERS,
    THREADS,
    constants,
    layer_arrays,
    template,
)
from .pool import LayerPool, device_address
from .slots import SlotCache
from .stats import LayerStats

FILL_BLOCKS, FILL_THREADS = 1024, 256

_FILL = """
    const char* src = (const char*)(meta[0]);
    const int64_t stride = meta[1];
    const int parts = (int)meta[2];
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nth = (long long)gridDim.x * blockDim.x;
    if (tid < N) out[tid] = slots[tid];
    const int n = fills[0];
    for (int k = 0; k < n; k++) {
        const char* rec = src + (int64_t)fills[1 + 2 * k] * stride;
        const int64_t slot = fills[2 + 2 * k];
        for (int p = 0; p < parts; p++) {
            const int64_t* q = meta + 3 + 4 * p;  // offset, bytes, address, row bytes
            const WORD* a = (const WORD*)(rec + q[0]);
            WORD* b = (WORD*)((char*)(q[2]) + slot * q[3]);
            const long long words = q[1] / (int64_t)sizeof(WORD);
            for (long long w = tid; w < words; w += nth) b[w] = a[w];
        }
    }
"""
_HEADER = "struct __align__(16) mlxs_w16 { unsigned long long x, y; };"
_WORDS = {16: "mlxs_w16", 8: "unsigned long long", 4: "unsigned int", 1: "unsigned char"}


class DevicePathError(RuntimeError):
    """The device path found no slot for a miss (its eligibility check was wrong)."""


def _word(values: list[int]) -> int:
    """The widest copy word dividing every offset, size and address."""
    return next(w for w in _WORDS if all(v % w == 0 for v in values))


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
        sources: ``{layer: host address}`` of each layer's page-locked file mapping.
        strides: ``{layer: record stride}`` in those files.
    """

    def __init__(
        self,
        caches: dict[int, SlotCache],
        pools: dict[int, LayerPool],
        stats: dict[int, LayerStats],
        sources: dict[int, int],
        strides: dict[int, int],
    ):
        self.caches, self.pools, self.stats = caches, pools, stats
        self.layers = sorted(caches)
        weights = {tuple(c.policy.w) for c in caches.values()}
        assert len(weights) == 1, "one policy for every layer"
        self.weights = weights.pop()
        for li, c in caches.items():
            if c.num_experts > MAX_EXPERTS:
                raise ValueError(
                    f"layer {li}: {c.num_experts} experts exceed the device path's "
                    f"{MAX_EXPERTS}; use device_reads=False"
                )
        # every layer's table and ranking, then the constants, in one device buffer
        self._host: dict[int, dict[str, np.ndarray]] = {}
        self._off: dict[int, dict[str, int]] = {}
        self._span: dict[int, tuple[int, int]] = {}
        pos = 0
        for li in self.layers:
            c = caches[li]
            self._host[li] = layer_arrays(c.num_experts, c.capacity)
            self._off[li], end = _offsets(self._host[li], pos)
            self._span[li] = (pos, end)
            pos = end
        const = constants(self.weights)
        const_off, total = _offsets(const, pos)
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
        self._ptrs, self._meta, self._fill = {}, {}, {}
        for li in self.layers:
            off = {**self._off[li], **const_off}
            addr = [self._addr + off[name] for name in POINTERS]
            self._ptrs[li] = mx.array(np.array(addr, np.uint64))
            self._meta[li] = self._layer_meta(li, sources[li], strides[li])
            word = self._meta[li][1]
            if word not in self._fill:
                self._fill[word] = mx.fast.cuda_kernel(
                    name=f"mlxs_fill_{word}",
                    input_names=["fills", "slots", "meta"],
                    output_names=["out"],
                    source=_FILL.replace("WORD", _WORDS[word]),
                    header=_HEADER,
                )
        mx.eval([*self._ptrs.values(), *(m for m, _ in self._meta.values())])
        self._kernel = mx.fast.cuda_kernel(
            name="mlxs_plan",
            input_names=["ids", "p"],
            output_names=["slots", "fills"],
            source=PLAN,
        )

    def _layer_meta(self, li: int, source: int, stride: int) -> tuple[mx.array, int]:
        pool = self.pools[li]
        src = cuda.device_pointer(source)
        meta, checked = [src, stride, len(pool.layout.parts)], [src, stride]
        for p, (addr, row) in zip(pool.layout.parts, pool.row_pointers()):
            meta += [p.offset, p.nbytes, addr, row]
            checked += [p.offset, p.nbytes, addr, row]
        return mx.array(np.array(meta, np.int64)), _word(checked)

    # ------------------------------------------------------------ calls
    def takes(self, layer: int, indices: mx.array) -> bool:
        """Whether the device path can serve a call of ``indices``: a decode step's few
        ids that fit in the slots the pins leave, in a pool that cannot hold every
        expert (one that can is loaded whole by its first call, on the host)."""
        c = self.caches[layer]
        return c.capacity < c.num_experts and indices.size <= min(MAX_IDS, c.capacity - c.pin_count)

    def slots(self, layer: int, indices: mx.array) -> mx.array:
        """The call's slot ids, lazily: misses filled by the device before use."""
        if layer not in self.on_device:
            self.to_device(layer)
        c = self.caches[layer]
        n = indices.size
        slots, fills = self._kernel(
            inputs=[indices, self._ptrs[layer]],
            template=template(c.num_experts, c.capacity, n, self.weights),
            grid=(THREADS, 1, 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[indices.shape, (1 + 2 * n,)],
            output_dtypes=[mx.int32, mx.int32],
        )
        meta, word = self._meta[layer]
        (out,) = self._fill[word](
            inputs=[fills, slots, meta],
            template=[("N", n)],
            grid=(FILL_BLOCKS * FILL_THREADS, 1, 1),
            threadgroup=(FILL_THREADS, 1, 1),
            output_shapes=[indices.shape],
            output_dtypes=[mx.int32],
        )
        st = self.stats[layer]
        st.device_calls += 1
        st.fastpath += 1  # until the counters say the call missed
        c.stats.calls += 1
        return out

    def done(self, call: LayerCall, y: mx.array) -> mx.array:
        """Complete a device-path call: keep its output, evaluated before the host takes
        the table back (then the layer's kernels have run and its slots are read: each
        decode step's output depends on the one before)."""
        self._outputs[call.layer] = y
        return y

    # ------------------------------------------------------------ ownership
    def to_device(self, layer: int) -> None:
        """Send ``layer``'s slot table and its policy's ranking state to the device."""
        c = self.caches[layer]
        c.flush()
        assert not c.pending, "a layer's reads must land before the device takes its table"
        host = self._host[layer]
        host["slot_of"][:], host["expert_in"][:] = c.slot_of, c.expert_in
        for name, a in c.policy.state.items():
            host[name][...] = a
        host["counters"][:] = 0
        host["counters"][FREE] = int((c.expert_in < 0).sum())
        self._seen[layer][:] = host["counters"]
        self._copy(layer, cuda.H2D)
        self.on_device.add(layer)

    def to_host(self, layer: int) -> None:
        """Bring ``layer``'s table and ranking state back to its ``SlotCache`` and
        policy, once the device is done with them; its counters go to the stats."""
        if layer not in self.on_device:
            return
        self._settle(layer)
        self._copy(layer, cuda.D2H)
        host, c = self._host[layer], self.caches[layer]
        for name, a in c.policy.state.items():
            a[...] = host[name]
        c.set_tables(host["slot_of"], host["expert_in"])
        held = np.flatnonzero(c.expert_in >= 0)
        self.pools[layer].set_lut(c.expert_in[held], held)
        self._count(layer, host["counters"])
        self.on_device.discard(layer)

    def settle_stats(self) -> None:
        """Bring every layer's counters to the stats (tables stay on the device)."""
        for li in sorted(self.on_device):
            self._settle(li)
            ctr = np.zeros(N_COUNTERS, np.int64)
            src = self._addr + self._off[li]["counters"]
            cuda.copy_now(ctr.ctypes.data, src, ctr.nbytes, cuda.D2H)
            self._count(li, ctr)

    def _settle(self, layer: int) -> None:
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

    def _count(self, layer: int, ctr: np.ndarray) -> None:
        new = ctr.astype(np.int64)
        d = new - self._seen[layer]
        self._seen[layer] = new.copy()
        if d[FAILED]:
            raise DevicePathError(
                f"layer {layer}: the device path found no free slot for {d[FAILED]} misses"
            )
        c, st = self.caches[layer], self.stats[layer]
        c.stats.hits += int(d[HITS])
        c.stats.misses += int(d[MISSES])
        c.stats.evictions += int(d[EVICTIONS])
        st.fastpath -= int(d[MISSED_CALLS])
        st.fallback += int(d[MISSED_CALLS])
        nbytes = self.pools[layer].layout.record_bytes
        st.records_read += int(d[MISSES])
        st.bytes_read += int(d[MISSES]) * nbytes


def device_path(store, checksums: bool) -> DevicePath:
    """The device path of ``store`` (``device_reads``), over its native reader's
    page-locked mappings; with ``checksums`` every record is checked on the host first.

    Raises:
        ValueError: no cuda pools, or no mapped files.
        ExpertChecksumError: a corrupt record.
    """
    native = store.native
    if store.pool_mode != "cuda" or native is None or not native.sources:
        raise ValueError(
            "device_reads needs cuda pools and the native reader's page-locked mappings "
            f"(here pool mode {store.pool_mode!r}, reader {store.reader_name!r}, "
            f"mapped files {bool(native and native.sources)}): run on MLX's CUDA build "
            "with map_files on"
        )
    if checksums:
        for li in store.layers:
            native.verify_mapped(li)
    strides = {li: store.meta.layers[li].stride for li in store.layers}
    pools = {li: store.pool(li) for li in store.layers}
    return DevicePath(store.caches, pools, store.stats, native.sources, strides)
