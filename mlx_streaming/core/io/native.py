"""The native record reader (``engine.c``), built by ``pip install`` and driven through
ctypes.

``NativeReader.start(layer, experts, slots)`` starts reading a wave of records into pool
slots on the engine's own threads, without the GIL, and ``Started.result()`` collects it;
a request over a wave is read before ``start`` returns, a wave at a time. Pieces ``pread`` into a
staging area are copied into each slot's part rows (``cudaMemcpyAsync`` for CUDA pools,
``memcpy`` for host pools), XXH3 checksums checked with the xxhash package's own
``XXH3_64bits``. Where the compiled library is missing (a source tree never installed),
``library()`` is None: on the CPU the store then reads with the Python reader
(``io.reader``) and the load line says so (``Runtime.line``: the reader's reason); CUDA
and O_DIRECT need this reader, and ``runtime.resolve`` refuses them, saying so.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
import threading

import numpy as np

from .engine_lib import (
    CHECKSUM,
    COUNTERS,
    ERR_BYTES,
    N_COUNTERS,
    check_waves,
    error_buffer,
    hash_function,
    library,
    status_error,
    why_unavailable,
)
from .futures import Done, Started


def _ptr(a) -> int | None:
    return None if a is None else a.ctypes.data


class NativeReader:
    """Reads expert records into pool slots on native threads.

    Args:
        meta: The expert directory's ``ExpertMeta``.
        pools: ``{layer: LayerPool}``; each slot's part rows are where records land.
        threads: Worker threads (the calling thread works too).
        direct: Open the files with O_DIRECT (bypass the page cache).
        sequential: The files are read from start to end (a swap tier's fill): the
            kernel reads ahead, where random reads (the default) tell it not to.
        checksums: Check each record's checksum the first time this reader reads it
            (``checked[layer][expert]`` says which passed).
        cuda: The CUDA runtime module (``io.cuda``) for device pools, else None.
        wave: Records staged at once.
        piece_bytes: Largest piece one ``pread`` covers.

    Raises:
        OSError: the engine is unavailable or refuses a layer (the message says why).
    """

    def __init__(
        self,
        meta,
        pools: dict,
        threads: int = 4,
        direct: bool = False,
        checksums: bool = True,
        cuda=None,
        wave: int = 8,
        piece_bytes: int = 4 << 20,
        sequential: bool = False,
    ):
        lib = library()
        if lib is None:
            raise OSError(f"the native reader is unavailable: {why_unavailable()}")
        h = hash_function() if checksums else None
        if checksums and h is None:
            raise OSError(
                "checksums need XXH3_64bits from the xxhash package, not found: pip install "
                "xxhash, or turn checksums off (--no-checksums, checksums=False)"
            )
        self.lib, self.meta, self._wave = lib, meta, wave
        self.pos = {li: i for i, li in enumerate(sorted(pools))}
        stride = max(meta.layers[li].stride for li in pools)
        self.handle, self._fds, self._streams = None, [], []  # what close() releases
        self.lock = threading.Lock()  # one start..finish at a time (a request ring's start, stop)
        self._pending: Started | None = None  # started, not yet finished
        self._cuda = cuda
        if cuda is not None:
            self._staging = cuda.page_locked(wave * stride)
            for _ in range(threads + 1):
                self._streams.append(cuda.new_stream())
            copy, sync = cuda.function("cudaMemcpyAsync"), cuda.function("cudaStreamSynchronize")
        else:
            from .reader import aligned_buffer

            self._staging = aligned_buffer(wave * stride)
            self._streams, copy, sync = [], None, None
        streams = (ctypes.c_void_p * max(1, len(self._streams)))(*self._streams)
        self._err = error_buffer()  # used under self.lock once built
        self.handle = lib.mlxs_new(
            len(pools), threads, wave, stride, piece_bytes, _ptr(self._staging), copy, sync,
            streams, h, self._err, ERR_BYTES,
        )  # fmt: skip
        if not self.handle:
            self.close()
            raise OSError(f"the native reader could not be created: {self._why()}")
        self._keep = []
        self.checked: dict[int, np.ndarray] = {}
        self.counters = np.zeros((len(pools), N_COUNTERS), np.int64)
        self._counter_ptrs = [_ptr(c) for c in self.counters]
        # a started read's experts, slots and statuses (the engine copies the ids)
        self._started = np.zeros((3, wave), np.int32)
        self._started_ptrs = [_ptr(r) for r in self._started]
        try:
            for li, pos in self.pos.items():
                self._add(li, pos, pools[li], direct, checksums, sequential)
        except BaseException:
            self.close()
            raise

    def _add(self, li, pos, pool, direct, checksums, sequential) -> None:
        """Open layer ``li``'s file and register its layout with the engine."""
        lay = self.meta.layers[li]
        flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
        try:
            fd = os.open(self.meta.file(li), flags)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:  # e.g. tmpfs
                raise OSError(
                    e.errno,
                    f"{self.meta.file(li)}: its filesystem refuses O_DIRECT; run with "
                    "--no-direct-io (direct_io=False), or keep the experts on a disk's filesystem",
                ) from e
            raise
        self._fds.append(fd)  # closed by close(), whatever happens next
        if direct and sys.platform == "darwin":  # macOS has no O_DIRECT: F_NOCACHE
            import fcntl

            fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)
        elif not direct and hasattr(os, "posix_fadvise"):  # at random: no read-ahead
            os.posix_fadvise(
                fd, 0, 0, os.POSIX_FADV_SEQUENTIAL if sequential else os.POSIX_FADV_RANDOM
            )
        rows = pool.row_pointers()
        dst = (ctypes.c_void_p * len(rows))(*[a for a, _ in rows])
        arrays = [
            np.array([p.offset for p in lay.parts], np.int64),
            np.array([p.nbytes for p in lay.parts], np.int64),
            np.array([b for _, b in rows], np.int64),
            np.array([int(c, 16) for c in lay.checksums], np.uint64)
            if checksums and lay.checksums
            else None,
            np.zeros(lay.num_experts, np.uint8),
        ]
        self._keep += [dst, arrays, pool]  # the memory the engine points into
        off, nbytes, row, sums, self.checked[li] = arrays
        rc = self.lib.mlxs_layer(
            self.handle, pos, fd, lay.stride, lay.record_bytes, lay.num_experts, pool.slots,
            len(lay.parts), _ptr(off), _ptr(nbytes), ctypes.cast(dst, ctypes.c_void_p),
            _ptr(row), _ptr(sums), _ptr(self.checked[li]), self._err, ERR_BYTES,
        )  # fmt: skip
        if rc:
            raise OSError(f"{self.meta.file(li)}: {self._why()}")

    def _read_waves(self, layer: int, experts, slots) -> int:
        """``start``'s read of more than a wave: the records a wave at a time, each started
        and finished on the engine's threads, the GIL released meanwhile; returns the bytes
        read. A read started and not yet finished is finished first (its ``result()``
        keeps its outcome)."""
        e = np.ascontiguousarray(experts, np.int32)
        s = np.ascontiguousarray(slots, np.int32)
        pos, w = self.pos[layer], self._wave
        with self.lock:
            self._wait_started()
            if len(e) > w or len(e) != len(s):  # what no one wave's check sees (a wave of
                # a request one slot longer than a wave has as many of each): the engine
                # checks the rest
                check_waves(layer, e, s)
            calls = 0
            try:
                for a in range(0, max(len(e), 1), w):
                    calls += 1
                    self._begin(pos, layer, e[a : a + w], s[a : a + w], now=True)
                    self._end(pos, layer, e[a : a + w])
            except Exception:
                raise
            except BaseException:  # an interrupt between a wave's start and finish
                self._drain()
                raise
            finally:  # one call per read, as the counters have always counted
                self.counters[pos, 0] -= max(calls - 1, 0)
        return len(e) * self.meta.layers[layer].record_bytes

    @property
    def wave(self) -> int:
        """The most records ``start`` takes."""
        return self._wave

    def start(self, layer: int, experts, slots) -> Started | Done:
        """Start reading records ``experts`` of ``layer`` into ``slots`` (reserved by the
        caller) on the engine's threads and return at once; ``result()`` waits and returns
        the bytes read. A read started and not yet finished is finished first (its
        ``result()`` keeps its outcome). At most a ``wave`` is started; more are read
        before ``start`` returns, wave by wave, and a bad request among them comes back as
        ``Done(error)``. The reader's one way to read (``Loader`` calls it).

        Raises:
            ValueError: a bad request of at most a wave (refused, nothing read).
            ExpertChecksumError, RecordReadError (from ``result()``): naming the file and
                the expert; the slots written may hold partial data and must not be used.
        """
        if len(experts) > self._wave:
            try:
                return Done(self._read_waves(layer, experts, slots))
            except Exception as e:  # noqa: BLE001 - raised by result(), as a started read's
                return Done(error=e)
        pos = self.pos[layer]
        with self.lock:
            self._wait_started()  # one its caller lost (interrupted): its Started keeps it
            try:
                started = Started(self, layer, np.array(experts, np.int32))
                self._begin(pos, layer, experts, slots)
                self._pending = started  # nothing raises once the engine has started
            except BaseException:  # an interrupt once the engine may have started: no
                self._drain()  # thread writes the caller's slots once this returns
                raise
            return self._pending

    def _drain(self) -> None:
        """Finish whatever read the engine holds (under the lock): an interrupt came
        between its start and its finish. Into its ``Started`` where one was made; else
        its outcome is dropped (the engine refuses, harmlessly, when it holds none)."""
        if self._pending is not None:
            self._wait_started()
            return
        self._drop()

    def _drop(self) -> None:
        """mlxs_finish of the read the engine holds, its outcome dropped (under the lock)."""
        status, counts = np.zeros(self._wave, np.int32), np.zeros(N_COUNTERS, np.int64)
        self.lib.mlxs_finish(self.handle, _ptr(status), _ptr(counts), self._err, ERR_BYTES)

    def _begin(self, pos: int, layer: int, experts, slots, now: bool = False) -> None:
        """mlxs_start (under the lock); ``now``: read before returning, on this thread too."""
        n = len(experts)
        if len(slots) != n:
            raise ValueError(
                f"the native reader refused a request: {n} experts for {len(slots)} slots "
                f"(layer {layer})"
            )
        if n <= self._wave:  # one started read at a time: its id buffers are reused
            buf, (pe, ps, _) = self._started, self._started_ptrs
            buf[0, :n], buf[1, :n] = experts, slots
        else:  # the engine refuses it, saying why
            pe, ps = (_ptr(np.ascontiguousarray(a, np.int32)) for a in (experts, slots))
        if self.lib.mlxs_start(self.handle, pos, n, pe, ps, now, self._err, ERR_BYTES):
            raise ValueError(f"the native reader refused a request: {self._why()} (layer {layer})")

    def _end(self, pos: int, layer: int, e: np.ndarray) -> int:
        """mlxs_finish of the read ``_begin`` started (records ``e``), under the lock."""
        st = self._started[2, : len(e)]
        rc = self.lib.mlxs_finish(
            self.handle, self._started_ptrs[2], self._counter_ptrs[pos], self._err, ERR_BYTES
        )
        return self._outcome(rc, layer, e, st)

    def _wait_started(self) -> None:
        """Finish the started read not yet finished, if any, into its ``Started`` (under
        the lock)."""
        t = self._pending
        if t is None:
            return
        if t.outcome is None:  # cleared only once finished: an interrupt retries it
            try:
                t.outcome = self._end(self.pos[t.layer], t.layer, t.experts)
            except Exception as e:  # noqa: BLE001 - raised again on each result()
                t.outcome = e
        self._pending = None

    def wait_started(self) -> None:
        """Finish the started read, if one is not yet finished (its ``Started`` keeps
        the outcome)."""
        with self.lock:
            self._wait_started()

    def staged(self) -> bool:
        """Whether no started read has pieces left to read and copy (idle, or its
        workers done)."""
        return bool(self.lib.mlxs_staged(self.handle))

    def _outcome(self, rc: int, layer: int, e: np.ndarray, st: np.ndarray) -> int:
        """Bytes read, or the error that ``rc`` (a call's status) stands for."""
        if rc:
            bad = int(e[np.flatnonzero(st == CHECKSUM)[0]]) if rc == CHECKSUM else None
            raise status_error(rc, self._why(), self.meta.file(layer), layer, bad)
        return len(e) * self.meta.layers[layer].record_bytes

    def _why(self) -> str:
        """The last engine call's message (read under the lock its call was made in)."""
        return self._err.value.decode(errors="replace")

    def read_gbps(self) -> float:
        """Bytes over the wall time of the reads (GB/s)."""
        done, busy = self.read_totals()
        return done / busy if busy else 0.0

    def read_totals(self) -> tuple[int, int]:
        """Bytes read and the wall time of the reads (ns), since the counters' reset."""
        c = dict(zip(COUNTERS, self.counters.sum(0).tolist()))
        return c["bytes"], c["busy_ns"]

    def reset_counters(self) -> None:
        self.counters[:] = 0

    @property
    def threads(self) -> int:
        """The engine's worker threads (all that were asked for: the engine starts all or
        none)."""
        return self.lib.mlxs_threads(self.handle)

    def close(self) -> None:
        """Finish a started read (its ``result()`` keeps the outcome), stop the threads
        and close the files (idempotent)."""
        with self.lock:
            self._wait_started()
            if self.handle:
                self.lib.mlxs_free(self.handle)
                self.handle = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        streams, self._streams = self._streams, []
        for st in streams:  # the engine's threads, which used them, have stopped
            self._cuda.destroy_stream(st)

    def __del__(self):  # a store dropped without close(): threads, files, streams
        with contextlib.suppress(Exception):
            self.close()
