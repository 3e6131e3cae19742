"""The device reader (CUDA, expert files mapped, or a swap tier): the GPU copies records
into pool slots itself, from page-locked mappings of the expert files
(``filemap.FileMaps``), or trades them with a swap tier's page-locked slots
(``tier.SwapTier``), in the graph of the call that needs them.

One routine, ``mlxs_copy`` (``COPY_HEADER``), copies the records a list names (``[n, e0,
s0, e1, s1...]``: expert, slot) into their slots' part rows. The host path gives that
list from the host (``start``), through the kernel ``fill``, which then passes the slot ids
it was given on: the matmuls that read them run after it. The device path's kernel plans
the list on the GPU and runs the same routine (``copy_meta`` gives it the layer's
description). Either way the copy is queued on MLX's stream, behind every computation
queued before it and ahead of every one after, so nothing waits on the host. Every
record's checksum is checked on the host when the reader opens (the GPU copies without
checking).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..ids import SLOT_IDS
from . import cuda
from .filemap import FileMaps
from .futures import Done
from .kernels import Kernels

FILL_BLOCKS, FILL_THREADS = 1024, 256

# The one copy routine, shared with the device path's plan kernel (``device_plan``):
# ``mlxs_parts`` moves one record's parts between a source laid out as the file's record
# and a pool slot, in words of ``W``, by thread ``tid`` of ``nth``: ``MLXS_IN`` the record
# into the slot, ``MLXS_SWAP`` they trade (each word exchanged by the one thread that owns
# it), ``MLXS_OUT`` the slot into the record, ``MLXS_FRESH`` as ``IN`` reading the source
# past the caches (a record the host wrote). ``mlxs_copy`` runs it over a fills list
# (``[n, r0, s0, r1, s1...]``), in or (``SWAP``) trading. ``meta``: the layer's source
# address, stride, part count, then per part its offset, bytes, pool address, row bytes.
COPY_HEADER = """
struct __align__(16) mlxs_w16 { unsigned long long x, y; };
template <typename W> __device__ __forceinline__ W mlxs_ldcv(const W* p) { return __ldcv(p); }
template <> __device__ __forceinline__ mlxs_w16 mlxs_ldcv<mlxs_w16>(const mlxs_w16* p) {
    const ulonglong2 v = __ldcv((const ulonglong2*)p);
    return mlxs_w16{v.x, v.y};
}
enum { MLXS_IN = 0, MLXS_SWAP = 1, MLXS_OUT = 2, MLXS_FRESH = 3 };
template <typename W, int MODE>
__device__ void mlxs_parts(char* rec, int64_t slot, const int64_t* meta, long long tid,
                           long long nth) {
    const int parts = (int)meta[2];
    for (int p = 0; p < parts; p++) {
        const int64_t* q = meta + 3 + 4 * p;
        W* a = (W*)(rec + q[0]);
        W* b = (W*)((char*)(q[2]) + slot * q[3]);
        const long long words = q[1] / (int64_t)sizeof(W);
        for (long long w = tid; w < words; w += nth) {
            if (MODE == MLXS_FRESH) {
                b[w] = mlxs_ldcv(a + w);
                continue;
            }
            const W x = a[w];
            if (MODE != MLXS_IN) a[w] = b[w];  // the slot's word goes where the record's was
            if (MODE != MLXS_OUT) b[w] = x;
        }
    }
}
template <typename W, int SWAP>
__device__ void mlxs_copy(const int* f, const int64_t* meta, long long tid, long long nth) {
    char* src = (char*)(meta[0]);
    for (int k = 0; k < f[0]; k++) {
        if (f[1 + 2 * k] < 0) continue;  // no record (a defect the planner counted)
        mlxs_parts<W, SWAP ? MLXS_SWAP : MLXS_IN>(src + (int64_t)f[1 + 2 * k] * meta[1],
                                                  f[2 + 2 * k], meta, tid, nth);
    }
}
"""
_FILL = """
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nth = (long long)gridDim.x * blockDim.x;
    if (tid < N) out[tid] = slots[tid];
    mlxs_copy<WORD, SWAP>(fills, meta, tid, nth);
"""
FILL_NAMES = (["fills", "slots", "meta"], ["out"])  # the fill kernel's inputs, outputs
_WORDS = {16: "mlxs_w16", 8: "unsigned long long", 4: "unsigned int", 1: "unsigned char"}


def copy_reference(fills, source: np.ndarray, pool: np.ndarray, swap: bool = False) -> None:
    """``mlxs_copy`` on numpy rows of whole records (``source [R, stride]``, ``pool [S,
    stride]``), for tests: each listed record into its slot; with ``swap`` they trade."""
    pairs = np.asarray(fills[1 : 1 + 2 * int(fills[0])], np.int64).reshape(-1, 2)
    for r, s in pairs:
        if swap:
            source[r], pool[s] = pool[s].copy(), source[r].copy()
        else:
            pool[s] = source[r]


def copy_kernel(
    name: str, source: str, word: int, input_names: list[str], output_names, header: str = ""
):
    """The variants (``kernels.Kernels``) of a CUDA kernel whose ``source`` calls
    ``mlxs_copy<WORD, SWAP>``, for copy words of ``word`` bytes (its constants give
    ``SWAP``); ``header``: more device routines, after ``COPY_HEADER``."""
    return Kernels(
        f"{name}_{word}",
        source.replace("WORD", _WORDS[word]),
        input_names,
        output_names,
        header=COPY_HEADER + header,
    )


def _word(values: list[int]) -> int:
    """The widest copy word dividing every offset, size and address."""
    return next(w for w in _WORDS if all(v % w == 0 for v in values))


class DeviceReader:
    """Copies records into cuda pool slots on the GPU (see the module's text), from the
    mapped files, or trading them with a swap tier (``tier.SwapTier``: ``swap``).

    Args:
        meta: The expert directory's ``ExpertMeta``.
        pools: ``{layer: LayerPool}`` (cuda pools).
        checksums: Check every record on the host first (the tier checks as it loads).
        tier: A ``SwapTier`` of ``pools`` (page-locked, device-mapped) instead of the
            mapped files; the reader closes it.
        files: A partial tier's reader of the records outside it (the native reader);
            the reader closes it.
        tick: Called after each layer's file is mapped and after each is checked (e.g.
            a pipeline's ``Pace.tick``).

    Raises:
        OSError: a file could not be mapped or page-locked (the message says which).
        ExpertChecksumError: a corrupt record (naming the file and the expert).
    """

    wave = None  # any number of records per start

    def __init__(
        self,
        meta,
        pools: dict,
        checksums: bool = True,
        tier=None,
        files=None,
        tick: Callable[[], None] | None = None,
    ):
        self.meta, self.pools, self.tier, self.swap = meta, pools, tier, tier is not None
        self.files = files  # a partial tier's: the store's reader of the rest
        self.maps = self.ring = None
        try:
            if tier is None:
                self.maps = FileMaps(meta, sorted(pools), cuda=cuda, tick=tick)
                checked = {li: np.zeros(meta.layers[li].num_experts, np.uint8) for li in pools}
                for li in sorted(pools) if checksums else ():
                    self.maps.verify(li, checked[li])
                    if tick is not None:
                        tick()
            self._meta, self._kernels = {}, {}
            for li in sorted(pools):
                self._meta[li] = self._layer_meta(li)
                word = self._meta[li][1]
                if word not in self._kernels:
                    self._kernels[word] = copy_kernel("mlxs_fill", _FILL, word, *FILL_NAMES)
            mx.eval([m for m, _ in self._meta.values()])
        except BaseException:
            self._release()
            raise

    @property
    def mapped_bytes(self) -> int:
        return self.tier.nbytes if self.swap else self.maps.nbytes

    def _layer_meta(self, li: int) -> tuple[mx.array, int]:
        pool, stride = self.pools[li], self.meta.layers[li].stride
        src = self.tier.sources[li] if self.swap else cuda.device_pointer(self.maps.sources[li])
        meta, checked = [src, stride, len(pool.layout.parts)], [src, stride]
        for p, (addr, row) in zip(pool.layout.parts, pool.row_pointers()):
            meta += [p.offset, p.nbytes, addr, row]
            checked += [p.offset, p.nbytes, addr, row]
        return mx.array(np.array(meta, np.int64)), _word(checked)

    def open_ring(self) -> None:
        """A bounded tier's device path: a request ring over the files' reader, through
        which the plan kernel asks for the records beyond the tier (``io.ring``); each
        layer's copy description then names it (``device_tier.TIER_COPY``'s ``meta``)."""
        from .ring import DEVICE_ENTRIES, DEVICE_READERS, RequestRing

        ring = self.ring = RequestRing(self.files, DEVICE_ENTRIES, DEVICE_READERS, cuda=cuda)
        for li, (meta, word) in self._meta.items():
            at = [ring.device_words, ring.device_staging, ring.stride, self.files.pos[li]]
            extra = mx.array(np.array([*at, ring.entries], np.int64))
            self._meta[li] = mx.concatenate([meta, extra]), _word([word, *at[1:3]])
        mx.eval([m for m, _ in self._meta.values()])

    def copy_meta(self, layer: int) -> tuple[mx.array, int]:
        """``layer``'s copy description (``COPY_HEADER``'s ``meta``) and its copy word
        (bytes), for a kernel that copies records itself (``copy_kernel``)."""
        return self._meta[layer]

    def fill(self, layer: int, fills: mx.array, slots: mx.array) -> mx.array:
        """Copy the records ``fills`` names into their slots, lazily; returns ``slots``
        once they are in (an array the matmuls then read)."""
        meta, word = self._meta[layer]
        (out,) = self._kernels[word]((("N", slots.size), ("SWAP", int(self.swap))))(
            inputs=[fills, slots, meta],
            grid=(FILL_BLOCKS * FILL_THREADS, 1, 1),
            threadgroup=(FILL_THREADS, 1, 1),
            output_shapes=[slots.shape],
            output_dtypes=[slots.dtype],
        )
        return out

    def start(self, layer: int, experts, slots) -> Done:
        """Queue the copies of records ``experts`` into ``slots`` on MLX's stream now
        (the host path: its computations on these slots are queued after)."""
        if self.swap:  # the tier's trades (tier.SwapTier.take), by the fill kernel
            return self.tier.take(layer, experts, slots, self._trade, self.files)
        self._queue(layer, experts, slots)
        return Done(len(experts) * self.meta.layers[layer].record_bytes)

    def _trade(self, layer: int, trades):
        """Queue the exchanges of ``trades`` (tier row, slot); a wait for them."""
        out = self._queue(layer, [h for h, _ in trades], [s for _, s in trades])
        return lambda: mx.eval(out)

    def _queue(self, layer: int, records, slots) -> mx.array:
        n = len(records)
        fills = np.empty(1 + 2 * n, np.int32)
        fills[0], fills[1::2], fills[2::2] = n, records, slots
        out = self.fill(layer, mx.array(fills), mx.zeros((1,), SLOT_IDS))
        mx.async_eval(out)
        return out

    def read_gbps(self) -> float:  # the GPU's copies are timed with its work, not apart
        return self.files.read_gbps() if self.files is not None else 0.0

    def reset_counters(self) -> None:
        if self.tier is not None:
            self.tier.traded_bytes = 0
        if self.files is not None:
            self.files.reset_counters()

    def close(self) -> None:
        try:
            mx.synchronize()  # no kernel reads the mappings (or the tier) any more
        finally:  # a device that failed (a kernel's trap) runs nothing more
            self._release()

    def _release(self) -> None:
        try:
            if self.ring is not None:  # its threads read with the files' reader
                self.ring.close()
            if self.files is not None:
                self.files.close()
        finally:
            if self.tier is not None:
                self.tier.close()
            if self.maps is not None:
                self.maps.close()
