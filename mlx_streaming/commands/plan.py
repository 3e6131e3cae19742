"""``python -m mlx_streaming plan``: what each budget and policy buys, from a trace."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from ..core.options import StreamConfig
from ..planning.budget import PoolShape, TooSmall, default_zero_slot
from ..planning.planner import PlanRow, plan, resolve_policies
from ..planning.trace import RoutingTrace
from ._args import nonneg_float, nonneg_int, positive_float, positive_int
from ._plan_tiers import (
    check_tiers,
    fitting_budgets,
    plan_tiers,
    print_tiers,
    say_bits,
    say_skipped,
    say_window,
    span,
    tagged,
)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_streaming plan",
        description=(
            "Replay a routing trace through the cache policies at each budget and predict hit "
            "rate, miss bytes per token and tok/s (from a compute time and a read bandwidth, "
            "measured by `bench`). The trace's second half is replayed."
        ),
    )
    p.add_argument("--trace", help="routing trace (.npz); not needed with --machines-gb")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model directory or repo id (its experts' sizes)")
    src.add_argument("--expert-dir", help="an expert directory (its meta)")
    src.add_argument("--expert-bytes", type=positive_int, help="bytes per expert")
    p.add_argument("--top-k", type=positive_int, help="with --expert-bytes (default: trace's)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--budget-gb", type=positive_float, nargs="+")
    size.add_argument("--slots", type=positive_int, nargs="+")
    size.add_argument(
        "--memory-gb",
        type=positive_float,
        help="the memory left after the trunk (and, off CUDA, the KV cache of the context "
        "you will run), shared by the pools and the tier beneath them (the page cache, or "
        "the store's --swap-tier): each split's hits per tier "
        "(pool, page cache or swap tier, disk), predicted tok/s and the flags that run it, "
        "best first (needs a compute time and the disk's bandwidth, e.g. --bench)",
    )
    p.add_argument(
        "--host-gb",
        type=positive_float,
        help="with --slots or --budget-gb, pools in a GPU's own memory (CUDA): this much "
        "host memory beneath them, as the page cache or as the store's swap tier (with "
        "--model, less the trunk's largest block, which MLX stages in host memory as it "
        "loads); each row's hits per tier, disk bytes, predicted tok/s and flags, best first",
    )
    p.add_argument(
        "--host-ms-per-call",
        type=nonneg_float,
        default=0.0,
        help="with --memory-gb or --host-gb: the host path's own work per MoE layer call "
        "(routing read, planning, launches: 1.35 on an H100, 2026-12-05b; bench reports "
        "it), added in series to each row the host path serves (every row with "
        "--memory-gb; with --host-gb the page cache's, a swap tier's being the device "
        "path's); default 0: left out",
    )
    p.add_argument(
        "--mem-gbps",
        type=positive_float,
        default=10.0,
        help="with --memory-gb or --host-gb: the host tier's copy bandwidth (default 10)",
    )
    p.add_argument(
        "--policy",
        default="auto",
        help="a policy, all, or auto (all, with the best marked); lru and belady are always shown",
    )
    p.add_argument("--tokens", type=positive_int, default=20000, help="trace tokens to replay")
    p.add_argument(
        "--window",
        type=positive_int,
        help="the tokens a run decodes: each row also gives the 10th and 90th percentiles "
        "of its miss (or disk) MB/token and tok/s over the replayed "
        "routing's stretches of this many tokens, as a run that long may see them "
        "(default 256, or a fifth of --tokens where that is less)",
    )
    p.add_argument(
        "--layer-sample",
        type=nonneg_int,
        default=6,
        help="simulate this many layers, spread evenly (0: all)",
    )
    p.add_argument(
        "--pin-hot",
        type=nonneg_int,
        default=0,
        help="pin each layer's N statically hottest experts (from the first half)",
    )
    p.add_argument(
        "--bits",
        type=positive_int,
        nargs="+",
        help="plan the experts at each of these precisions, as `requantize --bits B` would "
        "write them (each record's bytes from its layout; needs --model or --expert-dir), "
        "their rows side by side; a precision the memory cannot hold is said and skipped. "
        "Give --t-compute-ms one value per precision where you have measured them (bench on "
        "each requantized model: stock mlx-lm decoded 3-bit experts at 72 tok/s against "
        "4-bit's 106 in one H100 call), else the one compute time serves every row",
    )
    p.add_argument(
        "--group-size",
        type=positive_int,
        help="with --bits, the group size requantize would write (default: the source's, else 64)",
    )
    p.add_argument("--bench", help="a `bench --json` result: t_compute and read bandwidth")
    p.add_argument(
        "--t-compute-ms",
        type=positive_float,
        nargs="+",
        help="compute time per token (one value; with --bits, one per precision or one for all)",
    )
    p.add_argument("--read-gbps", type=positive_float)
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.add_argument("--plot", help="write a PNG of hit rate against budget (needs matplotlib)")
    p.add_argument(
        "--machines-gb",
        help="pipeline planning: memory per host for the model, rank order (e.g. 48,24); "
        "prints the --pipeline-split and each rank's pool budget (needs --model)",
    )
    p.add_argument(
        "--context",
        type=nonneg_int,
        default=StreamConfig.context,
        help="with --machines-gb: tokens of context each rank keeps KV cache room for",
    )
    p.add_argument(
        "--cpu-ranks",
        action="store_true",
        help="with --machines-gb: the ranks run on the CPU, whose pools need no zero slot "
        "(by default each pool is counted with one, as on Metal and CUDA)",
    )
    return p


def plan_hosts(a) -> None:
    """Print the pipeline split and per-rank pool budgets for ``--machines-gb``."""
    from ..planning.pipeline import ModelBytes, suggest_split
    from ..prep.hub import load_lazy, resolve_model_path

    if not a.model:
        raise ValueError("--machines-gb needs --model (the trunk's size per layer)")
    try:
        hosts = [float(x) for x in a.machines_gb.split(",")]
    except ValueError:
        raise ValueError(f"--machines-gb {a.machines_gb!r}: give GB per host, e.g. 48,24") from None
    model, _ = load_lazy(resolve_model_path(a.model))
    sp = suggest_split(
        ModelBytes.from_model(model, default_zero_slot("cpu" if a.cpu_ranks else "metal")),
        hosts,
        a.context,
    )
    if a.json:
        print(json.dumps(sp.to_json(), indent=1))
        return
    budgets = ",".join(str(r["pool_budget_gb"]) for r in sp.ranks)
    print(f"--pipeline-split {','.join(map(str, sp.split))} --rank-budget-gb {budgets}")
    print(f"each MoE layer keeps {sp.share:.1%} of its experts in pools; each rank's memory "
          f"holds its trunk, the KV cache of {a.context} tokens, its pools, and the margin and "
          "MLX's buffer-cache cap that load adds to them")  # fmt: skip
    for r in sp.ranks:
        print(
            f"rank {r['rank']}: layers {r['layers'][0]}-{r['layers'][1]} "
            f"({r['moe_layers']} MoE), trunk {r['trunk_gb']} GB, KV cache {r['kv_gb']} GB, "
            f"pools {r['pool_budget_gb']} GB"
        )


def _layouts(a) -> tuple[dict, int]:
    """The expert records' layouts (MoE layer -> ``LayerLayout``) of ``--expert-dir`` or
    ``--model``, and top-k."""
    if a.expert_dir:
        from ..core.meta import load_meta

        meta = load_meta(a.expert_dir)
        return dict(meta.layers), meta.top_k
    from ..core.discovery import find_expert_sites
    from ..prep.hub import load_lazy, resolve_model_path
    from ..prep.split_experts import layer_layout

    model, config = load_lazy(resolve_model_path(a.model))
    sites = find_expert_sites(model, config)
    return {s.layer: layer_layout(s, "x") for s in sites}, next(s.top_k for s in sites if s.top_k)


def _shapes(a, trace: RoutingTrace) -> list[tuple[int | None, PoolShape]]:
    """The pools' shape of each precision planned: ``(bits, shape)``, bits None for the
    experts as they are."""
    if a.expert_bytes:
        if a.bits:
            raise ValueError("--bits needs the experts' layouts: give --model or "
                             "--expert-dir in place of --expert-bytes")  # fmt: skip
        k = a.top_k or trace.top_k
        return [(None, PoolShape([a.expert_bytes] * trace.layers, trace.num_experts, k))]
    layouts, top_k = _layouts(a)
    if not a.bits:
        return [(None, PoolShape.from_layouts(layouts, top_k))]
    from ..prep.requantize import requantized_layouts

    out = []
    for bits in a.bits:
        try:
            lay = requantized_layouts(layouts, bits, a.group_size)
        except ValueError as e:
            raise ValueError(f"--bits {bits}: {e} (--group-size sets another)") from None
        out.append((bits, PoolShape.from_layouts(lay, top_k)))
    return out


def _compute_times(a, t: float | None, n: int) -> list[float | None]:
    """The compute time of each of ``n`` precisions: ``--t-compute-ms``'s one value per
    precision, else ``t`` for all."""
    given = a.t_compute_ms or []
    if len(given) > 1 and not a.bits:
        raise ValueError(f"--t-compute-ms has {len(given)} values: give one (several only "
                         "with --bits, one per precision)")  # fmt: skip
    if len(given) > 1 and len(given) != n:
        raise ValueError(f"--t-compute-ms has {len(given)} values: give one, or one per "
                         f"precision of --bits ({n})")  # fmt: skip
    return [v / 1e3 for v in given] if len(given) == n > 1 else [t] * n


def _each_precision(shapes, times, fn) -> tuple[list, list[str]]:
    """``fn(shape, t, skip)`` of each precision, as ``(bits, shape, t, result)``. With
    several precisions, what one cannot hold (``TooSmall``) is skipped, its reason kept:
    the whole precision, or one of its budgets (``fn`` appends those to ``skip``; with
    one precision ``skip`` is None and ``fn`` raises). Any other error is raised, and
    ``TooSmall`` where no precision is left."""
    done, skipped, several = [], [], len(shapes) > 1
    for (bits, shape), t in zip(shapes, times):
        skip = [] if several else None
        try:
            done.append((bits, shape, t, fn(shape, t, skip)))
        except TooSmall as e:
            if not several:
                raise
            skip = [str(e)]
        skipped += [f"{bits} bits: {why}" for why in skip or []]
    if not done:
        raise TooSmall("no precision of --bits fits: " + "; ".join(skipped))
    return done, skipped


def _bounds(a) -> tuple[float | None, float | None]:
    t, b = (a.t_compute_ms[0] / 1e3 if a.t_compute_ms else None), a.read_gbps
    if a.bench:
        try:
            with open(a.bench) as f:
                r = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--bench {a.bench} is not a `bench --json` result ({e})") from e
        if isinstance(r, list):  # one result per budget: the timings are the model's, alike
            r = r[0] if r else None
        if not isinstance(r, dict):
            raise ValueError(f"--bench {a.bench} is not a `bench --json` result")
        if t is None and r.get("t_compute_ms"):
            t = r["t_compute_ms"] / 1e3
        b = b or r.get("storage_gbps")
    return t, b


def plot(rows: list[PlanRow], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'mlx-streaming[plot]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for pol in dict.fromkeys(r.policy for r in rows):
        pts = sorted((r.budget_gb, r.hit_rate) for r in rows if r.policy == pol)
        ax.plot(*zip(*pts), marker="o", label=pol, linestyle="--" if pol == "belady" else "-")
    ax.set_xlabel("expert pool budget (GB)")
    ax.set_ylabel("hit rate (held-out routing)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    a = setup_arg_parser().parse_args(argv)
    if a.machines_gb:
        if a.bits or a.window:
            raise ValueError(f"{'--bits' if a.bits else '--window'} plans pools, not a "
                             "pipeline's split: drop it with --machines-gb")  # fmt: skip
        return plan_hosts(a)
    if a.host_gb and a.memory_gb:
        raise ValueError("give --memory-gb (pools and the tier beneath share one memory) or "
                         "--host-gb with --slots or --budget-gb (pools on a GPU), not both")  # fmt: skip
    if a.host_gb and not (a.slots or a.budget_gb):
        raise ValueError("--host-gb plans the host tier beneath pools of a given size: "
                         "add --slots or --budget-gb")  # fmt: skip
    if not a.trace or not (a.budget_gb or a.slots or a.memory_gb):
        raise ValueError(
            "plan needs --trace and --budget-gb, --slots or --memory-gb (or --machines-gb)"
        )
    if a.plot and a.bits and len(a.bits) > 1:
        raise ValueError("--plot draws one precision: give one --bits value, or drop --plot")
    if a.bits and len(set(a.bits)) < len(a.bits):
        raise ValueError(f"--bits {' '.join(map(str, a.bits))}: name each precision once")
    if a.group_size and not a.bits:
        raise ValueError("--group-size sizes the precisions of --bits: add --bits")
    t, b = _bounds(a)
    times = _compute_times(a, t, len(a.bits or [None]))  # before the model is read
    trace = RoutingTrace.load(a.trace)
    a.tokens = min(a.tokens, trace.split(0.5)[1].tokens)  # what is replayed: held out
    if a.window and a.tokens < 5 * a.window:
        raise ValueError(f"{a.tokens} tokens replayed (--tokens, at most the trace's "
                         f"held-out half) hold fewer than 5 stretches of --window "
                         f"{a.window}: lower --window")  # fmt: skip
    a.window = a.window or max(1, min(256, a.tokens // 5))  # (each row says which)
    shapes = _shapes(a, trace)
    if a.memory_gb or a.host_gb:
        if a.plot or a.pin_hot:
            raise ValueError(
                "--memory-gb and --host-gb plan the two tiers without --plot or --pin-hot: "
                "drop them"
            )
        check_tiers(a, times[0], b)  # what no precision changes, before any is planned
        done, skipped = _each_precision(
            shapes, times, lambda s, tb, skip: plan_tiers(a, trace, s, tb, b, skip)
        )
        rows = [r for bits, shape, tb, (got, _, _) in done for r in tagged(got, bits, shape, tb)]
        rows.sort(key=lambda r: (-r["predicted_tok_per_s"], -r["serial_tok_per_s"]))
        return print_tiers(a, rows, *done[0][3][1:], skipped)
    pols = resolve_policies(a.policy)

    def rows_of(shape, tb, skip):
        budgets = fitting_budgets(shape, a.budget_gb or (), default_zero_slot(), skip)
        return plan(trace, shape, budgets_gb=budgets, slots=a.slots or (), policies=pols,
                    t_compute_s=tb, read_gbps=b, tokens=a.tokens,
                    layer_sample=a.layer_sample or None, pin_hot=a.pin_hot,
                    window=a.window)  # fmt: skip

    done, skipped = _each_precision(shapes, times, rows_of)
    rows = [r for *_, got in done for r in got]
    tags = [(bits, shape, tb) for bits, shape, tb, got in done for _ in got]
    best = {}
    for r, (bits, _, _) in zip(rows, tags):
        key = (bits, r.slots)
        if r.policy != "belady" and (key not in best or r.hit_rate > best[key].hit_rate):
            best[key] = r
    if a.json:
        say_skipped(skipped)
        out = []
        for r, (bits, shape, tb) in zip(rows, tags):
            out += tagged([{**r.to_json(), "best": best[bits, r.slots] is r}], bits, shape, tb)
        print(json.dumps(out, indent=1))
    else:
        for i, (r, (bits, shape, _)) in enumerate(zip(rows, tags)):
            if i == 0 or bits != tags[i - 1][0]:
                if bits is not None:
                    mb = np.mean(shape.slot_bytes) / 1e6
                    print(f"at {bits} bits ({mb:.3f} MB an expert)")
                print(
                    f"{'policy':<11} {'slots':>5} {'GB':>8} {'hit':>6} {'MB miss/tok':>12} "
                    f"{'p10-p90':>15} {'tok/s':>8} {'p10-p90':>15} {'serial':>8}"
                )
            tps = f"{r.predicted_tok_per_s:8.2f}" if r.predicted_tok_per_s else f"{'-':>8}"
            ser = f"{r.serial_tok_per_s:8.2f}" if r.serial_tok_per_s else f"{'-':>8}"
            spread = span([v / 1e6 for v in r.miss_bytes_per_token_p10_p90])
            tps_spread = span(r.tok_per_s_p10_p90)
            mark = " *" if best[bits, r.slots] is r and a.policy == "auto" else ""
            print(
                f"{r.policy:<11} {r.slots:>5} {r.budget_gb:>8.3f} {r.hit_rate:6.3f} "
                f"{r.miss_bytes_per_token / 1e6:12.2f} {spread:>15} {tps} {tps_spread:>15} "
                f"{ser}{mark}"
            )
        if a.bits:
            say_bits(a, skipped)
        print(say_window(a))
        if t is None or b is None:
            print("(tok/s: give --bench, or --t-compute-ms and --read-gbps)", file=sys.stderr)
    if a.plot:
        plot(rows, a.plot)


if __name__ == "__main__":
    main()
