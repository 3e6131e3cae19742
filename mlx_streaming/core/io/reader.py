"""The Python record reader: fixed-stride records read with ``preadv`` on a pool of
threads, straight into host slot rows.

It serves host pools where the compiled reader is not used (Apple Silicon and macOS,
where that is untested; the CPU where it is not built) and is the tests' oracle for it.
``RecordReader`` knows files, strides and byte ranges, nothing of experts or caches: a
batch of ``RecordJob``s (record id, the buffers its bytes go to, a step to run once they
have landed) is sorted into runs of adjacent records; each run becomes one ``preadv``
(the GIL is released during it), runs larger than twice ``PIECE_BYTES`` (32 MB) are cut
into pieces issued together on the threads. ``PythonReader`` puts it behind the readers'
one call, ``start(layer, experts, slots)``, with the records' checksums checked on their
first read. ``direct`` bypasses the page cache with macOS's
``F_NOCACHE`` (reads into any buffer); Linux's O_DIRECT needs aligned whole-record reads,
which the native reader does.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .futures import Done, Gather

MAX_RUN_BYTES = 8 << 20  # adjacent records are merged into one run up to this size
PIECE_BYTES = 16 << 20  # runs larger than twice this are read as pieces on several threads
# (smaller pieces measured slower on the H200 machine: each piece costs a driver copy call)
PIECE_ALIGN = 4096  # piece boundaries (O_DIRECT needs aligned offsets and lengths)
INLINE_BYTES = 256 << 10  # reads up to this size: on the calling thread (waking one costs more)
IOV_MAX = 1024


class RecordReadError(OSError):
    """A record could not be read in full."""


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer (anonymous mmap), suitable for O_DIRECT."""
    mm = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes)


@dataclass
class RecordJob:
    """Read record ``id``'s first bytes into ``bufs`` (in order), then run ``after``."""

    id: int
    bufs: list
    after: Callable[[], None] | None = None
    nbytes: int = field(init=False, default=0)

    def __post_init__(self):
        self.bufs = [
            b
            if isinstance(b, memoryview) and b.format == "B" and b.ndim == 1
            else memoryview(b).cast("B")
            for b in self.bufs
        ]
        self.nbytes = sum(b.nbytes for b in self.bufs)


@dataclass
class ReadStats:
    reads: int = 0  # preadv calls
    records: int = 0
    bytes: int = 0
    seconds: float = 0.0  # wall time of read batches (overlapping batches both count)

    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class _Piece:
    """One preadv: ``vecs`` at file ``offset``, covering ``(job, start, end)`` byte
    ranges of jobs; ``left`` counts each job's pieces still to land (shared)."""

    offset: int
    vecs: list
    jobs: list
    left: dict = field(default_factory=dict)


def _slice(vecs: list[memoryview], a: int, b: int) -> list[memoryview]:
    """The views covering bytes [a, b) of the concatenation of ``vecs``."""
    out, pos = [], 0
    for v in vecs:
        end = pos + v.nbytes
        if end > a and pos < b:
            out.append(v[max(a, pos) - pos : min(b, end) - pos])
        pos = end
        if pos >= b:
            break
    return out


def _preadv(fd: int, path, vecs, offset: int) -> int:
    """``os.preadv``, its error naming the file and the byte, as the native reader's do."""
    try:
        return os.preadv(fd, vecs, offset)
    except OSError as e:
        raise RecordReadError(e.errno, f"{path}: {e.strerror} at byte {offset}") from e


class RecordReader:
    """Reads records ``id`` at ``id * stride`` of registered files, at random (no kernel
    read-ahead) unless ``sequential`` (start to end: a swap tier's fill)."""

    def __init__(self, threads: int = 4, direct: bool = False, piece_bytes: int = PIECE_BYTES,
                 sequential: bool = False):  # fmt: skip
        self.threads = max(1, int(threads))
        self.direct, self.sequential = bool(direct), sequential
        if self.direct and sys.platform != "darwin":
            raise ValueError(
                "the Python reader bypasses the page cache with macOS's F_NOCACHE only; "
                "O_DIRECT needs aligned whole-record reads: use the native reader"
            )
        self.piece_bytes = max(PIECE_ALIGN, int(piece_bytes))
        self.stats = ReadStats()
        self._files: dict = {}  # key -> (fd, stride, path)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="mlxs-read")
        self._lock = threading.Lock()
        self._sink = memoryview(bytearray(0))

    def open(self, key, path: str | Path, stride: int) -> None:
        """Register ``path`` under ``key`` with its record stride."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise RecordReadError(e.errno, f"cannot open expert file {path}: {e.strerror}") from e
        try:
            if not self.direct and hasattr(os, "posix_fadvise"):  # at random: no read-ahead
                seq = self.sequential  # (start to end, a swap tier's fill: read ahead)
                os.posix_fadvise(
                    fd, 0, 0, os.POSIX_FADV_SEQUENTIAL if seq else os.POSIX_FADV_RANDOM
                )
            if self.direct:
                import fcntl

                fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)
        except BaseException:
            os.close(fd)
            raise
        self._files[key] = (fd, stride, path)
        if len(self._sink) < stride:
            self._sink = memoryview(bytearray(stride))

    def _runs(self, stride: int, jobs: list[RecordJob]) -> list[list[RecordJob]]:
        """Adjacent records whose reads can be one preadv (padding goes to a sink)."""
        runs: list[list[RecordJob]] = []
        for j in sorted(jobs, key=lambda j: j.id):
            r = runs[-1] if runs else None
            if (
                r
                and j.id == r[-1].id + 1
                and (len(r) + 1) * stride <= MAX_RUN_BYTES
                and sum(len(x.bufs) + 1 for x in r) + len(j.bufs) <= IOV_MAX
            ):
                r.append(j)
            else:
                runs.append([j])
        return runs

    def _pieces(self, stride: int, jobs: list[RecordJob]) -> list[_Piece]:
        """The batch as preadv calls: runs of adjacent records, each cut into pieces of
        about ``piece_bytes`` so one large record is read by several threads at once."""
        out = []
        for run in self._runs(stride, jobs):
            vecs, spans, pos = [], [], 0
            for i, j in enumerate(run):
                if i and stride > run[i - 1].nbytes:
                    pad = stride - run[i - 1].nbytes
                    vecs.append(self._sink[:pad])
                    pos += pad
                spans.append((j, pos))
                vecs.extend(j.bufs)
                pos += j.nbytes
            offset = run[0].id * stride
            n = max(1, -(-pos // self.piece_bytes)) if pos > 2 * self.piece_bytes else 1
            step = -(-pos // n)
            step = -(-step // PIECE_ALIGN) * PIECE_ALIGN
            for a in range(0, pos, step):
                b = min(pos, a + step)
                out.append(
                    _Piece(
                        offset + a,
                        _slice(vecs, a, b),
                        [
                            (j, max(a, s) - s, min(b, s + j.nbytes) - s)
                            for j, s in spans
                            if s < b and s + j.nbytes > a
                        ],
                    )
                )
        left = {}
        for pc in out:
            for j, lo, hi in pc.jobs:
                if hi > lo:
                    left[id(j)] = left.get(id(j), 0) + 1
        for pc in out:
            pc.left = left
        return out

    def _read_piece(self, fd, path, piece: _Piece, lock: threading.Lock) -> int:
        want = sum(v.nbytes for v in piece.vecs)
        got = _preadv(fd, path, piece.vecs, piece.offset)
        if got != want:
            self._finish_short(fd, path, piece.vecs, piece.offset, got)
        nbytes = 0
        for j, lo, hi in piece.jobs:
            if hi <= lo:
                continue
            nbytes += hi - lo
            with lock:
                piece.left[id(j)] -= 1
                last = piece.left[id(j)] == 0
            if last and j.after is not None:
                j.after()
        return nbytes

    @staticmethod
    def _finish_short(fd, path, vecs, offset, got) -> None:
        pos = 0
        for v in vecs:
            end = pos + v.nbytes
            start = max(got - pos, 0)
            while start < v.nbytes:
                k = _preadv(fd, path, [v[start:]], offset + pos + start)
                if k <= 0:
                    raise RecordReadError(
                        5,
                        f"short read of {path} at byte {offset + pos + start}: the expert "
                        "file is truncated; split the model again",
                    )
                start += k
            pos = end

    def submit(self, key, jobs: list[RecordJob]) -> Future:
        """Start reading ``jobs``; the future's result is the byte count. A failing job
        (read error, or an exception from its ``after``) fails the future. Small batches
        are read on the calling thread; the rest return at once, reading on the pool."""
        fd, stride, path = self._files[key]
        pieces = self._pieces(stride, jobs)
        lock = threading.Lock()
        t0 = time.perf_counter()

        def finish(nbytes: int) -> int:
            with self._lock:
                self.stats.reads += len(pieces)
                self.stats.records += len(jobs)
                self.stats.bytes += nbytes
                self.stats.seconds += time.perf_counter() - t0
            return nbytes

        total = sum(j.nbytes for j in jobs)
        if total <= INLINE_BYTES or self.threads == 1:
            try:
                return Done(finish(sum(self._read_piece(fd, path, pc, lock) for pc in pieces)))
            except Exception as e:  # noqa: BLE001 - handed to the caller through the future
                return Done(error=e)
        futures = []
        try:
            for pc in pieces:
                futures.append(self._pool.submit(self._read_piece, fd, path, pc, lock))
        except BaseException:  # an interrupt: no thread writes the caller's slots after
            for f in futures:
                f.cancel()
            wait(futures)
            raise
        return Gather(futures, finish)

    def read(self, key, ids, out: np.ndarray) -> int:
        """Read whole records ``ids`` into rows of ``out`` ([n, stride]); returns bytes."""
        jobs = [RecordJob(int(e), [out[i]]) for i, e in enumerate(ids)]
        return self.submit(key, jobs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd, _, _ in self._files.values():
            os.close(fd)
        self._files.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


class PythonReader:
    """Reads expert records into host pool slots on Python threads (``RecordReader``),
    each record's checksum checked the first time it is read.

    Args:
        meta: The expert directory's ``ExpertMeta``.
        pools: ``{layer: LayerPool}`` of host pools; records land in their slot rows.
        threads, direct, sequential: As ``RecordReader``'s.
        checksums: Check records against the meta's checksums (``checked`` says which
            passed).
    """

    wave = None  # any number of records per start

    def __init__(self, meta, pools: dict, threads: int = 4, direct: bool = False,
                 checksums: bool = True, sequential: bool = False):  # fmt: skip
        self.meta, self.pools, self.checksums = meta, pools, checksums
        self.files = RecordReader(threads=threads, direct=direct, sequential=sequential)
        try:
            for li in pools:
                self.files.open(li, meta.file(li), meta.layers[li].stride)
        except BaseException:
            self.files.close()
            raise
        self.checked = {li: np.zeros(meta.layers[li].num_experts, np.uint8) for li in pools}
        self._last: Future | None = None  # the latest read started, until waited here

    def start(self, layer: int, experts, slots) -> Future | Done:
        """Start reading records ``experts`` of ``layer`` into ``slots``; ``result()``
        waits (bytes read) and raises ``RecordReadError`` or ``ExpertChecksumError``."""
        pool = self.pools[layer]
        jobs = []
        for e, s in zip(experts, slots):
            bufs = pool.record_bufs(int(s))
            jobs.append(RecordJob(int(e), bufs, self._check(layer, int(e), bufs)))
        self._last = self.files.submit(layer, jobs)
        return self._last

    def wait_started(self) -> None:
        """Wait until the latest read started has stopped writing (its future keeps the
        outcome): one its caller lost to an interrupt must not land in slots the next
        trades reuse."""
        last, self._last = self._last, None
        if last is not None:
            with contextlib.suppress(Exception):  # its future keeps it for its caller
                last.result()

    def _check(self, layer: int, expert: int, bufs):
        lay = self.meta.layers[layer]
        if not (self.checksums and lay.checksums) or self.checked[layer][expert]:
            return None

        def check():
            import xxhash

            from ..format import ExpertChecksumError

            h, left = xxhash.xxh3_64(), lay.record_bytes
            for b in bufs:
                h.update(b[:left])
                left -= min(left, b.nbytes)
            if h.hexdigest() != lay.checksums[expert]:
                raise ExpertChecksumError(
                    f"expert {expert} of layer {layer} in {self.meta.file(layer)} fails its "
                    f"checksum ({h.hexdigest()} != {lay.checksums[expert]}): the file is "
                    "corrupt; split the model again"
                )
            self.checked[layer][expert] = 1

        return check

    def read_gbps(self) -> float:
        return self.files.stats.gbps()

    def reset_counters(self) -> None:
        self.files.stats = ReadStats()

    def close(self) -> None:
        self.files.close()
