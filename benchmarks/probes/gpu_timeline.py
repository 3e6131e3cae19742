"""The GPU's own timeline of decode steps, stock against streamed (issue 31, item 8; issue
33's O_DIRECT runs): every kernel and copy the device ran, from Nsight Systems.

``decode_split.py`` times the host; this says what the device did meanwhile. Run under
``nsys profile --capture-range=cudaProfilerApi`` (``gpu_suite.sh nsys``), a process loads
one model (``--mode stock`` or ``streamed`` at ``--residency``, the DeepSeek-V2-Lite
trace's routing), decodes a few tokens to warm up, then opens the profiler's capture
range around ``--tokens`` decode steps of mlx-lm's ``generate_step`` (the prompt's
prefill outside it). ``--report STOCK STREAMED`` then reads the two runs' ``nsys stats``
tables (``cuda_gpu_trace``, ``cuda_api_sum`` as CSV) and prints per decode step: the
window, the time the device was busy (the union of kernels and copies) and idle, its
gaps over 5 µs, kernels by name (count and µs per step; ``mlxs_plan``: the device
path's plan kernel), copies, and the host's CUDA API calls. A device idle for most of a
step means the host bounds it; the plan kernel's µs per call is its cost on the device.

    nsys profile -t cuda --cuda-graph-trace=node --capture-range=cudaProfilerApi \
        --capture-range-end=stop -o /tmp/nsys-streamed \
        python benchmarks/probes/gpu_timeline.py --workdir /tmp/mlxs --mode streamed
    nsys stats -r cuda_gpu_trace,cuda_api_sum -f csv -o /tmp/nsys-streamed \
        /tmp/nsys-streamed.nsys-rep
    python benchmarks/probes/gpu_timeline.py --report /tmp/nsys-stock /tmp/nsys-streamed
"""

from __future__ import annotations

import csv
import ctypes
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import PROMPT, build, finish, log, parser, routing_trace, slots_at, stock, streamed  # noqa: E402

from mlx_streaming.commands._args import positive_int  # noqa: E402

GAP_US = 5.0  # device idle gaps longer than this are counted


def profiler(on: bool) -> None:
    """Open or close the profiler's capture range (the driver's ``cuProfilerStart``)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        log("no CUDA driver: the capture range is not marked")
        return
    err = (cuda.cuProfilerStart if on else cuda.cuProfilerStop)()
    if err:
        log(f"cuProfiler{'Start' if on else 'Stop'} returned {err}")


def decode(model, tok, tokens: int, warm: int = 8) -> None:
    """``warm`` decode steps, then ``tokens`` inside the capture range."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, generation_stream

    ids = mx.array(tok.encode(PROMPT))
    gen = generate_step(ids, model, max_tokens=warm + tokens + 1)
    for _ in range(warm):
        next(gen)
    mx.synchronize(generation_stream)  # the stream generate_step runs on
    profiler(True)
    for _ in range(tokens):
        next(gen)
    mx.synchronize(generation_stream)
    profiler(False)
    gen.close()


def _rows(prefix: str, report: str) -> list[dict]:
    path = Path(f"{prefix}_{report}.csv")  # as `nsys stats -o PREFIX -f csv` names it
    if not path.exists():
        raise FileNotFoundError(f"{path}: no {report} table (run nsys stats first)")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _col(row: dict, *words: str) -> str:
    """The first column whose name holds every one of ``words``."""
    found = next((k for k in row if all(w in k for w in words)), None)
    if found is None:
        raise KeyError(f"no column with {words} among {list(row)}: another nsys version?")
    return found


def summarize(prefix: str, tokens: int) -> dict:
    """Per decode step: the device's window, busy and idle µs, gaps, kernels by name,
    copies; the host's CUDA API calls."""
    rows = _rows(prefix, "cuda_gpu_trace")
    if not rows:
        return {"error": f"{prefix}: no kernel or copy in the capture range"}
    start, dur, name = _col(rows[0], "Start"), _col(rows[0], "Duration"), _col(rows[0], "Name")
    spans = sorted((float(r[start]), float(r[start]) + float(r[dur]), r[name]) for r in rows)
    busy, gaps, end = 0.0, [], spans[0][0]
    for s, e, _ in spans:
        if s > end:
            gaps.append(s - end)
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    window = end - spans[0][0]
    by_name = defaultdict(lambda: [0, 0.0])
    for s, e, n in spans:
        key = n if n.startswith("[") else n.split("(")[0][:80]
        by_name[key][0] += 1
        by_name[key][1] += e - s
    per = 1e3 * tokens  # ns per µs, per step
    kernels = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    api = []
    for r in _rows(prefix, "cuda_api_sum"):
        total, calls = _col(r, "Total Time"), _col(r, "Num Calls")
        api.append((r[_col(r, "Name")], float(r[total]) / per, int(r[calls]) / tokens))
    api.sort(key=lambda x: -x[1])
    long_gaps = [g for g in gaps if g > GAP_US * 1e3]
    return {
        "window_us_per_step": round(window / per, 1),
        "busy_us_per_step": round(busy / per, 1),
        "idle_us_per_step": round((window - busy) / per, 1),
        "busy_share": round(busy / window, 3) if window else None,
        "gaps_over_5us_per_step": round(len(long_gaps) / tokens, 1),
        "gaps_over_5us_us_per_step": round(sum(long_gaps) / per, 1),
        "ops_per_step": round(len(spans) / tokens, 1),
        "by_name": [
            {
                "name": k,
                "per_step": round(c / tokens, 2),
                "us_per_step": round(t / per, 1),
                "us_each": round(t / c / 1e3, 2),
            }
            for k, (c, t) in kernels[:25]
        ],  # fmt: skip
        "plan_kernel_us_each": next(
            (round(t / c / 1e3, 2) for k, (c, t) in kernels if "mlxs_plan" in k), None
        ),
        "api": [
            {"name": n, "us_per_step": round(t, 1), "calls_per_step": round(c, 2)}
            for n, t, c in api[:12]
        ],
    }


def main():
    p = parser(__doc__, preset="dsv2-lite")
    p.add_argument("--mode", choices=["stock", "streamed"], default="streamed")
    p.add_argument("--residency", type=float, default=0.5)
    p.add_argument(
        "--tokens", type=positive_int, default=16, help="decode steps in the capture range"
    )
    p.add_argument("--report", nargs=2, metavar=("STOCK", "STREAMED"),
                   help="nsys stats prefixes of the two runs: print the comparison")  # fmt: skip
    a = p.parse_args()
    if a.report:
        res = {m: summarize(prefix, a.tokens) for m, prefix in zip(("stock", "streamed"), a.report)}
        for m, r in res.items():
            log(m, {k: v for k, v in r.items() if k not in ("by_name", "api")})
        finish(a, "gpu_timeline", {"tokens": a.tokens, "residency": a.residency, **res})
        return
    ck, ed, meta = build(a)
    trace, start = routing_trace(a)
    if a.mode == "stock":
        model, tok, _ = stock(ck, trace, start)
    else:
        slots = slots_at(meta, a.residency)
        model, tok, store, _ = streamed(ck, ed, trace, start, slots=slots)
        log("runtime", store.runtime.to_json())
    decode(model, tok, a.tokens)
    log(f"{a.mode}: {a.tokens} decode steps profiled")


if __name__ == "__main__":
    main()
