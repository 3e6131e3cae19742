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
* ``compute``: a chain of float16 matmuls sized to about a decode step's compute;
* ``same stream`` / ``two streams``: both, queued on one stream, or the copy on a second
  stream; ``overlap`` is the share of the shorter one hidden (1: fully beside, 0: in
  series).

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
    p.add_argument("--matmuls", type=int, default=24, help="matmuls in the compute chain")
    p.add_argument("--dim", type=int, default=4096, help="square matmul size")
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
    mx.eval(x, w, buf)

    def compute():
        y = x
        for _ in range(a.matmuls):
            y = y @ w
        return y

    side = mx.new_stream(mx.gpu)
    res: dict = {"mb": a.mb, "blocks_of": 256}
    res["compute_ms"] = 1e3 * timed(compute, a.repeat)
    res["copy"] = {}
    for blocks in [int(b) for b in a.blocks.split(",")]:
        t = timed(lambda b=blocks: copy(b), a.repeat)
        same = timed(lambda b=blocks: [compute(), copy(b)], a.repeat)
        two = timed(lambda b=blocks: [compute(), copy(b, side)], a.repeat)
        short = min(t, res["compute_ms"] / 1e3)
        total = t + res["compute_ms"] / 1e3
        res["copy"][blocks] = row = {
            "copy_ms": 1e3 * t,
            "gbps_each_way": nbytes / t / 1e9,
            "same_stream_ms": 1e3 * same,
            "two_streams_ms": 1e3 * two,
            "overlap_same": (total - same) / short,
            "overlap_two": (total - two) / short,
        }
        print(
            f"{blocks:5d} blocks: copy {row['copy_ms']:.2f} ms ({row['gbps_each_way']:.1f} "
            f"GB/s each way), compute {res['compute_ms']:.2f} ms, one stream "
            f"{row['same_stream_ms']:.2f} ms (overlap {row['overlap_same']:.2f}), two "
            f"streams {row['two_streams_ms']:.2f} ms (overlap {row['overlap_two']:.2f})",
            flush=True,
        )
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
