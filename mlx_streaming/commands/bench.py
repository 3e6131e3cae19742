"""``python -m mlx_streaming bench``: the seed script's benchmark, as flags."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..bench.run import DEFAULT_PROMPT, BenchConfig, run_bench
from ..config import PREFILL_CHUNK
from ..core.format import write_json_atomic
from ._args import (
    add_pipeline_args,
    add_store_args,
    nonneg_int,
    pipeline_kwargs,
    positive_float,
    positive_int,
    stream_config,
)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_streaming bench",
        description=(
            "Benchmark a streamed MoE model: tok/s (median of --repeat), memory, hit rate, "
            "bytes read, host time per layer call. Each flag names the seed script's "
            "environment variable it replaces."
        ),
    )
    p.add_argument("--model", required=True, help="MLX model directory or repo id (MODEL)")
    add_store_args(p, several=True)
    add_pipeline_args(p)
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt (PROMPT)")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="tokens (MAXTOK)")
    p.add_argument(
        "--warmup-tokens",
        type=nonneg_int,
        default=None,
        help="warm-up tokens, default --max-tokens (WARMUP_TOK)",
    )
    p.add_argument("--repeat", type=positive_int, default=3, help="timed runs (REPEAT)")
    p.add_argument("--wired-gb", type=positive_float, help="mx.set_wired_limit (WIRED_GB)")
    p.add_argument(
        "--pin-hot",
        type=nonneg_int,
        default=0,
        help="pin each layer's N hottest experts after calibration (PIN_HOT)",
    )
    p.add_argument("--cal-tokens", type=positive_int, default=32, help="(CAL_TOK)")
    p.add_argument(
        "--expert-bits", type=positive_int, help="checked against the meta (EXPERT_BITS)"
    )
    p.add_argument(
        "--expert-group", type=positive_int, help="checked against the meta (EXPERT_GROUP)"
    )
    p.add_argument(
        "--prefill-chunk",
        type=nonneg_int,
        default=PREFILL_CHUNK,
        help=f"prefill_step_size, default {PREFILL_CHUNK}; 0 = mlx-lm's default "
        "(PREFILL_CHUNK; the seed's default is 2)",
    )
    p.add_argument(
        "--compare-stock",
        action="store_true",
        help="also run stock mlx-lm fully resident, in --repeat pairs alternating with the "
        "streamed model (ratios: the pairs' medians), and check exactness",
    )
    s = p.add_argument_group("speed")
    s.add_argument(
        "--predictor",
        choices=["router", "transition"],
        default="router",
        help="with --prefetch; router: next layer's router; transition: learned from the trace",
    )
    s.add_argument(
        "--routing-trace",
        help="replay this routing trace (.npz) instead of the "
        "router's choices (the transition predictor learns from its first half; "
        "replay starts at its second half)",
    )
    s.add_argument("--trace-start", type=nonneg_int, help="trace token to start replay at")
    s.add_argument(
        "--record-trace",
        help="write the routing taken to this .npz (in a pipeline each rank its own layers, to NAME.rankR.npz)",
    )
    s.add_argument(
        "--cold",
        action="store_true",
        help="evict the expert files from the page cache before each timed run",
    )
    s.add_argument(
        "--memory-limit-gb",
        type=positive_float,
        help="run within a memory cgroup of this size (needs root): larger than RAM, the "
        "page cache (or on CUDA the default's swap tier) holds only what the trunk and pools "
        "leave of it; not with --compare-stock",
    )
    s.add_argument(
        "--t-compute-ms",
        type=positive_float,
        help="resident time per token for the bound (default: stock's, with --compare-stock)",
    )
    s.add_argument(
        "--read-gbps",
        type=positive_float,
        help="storage bandwidth for the bound (default: measured)",
    )
    p.add_argument("--json", dest="json_out", help="also write the result JSON here")
    p.add_argument("--report", help="write results.json, PNG plots and summary.md here")
    return p


CONFIG_FLAGS = (
    "model",
    "expert_dir",
    "prompt",
    "max_tokens",
    "warmup_tokens",
    "repeat",
    "wired_gb",
    "pin_hot",
    "cal_tokens",
    "expert_bits",
    "expert_group",
    "prefill_chunk",
    "predictor",
    "routing_trace",
    "trace_start",
    "record_trace",
    "cold",
    "memory_limit_gb",
    "compare_stock",
    "t_compute_ms",
    "read_gbps",
)


def main(argv=None) -> None:
    a = setup_arg_parser().parse_args(argv)
    if a.predictor == "transition" and not a.prefetch:
        raise ValueError("--predictor transition guesses for read-ahead: add --prefetch")
    if a.trace_start is not None and not a.routing_trace:
        raise ValueError("--trace-start is a position in --routing-trace: give the trace")
    kw = {k: getattr(a, k) for k in CONFIG_FLAGS}
    kw.update(memory_series=bool(a.report), progress=True)
    sizes = [{"slots": s, "budget_gb": None} for s in a.slots or []] + [
        {"slots": None, "budget_gb": g} for g in a.budget_gb or []
    ]
    pipe = pipeline_kwargs(a)
    group = pipe.get("pipeline_group")
    if pipe.get("pipeline_split"):
        kw["pipeline_split"] = tuple(pipe["pipeline_split"])
    if "budget_gb" in pipe:  # --rank-budget-gb: this rank's
        sizes = [{"slots": None, "budget_gb": pipe["budget_gb"]}]
    watch = pipe.get("pipeline_watch")
    results = [
        run_bench(BenchConfig(**kw, stream=stream_config(a, **size)), group, watch)
        for size in sizes or [{"slots": None, "budget_gb": None}]
    ]
    if group is not None and group.rank() != 0:
        return  # rank 0 reports for all (its result holds every rank's figures)
    out = results[0] if len(results) == 1 else results
    text = json.dumps(out, ensure_ascii=False, indent=2)
    print(text)
    if a.json_out:
        write_json_atomic(Path(a.json_out), out)  # a run cut short leaves no half file
    if a.report:
        from ..bench.report import write_report

        for path in write_report(results, a.report):
            print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
