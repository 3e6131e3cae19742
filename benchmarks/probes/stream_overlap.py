"""What a device-path read-ahead could win on CUDA: how fast a kernel copies from
page-locked, device-mapped host memory (the swap tier) by its block count, and whether
such a copy on a second MLX stream runs beside compute on the first.

A swap tier's misses are trades: each word of a record comes over the bus from the tier
and the victim's word goes back (``mlxs_copy`` with ``SWAP``). The device path runs them
in its plan kernel, in series with the layer's matmuls (2026-12-05: 164 MB per token at
50% residency, modelled as ~3.3 ms of a 24.7 ms token). Cases, each the median of
``--repeat`` timed evaluations:

* ``copy``: ``--mb`` MB swapped between mapped host memory and a device buffer, alone, by
  blocks of 256 threads (the plan kernel uses 128 blocks);
* ``compute``: ``gemm``, a chain of float16 4096x4096 matmuls (cuBLAS's kernels may hold
  every SM), or ``qmv``, a decode step's kind of work: a chain of 4-bit matrix-vector
  products (DS2-Lite's expert shapes), each a small kernel;
* ``same stream`` / ``two streams``: both, queued on one stream, or the copy on a second
  MLX stream; ``dma``: the same bytes in and out by ``cudaMemcpyAsync`` on a stream of
  our own (the copy engines, not the SMs) while MLX computes; ``overlap`` is the share of
  the shorter one hidden (1: fully beside, 0: in series).

    python benchmarks/probes/stream_overlap.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_streaming.core.cache.pool import device_address  # noqa: E402
from mlx_streaming.core.io import cuda  # noqa: E402

SWAP = """
    uint4* host = (uint4*)(ptr[0]);
    uint4* dev = (uint4*)(buf);
    const long long words = ptr[1] / 16;
    const long long nth = (long long)gridDim.x * blockDim.x;
    for (long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x; w < words; w += nth) {
        uint4 a = host[w];
        uint4 b = dev[w];
        host[w] = b;
        dev[w] = a;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) { out[0] = 1; }
"""


def timed(fn, repeat: int) -> float:
    """Median seconds of ``fn()`` evaluated and synchronised."""
    times = []
    for _ in range(repeat + 1):  # the first compiles
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=164, help="MB swapped per copy (default 164)")
    p.add_argument("--blocks", default="128,512,1024,2048", help="block counts to try")
    p.add_argument("--compute", default="gemm,qmv", help="compute kinds to try")
    p.add_argument("--matmuls", type=int, default=24, help="gemm: matmuls in the chain")
    p.add_argument("--dim", type=int, default=4096, help="gemm: square matmul size")
    p.add_argument("--qmvs", type=int, default=600, help="qmv: products in the chain")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    if not cuda.available() or mx.default_device() != mx.gpu:
        raise SystemExit("stream_overlap: needs MLX's CUDA build and a GPU")

    nbytes = a.mb << 20
    host, dev_addr = cuda.shared_host(nbytes)
    host[:] = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    ptr = mx.array(np.array([dev_addr, nbytes], np.uint64).view(np.int64))
    buf = mx.zeros((nbytes,), mx.uint8)
    kernel = mx.fast.cuda_kernel(
        name="probe_swap", input_names=["ptr", "buf"], output_names=["out"], source=SWAP
    )

    def copy(blocks: int, stream=None):
        with mx.stream(stream or mx.default_stream(mx.gpu)):
            (o,) = kernel(
                inputs=[ptr, buf],
                grid=(blocks * 256, 1, 1),
                threadgroup=(256, 1, 1),
                output_shapes=[(1,)],
                output_dtypes=[mx.int32],
            )
        return o

    x = mx.random.normal((a.dim, a.dim)).astype(mx.float16)
    w = (mx.random.normal((a.dim, a.dim)) / a.dim**0.5).astype(mx.float16)
    v = mx.random.normal((1, 2048)).astype(mx.float16)
    # a layer's expert pair each, 26 layers: 76 MB, more than the L2 cache holds
    pairs = [
        (
            mx.quantize((mx.random.normal((1408, 2048)) / 45).astype(mx.float16), 64, 4),
            mx.quantize((mx.random.normal((2048, 1408)) / 38).astype(mx.float16), 64, 4),
        )
        for _ in range(26)
    ]
    mx.eval(x, w, v, pairs, buf)

    def gemm():
        y = x
        for _ in range(a.matmuls):
            y = y @ w
        return y

    def qmv():
        y = v
        for i in range(a.qmvs // 2):
            up, down = pairs[i % len(pairs)]
            h = mx.quantized_matmul(y, *up, transpose=True, group_size=64, bits=4)
            y = mx.quantized_matmul(h, *down, transpose=True, group_size=64, bits=4)
        return y

    dst = device_address(buf)
    back, _ = cuda.shared_host(nbytes)

    def dma() -> None:  # in and out, on our own stream (waited for by cuda.synchronize)
        half = nbytes // 2
        cuda.copy_to_device(dst, host.ctypes.data, half)
        cuda.copy_to_device(back.ctypes.data, dst + half, half, cuda.D2H)

    def dma_with(compute):
        dma()
        y = compute()
        mx.eval(y)
        cuda.synchronize()
        return y

    side = mx.new_stream(mx.gpu)
    res: dict = {"mb": a.mb, "blocks_of": 256, "copy": {}, "compute": {}}
    for blocks in [int(b) for b in a.blocks.split(",")]:
        t = timed(lambda b=blocks: copy(b), a.repeat)
        res["copy"][blocks] = {"copy_ms": 1e3 * t, "gbps_each_way": nbytes / t / 1e9}
        print(f"{blocks:5d} blocks: copy {1e3 * t:.2f} ms ({nbytes / t / 1e9:.1f} GB/s each way)")
    t_dma = timed(lambda: (dma(), cuda.synchronize(), mx.array(0))[-1], a.repeat)
    res["dma_ms"] = 1e3 * t_dma
    print(f"  dma: {1e3 * t_dma:.2f} ms ({nbytes / t_dma / 1e9:.1f} GB/s, half each way)")
    blocks = int(a.blocks.split(",")[0])
    t = res["copy"][blocks]["copy_ms"] / 1e3
    for kind in a.compute.split(","):
        compute = {"gemm": gemm, "qmv": qmv}[kind]
        c = timed(compute, a.repeat)
        same = timed(lambda f=compute: [f(), copy(blocks)], a.repeat)
        two = timed(lambda f=compute: [f(), copy(blocks, side)], a.repeat)
        with_dma = timed(lambda f=compute: dma_with(f), a.repeat)

        def hid(total: float, t_copy: float, c: float = c) -> float:
            return (c + t_copy - total) / min(c, t_copy)

        res["compute"][kind] = row = {
            "compute_ms": 1e3 * c,
            "same_stream_ms": 1e3 * same,
            "two_streams_ms": 1e3 * two,
            "dma_ms": 1e3 * with_dma,
            "overlap_same": hid(same, t),
            "overlap_two": hid(two, t),
            "overlap_dma": hid(with_dma, t_dma),
        }
        print(
            f"{kind}: compute {row['compute_ms']:.2f} ms; with the {blocks}-block copy: one "
            f"stream {row['same_stream_ms']:.2f} ms (overlap {row['overlap_same']:.2f}), two "
            f"streams {row['two_streams_ms']:.2f} ms (overlap {row['overlap_two']:.2f}); with "
            f"dma {row['dma_ms']:.2f} ms (overlap {row['overlap_dma']:.2f})",
            flush=True,
        )
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
