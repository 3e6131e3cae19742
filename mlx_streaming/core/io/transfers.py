"""Small transfers between host and device on CUDA, through page-locked host memory
the device reads.

MLX's own read of a small array (``mx.eval`` then ``np.array``) touches MLX's managed
buffer from the host, which migrates its page: ~130 µs on an H200 for six ids, once per
MoE layer call. ``IdTransfers.start`` instead launches, with the routing, a one-thread
kernel that writes the ids into page-locked host memory the device can address; once its
output is evaluated the host reads them there (~46 µs). A second channel brings a
read-ahead predictor's guess along with the routing.

The other way, ``mx.array(ids)`` of a few host ids (the slots a call runs) may take a
cached device buffer, which MLX first moves to managed memory (``cudaMallocManaged`` and
a blocking copy, MLX 0.32 ``CudaAllocator::malloc_async``). ``IdTransfers.to_device``
writes the ids into a ring of such host buffers and a one-thread kernel copies them
into a device array. The values are the same integers either way; a check at start-up
compares both transfers with MLX's own and keeps MLX's where they differ.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np

from ..ids import DECODE_IDS, SLOT_IDS, SLOT_IDS_NP
from .kernels import Kernels

CHANNELS = 2  # reads in flight at once: a call's routing and its predictor's guess
_DTYPES = {mx.uint32: np.uint32, mx.int32: np.int32}
_TO_DEVICE = """
    const unsigned int* src = (const unsigned int*)(addr[0]);
    for (int i = 0; i < N; i++) out[i] = src[i];
"""
RING = 64  # host buffers for to_device: one is rewritten only 64 calls later
_SOURCE = """
    unsigned int* out = (unsigned int*)(dst[0]);
    for (int i = 0; i < N; i++) out[i] = (unsigned int)ids[i];
    __threadfence_system();
    done[0] = 1;
"""


class IdTransfers:
    """Small id arrays between host and device through page-locked host memory the
    device reads: a routing read on the host (``start``, then ``read``), slot ids sent to
    the device (``to_device``)."""

    def __init__(self):
        from . import cuda

        # CHANNELS host buffers of DECODE_IDS ids: the routing, and a predictor's guess
        self._host, dev = cuda.shared_host(4 * DECODE_IDS * CHANNELS)
        self._host = self._host.reshape(CHANNELS, 4 * DECODE_IDS)
        self._addr = [
            mx.array(np.array([dev + 4 * DECODE_IDS * c], np.uint64)) for c in range(CHANNELS)
        ]
        mx.eval(self._addr)
        self._kernel = Kernels("mlxs_routing_to_host", _SOURCE, ["ids", "dst"], ["done"])
        # to_device: RING buffers of DECODE_IDS ids, each with its address as a device array
        self._ring, ring_dev = cuda.shared_host(4 * DECODE_IDS * RING)
        self._ring = self._ring.view(SLOT_IDS_NP).reshape(RING, DECODE_IDS)
        self._ring_addr = [
            mx.array(np.array([ring_dev + 4 * DECODE_IDS * i], np.uint64)) for i in range(RING)
        ]
        mx.eval(self._ring_addr)
        self._next = 0
        self._copy = Kernels("mlxs_ids_to_device", _TO_DEVICE, ["addr"], ["out"])

    def start(self, ids: mx.array, channel: int = 0) -> mx.array | None:
        """The kernel's output (evaluate it, then ``read`` on the same ``channel``), or
        None where ``ids`` is read the usual way (too many, or not 32-bit integers)."""
        if ids.size > DECODE_IDS or ids.dtype not in _DTYPES:
            return None
        (done,) = self._kernel((("N", ids.size),))(
            inputs=[ids, self._addr[channel]],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.int32],
        )
        return done

    def read(self, ids: mx.array, channel: int = 0) -> np.ndarray:
        """``ids`` on the host, once ``start(ids, channel)``'s output has been evaluated."""
        n = ids.size
        host = self._host[channel, : 4 * n]
        return host.view(_DTYPES[ids.dtype]).reshape(ids.shape).copy()

    def to_device(self, ids: np.ndarray) -> mx.array:
        """``mx.array(ids)`` as slot ids (``ids.SLOT_IDS``, uint32), without a
        host-made MLX buffer (``ids`` at most ``DECODE_IDS``; larger arrays take ``mx.array``)."""
        if ids.size > DECODE_IDS:
            return mx.array(ids.astype(SLOT_IDS_NP))
        i, self._next = self._next, (self._next + 1) % RING
        self._ring[i, : ids.size] = ids.ravel()
        (out,) = self._copy((("N", ids.size),))(
            inputs=[self._ring_addr[i]],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[ids.shape],
            output_dtypes=[SLOT_IDS],
        )
        return out


def id_transfers() -> tuple[IdTransfers | None, str]:
    """An ``IdTransfers`` whose transfers of test arrays equal MLX's own, and ``""``; or
    None and why (no CUDA runtime, no kernel compiler, or a different result: each
    routing is then read the usual way)."""
    from . import cuda

    if not cuda.available() or not hasattr(mx.fast, "cuda_kernel"):
        return None, "no CUDA runtime or kernel compiler: routing read the usual way"

    def fallback(why: str) -> tuple[None, str]:
        why = f"the ids' transfers failed their start-up check ({why})"
        warnings.warn(
            f"{why}: each MoE layer's routing is read the usual way (slower; exact all the same)",
            stacklevel=3,
        )
        return None, why + ": routing read the usual way"

    try:
        r = IdTransfers()
        for ids in (
            mx.array([[5, 0, 63, 7, 2, 41]], mx.uint32),
            mx.arange(DECODE_IDS, dtype=mx.int32),
        ):
            ids = ids[..., ::-1] + 0  # computed on the device, like a router's output
            for c in range(CHANNELS):
                done = r.start(ids, c)
                mx.eval(done, ids)
                if not np.array_equal(r.read(ids, c), np.array(ids)):
                    return fallback(f"channel {c} read other ids than MLX's")
        for i in range(RING + 1):  # every ring buffer, and one reused
            want = np.random.default_rng(i).integers(0, 2**31, (1, 6), np.int32)
            if not np.array_equal(np.array(r.to_device(want)), want):
                return fallback(f"ring buffer {i % RING} sent other ids than MLX's")
        return r, ""
    except Exception as e:  # noqa: BLE001 (any failure: read the usual way)
        return fallback(repr(e))
