"""The CUDA runtime through ctypes: page-locked host memory, copies into MLX's CUDA
memory, and page-locked file mappings the device reads.

Pools are plain device memory (see ``cache.pool``); the native reader's records land in
page-locked host buffers and are copied with ``cudaMemcpyAsync`` on a non-blocking stream
per thread, at PCIe speed, with the GIL released (the engine calls the same functions
directly). MLX never sees these copies: the store marks a slot resident only after its
copy has been synchronized. ``available()`` is False without a CUDA runtime (then
``runtime.resolve`` refuses cuda pools, saying so).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import threading

_lib = None
_lock = threading.Lock()
_local = threading.local()
H2D = 1  # cudaMemcpyHostToDevice
NON_BLOCKING = 1  # cudaStreamNonBlocking
ATTR_DEVICE = 2  # cudaMemoryTypeDevice
D2H = 2  # cudaMemcpyDeviceToHost
REGISTER_MAPPED = 2  # cudaHostRegisterMapped
REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly


class CudaError(RuntimeError):
    pass


def _candidates() -> list[str]:
    names = []
    found = ctypes.util.find_library("cudart")
    if found:
        names.append(found)
    for pat in ("/usr/local/cuda*/lib64/libcudart.so*", "/usr/lib/x86_64-linux-gnu/libcudart.so*"):
        names += sorted(glob.glob(pat), reverse=True)
    try:  # the runtime shipped beside MLX's CUDA wheel, if any
        import mlx

        for base in list(getattr(mlx, "__path__", [])):
            root = os.path.dirname(base)
            for sub in ("nvidia/cu*/lib", "nvidia/cuda_runtime/lib"):
                names += sorted(glob.glob(os.path.join(root, sub, "libcudart.so*")))
    except ImportError:
        pass
    return names


def lib():
    """The loaded CUDA runtime, or None."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = False
            for name in _candidates():
                try:
                    cand = ctypes.CDLL(name)
                    n = ctypes.c_int(0)
                    if cand.cudaGetDeviceCount(ctypes.byref(n)) == 0 and n.value > 0:
                        _lib = cand
                        break
                except OSError:
                    continue
        return _lib or None


def available() -> bool:
    return lib() is not None


def _check(err: int, what: str) -> None:
    if err != 0:
        rt = lib()
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        raise CudaError(f"{what} failed: {rt.cudaGetErrorString(err).decode()} ({err})")


class _PointerAttributes(ctypes.Structure):
    # the documented fields, then room for any the runtime version adds
    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("devicePointer", ctypes.c_void_p),
        ("hostPointer", ctypes.c_void_p),
        ("reserved", ctypes.c_byte * 256),
    ]


def memory_type(ptr: int) -> int:
    """The CUDA memory type of ``ptr`` (0 unregistered host, 1 host, 2 device, 3 managed;
    -1 when the runtime cannot tell)."""
    attrs = _PointerAttributes()
    if lib().cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(ptr)) != 0:
        return -1
    return attrs.type


def page_locked(nbytes: int):
    """A page-locked host buffer from ``cudaHostAlloc`` as a uint8 NumPy array; the CUDA
    allocation is freed when the array is."""
    import weakref

    import numpy as np

    ptr = ctypes.c_void_p()
    _check(
        lib().cudaHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(max(nbytes, 1)), 0), "cudaHostAlloc"
    )
    raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr.value)
    arr = np.frombuffer(raw, dtype=np.uint8, count=nbytes)
    weakref.finalize(raw, lib().cudaFreeHost, ptr)
    return arr


def shared_host(nbytes: int):
    """Page-locked host memory mapped into the device's address space
    (``cudaHostAllocMapped``): ``(uint8 host array, device address)``. Kernels read and
    write it over the bus; host writes become visible to a running kernel."""
    import weakref

    import numpy as np

    ptr = ctypes.c_void_p()
    _check(
        lib().cudaHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(max(nbytes, 1)), 2),
        "cudaHostAlloc(mapped)",
    )
    dev = ctypes.c_void_p()
    _check(lib().cudaHostGetDevicePointer(ctypes.byref(dev), ptr, 0), "cudaHostGetDevicePointer")
    raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr.value)
    arr = np.frombuffer(raw, dtype=np.uint8, count=nbytes)
    arr[:] = 0
    weakref.finalize(raw, lib().cudaFreeHost, ptr)
    return arr, dev.value


def register_read_only(ptr: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` of host memory at ``ptr`` (a read-only file mapping: the
    file's page-cache pages) so that copies from it go straight to the device, and map
    it into the device's address space (kernels may read it: ``device_pointer``)."""
    flags = REGISTER_READ_ONLY | REGISTER_MAPPED
    _check(
        lib().cudaHostRegister(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), flags),
        "cudaHostRegister",
    )


def device_pointer(ptr: int) -> int:
    """The device address of registered or mapped host memory at ``ptr``."""
    dev = ctypes.c_void_p()
    _check(
        lib().cudaHostGetDevicePointer(ctypes.byref(dev), ctypes.c_void_p(ptr), 0),
        "cudaHostGetDevicePointer",
    )
    return dev.value


def unregister(ptr: int) -> None:
    """Undo ``register_read_only``."""
    _check(lib().cudaHostUnregister(ctypes.c_void_p(ptr)), "cudaHostUnregister")


def new_stream() -> int:
    """A non-blocking CUDA stream (for a native thread's copies)."""
    s = ctypes.c_void_p()
    _check(
        lib().cudaStreamCreateWithFlags(ctypes.byref(s), NON_BLOCKING), "cudaStreamCreateWithFlags"
    )
    return s.value


def destroy_stream(stream: int) -> None:
    """Destroy a stream made by ``new_stream`` (its queued work finishes first)."""
    _check(lib().cudaStreamDestroy(ctypes.c_void_p(stream)), "cudaStreamDestroy")


def function(name: str) -> int:
    """The address of a CUDA runtime function, for native code to call."""
    return ctypes.cast(getattr(lib(), name), ctypes.c_void_p).value


def _stream():
    s = getattr(_local, "stream", None)
    if s is None:
        s = ctypes.c_void_p()
        _check(
            lib().cudaStreamCreateWithFlags(ctypes.byref(s), NON_BLOCKING),
            "cudaStreamCreateWithFlags",
        )
        _local.stream = s
    return s


def copy_to_device(dst: int, src: int, nbytes: int, kind: int = H2D) -> None:
    """Queue a host-to-device copy (``kind`` D2H: device-to-host) on this thread's
    stream."""
    _check(
        lib().cudaMemcpyAsync(
            ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes), kind, _stream()
        ),
        "cudaMemcpyAsync",
    )


def copy_now(dst: int, src: int, nbytes: int, kind: int = H2D) -> None:
    """Copy ``nbytes`` between host and device and wait (``kind`` H2D or D2H); the
    caller makes sure no queued device work still uses the device side."""
    _check(
        lib().cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes), kind),
        "cudaMemcpy",
    )


def device_memory() -> tuple[int, int]:
    """``(total, free)`` bytes of the current device's memory (``cudaMemGetInfo``)."""
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _check(lib().cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)), "cudaMemGetInfo")
    return total.value, free.value


def device_synchronize() -> None:
    """Wait for everything queued on the device, on every stream (a pageable copy's
    ``cudaMemcpy`` may return before its transfer has landed)."""
    _check(lib().cudaDeviceSynchronize(), "cudaDeviceSynchronize")


def synchronize() -> None:
    """Wait for this thread's queued copies."""
    _check(lib().cudaStreamSynchronize(_stream()), "cudaStreamSynchronize")
