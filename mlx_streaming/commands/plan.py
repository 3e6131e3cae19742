"""``python -m mlx_streaming plan``: what each budget and policy buys, from a trace."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from ..core.cache.policy import DEFAULT_POLICY
from ..core.options import StreamConfig
from ..planning.budget import PoolShape, default_zero_slot, plan_budget
from ..planning.planner import PlanRow, plan, resolve_policies, sample_layers, shared_layers
from ..planning.trace import RoutingTrace
from ._args import nonneg_float, nonneg_int, positive_float, positive_int


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
    p.add_argument("--bench", help="a `bench --json` result: t_compute and read bandwidth")
    p.add_argument("--t-compute-ms", type=positive_float)
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


def _shape(a, trace: RoutingTrace) -> PoolShape:
    if a.expert_bytes:
        return PoolShape([a.expert_bytes] * trace.layers, trace.num_experts, a.top_k or trace.top_k)
    if a.expert_dir:
        from ..core.meta import load_meta

        return PoolShape.from_meta(load_meta(a.expert_dir))
    from ..core.discovery import find_expert_sites
    from ..prep.hub import load_lazy, resolve_model_path
    from ..prep.split_experts import layer_layout

    model, config = load_lazy(resolve_model_path(a.model))
    sites = find_expert_sites(model, config)
    layouts = [layer_layout(s, "x") for s in sites]
    return PoolShape(
        [sum(p.nbytes for p in lay.parts) for lay in layouts],
        [s.num_experts for s in sites],
        next(s.top_k for s in sites if s.top_k),
        [s.layer for s in sites],
        [lay.stride for lay in layouts],
    )


def plan_tiers(a, trace: RoutingTrace, shape: PoolShape, t, b) -> None:
    """``--memory-gb``: the pools against the tier beneath them; ``--host-gb``: the tier
    beneath pools of their own (``planning.tiers``)."""
    from ..core.io.tier import MARGIN
    from ..planning.tiers import best_split, split_rows

    flag = "--memory-gb" if a.memory_gb else "--host-gb"
    if t is None or b is None:
        raise ValueError(f"{flag} needs a compute time and the disk's bandwidth: --bench, "
                         "or --t-compute-ms and --read-gbps")  # fmt: skip
    if a.policy == "all" or a.policy == "belady":
        raise ValueError(f"{flag} plans one policy the store runs, not --policy "
                         f"{a.policy}: name one (e.g. predictive)")  # fmt: skip
    pol = DEFAULT_POLICY if a.policy == "auto" else a.policy
    L = shared_layers(trace, shape)  # a trace of another model is refused, as in plan
    sim = dict(layers=sample_layers(L, a.layer_sample or None),
               model_layers=len(shape.slot_bytes), tokens=a.tokens)  # fmt: skip
    _, test = trace.split(0.5)
    slot, record = int(np.mean(shape.slot_bytes[:L])), int(np.mean(shape.strides[:L]))
    rates = (t, a.mem_gbps, b)
    host_s = a.host_ms_per_call / 1e3 * len(shape.slot_bytes)  # per token: a call a layer
    if a.memory_gb:  # pools in this machine's memory: its zero slot rule (GPUs: one each)
        zero = default_zero_slot()
        try:
            rows = best_split(test, pol, int(a.memory_gb * 1e9), slot, record, shape.top_k,
                              *rates, beneath=("page cache", "swap"), zero_slot=zero,
                              host_s=host_s, **sim)  # fmt: skip
        except ValueError as e:
            raise ValueError(f"--memory-gb {a.memory_gb}: {e}; raise it") from None
        what = f"{a.memory_gb} GB for pools and the tier beneath them"
    else:  # pools in a GPU's own memory: a zero slot each
        E, k = min(shape.num_experts), shape.top_k
        gpu_zero = default_zero_slot("cuda")
        slots = a.slots or [plan_budget(shape, g, gpu_zero).default_slots for g in a.budget_gb]
        if min(slots) < k:
            raise ValueError(f"--slots {min(slots)} is below top_k={k}: a pool holds one "
                             f"token's experts at least; give --slots {k} or more")  # fmt: skip
        host, what, reserve = int(a.host_gb * 1e9), f"{a.host_gb} GB of host memory", 0
        if a.model:  # what loading its trunk takes beside a swap tier (load's reserve)
            from ..model_builder import trunk_host_bytes
            from ..prep.hub import load_lazy, resolve_model_path

            reserve = trunk_host_bytes(load_lazy(resolve_model_path(a.model))[0], "cuda")
            what += f" (less {reserve / 1e9:.2f} GB for the trunk as it loads, beside a swap tier)"
        sizes = sorted({min(s, E) for s in slots})[::-1]
        rows = []
        for tier, room in (("page cache", host), ("swap", max(0, host - reserve))):
            rows += split_rows(test, pol, [(s, room) for s in sizes], slot, record, *rates,
                               beneath=(tier,), zero_slot=gpu_zero, host_s=host_s,
                               device_swap=True, **sim)  # fmt: skip
        rows.sort(key=lambda r: -r["predicted_tok_per_s"])
        for r in rows:  # CUDA's default takes a swap tier (whole where it fits)
            r["flags"] += " --no-swap-tier" if r["tier"] == "page cache" else ""
        what = f"pools on the device, {what} beneath them"
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"policy {pol}; {what} (the page cache, or the store's swap tier, each less "
          f"{MARGIN / 1e9:.2f} GB left to the process); best first")  # fmt: skip
    print(f"{'slots':>5} {'beneath':<10} {'pool GB':>8} {'tier GB':>8} {'pool':>6} {'tier':>6} "
          f"{'disk':>6} {'disk MB/tok':>11} {'tok/s':>8} {'serial':>8}  flags")  # fmt: skip
    for r in rows:
        print(f"{r['slots']:>5} {r['tier']:<10} {r['pool_gb']:>8.2f} {r['tier_gb']:>8.2f} "
              f"{r['pool_share']:6.3f} {r['tier_share']:6.3f} {r['disk_share']:6.3f} "
              f"{r['disk_mb_per_token']:>11.2f} {r['predicted_tok_per_s']:>8.2f} "
              f"{r['serial_tok_per_s']:>8.2f}  "
              f"{r['flags']}")  # fmt: skip
    print("(tok/s: the reads and copies hidden under compute; serial: after it, as a "
          "layer's misses wait for its routing without read-ahead)")  # fmt: skip
    if a.host_gb and not a.host_ms_per_call:
        print("(on CUDA the page cache runs the host path, whose own work per layer call "
              "these tok/s leave out: give --host-ms-per-call; a swap tier, whole or "
              "bounded, the device path)")  # fmt: skip


def _bounds(a) -> tuple[float | None, float | None]:
    t, b = (a.t_compute_ms / 1e3 if a.t_compute_ms else None), a.read_gbps
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
    trace = RoutingTrace.load(a.trace)
    shape = _shape(a, trace)
    t, b = _bounds(a)
    if a.memory_gb or a.host_gb:
        if a.plot or a.pin_hot:
            raise ValueError(
                "--memory-gb and --host-gb plan the two tiers without --plot or --pin-hot: "
                "drop them"
            )
        return plan_tiers(a, trace, shape, t, b)
    rows = plan(
        trace,
        shape,
        budgets_gb=a.budget_gb or (),
        slots=a.slots or (),
        policies=resolve_policies(a.policy),
        t_compute_s=t,
        read_gbps=b,
        tokens=a.tokens,
        layer_sample=a.layer_sample or None,
        pin_hot=a.pin_hot,
    )
    best = {}
    for r in rows:
        if r.policy != "belady" and (r.slots not in best or r.hit_rate > best[r.slots].hit_rate):
            best[r.slots] = r
    if a.json:
        print(json.dumps([{**r.to_json(), "best": best[r.slots] is r} for r in rows], indent=1))
    else:
        print(
            f"{'policy':<11} {'slots':>5} {'GB':>8} {'hit':>6} {'MB miss/tok':>12} "
            f"{'tok/s':>8} {'serial':>8}"
        )
        for r in rows:
            tps = f"{r.predicted_tok_per_s:8.2f}" if r.predicted_tok_per_s else f"{'-':>8}"
            ser = f"{r.serial_tok_per_s:8.2f}" if r.serial_tok_per_s else f"{'-':>8}"
            mark = " *" if best[r.slots] is r and a.policy == "auto" else ""
            print(
                f"{r.policy:<11} {r.slots:>5} {r.budget_gb:>8.3f} {r.hit_rate:6.3f} "
                f"{r.miss_bytes_per_token / 1e6:12.2f} {tps} {ser}{mark}"
            )
        if t is None or b is None:
            print("(tok/s: give --bench, or --t-compute-ms and --read-gbps)", file=sys.stderr)
    if a.plot:
        plot(rows, a.plot)


if __name__ == "__main__":
    main()
