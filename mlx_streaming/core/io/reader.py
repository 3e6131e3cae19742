"""Fixed-stride record reads with a pool of ``pread`` threads.

The reader knows files, strides and byte ranges, nothing of experts or caches. A batch of
record ids is sorted into runs of adjacent records, each run becomes one ``preadv`` (the
GIL is released during it) into a caller-supplied, page-aligned buffer, and the runs are
issued together on a thread pool. ``direct=True`` bypasses the page cache (``O_DIRECT`` on
Linux, ``F_NOCACHE`` on macOS).
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_RUN_BYTES = 8 << 20  # a merged run is split beyond this, to spread it over threads
INLINE_BYTES = 512 << 10  # batches smaller than this are read on the calling thread
IOV_MAX = 1024


class RecordReadError(OSError):
    """A record could not be read in full."""


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer (anonymous mmap), suitable for O_DIRECT."""
    mm = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes)


@dataclass
class ReadStats:
    reads: int = 0  # preadv calls
    records: int = 0
    bytes: int = 0
    seconds: float = 0.0  # wall time of read batches

    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class RecordReader:
    """Reads records ``id`` at ``id * stride`` of registered files."""

    def __init__(self, threads: int = 4, direct: bool = False):
        self.threads = max(1, int(threads))
        self.direct = bool(direct)
        self.stats = ReadStats()
        self._files: dict = {}  # key -> (fd, stride, path)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="mlxs-read")
        self._lock = threading.Lock()

    def open(self, key, path: str | Path, stride: int) -> None:
        """Register ``path`` under ``key`` with its record stride."""
        path = Path(path)
        flags = os.O_RDONLY
        if self.direct and sys.platform.startswith("linux"):
            flags |= os.O_DIRECT
        try:
            fd = os.open(path, flags)
        except OSError as e:
            if self.direct and e.errno == 22:  # EINVAL: the filesystem refuses O_DIRECT
                warnings.warn(f"{path}: O_DIRECT not supported here, reading through the "
                              "page cache", stacklevel=2)
                fd = os.open(path, os.O_RDONLY)
            else:
                raise RecordReadError(e.errno, f"cannot open expert file {path}: {e.strerror}") from e
        if self.direct and sys.platform == "darwin":
            import fcntl

            fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)
        self._files[key] = (fd, stride, path)

    def stride(self, key) -> int:
        return self._files[key][1]

    def _runs(self, key, ids) -> list[tuple[int, int, int]]:
        """(first id, row in output, count) of adjacent-id runs, split at MAX_RUN_BYTES."""
        stride = self._files[key][1]
        per = max(1, MAX_RUN_BYTES // stride)
        runs, i, n = [], 0, len(ids)
        while i < n:
            j = i + 1
            while j < n and ids[j] == ids[j - 1] + 1 and j - i < per:
                j += 1
            runs.append((int(ids[i]), i, j - i))
            i = j
        return runs

    def _read_run(self, fd, path, stride, first, row, count, out) -> int:
        view = memoryview(out[row:row + count]).cast("B")
        want = count * stride
        got = 0
        while got < want:
            n = os.preadv(fd, [view[got:]], first * stride + got)
            if n <= 0:
                raise RecordReadError(
                    5, f"short read of {path} at record {first} ({got} of {want} bytes): "
                    "the expert file is truncated; split the model again")
            got += n
        return want

    def read(self, key, ids, out: np.ndarray) -> int:
        """Read records ``ids`` (ascending) into rows of ``out`` (``[len(ids), stride]``).

        Returns the number of bytes read. Raises ``RecordReadError`` on failure.
        """
        return self.submit(key, ids, out).result()

    def submit(self, key, ids, out: np.ndarray) -> Future:
        """Start reading; the future's result is the byte count."""
        fd, stride, path = self._files[key]
        assert out.shape[1] == stride and len(out) >= len(ids)
        runs = self._runs(key, ids)
        t0 = time.perf_counter()
        total = len(ids) * stride

        def finish(nbytes: int) -> int:
            with self._lock:
                self.stats.reads += len(runs)
                self.stats.records += len(ids)
                self.stats.bytes += nbytes
                self.stats.seconds += time.perf_counter() - t0
            return nbytes

        if total <= INLINE_BYTES or (len(runs) == 1 and self.threads == 1):
            fut: Future = Future()
            try:
                fut.set_result(finish(sum(self._read_run(fd, path, stride, *r, out)
                                          for r in runs)))
            except OSError as e:
                fut.set_exception(e)
            return fut
        parts = [self._pool.submit(self._read_run, fd, path, stride, *r, out) for r in runs]
        return _Gather(parts, finish)

    def submit_scatter(self, key, ids, iovecs: list[list], record_bytes: int) -> Future:
        """Start reading the first ``record_bytes`` of records ``ids`` (ascending) into
        per-record buffer lists ``iovecs[i]`` (a scatter read; adjacent records are
        merged into one ``preadv``, the padding between them read into a sink)."""
        fd, stride, path = self._files[key]
        pad = stride - record_bytes
        sink = memoryview(bytearray(pad)) if pad else None
        jobs, i, n = [], 0, len(ids)
        while i < n:
            vecs, first = list(iovecs[i]), int(ids[i])
            j = i + 1
            while (j < n and ids[j] == ids[j - 1] + 1 and (j - i) * stride < MAX_RUN_BYTES
                   and len(vecs) + len(iovecs[j]) + 1 <= IOV_MAX):
                if sink is not None:
                    vecs.append(sink)
                vecs.extend(iovecs[j])
                j += 1
            jobs.append((first, vecs))
            i = j
        t0 = time.perf_counter()
        total = n * record_bytes

        def run(first, vecs) -> int:
            want = sum(v.nbytes for v in vecs)
            got = os.preadv(fd, vecs, first * stride)
            if got != want:  # rare: finish a short read buffer by buffer
                got = self._finish_short(fd, path, vecs, first * stride, got, want)
            return got

        def finish(nbytes: int) -> int:
            with self._lock:
                self.stats.reads += len(jobs)
                self.stats.records += n
                self.stats.bytes += nbytes
                self.stats.seconds += time.perf_counter() - t0
            return nbytes

        if total <= INLINE_BYTES or len(jobs) == 1 or self.threads == 1:
            fut: Future = Future()
            try:
                fut.set_result(finish(sum(run(*j) for j in jobs)))
            except OSError as e:
                fut.set_exception(e)
            return fut
        return _Gather([self._pool.submit(run, *j) for j in jobs], finish)

    @staticmethod
    def _finish_short(fd, path, vecs, offset, got, want) -> int:
        flat = [memoryview(v).cast("B") for v in vecs]
        pos = 0
        for v in flat:
            end = pos + v.nbytes
            if got < end:
                start = max(got - pos, 0)
                while start < v.nbytes:
                    k = os.preadv(fd, [v[start:]], offset + pos + start)
                    if k <= 0:
                        raise RecordReadError(
                            5, f"short read of {path} at byte {offset + pos + start}: the "
                            "expert file is truncated; split the model again")
                    start += k
            pos = end
        return want

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd, _, _ in self._files.values():
            os.close(fd)
        self._files.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Gather(Future):
    """A future over several reads; its result is their byte total."""

    def __init__(self, parts: list[Future], finish):
        super().__init__()
        self._parts, self._finish = parts, finish

    def result(self, timeout=None):
        if not self.done():
            try:
                self.set_result(self._finish(sum(p.result(timeout) for p in self._parts)))
            except OSError as e:
                self.set_exception(e)
        return super().result(timeout)

    def done(self):
        return super().done()
