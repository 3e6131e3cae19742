"""The host's cost of one MLX CUDA custom-kernel call, by the size of its source and its
template arguments: what the device path pays per MoE layer call for its plan kernel.

MLX 0.32 builds a custom kernel's whole text at every call (its header, signature,
template constants and source) and hashes that text again when the graph is evaluated,
to find the compiled module. So a long source costs host time per call, not once. Each
case is a kernel that copies one value, its source padded by a comment to a size; the
calls chain (each reads the last's output), 26 to a graph as in a DeepSeek-V2-Lite
decode step. Printed per call: the Python call (``build``) and ``async_eval``'s encoding
and launch (``launch``), medians of the repeats.

    python benchmarks/probes/kernel_call_cost.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402

from mlx_streaming.core.cache.plan_kernel import PLAN, plan_constants  # noqa: E402
from mlx_streaming.core.io.device_reader import COPY_HEADER  # noqa: E402
from mlx_streaming.core.io.kernels import with_consts  # noqa: E402


def compact(source: str) -> str:
    """``source`` without its comments, indentation and blank lines."""
    lines = (re.sub(r"\s*//.*", "", line).strip() for line in source.split("\n"))
    return "\n".join(line for line in lines if line)


BODY = "if (threadIdx.x == 0 && blockIdx.x == 0) { out[0] = a[0] + 1u; }\n"


def _case(name: str, size: int, header: str, n_template: int):
    pad = max(0, size - len(BODY))
    source = BODY + ("// " + "x" * 76 + "\n") * (pad // 80)
    kernel = mx.fast.cuda_kernel(
        name=f"cost_{name}",
        input_names=["a"],
        output_names=["out"],
        source=source,
        header=header,
    )
    tmpl = list(plan_constants(64, 32, 6, (1.0,) * 6))[:n_template]
    return kernel, tmpl, len(source)


def _run(kernel, tmpl, layers: int, repeat: int) -> tuple[float, float]:
    build, launch = [], []
    x = mx.zeros((1,), mx.uint32)
    mx.eval(x)
    for _ in range(repeat):
        t0 = time.perf_counter()
        y = x
        for _ in range(layers):
            (y,) = kernel(
                inputs=[y],
                template=tmpl,
                grid=(32, 1, 1),
                threadgroup=(32, 1, 1),
                output_shapes=[(1,)],
                output_dtypes=[mx.uint32],
            )
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        build.append((t1 - t0) / layers)
        launch.append((t2 - t1) / layers)
    return statistics.median(build) * 1e6, statistics.median(launch) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    plan_size = len(PLAN)
    baked = len(with_consts("p", PLAN, plan_constants(64, 32, 6, (1.0,) * 6))[1])
    cases = [  # (name, source size, header, template arguments)
        ("plan_template_args", plan_size, COPY_HEADER, 9),
        ("plan_compacted_template_args", len(compact(PLAN)), compact(COPY_HEADER), 9),
        ("plan_constants_in_source", baked, COPY_HEADER, 0),  # the package's since 2026-12-04
        ("tiny_no_header", 0, "", 0),
    ]
    rows = []
    for name, size, header, n_t in cases:
        kernel, tmpl, n = _case(name, size, header, n_t)
        _run(kernel, tmpl, args.layers, 5)  # compile
        build, launch = _run(kernel, tmpl, args.layers, args.repeat)
        row = {
            "case": name,
            "source_chars": n,
            "header_chars": len(header),
            "template_args": n_t,
            "build_us": round(build, 2),
            "launch_us": round(launch, 2),
        }
        print(row, flush=True)
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"plan_chars": plan_size, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
