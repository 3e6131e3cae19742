"""Which MLX kernel a gather matmul takes, and how a pool's call takes stock's kernel.

Different kernels accumulate in different orders, so a streamed expert call is
bit-identical to stock mlx-lm's only if MLX picks the same kernel for both. MLX picks by
shape, and on Metal also by the number of experts in the array passed in: for a pool
that is the slot count, not the model's expert count. ``kernel`` restates MLX's rule per
backend; ``pool_sorted_flag`` gives the ``sorted_indices`` flag under which the pool's
call takes the kernel that stock's call (same rows, all experts) takes.

The rule as read from ml-explore/mlx (``MLX_RULE_SOURCE``), with ``M`` the rows per
matrix (1 in mlx-lm's SwitchGLU), ``B`` the matrices in the batch (the routed rows),
``E`` the experts in the weight array:

* Metal, quantized (``backend/metal/quantized.cpp``, ``GatherQMM::eval_gpu``):
  ``M == 1 and B >= 16 and sorted and B // E >= 4`` -> ``gather_qmm_rhs``;
  ``M >= vector_limit(K, N, device)`` -> ``gather_qmm``; else ``gather_qmv``.
* Metal, float (``backend/metal/matmul.cpp``, ``GatherMM::eval_gpu``):
  ``M == 1 and sorted`` -> ``gather_mm_rhs``; ``M == 1`` -> ``gather_mv``; else mm.
* CUDA, quantized (``backend/cuda/quantized/quantized.cpp``): ``M * B < 8`` -> ``qmv``,
  else ``qmm`` (neither E nor the sorted flag matter).
* CUDA, float (``backend/cuda/matmul.cpp``, ``GatherMM::eval_gpu``): ``M == 1 and
  sorted`` -> grouped gemm; else gemv / gemm.
* CPU: one kernel for every shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

MLX_RULE_SOURCE = (
    "ml-explore/mlx 0.32 (main at 846d176, 2026-11), read against the installed mlx 0.32.4"
)
BACKENDS = ("cpu", "metal", "cuda")


class KernelParityError(RuntimeError):
    """A pool's gather matmul would take another MLX kernel than stock mlx-lm's."""


def backend() -> str:
    """``cpu``, ``metal`` or ``cuda``: the backend of MLX's default device."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


@dataclass(frozen=True)
class GatherCall:
    """The shape facts MLX's kernel choice reads."""

    backend: str
    quantized: bool
    M: int  # rows per matrix
    B: int  # matrices in the batch (routed rows in mlx-lm's SwitchGLU)
    E: int  # experts in the weight array passed in
    sorted: bool  # sorted_indices


def kernel(c: GatherCall) -> str:
    """The kernel MLX runs for ``c`` (``MLX_RULE_SOURCE``)."""
    if c.backend == "cpu":
        return "cpu"
    if c.backend == "metal":
        if c.quantized:
            if c.M == 1 and c.B >= 16 and c.sorted and c.B // c.E >= 4:
                return "gather_qmm_rhs"
            # M >= vector_limit (6 to 33 by device, never met by M == 1) picks gather_qmm:
            # E and the sorted flag play no part there, so stock and pool agree
            return "gather_qmv" if c.M == 1 else f"gather_qmm_or_qmv(M={c.M})"
        if c.M == 1:
            return "gather_mm_rhs" if c.sorted else "gather_mv"
        return "gather_mm"
    if c.backend == "cuda":
        if c.quantized:
            return "qmv" if c.M * c.B < 8 else "qmm"
        if c.M == 1:
            return "grouped_gemm" if c.sorted else "gather_mv"
        return "gather_mm"
    raise ValueError(f"unknown backend {c.backend!r} (one of {BACKENDS})")


def reads_experts(backend: str, quantized: bool) -> bool:
    """Whether the number of experts in the weight array can change ``backend``'s kernel
    choice (only Metal's quantized rule reads it): where it cannot, stock's own flag
    gives a pool stock's kernel at every shape."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (one of {BACKENDS})")
    return backend == "metal" and quantized


def pool_sorted_flag(
    backend: str,
    quantized: bool,
    M: int,
    B: int,
    model_experts: int,
    pool_experts: int,
    stock_sorted: bool,
) -> bool:
    """The ``sorted_indices`` flag under which a pool of ``pool_experts`` slots takes the
    kernel that stock's call over ``model_experts`` takes.

    Raises:
        KernelParityError: no flag gives stock's kernel.
    """
    want = kernel(GatherCall(backend, quantized, M, B, model_experts, stock_sorted))
    for flag in (stock_sorted, not stock_sorted):
        if kernel(GatherCall(backend, quantized, M, B, pool_experts, flag)) == want:
            return flag
    raise KernelParityError(
        f"on {backend}, a gather matmul of {B} rows over {pool_experts} pool slots cannot "
        f"take stock's kernel {want} (over {model_experts} experts); streaming this layer "
        "would not be bit-exact: give the layer every expert's slot, or fewer"
    )


def _batch(x: mx.array, indices: mx.array) -> tuple[int, int]:
    """(M, B) of a gather matmul of ``x`` [..., M, K] with ``indices``."""
    shape = np.broadcast_shapes(tuple(x.shape[:-2]), tuple(indices.shape))
    return x.shape[-2], math.prod(shape)


def _flag(proj, x: mx.array, indices: mx.array, sorted_indices: bool) -> bool:
    key = (x.shape, indices.shape, sorted_indices)
    flag = proj.flags.get(key)
    if flag is None:  # decided once per call shape (a decode step repeats one shape)
        M, B = _batch(x, indices)
        flag = pool_sorted_flag(
            proj.backend,
            isinstance(proj, QuantizedSwitchLinear),
            M,
            B,
            proj.model_experts,
            proj.slots,
            sorted_indices,
        )
        proj.flags[key] = flag
    return flag


class _StockKernel:
    """Over pool slots, passes MLX the sort flag under which the gather matmul takes the
    kernel that stock's call over ``model_experts`` experts takes on ``backend``."""

    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        slots: int,
        *,
        model_experts: int,
        backend: str,
        **kw,
    ):
        super().__init__(input_dims, output_dims, slots, **kw)
        self.model_experts, self.backend, self.slots = model_experts, backend, slots
        object.__setattr__(self, "flags", {})  # call shape -> sorted flag (not a child)
        # stock's flag is the pool's where the expert count plays no part in the choice,
        # or the pool passes stock's very array shape: no per-call lookup
        quantized = isinstance(self, QuantizedSwitchLinear)
        self.own_flag = not reads_experts(backend, quantized) or model_experts == slots

    def __call__(self, x, indices, sorted_indices=False):
        if self.own_flag:
            return super().__call__(x, indices, sorted_indices)
        return super().__call__(x, indices, _flag(self, x, indices, sorted_indices))


class PoolQuantizedSwitchLinear(_StockKernel, QuantizedSwitchLinear):
    """mlx-lm's ``QuantizedSwitchLinear`` over pool slots, taking stock's kernel."""


class PoolSwitchLinear(_StockKernel, SwitchLinear):
    """mlx-lm's ``SwitchLinear`` over pool slots, taking stock's kernel."""
