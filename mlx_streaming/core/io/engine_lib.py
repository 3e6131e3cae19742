"""The native engine's library (``engine*.c``, built by ``pip install``): found, loaded
and declared for ctypes once per process; its statuses, counters and request checks."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path

import numpy as np

from ..extensions import extension_path

HERE = Path(__file__).parent
# mlxs_finish's statuses that the reader words itself (engine.h: ST_CHECKSUM, ST_ARGS,
# ST_COPY)
CHECKSUM, REFUSED, COPY = 2, 4, 5
# calls, records, bytes, read ns (pread + copy calls), busy ns (wall), pread ns, copy-call ns,
# sync ns, copy calls: the threads' times are summed over threads
COUNTERS = ("calls", "records", "bytes", "read_ns", "busy_ns", "pread_ns", "copy_ns", "sync_ns",
            "copies")  # fmt: skip
N_COUNTERS = len(COUNTERS)
ERR_BYTES = 512  # an engine message's buffer
MAX_THREADS = 63  # reader threads the engine runs at most (engine.h: MAX_THREADS - 1)
ABI = 5  # engine.h's MLXS_ABI: raised with it whenever a call's arguments change

_lock = threading.Lock()
_lib: ctypes.CDLL | None | bool = None
_why = ""


def staging(meta) -> tuple[int, int]:
    """``(wave, bytes)``: the records the native reader stages at once (a call's misses
    in one wave) and the buffer they take (page-locked on CUDA), for ``meta``'s layers."""
    wave = max(8, meta.top_k)
    return wave, wave * max((lay.stride for lay in meta.layers.values()), default=0)


def direct_refused(paths) -> str:
    """Why the filesystem of one of ``paths`` refuses the native reader's O_DIRECT reads
    ('' where each takes them): some refuse the open (tmpfs before Linux 6.6), some the
    read itself."""
    if not hasattr(os, "O_DIRECT"):
        return "this system has no O_DIRECT"
    page = mmap.mmap(-1, mmap.PAGESIZE)  # page-aligned, as the reader's staging
    try:
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                try:
                    os.preadv(fd, [page], 0)
                finally:
                    os.close(fd)
            except OSError as e:
                return f"{path}: {e.strerror or e}"
    finally:
        page.close()
    return ""


def library_path() -> Path | None:
    """The compiled engine inside the installed package, if it was built."""
    return extension_path(HERE, "_engine")


def library() -> ctypes.CDLL | None:
    """The compiled engine, or None (``why_unavailable()`` says why)."""
    global _lib, _why
    with _lock:
        if _lib is None:
            path = library_path()
            try:
                if path is None:
                    raise OSError(
                        f"no compiled engine (_engine*.so) in {HERE}: install the package "
                        "with pip install (it builds the engine)"
                    )
                lib = ctypes.CDLL(str(path))
                _declare(lib)
                _lib = lib
            except OSError as e:
                _lib, _why = False, str(e)
            except AttributeError as e:  # a library built from older sources
                _lib, _why = False, f"{path} is out of date ({e}): pip install the package again"
        return _lib or None


def use_library(path: str | Path) -> ctypes.CDLL:
    """Load the engine from ``path`` instead of the installed package, for this process
    (a sanitizer build under test: ``.ci/sanitize``). Call before any store is built."""
    global _lib
    with _lock:
        lib = ctypes.CDLL(str(path))
        _declare(lib)
        _lib = lib
    return lib


def why_unavailable() -> str:
    library()
    return _why


def _declare(lib) -> None:
    P, Int, L, S = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_char_p
    lib.mlxs_abi.restype, lib.mlxs_abi.argtypes = Int, []
    if lib.mlxs_abi() != ABI:  # (a library without it raises AttributeError: the same)
        raise AttributeError(f"its calls are version {lib.mlxs_abi()}, this package's {ABI}")
    # every call that can fail ends with the caller's (err, err_len) for its message
    lib.mlxs_new.restype = P
    lib.mlxs_new.argtypes = [Int, Int, Int, L, L, P, P, P, P, P, S, Int]
    lib.mlxs_layer.restype = Int
    lib.mlxs_layer.argtypes = [P, Int, Int, L, L, Int, Int, Int, P, P, P, P, P, P, S, Int]
    lib.mlxs_start.restype = Int
    lib.mlxs_start.argtypes = [P, Int, Int, P, P, Int, S, Int]
    lib.mlxs_finish.restype = Int
    lib.mlxs_finish.argtypes = [P, P, P, S, Int]
    lib.mlxs_staged.restype = Int
    lib.mlxs_staged.argtypes = [P]
    lib.mlxs_free.argtypes = [P]
    lib.mlxs_threads.restype = Int
    lib.mlxs_threads.argtypes = [P]
    lib.mlxs_ring_start.restype = Int
    lib.mlxs_ring_start.argtypes = [P, P, Int, P, L, Int, Int, S, Int]
    lib.mlxs_ring_counters.restype = Int
    lib.mlxs_ring_counters.argtypes = [P, P, Int]
    lib.mlxs_ring_stop.argtypes = [P]
    lib.mlxs_ring_post.restype = lib.mlxs_ring_done.restype = ctypes.c_int32
    lib.mlxs_ring_post.argtypes = [P, Int, ctypes.c_int32, ctypes.c_int32]
    lib.mlxs_ring_done.argtypes = [P, Int]


def error_buffer() -> ctypes.Array:
    """A buffer for an engine call's message (``err``, ``len(buf)``)."""
    return ctypes.create_string_buffer(ERR_BYTES)


def hash_function() -> int | None:
    """Address of ``XXH3_64bits`` in the xxhash package's extension (the checksums of the
    expert directory are XXH3-64)."""
    try:
        import xxhash._xxhash as ext

        return ctypes.cast(ctypes.CDLL(ext.__file__).XXH3_64bits, ctypes.c_void_p).value
    except (ImportError, OSError, AttributeError):
        return None


def status_error(rc: int, why: str, path, layer: int, bad: int | None = None) -> Exception:
    """The error a failed read's status ``rc`` stands for (``why``: the engine's message;
    ``bad``: the expert that failed its checksum), naming the file and the layer."""
    from ..format import ExpertChecksumError
    from .reader import RecordReadError

    if rc == REFUSED:
        return ValueError(f"the native reader refused a request: {why} (layer {layer})")
    if rc == CHECKSUM:  # worded as the Python reader words it
        return ExpertChecksumError(
            f"expert {bad} of layer {layer} in {path} fails its checksum: the file is corrupt; "
            "split the model again"
        )
    if rc == COPY:  # the file read well: the device refused the copy
        return RecordReadError(
            f"{path}: {why} (layer {layer}): the GPU did not take the copy (out of memory, or "
            "a failed device); the file is not at fault"
        )
    return RecordReadError(f"{path}: {why} (layer {layer}); split the model again")


def check_waves(layer: int, e: np.ndarray, s: np.ndarray) -> None:
    """Refuse, before any wave is read, a request of several waves that no one wave's
    check would: lengths that differ, a slot named in two waves."""
    if len(e) != len(s):
        why = f"{len(e)} experts for {len(s)} slots"
    else:
        seen, count = np.unique(s, return_counts=True)
        if not (count > 1).any():
            return
        why = f"bad request: slot {seen[count > 1][0]} named twice"
    raise ValueError(f"the native reader refused a request: {why} (layer {layer})")
