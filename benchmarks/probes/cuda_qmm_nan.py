"""A minimal reproducer of stock Qwen3-Next's NaN on MLX CUDA: one quantized linear in
bf16, its input dim ``K`` and the rows ``M`` varied, after MLX's buffer cache was filled
with NaN (so memory a kernel reads without writing shows up). Each case is run 20 times;
the count of runs with a non-finite output is printed beside the CPU's.

    python benchmarks/probes/cuda_qmm_nan.py
"""

from __future__ import annotations

import sys

import mlx.core as mx

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # its docstring is its help
    print(__doc__)
    sys.exit(0)
if __name__ == "__main__" and not mx.cuda.is_available():
    sys.exit(f"{__file__}: a probe of MLX's CUDA backend, which this machine lacks")
import mlx.nn as nn


def poison():
    """Leave NaN-filled buffers of many sizes in MLX's cache."""
    junk = [mx.full((n,), float("nan"), mx.bfloat16) for n in (256, 1024, 4096, 16384, 65536)]
    mx.eval(junk)
    del junk


def case(device, k, n, m, bits=4, group=64, runs=20) -> int:
    mx.set_default_device(device)
    mx.random.seed(0)
    lin = nn.Linear(k, n, bias=False)
    lin.set_dtype(mx.bfloat16)
    q = nn.QuantizedLinear.from_linear(lin, group_size=group, bits=bits)
    x = mx.random.normal((1, m, k)).astype(mx.bfloat16)
    bad = 0
    for _ in range(runs):
        poison()
        y = q(x)
        bad += not bool(mx.isfinite(y.astype(mx.float32)).all())
    return bad


def main():
    print("K    N    M   bits  gpu-bad/20  cpu-bad/20", flush=True)
    for k, n in ((64, 128), (128, 64), (128, 128), (256, 64)):
        for m in (1, 2, 4, 8, 16, 64):
            for bits in (4, 8):
                g, c = case(mx.gpu, k, n, m, bits), case(mx.cpu, k, n, m, bits, runs=2)
                print(f"{k:<4} {n:<4} {m:<3} {bits:<5} {g:<11} {c}", flush=True)


if __name__ == "__main__":
    main()
