"""The device path of a decode step's layer call on CUDA: no host synchronisation.

Where the expert files are mapped, page-locked and mapped into the device's address space
(``map_files`` on CUDA), the device itself can serve a small call's misses. Two kernels
join the call's graph, before the expert matmuls:

* ``plan`` (one warp) looks the routed ids up in a slot table kept in device memory,
  evicts the least recently used slots outside the call for the misses (within one call,
  the lowest expert first, as ``policy.LRU``: the same hits as the simulator's), and
  outputs the rows' slot ids and the list of (expert, slot) to fill;
* ``fill`` (the whole device) copies each listed record's parts from the mapped file into
  its slot, then passes the slot ids on, so that the matmuls, which read them, run after.

The host never waits: it builds the next layer at once, as stock mlx-lm does. Every row
is the same matmul on the same bytes as in the host path, so outputs stay bit-identical.

The slot table has one owner at a time. A call the device path cannot take (a prompt,
recording, pins that leave too few slots) first brings the layer's table back to the
host's ``SlotCache`` (``to_host``), and the next device call sends it over again
(``to_device``), recency order included. Stats are brought back the same way.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..io import cuda
from .calls import LayerCall
from .pool import LayerPool, device_address
from .slots import SlotCache
from .stats import LayerStats

MAX_IDS = 64  # routed ids per call the device path takes (a decode step's)
PINNED = 2**31 - 1  # a pinned slot's stamp: never a victim
COUNTERS = 8  # clock, hits, misses, evictions, calls with misses, failures, spare
FILL_BLOCKS, FILL_THREADS = 1024, 256

_PLAN = """
    int* t = (int*)(st[0]);
    int* slot_of = t;
    int* expert_in = t + E;
    int* stamp = t + E + S;
    int* ctr = t + E + 2 * S;
    const int lane = threadIdx.x;
    __shared__ int clock_now;
    if (lane == 0) {
        clock_now = ctr[0] + 1;
        ctr[0] = clock_now;
    }
    __syncthreads();
    const int clock = clock_now;
    for (int i = lane; i < N; i += 32) {  // this call's resident experts are protected
        int s = slot_of[(int)ids[i]];
        if (s >= 0 && stamp[s] != PINNED) stamp[s] = clock;
    }
    __syncthreads();
    int hits = 0, misses = 0, evicted = 0, failed = 0;
    for (int i = 0; i < N; i++) {
        const int e = (int)ids[i];
        int s = slot_of[e];
        if (s < 0) {  // a miss: the least recently used slot outside the call
            unsigned long long best = ~0ull;
            for (int j = lane; j < S; j += 32) {
                int sj = stamp[j];
                if (sj < clock) {  // oldest first; within a call, lowest expert (as LRU)
                    unsigned long long key = ((unsigned long long)(unsigned)(sj + 1) << 32) |
                                             ((unsigned long long)(expert_in[j] + 1) << 16) |
                                             (unsigned long long)j;
                    best = key < best ? key : best;
                }
            }
            for (int off = 16; off > 0; off >>= 1) {
                unsigned long long o = __shfl_down_sync(0xffffffffu, best, off);
                best = o < best ? o : best;
            }
            if (lane == 0) {
                if (best == ~0ull) {
                    failed++;
                } else {
                    int v = (int)(best & 0xffffull);
                    int old = expert_in[v];
                    if (old >= 0) {
                        slot_of[old] = -1;
                        evicted++;
                    }
                    expert_in[v] = e;
                    slot_of[e] = v;
                    stamp[v] = clock;
                    fills[1 + 2 * misses] = e;
                    fills[2 + 2 * misses] = v;
                    misses++;
                }
            }
            __syncthreads();
            s = slot_of[e];
        } else if (lane == 0) {
            bool again = false;
            for (int j = 0; j < i; j++) again = again || ((int)ids[j] == e);
            hits += again ? 0 : 1;
        }
        if (lane == 0) slots[i] = s < 0 ? 0 : s;
    }
    if (lane == 0) {
        fills[0] = misses;
        ctr[1] += hits;
        ctr[2] += misses;
        ctr[3] += evicted;
        ctr[4] += misses > 0;
        ctr[5] += failed;
    }
"""

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


class DevicePath:
    """Serves small layer calls of cuda pools on the device (see the module's text).

    Args:
        caches, pools, stats: the store's, per layer.
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
        for li, c in caches.items():  # a victim's key packs expert + 1 and slot in 16 bits
            if c.num_experts >= 0xFFFF or c.capacity > 0xFFFF:
                raise ValueError(
                    f"layer {li}: {c.num_experts} experts and {c.capacity} slots exceed the "
                    "device path's 65,534; use device_reads=False"
                )
        self._base: dict[int, int] = {}  # layer -> offset of its table (ints)
        n = 0
        for li in self.layers:
            self._base[li] = n
            n += self._size(li)
        mx.clear_cache()  # a fresh device buffer, not a recycled managed one
        self._table = mx.zeros((n,), mx.int32)  # every layer's table, in device memory
        mx.eval(self._table)
        self._addr = device_address(self._table)
        self._seen = np.zeros((len(self.layers), COUNTERS), np.int64)  # counters taken
        self.on_device: set[int] = set()  # layers whose table the device owns
        self._outputs: dict[int, mx.array] = {}  # each layer's last device-path output
        self._st, self._meta, self._fill = {}, {}, {}
        for li in self.layers:
            self._st[li] = mx.array(np.array([self._addr + 4 * self._base[li]], np.uint64))
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
        mx.eval([*self._st.values(), *(m for m, _ in self._meta.values())])
        self._kernel = mx.fast.cuda_kernel(
            name="mlxs_plan",
            input_names=["ids", "st"],
            output_names=["slots", "fills"],
            source=_PLAN.replace("PINNED", str(PINNED)),
        )

    def _size(self, li: int) -> int:
        c = self.caches[li]
        return c.num_experts + 2 * c.capacity + COUNTERS

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
        """Whether the device path can serve a call of ``indices`` (fits in the slots
        the pins leave)."""
        c = self.caches[layer]
        return indices.size <= min(MAX_IDS, c.capacity - c.pin_count)

    def slots(self, layer: int, indices: mx.array) -> mx.array:
        """The call's slot ids, lazily: misses filled by the device before use."""
        if layer not in self.on_device:
            self.to_device(layer)
        c = self.caches[layer]
        n = indices.size
        slots, fills = self._kernel(
            inputs=[indices, self._st[layer]],
            template=[("N", n), ("E", c.num_experts), ("S", c.capacity)],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
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
        """Send ``layer``'s slot table (and its policy's eviction order) to the device."""
        c = self.caches[layer]
        c.flush()
        assert not c.pending, "a layer's reads must land before the device takes its table"
        stamp = np.full(c.capacity, -1, np.int32)
        resident = c.expert_in[c.expert_in >= 0]
        pins = c.pinned
        order = c.policy.victims(len(resident) - len(pins), protect=pins)
        stamp[c.slot_of[np.asarray(order, np.int64)]] = np.arange(len(order), dtype=np.int32)
        for e in pins:
            stamp[c.slot_of[e]] = PINNED
        head = np.concatenate([c.slot_of, c.expert_in, stamp, [len(order)]]).astype(np.int32)
        cuda.copy_now(self._addr + 4 * self._base[layer], head.ctypes.data, head.nbytes)
        self.on_device.add(layer)

    def to_host(self, layer: int) -> None:
        """Bring ``layer``'s table back to its ``SlotCache``, once the device is done with
        it; its counters go to the stats."""
        if layer not in self.on_device:
            return
        t = self._read(layer)
        c, pool = self.caches[layer], self.pools[layer]
        E, S = c.num_experts, c.capacity
        slot_of, expert_in, stamp = t[:E], t[E : E + S], t[E + S : E + 2 * S]
        policy = c.policy
        for e in c.expert_in[c.expert_in >= 0].tolist():
            policy.remove(e)
        held = np.flatnonzero(expert_in >= 0)
        for s in held[np.lexsort((expert_in[held], stamp[held]))].tolist():  # LRU's order
            policy.insert(int(expert_in[s]))
        c.set_tables(slot_of, expert_in)
        pool.set_lut(expert_in[held], held)
        self._count(layer, t[E + 2 * S :])
        self.on_device.discard(layer)

    def settle_stats(self) -> None:
        """Bring every layer's counters to the stats (tables stay on the device)."""
        for li in sorted(self.on_device):
            c = self.caches[li]
            t = self._read(li)
            self._count(li, t[c.num_experts + 2 * c.capacity :])

    def _read(self, layer: int) -> np.ndarray:
        out = self._outputs.pop(layer, None)
        if out is not None:
            mx.eval(out)  # the layer's kernels have run and no queued matmul reads its slots
        host = np.zeros(self._size(layer), np.int32)
        src = self._addr + 4 * self._base[layer]
        cuda.copy_now(host.ctypes.data, src, host.nbytes, cuda.D2H)
        return host

    def _count(self, layer: int, ctr: np.ndarray) -> None:
        i = self.layers.index(layer)
        new = ctr.astype(np.int64)
        d = new - self._seen[i]
        self._seen[i] = new
        if d[5]:
            raise DevicePathError(
                f"layer {layer}: the device path found no free slot for {d[5]} misses"
            )
        c, st = self.caches[layer], self.stats[layer]
        c.stats.hits += int(d[1])
        c.stats.misses += int(d[2])
        c.stats.evictions += int(d[3])
        st.fastpath -= int(d[4])
        st.fallback += int(d[4])
        nbytes = self.pools[layer].layout.record_bytes
        st.records_read += int(d[2])
        st.bytes_read += int(d[2]) * nbytes


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
