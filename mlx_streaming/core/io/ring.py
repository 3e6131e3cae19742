"""The native engine's request ring (``engine_ring.c``): records asked for through
entries in memory that a kernel on the device and the host both address, read by the
engine's threads into each entry's staging record and answered through its done word,
with no CUDA call on the host's side.

An entry is ``RING_WORDS`` int32 words: the poster writes the layer position and the
expert, then a new number into ``SEQ``; the engine reads the record (whole, as laid out
in its file) into the entry's staging record, writes ``STATUS`` and ``ERRNO``, then the
same number into ``DONE``. ``RequestRing.post`` and ``wait`` are that protocol on the host
(tests; a poster without a device); a kernel follows it with the device addresses
``device_words`` and ``device_staging``.
"""

from __future__ import annotations

import os
import time
import weakref

import numpy as np

from .engine_lib import ERR_BYTES, error_buffer, status_error

RING_WORDS = 16  # an entry's int32 words (engine_ring.c): a cache line each
SEQ, LAYER, EXPERT, DONE, STATUS, ERRNO = range(6)
MAX_ENTRIES, MAX_READERS = 64, 16  # engine_ring.c's MAX_RING, MAX_RING_READERS
# requests answered, bytes read, failed, read ns (summed over readers), answer ns (seen to
# answered, summed), the longest answer ns, busy ns (wall time with a reader reading),
# reads (the pieces read)
COUNTERS = ("requests", "bytes", "failed", "read_ns", "answer_ns", "max_ns", "busy_ns", "reads")
# a bounded tier's device path: reads one layer call may ask for at once (its ids at most),
# the ring threads reading them, and the reads a record is cut in (a decode call's lone
# miss read by several threads at once). 8 threads in 8 pieces decoded 1.19x and 1.16x
# 16 in 16 on one H100 in either order, every run faster, its lone record 3.5-3.9 ms
# against 4.8-4.9 (benchmarks/RESULTS.md 2026-12-07g); 16x16 had won only a probe of
# the lone record against 16 threads in 8 pieces, on a faster disk (2.05 against 3.85 ms)
DEVICE_ENTRIES, DEVICE_READERS, DEVICE_PIECES = 16, 8, 8


def device_cut(readers: int | None = None, pieces: int | None = None) -> tuple[int, int]:
    """A device path's ring: ``(readers, pieces)`` as given (``StreamConfig.ring_readers``,
    ``ring_pieces``), else ``DEVICE_READERS`` and a piece a reader, ``DEVICE_PIECES`` at most."""
    readers = readers or DEVICE_READERS
    return readers, pieces or min(DEVICE_PIECES, readers)


def cut_said(cut: tuple[int, int]) -> str:
    """The load line's words for a ring of ``cut`` (``device_cut``) past a bounded tier."""
    return (f"they fill the tier at load; the records beyond it: the request ring's {cut[0]} "
            f"threads, {cut[1]} pieces a record")  # fmt: skip


# A read's wait (the plan kernel's and the host path's): long enough for a slow disk's
# record behind 15 others (a kernel's trap loses the process's CUDA context), short enough
# that a dead ring fails the call
READ_WAIT_S = 30
_rings: weakref.WeakSet = weakref.WeakSet()  # every ring made, for ``unexplained_failure``
_closed_failures: list[Exception] = []  # ... and what the last closed one left unexplained


class RingError(OSError):
    """A request ring could not start (its staging, or its threads); the message says why."""

    def __init__(self, why):
        why = str(why)
        prefix = "the request ring could not start"
        super().__init__(why if why.startswith(prefix) else f"{prefix}: {why}")


def unexplained_failure() -> Exception | None:
    """A record a kernel asked a ring for whose read failed (the kernel traps on it, and
    MLX then raises a CUDA error that names nothing): the error that names its file,
    layer and expert, for the commands to say beside MLX's; None where there is none."""
    for ring in list(_rings):
        e = ring.failed()
        if e is not None:
            return e
    return _closed_failures[-1] if _closed_failures else None


class RequestRing:
    """Answers requests for records posted into shared memory, on the engine's threads.

    Args:
        reader: The ``NativeReader`` whose engine reads (its files and checksums); it
            must outlive the ring (closing it stops the ring).
        entries: Requests outstanding at once (a layer call's misses: at most its
            distinct routed experts).
        readers: Threads that read records, each a piece at a time.
        cuda: The CUDA runtime module (``io.cuda``): entries and staging in page-locked
            host memory mapped into the device; else plain host memory (no device).
        pieces: The reads each record is cut in (1 to ``readers``; whole pages each).

    Raises:
        OSError: the engine refuses the ring (the message says why).
    """

    def __init__(self, reader, entries: int = 8, readers: int = 4, cuda=None, pieces: int = 1):
        self.reader, self.handle = reader, None
        if not 1 <= entries <= MAX_ENTRIES or not 1 <= readers <= MAX_READERS:
            raise ValueError(
                f"a ring of {entries} entries and {readers} readers: "
                f"1 to {MAX_ENTRIES} entries, 1 to {MAX_READERS} readers"
            )
        if not 1 <= pieces <= readers:
            raise ValueError(f"{pieces} pieces a record: 1 to the ring's {readers} readers")
        if not reader.pos:
            raise ValueError("a request ring needs a reader with layers")
        self.stride = max(reader.meta.layers[li].stride for li in reader.pos)
        words_bytes, staging_bytes = entries * RING_WORDS * 4, entries * self.stride
        if cuda is not None:
            w, self.device_words = cuda.shared_host(words_bytes)
            st, self.device_staging = cuda.shared_host(staging_bytes)
        else:
            from .reader import aligned_buffer

            w, st = aligned_buffer(words_bytes), aligned_buffer(staging_bytes)
            w[:] = 0
            self.device_words = self.device_staging = None
        self.words = w.view(np.int32).reshape(entries, RING_WORDS)
        self.staging = st.reshape(entries, self.stride)
        err = error_buffer()
        with reader.lock:  # not beside the reader's close
            if not reader.handle:
                raise OSError("the request ring could not start: its reader is closed")
            rc = reader.lib.mlxs_ring_start(
                reader.handle, self.words.ctypes.data, entries, self.staging.ctypes.data,
                self.stride, readers, pieces, err, ERR_BYTES,
            )  # fmt: skip
        if rc:
            raise OSError(f"the request ring could not start: {err.value.decode()}")
        self.handle, self._told = reader.handle, set()  # failures ``wait`` raised
        self.readers, self.pieces = readers, pieces
        # A ring left running stops when it is dropped or at exit. ``weakref.finalize``
        # runs its callbacks at exit newest first: this one before those of the
        # page-locked entries made above, which free what the poller reads.
        self._left = weakref.finalize(self, _stop_left, reader, self.handle)
        _rings.add(self)
        _closed_failures.clear()  # a new ring: an earlier one's failure is not this run's

    @property
    def entries(self) -> int:
        """The number of the ring's entries (indices 0 to ``entries - 1``)."""
        return len(self.words)

    def post(self, k: int, layer: int, expert: int) -> int:
        """Ask for record ``expert`` of model layer ``layer`` through entry ``k`` (whose
        last request was answered); returns the request's number for ``wait``.

        Raises:
            RuntimeError: the ring is stopped, or entry ``k``'s last request is unanswered.
        """
        self._check(k)
        if not self.free(k):
            raise RuntimeError(f"request ring entry {k} still has a request unanswered")
        pos = self.reader.pos.get(layer, -1)
        return int(self.reader.lib.mlxs_ring_post(self.words.ctypes.data, k, pos, expert))

    def done(self, k: int) -> int:
        """The number of entry ``k``'s last answered request (its ``DONE`` word, read with
        acquire order: once it is a poster's number, the entry's status and staging
        record are that request's answer)."""
        return self.reader.lib.mlxs_ring_done(self.words.ctypes.data, k)

    def free(self, k: int) -> bool:
        """Whether entry ``k``'s last request is answered: it may be asked again."""
        return self.done(k) == self.words[k, SEQ]

    def wait(self, k: int, seq: int, timeout: float = 10.0) -> np.ndarray:
        """A copy of entry ``k``'s staging record once request ``seq`` is answered
        (``answered``)."""
        self.answered(k, seq, timeout)
        return self.staging[k].copy()

    def answered(self, k: int, seq: int, timeout: float = 10.0) -> None:
        """Return once request ``seq`` of entry ``k`` is answered: its record is in the
        entry's staging record.

        Raises:
            TimeoutError: no answer within ``timeout`` seconds.
            RuntimeError: the ring is stopped.
            ExpertChecksumError, RecordReadError, ValueError: the record failed (the
                message names the file, the layer and the expert).
        """
        row, until = self.words[k], time.monotonic() + timeout
        while self.done(k) != seq:
            self._check(k)
            if time.monotonic() > until:
                raise TimeoutError(f"the request ring did not answer entry {k} in {timeout} s")
            time.sleep(20e-6)
        if row[STATUS]:
            self._told.add((k, seq))
            raise self._error(k)

    def failed(self) -> Exception | None:
        """The error of an answered request that failed and that no ``wait`` raised (a
        kernel's, which traps on it), else of one left unanswered (a kernel stops waiting
        after ``plan_kernel.READ_WAIT_MS``), naming its file, layer and expert; else None."""
        from .reader import RecordReadError

        done = [self.done(k) for k in range(len(self.words))]
        for k, row in enumerate(self.words):
            if row[STATUS] and done[k] == row[SEQ] and (k, int(row[SEQ])) not in self._told:
                return self._error(k)
        for k, row in enumerate(self.words):
            if done[k] != row[SEQ]:
                (layer, path), e = self._where(k), int(row[EXPERT])
                why = "was asked of the request ring and not read in time"
                return RecordReadError(f"{path}: expert {e} of layer {layer} {why}")
        return None

    def _where(self, k: int) -> tuple[int | None, object]:
        row = self.words[k]
        layer = next((li for li, p in self.reader.pos.items() if p == row[LAYER]), None)
        return layer, self.reader.meta.file(layer) if layer is not None else "no file"

    def _error(self, k: int) -> Exception:
        row, (layer, path) = self.words[k], self._where(k)
        expert, st = int(row[EXPERT]), int(row[STATUS])
        why = os.strerror(int(row[ERRNO])) if row[ERRNO] else f"status {st}"
        return status_error(st, f"{why}: expert {expert}", path, layer, expert)

    @property
    def running(self) -> bool:
        """Whether the ring runs: neither it nor its reader (whose engine it runs on) closed."""
        return bool(self.handle) and self.reader.handle == self.handle

    def _check(self, k: int) -> None:
        if not self.running:
            raise RuntimeError("the request ring is stopped (closed, or its reader closed)")
        if not 0 <= k < len(self.words):
            raise ValueError(f"request ring entry {k}: 0 to {len(self.words) - 1}")

    def counters(self) -> dict[str, int]:
        """What the ring has done since it started (``COUNTERS``)."""
        out = np.zeros(len(COUNTERS), np.int64)
        rc = (
            self.reader.lib.mlxs_ring_counters(self.handle, out.ctypes.data, len(out))
            if self.running
            else -1
        )
        if rc == -2:
            raise RuntimeError(
                f"the engine keeps other counters than {COUNTERS}: reinstall the package"
            )
        if rc:
            raise RuntimeError("the request ring is stopped (closed, or its reader closed)")
        return dict(zip(COUNTERS, out.tolist()))

    def close(self) -> None:
        """Stop the ring's threads (every request posted before is answered first); idempotent."""
        with self.reader.lock:  # not beside the reader's close, which frees the engine
            self._stop()
        if self in _rings:  # its entries stay readable: what failed is kept
            _rings.discard(self)
            e = self.failed()
            if e is not None:
                _closed_failures[:] = [e]

    def _stop(self) -> None:
        self._left()  # stops the threads once: here, when dropped, or at exit
        self.handle = None


def _stop_left(reader, handle) -> None:
    """Stop the threads of a ring of engine ``handle``, unless its reader has closed (the
    engine stopped them). Called once per ring: at its close, when dropped, or at exit."""
    if reader.handle == handle:  # (without the lock: a collection may run where its holder is)
        reader.lib.mlxs_ring_stop(handle)
