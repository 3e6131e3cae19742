"""What MLX's evaluation calls cost the host: a fixed part per call and a part per op.

A chain of ``n`` small elementwise ops is launched with one ``mx.async_eval`` (its host
time is MLX encoding and launching them), or in ``k`` pieces of ``n / k`` ops each; then
the cost of reading a tiny array on the host (``mx.eval`` plus ``np.array``) once the
device is idle, and of making a tiny array from NumPy; on CUDA, what a custom kernel call
costs to build and launch against an elementwise op, by its inputs, template arguments
and source size. Medians over repeats, µs.

    python benchmarks/probes/mlx_launch.py --json out.json
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from harness import finish, log, median_us, parser  # noqa: E402


def chain(n: int, pieces: int, x: mx.array) -> float:
    """Host µs to launch ``n`` ops in ``pieces`` async_evals (the device drained after)."""
    per = max(1, n // pieces)

    def run():
        y = x
        for i in range(n):
            y = y * 1.0001 if i % 2 else y + 1e-6  # one primitive each
            if (i + 1) % per == 0:
                mx.async_eval(y)
        mx.async_eval(y)

    ts = []
    for _ in range(9):
        t = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t)
        mx.synchronize()
    return round(1e6 * statistics.median(ts[2:]), 1)


def _mapped_read(repeat: int) -> dict:
    """A decode step's routing (6 ids) read on the host two ways, the device idle: MLX's
    own (``mx.eval`` then ``np.array``: the host touches MLX's managed buffer), and a
    one-thread kernel that writes the ids into page-locked mapped host memory, read there
    after ``mx.eval`` of the kernel's output (no managed-memory migration)."""
    from mlx_streaming.core.io import cuda

    if not cuda.available():
        return {}
    host, dev = cuda.shared_host(64)
    kernel = mx.fast.cuda_kernel(
        name="mlxs_probe_routing_out",
        input_names=["ids", "dst"],
        output_names=["done"],
        source="""
            unsigned int* out = (unsigned int*)(dst[0]);
            for (int i = 0; i < 6; i++) out[i] = (unsigned int)ids[i];
            __threadfence_system();
            done[0] = 1;
        """,
    )
    addr = mx.array(np.array([dev], np.uint64))
    small = mx.array(np.arange(6, dtype=np.int32))

    def managed():
        z = small + 1
        mx.eval(z)
        return np.array(z)

    def mapped():
        z = small + 1
        (done,) = kernel(
            inputs=[z, addr], grid=(1, 1, 1), threadgroup=(1, 1, 1),
            output_shapes=[(1,)], output_dtypes=[mx.int32],
        )  # fmt: skip
        mx.eval(done)
        return host[:24].view(np.uint32).copy()

    same = np.array_equal(managed(), mapped())
    return {
        "routing_read_managed_us": median_us(managed, repeat, skip=2),
        "routing_read_mapped_us": median_us(mapped, repeat, skip=2),
        "routing_read_mapped_equal": bool(same),
    }


def _custom_kernels(n: int = 26) -> list[dict]:
    """Host µs per op to build and to launch a chain of ``n`` ops (a decode step's MoE
    layer calls): an elementwise op, then custom kernels that copy their input, from a
    tiny one up to the device path's call shape (4 inputs, 9 template arguments, an
    11 KB source): which of these MLX's per-call cost follows."""
    pad = "// " + "x" * 11000 + "\n"  # the size of the device path's kernel source
    body = "unsigned int i = threadIdx.x; if (i < 6) y[i] = a[i];"

    def kernel(name, inputs, source):
        return mx.fast.cuda_kernel(
            name=name, input_names=inputs, output_names=["y"], source=source
        )  # fmt: skip

    tmpl = [(c, 7) for c in "ABCDEFGHI"]
    variants = {
        "tiny": (kernel("mlxs_probe_tiny", ["a"], body), 1, None),
        "template9": (kernel("mlxs_probe_t9", ["a"], body), 1, tmpl),
        "source11kb": (kernel("mlxs_probe_11kb", ["a"], pad + body), 1, None),
        "inputs4": (kernel("mlxs_probe_in4", ["a", "b", "c", "d"], body), 4, None),
        "plan_shaped": (kernel("mlxs_probe_plan", ["a", "b", "c", "d"], pad + body), 4, tmpl),
    }
    x = mx.arange(6, dtype=mx.int32)
    extra = [mx.zeros((20,), mx.int64), mx.zeros((64,), mx.uint8), mx.zeros((1,), mx.int32)]
    mx.eval(x, *extra)

    def chain(step):
        builds, launches = [], []
        for _ in range(15):
            t0 = time.perf_counter()
            y = x
            for _ in range(n):
                y = step(y)
            t1 = time.perf_counter()
            mx.async_eval(y)
            t2 = time.perf_counter()
            mx.synchronize()
            builds.append(t1 - t0)
            launches.append(t2 - t1)
        med = lambda v: round(1e6 * statistics.median(v[3:]) / n, 2)  # noqa: E731
        return med(builds), med(launches)

    rows = []
    b, la = chain(lambda y: y + 1)
    rows.append({"op": "elementwise", "build_us": b, "launch_us": la})
    for name, (k, n_in, t) in variants.items():

        def step(y, k=k, n_in=n_in, t=t):
            kw = {"template": t} if t else {}
            (out,) = k(
                inputs=[y, *extra[: n_in - 1]], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                output_shapes=[y.shape], output_dtypes=[mx.int32], **kw,
            )  # fmt: skip
            return out

        b, la = chain(step)
        rows.append({"op": name, "build_us": b, "launch_us": la})
        log(rows[-1])
    return rows


def main():
    p = parser(__doc__, preset=None, trace=False, workdir=None)
    p.add_argument("--repeat", type=int, default=50)
    a = p.parse_args()
    x = mx.random.normal((8, 2048))
    mx.eval(x)
    rows = []
    for n in (8, 32, 128):
        for pieces in sorted({1, 2, 8, n}):
            us = chain(n, pieces, x)
            rows.append({"ops": n, "evals": pieces, "host_us": us, "us_per_op": round(us / n, 2)})
            log(rows[-1])
    small = mx.array(np.arange(6, dtype=np.int32))
    idx = small + 1
    mx.eval(idx)

    def read_back():
        z = small + 1
        mx.eval(z)
        np.array(z)

    prims = {
        "eval_and_read_6_ints_us": median_us(read_back, a.repeat, skip=2),
        "np_array_of_evaluated_us": median_us(lambda: np.array(idx), a.repeat, skip=2),
        "tolist_of_evaluated_us": median_us(lambda: idx.tolist(), a.repeat, skip=2),
        "mx_array_from_numpy_us": median_us(
            lambda: mx.array(np.arange(6, dtype=np.int32)), a.repeat, skip=2
        ),
        "empty_async_eval_us": median_us(lambda: mx.async_eval(idx), a.repeat, skip=2),
    }
    kernels = []
    if mx.default_device() != mx.cpu:
        prims.update(_mapped_read(a.repeat))
        kernels = _custom_kernels()
    log(prims)
    finish(
        a,
        "mlx_launch",
        {"device": str(mx.default_device()), "chains": rows, **prims, "custom_kernels": kernels},
    )


if __name__ == "__main__":
    main()
