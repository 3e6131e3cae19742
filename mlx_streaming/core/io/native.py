"""The native I/O engine (``engine.c``): built with the system's C compiler on first use,
driven through ctypes.

The engine reads expert records on its own threads, copies them into pool slots (with
``cudaMemcpyAsync`` when a CUDA runtime is given, else ``memcpy``), checks their
checksums with xxhash's own ``XXH3_64bits`` (from the xxhash package's extension), and
serves MoE layer calls posted to a mailbox by a GPU kernel, all without the GIL. Where
no compiler is found, ``engine_library()`` is None and the store keeps its Python paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("engine.c")
N_COUNTERS = 8  # calls, hits, misses, evictions, bytes, records, busy ns, read ns
STATUS = {
    0: "ok",
    1: "read failed",
    2: "checksum mismatch",
    3: "no slot left",
    4: "bad request",
    5: "copy to the device failed",
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None | bool = None
_why = ""


def _build_dir() -> Path:
    here = SOURCE.parent / "_build"
    try:
        here.mkdir(exist_ok=True)
        probe = here / f".w{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return here
    except OSError:
        d = Path(tempfile.gettempdir()) / f"mlx_streaming-native-{os.getuid()}"
        d.mkdir(exist_ok=True)
        return d


def _compile() -> Path:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src + sys.platform.encode() + cc.encode()).hexdigest()[:12]
    out = _build_dir() / f"engine-{tag}.so"
    if out.exists():
        return out
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    cmd = [cc, "-O2", "-shared", "-fPIC", "-pthread", "-o", str(tmp), str(SOURCE)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        tmp.unlink(missing_ok=True)
        raise OSError(f"compiling {SOURCE.name} failed: {r.stderr.strip()[-500:]}")
    os.replace(tmp, out)  # atomic: ranks building at once all end with a whole library
    return out


def engine_library() -> ctypes.CDLL | None:
    """The compiled engine, or None (``why_unavailable()`` says why)."""
    global _lib, _why
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL(str(_compile()))
                _declare(lib)
                _lib = lib
            except OSError as e:
                _lib, _why = False, str(e)
        return _lib or None


def why_unavailable() -> str:
    engine_library()
    return _why


def _declare(lib) -> None:
    P, Int, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.mlxs_new.restype = P
    lib.mlxs_new.argtypes = [Int, Int, Int, Int, L, L, P, P, P, P, P, L]
    lib.mlxs_layer.restype = Int
    lib.mlxs_layer.argtypes = [P, Int, Int, L, L, Int, Int] + [P] * 8 + [Int] + [P] * 4 + [P] * 3
    lib.mlxs_log.argtypes = [P, P, L, P, P, P]
    lib.mlxs_start.restype = Int
    lib.mlxs_start.argtypes = [P, P, P, P]
    lib.mlxs_read.restype = Int
    lib.mlxs_read.argtypes = [P, Int, Int, P, P, P]
    lib.mlxs_serve.restype = Int
    lib.mlxs_serve.argtypes = [P, Int, Int, P, P]
    lib.mlxs_stop.argtypes = [P]
    lib.mlxs_free.argtypes = [P]
    lib.mlxs_stage.restype = Int
    lib.mlxs_stage.argtypes = [P]
    lib.mlxs_served.restype = L
    lib.mlxs_served.argtypes = [P]
    lib.mlxs_slowest_ns.restype = L
    lib.mlxs_slowest_ns.argtypes = [P]
    lib.mlxs_error.restype = ctypes.c_char_p
    lib.mlxs_error.argtypes = [P]
    lib.mlxs_wait_change.restype = Int
    lib.mlxs_wait_change.argtypes = [P, L, L]


def _hash_function() -> int | None:
    """Address of ``XXH3_64bits`` in the xxhash package's extension (the checksums of the
    expert directory are XXH3-64)."""
    try:
        import xxhash._xxhash as ext

        return ctypes.cast(ctypes.CDLL(ext.__file__).XXH3_64bits, ctypes.c_void_p).value
    except (ImportError, OSError, AttributeError):
        return None


def _ptr(a) -> int:
    return 0 if a is None else a.ctypes.data


class EngineLayer:
    """One MoE layer as the engine sees it: its file, record layout, slot tables (shared
    with the Python side) and where each part of a slot lives."""

    def __init__(
        self,
        fd: int,
        layout,
        capacity: int,
        slot_of: np.ndarray,
        expert_in: np.ndarray,
        part_dst: list[int],
        part_row: list[int],
        lut_host: np.ndarray | None = None,
        lut_dev: int = 0,
        checksums: np.ndarray | None = None,
        queue: int = 64,
        owner=None,
    ):
        E = layout.num_experts
        self.fd, self.layout, self.capacity = fd, layout, capacity
        self.slot_of, self.expert_in = slot_of, expert_in
        self.pinned = np.zeros(E, np.uint8)
        self.last_use = np.zeros(E, np.int64)
        self.victims = np.full(queue, -1, np.int32)
        self.n_victims = np.zeros(2, np.int32)  # [count, generation]
        self.counters = np.zeros(N_COUNTERS, np.int64)
        self.stamp = np.zeros(E, np.int32)
        self.lut_host, self.lut_dev, self.checksums = lut_host, lut_dev, checksums
        self.part_off = np.array([p.offset for p in layout.parts], np.int64)
        self.part_bytes = np.array([p.nbytes for p in layout.parts], np.int64)
        self.part_dst = (ctypes.c_void_p * len(part_dst))(*part_dst)
        self.part_row = np.array(part_row, np.int64)
        self.owner = owner  # whatever holds the memory part_dst points into

    def queue_victims(self, order) -> None:
        """The policy's eviction order for the engine (it checks each entry as it uses
        it, so a stale queue is only a worse choice, never a wrong one)."""
        order = np.asarray(order, np.int32)[: len(self.victims)]
        self.n_victims[0] = 0
        self.victims[: len(order)] = order
        self.n_victims[0] = len(order)
        self.n_victims[1] += 1


class Engine:
    """A running engine over some layers (positions 0..n-1).

    Args:
        layers: ``EngineLayer`` per position.
        threads: Worker threads (the calling thread works too).
        max_rows: Largest call (routed rows) the mailbox carries.
        wave: Records staged at once.
        cuda: The CUDA runtime (``io.cuda``) to copy with, or None (memcpy).
        piece_bytes: Largest piece one read covers.
        log_words: Size of the log ring the Python side drains.
    """

    def __init__(
        self,
        layers: list[EngineLayer],
        threads: int = 8,
        max_rows: int = 256,
        wave: int = 8,
        cuda=None,
        piece_bytes: int = 4 << 20,
        log_words: int = 1 << 20,
        spin_us: int = 500,
    ):
        lib = engine_library()
        if lib is None:
            raise OSError(f"the native engine is unavailable: {why_unavailable()}")
        self.lib, self.layers, self.threads = lib, layers, threads
        self.max_rows = max_rows
        stride = max(lay.layout.stride for lay in layers)
        if cuda is not None:
            self._staging = cuda.pinned(wave * stride)
            self._streams = [cuda.new_stream() for _ in range(threads + 1)]
            copy, sync = cuda.function("cudaMemcpyAsync"), cuda.function("cudaStreamSynchronize")
        else:
            from .reader import aligned_buffer

            self._staging = aligned_buffer(wave * stride)
            self._streams, copy, sync = [0] * (threads + 1), None, None
        streams = (ctypes.c_void_p * (threads + 1))(*self._streams)
        h = _hash_function()
        if h is None and any(lay.checksums is not None for lay in layers):
            raise OSError(
                "checksums need xxhash's XXH3_64bits, not found in the xxhash "
                "package; pass verify=False to read without them"
            )
        self.handle = lib.mlxs_new(
            len(layers),
            threads,
            max_rows,
            wave,
            stride,
            piece_bytes,
            _ptr(self._staging),
            copy,
            sync,
            streams,
            h,
            spin_us * 1000,
        )
        if not self.handle:
            raise OSError("the native engine could not be created")
        for pos, lay in enumerate(layers):
            lo = lay.layout
            rc = lib.mlxs_layer(
                self.handle,
                pos,
                lay.fd,
                lo.stride,
                lo.record_bytes,
                lo.num_experts,
                lay.capacity,
                _ptr(lay.slot_of),
                _ptr(lay.expert_in),
                _ptr(lay.pinned),
                _ptr(lay.last_use),
                _ptr(lay.victims),
                _ptr(lay.n_victims),
                _ptr(lay.lut_host),
                lay.lut_dev,
                len(lo.parts),
                _ptr(lay.part_off),
                _ptr(lay.part_bytes),
                ctypes.cast(lay.part_dst, ctypes.c_void_p),
                _ptr(lay.part_row),
                _ptr(lay.checksums),
                _ptr(lay.counters),
                _ptr(lay.stamp),
            )
            if rc:
                raise OSError(f"the native engine refused layer position {pos}")
        self.log = np.zeros(log_words, np.int32)
        self.log_state = np.zeros(3, np.int64)  # head (engine), tail (Python), dropped
        base = self.log_state.ctypes.data
        lib.mlxs_log(self.handle, _ptr(self.log), log_words, base, base + 8, base + 16)
        self._closed = False

    def start(
        self,
        mailbox: int | None = None,
        answer_host: int | None = None,
        answer_dev: int | None = None,
    ) -> None:
        """Start the workers, and the mailbox loop when ``mailbox`` (host address) is
        given. With ``answer_dev`` (device memory) and ``answer_host`` (page-locked), the
        answers are copied to the device; otherwise they are written into the mailbox."""
        if self.lib.mlxs_start(self.handle, mailbox, answer_host, answer_dev):
            raise OSError("the native engine's threads could not start")

    def read(self, pos: int, experts, slots) -> np.ndarray:
        """Read records ``experts`` of layer position ``pos`` into ``slots`` (reserved by
        the caller); returns each record's status (0: ok). The GIL is released."""
        e = np.ascontiguousarray(experts, np.int32)
        s = np.ascontiguousarray(slots, np.int32)
        st = np.zeros(len(e), np.int32)
        self.lib.mlxs_read(self.handle, pos, len(e), _ptr(e), _ptr(s), _ptr(st))
        return st

    def serve(self, pos: int, ids) -> tuple[int, np.ndarray]:
        """Serve one call directly, as the mailbox loop would: ``(status, slots)``."""
        ids = np.ascontiguousarray(np.asarray(ids).reshape(-1), np.int32)
        out = np.zeros(len(ids), np.int32)
        return self.lib.mlxs_serve(self.handle, pos, len(ids), _ptr(ids), _ptr(out)), out

    def wait_log(self, seen: int, timeout_us: int) -> bool:
        """Wait (without the GIL) until the log's head moves past ``seen``."""
        return bool(self.lib.mlxs_wait_change(self.log_state.ctypes.data, seen, timeout_us))

    def drain(self):
        """The logged calls since the last drain: ``(pos, used, placed [(e, s, victim)],
        bytes)`` each; and how many were dropped (the ring was full)."""
        head, tail = int(self.log_state[0]), int(self.log_state[1])
        out, cap, ring = [], len(self.log), self.log
        while tail < head:
            pos, nu, npl, b0, b1 = (int(ring[(tail + i) % cap]) for i in range(5))
            idx = (tail + 5 + np.arange(nu + 3 * npl)) % cap
            body = ring[idx]
            out.append((pos, body[:nu].copy(), body[nu:].reshape(npl, 3).copy(), b0 | (b1 << 31)))
            tail += 5 + nu + 3 * npl
        self.log_state[1] = tail
        return out, int(self.log_state[2])

    def stop(self) -> None:
        """Stop the threads (the engine answers nothing more; ``close`` frees it)."""
        if not self._closed:
            self.lib.mlxs_stop(self.handle)

    def state(self) -> str:
        """Where the engine is, for error messages."""
        stage = self.lib.mlxs_stage(self.handle)
        where = {
            0: "idle",
            1: "in the slot tables",
            2: "reading and copying records",
            3: "copying a lookup table",
        }.get(stage, str(stage))
        slowest = self.lib.mlxs_slowest_ns(self.handle) / 1e6
        return (
            f"{where}, {self.lib.mlxs_served(self.handle)} calls served, the slowest in "
            f"{slowest:.1f} ms"
        )

    def error(self) -> str:
        return self.lib.mlxs_error(self.handle).decode()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.lib.mlxs_free(self.handle)
