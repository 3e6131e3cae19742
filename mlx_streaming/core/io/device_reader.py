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

import contextlib
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..ids import SLOT_IDS
from . import cuda
from .filemap import FileMaps
from .futures import Done
from .kernels import Kernels
from .ring import READ_WAIT_S

FILL_BLOCKS, FILL_THREADS = 1024, 256

# The one copy routine, shared with the device path's plan kernel (``device_plan``):
# ``mlxs_parts`` moves one record's parts between a source laid out as the file's record
# and a pool slot, in words of ``W``, by thread ``tid`` of ``nth``: ``MLXS_IN`` the record
# into the slot, ``MLXS_SWAP`` they trade (each word exchanged by the one thread that owns
# it), ``MLXS_OUT`` the slot into the record, ``MLXS_FRESH`` as ``IN`` reading the source
# past the caches (a record the host wrote). ``mlxs_copy`` runs it over a fills list
# (``[n, r0, s0, r1, s1...]``) in mode ``MODE``. ``meta``: the layer's source
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
template <typename W, int MODE>
__device__ void mlxs_copy(const int* f, const int64_t* meta, long long tid, long long nth) {
    char* src = (char*)(meta[0]);
    for (int k = 0; k < f[0]; k++) {
        if (f[1 + 2 * k] < 0) continue;  // no record (a defect the planner counted)
        mlxs_parts<W, MODE>(src + (int64_t)f[1 + 2 * k] * meta[1], f[2 + 2 * k], meta, tid,
                            nth);
    }
}
"""
_FILL = """
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nth = (long long)gridDim.x * blockDim.x;
    if (tid < N) out[tid] = slots[tid];
    mlxs_copy<WORD, MODE>(fills, meta, tid, nth);
"""
FILL_NAMES = (["fills", "slots", "meta"], ["out"])  # the fill kernel's inputs, outputs
_WORDS = {16: "mlxs_w16", 8: "unsigned long long", 4: "unsigned int", 1: "unsigned char"}


def fill_reference(fills, source: np.ndarray, pool: np.ndarray, swap: bool = False) -> None:
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
    ``mlxs_copy<WORD, MODE>``, for copy words of ``word`` bytes (its constants give
    ``MODE``: ``COPY_HEADER``'s MLXS_IN, SWAP, OUT or FRESH); ``header``: more device
    routines, after ``COPY_HEADER``."""
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
        files: A partial tier's reader of the records outside it (the native reader),
            whose engine reads them through a request ring (``io.ring``) on both paths;
            the reader closes both.
        tick: Called after each layer's file is mapped and after each is checked (e.g.
            a pipeline's ``Pace.tick``).
        ring: The request ring's (readers, pieces), needed with ``files`` (``Runtime.ring_cut``).

    Raises:
        OSError: a file could not be mapped or page-locked (the message says which).
        RingError: a partial tier's request ring could not start.
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
        ring: tuple[int, int] | None = None,
    ):
        self.meta, self.pools, self.tier, self.swap = meta, pools, tier, tier is not None
        self.files = files  # a partial tier's: its engine reads the rest, through the ring
        if files is not None and not (ring and ring[0]):
            raise ValueError("a partial tier's reader needs the ring's cut (Runtime.ring_cut)")
        self._ring_cut = ring
        self.maps = self.ring = self._reads = None
        self._ring_base = (0, 0)  # the ring's bytes and busy ns at the counters' reset
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
            if files is not None:
                self._open_ring()
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

    def _open_ring(self) -> None:
        """A bounded tier's request ring over the files' reader (``io.ring``), through
        which the plan kernel (device path) or ``RingReads`` (host path) asks for the
        records beyond the tier; each layer's copy description then names it
        (``device_tier.TIER_COPY``'s ``meta``), and a second one copies from its staging."""
        from . import ring as rings

        try:
            readers, pieces = self._ring_cut
            ring = rings.RequestRing(self.files, rings.DEVICE_ENTRIES, readers, cuda, pieces)
        except (OSError, MemoryError, cuda.CudaError) as e:
            raise rings.RingError(e) from e
        self.ring, self._staged = ring, {}
        for li, (meta, word) in self._meta.items():
            at = [ring.device_words, ring.device_staging, ring.stride, self.files.pos[li]]
            extra = mx.array(np.array([*at, ring.entries], np.int64))
            word = _word([word, *at[1:3]])
            self._meta[li] = mx.concatenate([meta, extra]), word
            self._staged[li] = mx.concatenate([extra[1:3], meta[2:]]), word
            if word not in self._kernels:
                self._kernels[word] = copy_kernel("mlxs_fill", _FILL, word, *FILL_NAMES)
        mx.eval([m for m, _ in [*self._meta.values(), *self._staged.values()]])
        self._reads = RingReads(ring, self._copy_staged, self.meta)

    def copy_meta(self, layer: int) -> tuple[mx.array, int]:
        """``layer``'s copy description (``COPY_HEADER``'s ``meta``) and its copy word
        (bytes), for a kernel that copies records itself (``copy_kernel``)."""
        return self._meta[layer]

    def fill(self, layer: int, fills: mx.array, slots: mx.array, staged=False) -> mx.array:
        """Copy the records ``fills`` names into their slots, lazily; returns ``slots``
        once they are in (an array the matmuls then read). ``staged``: the records are
        the request ring's entries (``fills`` names entries), read past the caches."""
        meta, word = (self._staged if staged else self._meta)[layer]
        mode = 3 if staged else int(self.swap)  # COPY_HEADER's MLXS_FRESH, SWAP or IN
        (out,) = self._kernels[word]((("N", slots.size), ("MODE", mode)))(
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
            return self.tier.take(layer, experts, slots, self._trade, self._reads)
        self._queue(layer, experts, slots)
        return Done(len(experts) * self.meta.layers[layer].record_bytes)

    def _trade(self, layer: int, trades) -> None:
        """Queue the exchanges of ``trades`` (tier row, slot) on MLX's stream: the reads'
        copies and the computations queued after them run after them."""
        self._queue(layer, [h for h, _ in trades], [s for _, s in trades])

    def _copy_staged(self, layer: int, slots) -> mx.array:
        """Queue the copies of the ring's entries 0.. into ``slots``."""
        return self._queue(layer, range(len(slots)), slots, staged=True)

    def _queue(self, layer: int, records, slots, staged=False) -> mx.array:
        n = len(records)
        fills = np.empty(1 + 2 * n, np.int32)
        fills[0], fills[1::2], fills[2::2] = n, records, slots
        out = self.fill(layer, mx.array(fills), mx.zeros((1,), SLOT_IDS), staged)
        mx.async_eval(out)
        return out

    def read_gbps(self) -> float:
        """The reads beyond a bounded tier (the files' reader's and the ring's): bytes over
        the wall time a reader was reading, since the counters' reset (GB/s); 0 with none
        (the GPU's copies are timed with its work, not apart)."""
        if self.files is None:
            return 0.0
        done, busy = self.files.read_totals()
        ring = self._ring_totals()
        done, busy = done + ring[0] - self._ring_base[0], busy + ring[1] - self._ring_base[1]
        return done / busy if busy else 0.0

    def _ring_totals(self) -> tuple[int, int]:
        if self.ring is None or not self.ring.running:
            return self._ring_base
        c = self.ring.counters()
        return c["bytes"], c["busy_ns"]

    def reset_counters(self) -> None:
        if self.tier is not None:
            self.tier.traded_bytes = 0
        if self.files is not None:
            self.files.reset_counters()
            self._ring_base = self._ring_totals()

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


class RingReads:
    """The host path's reads of the records beyond a bounded tier (``tier.SwapTier.take``'s
    file reader): each asked of the request ring from the host, then copied from the
    ring's staging into its slot by ``copy(layer, slots)`` (the fill kernel, queued on
    MLX's stream behind the tier's trades, so the victims are out first, and ahead of
    the computations that read the slots; it returns the copy's output). More records
    than the ring has entries are read in rounds, each round's copies finished before
    its entries are asked again."""

    def __init__(self, ring, copy, meta):
        self.ring, self.copy, self.meta = ring, copy, meta
        self._copied: mx.array | None = None  # the last copies from staging queued
        self._pending: _RingRead | None = None  # started, not yet waited for

    def start(self, layer: int, experts, slots) -> _RingRead:
        """Ask the ring for ``experts`` of ``layer`` (at most its entries now, the rest
        as ``result()`` goes); ``result()`` queues their copies into ``slots``."""
        self.wait_started()
        self._pending = _RingRead(self, layer, list(experts), list(slots))
        return self._pending

    def wait_started(self) -> None:
        """Finish the read started and not yet waited for (its caller was interrupted):
        every entry answered, so that the next post finds none still reading."""
        read, self._pending = self._pending, None
        if read is not None:  # its result() raises, not re-posts over the next read's
            read.outcome = RuntimeError("a ring read was given up (its caller interrupted)")
            self.settle(read.seqs)
            read.seqs = []

    def post(self, layer: int, experts) -> list[int]:
        """Post ``experts`` into entries 0.. once no queued copy reads them any more."""
        if self._copied is not None:
            mx.eval(self._copied)  # (done already where a routing read came between)
            self._copied = None
        return [self.ring.post(k, layer, int(e)) for k, e in enumerate(experts)]

    def answered(self, seqs: list[int]) -> bool:
        return all(self.ring.done(k) == q for k, q in enumerate(seqs))

    def settle(self, seqs: list[int]) -> None:
        """Wait until each request of ``seqs`` is answered (its outcome dropped), for
        ``READ_WAIT_S`` in all (an entry still unanswered then refuses its next post)."""
        until = time.monotonic() + READ_WAIT_S
        for k, q in enumerate(seqs):
            with contextlib.suppress(Exception):
                self.ring.answered(k, q, max(0.0, until - time.monotonic()))

    def rounds(self, read: _RingRead) -> int:
        """``read``'s records, round by round: each answered, then copied; its bytes."""
        if self._pending is read:
            self._pending = None
        n, at, k = len(read.experts), 0, self.ring.entries
        while True:
            for j, q in enumerate(read.seqs):
                self.ring.answered(j, q, READ_WAIT_S)
            m, read.seqs = len(read.seqs), []
            self._copied = self.copy(read.layer, read.slots[at : at + m])
            at += m
            if at >= n:
                return n * self.meta.layers[read.layer].record_bytes
            read.seqs = self.post(read.layer, read.experts[at : at + k])


class _RingRead:
    """``RingReads.start``'s read: ``result()`` the bytes read, or the first failure
    (the slots it names may hold partial data and must not be used)."""

    def __init__(self, reads: RingReads, layer: int, experts: list, slots: list):
        self.reads, self.layer, self.experts, self.slots = reads, layer, experts, slots
        self.outcome: int | BaseException | None = None
        self.seqs = reads.post(layer, experts[: reads.ring.entries])  # this round's

    def done(self) -> bool:
        last = len(self.experts) <= self.reads.ring.entries  # one round: no copy between
        return self.outcome is not None or (last and self.reads.answered(self.seqs))

    def result(self) -> int:
        if self.outcome is None:
            try:
                self.outcome = self.reads.rounds(self)
            except Exception as e:  # noqa: BLE001 - raised again on each result()
                self.outcome = e
            finally:
                if self.outcome is None or isinstance(self.outcome, BaseException):
                    self.reads.settle(self.seqs)  # none left reading into its entries
                    self.seqs = []
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome
