"""``plan --memory-gb`` and ``--host-gb``: the pools against the tier beneath them, each
row's hits per tier, disk bytes, predicted tok/s and flags; with ``--bits``, every
precision's rows side by side."""

from __future__ import annotations

import functools
import json
import sys

import numpy as np

from ..core.cache.policy import DEFAULT_POLICY
from ..planning.budget import PoolShape, TooSmall, default_zero_slot, plan_budget
from ..planning.planner import sample_layers, shared_layers
from ..planning.trace import RoutingTrace


def check_tiers(a, t: float | None, b: float | None) -> None:
    """Refuse what ``plan_tiers`` cannot plan: no compute time or bandwidth, or a policy
    the store does not run."""
    flag = "--memory-gb" if a.memory_gb else "--host-gb"
    if t is None or b is None:
        raise ValueError(f"{flag} needs a compute time and the disk's bandwidth: --bench, "
                         "or --t-compute-ms and --read-gbps")  # fmt: skip
    if a.policy == "all" or a.policy == "belady":
        raise ValueError(f"{flag} plans one policy the store runs, not --policy "
                         f"{a.policy}: name one (e.g. predictive)")  # fmt: skip


def plan_tiers(
    a, trace: RoutingTrace, shape: PoolShape, t, b, skip: list | None = None
) -> tuple[list[dict], str, str]:
    """``--memory-gb``: the pools against the tier beneath them; ``--host-gb``: the tier
    beneath pools of their own (``planning.tiers``). Returns the rows, best first, the
    policy and what memory they share. With ``skip``, a budget too small for this shape
    is left out and its reason appended there; without, ``TooSmall`` is raised.
    ``check_tiers`` has refused what it cannot plan, once for every precision."""
    from ..planning.tiers import best_split, split_rows

    pol = DEFAULT_POLICY if a.policy == "auto" else a.policy
    L = shared_layers(trace, shape)  # a trace of another model is refused, as in plan
    sim = dict(layers=sample_layers(L, a.layer_sample or None),
               model_layers=len(shape.slot_bytes), tokens=a.tokens, window=a.window)  # fmt: skip
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
        except TooSmall as e:
            raise TooSmall(f"--memory-gb {a.memory_gb}: {e}; raise it") from None
        what = f"{a.memory_gb} GB for pools and the tier beneath them"
    else:  # pools in a GPU's own memory: a zero slot each
        E, k = min(shape.num_experts), shape.top_k
        gpu_zero = default_zero_slot("cuda")
        slots = a.slots or [
            plan_budget(shape, g, gpu_zero).default_slots
            for g in fitting_budgets(shape, a.budget_gb, gpu_zero, skip)
        ]
        if min(slots) < k:
            raise ValueError(f"--slots {min(slots)} is below top_k={k}: a pool holds one "
                             f"token's experts at least; give --slots {k} or more")  # fmt: skip
        host, what, reserve = int(a.host_gb * 1e9), f"{a.host_gb} GB of host memory", 0
        if a.model:  # what loading its trunk takes beside a swap tier (load's reserve)
            reserve = _trunk_reserve(a.model)
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
    return rows, pol, what


def fitting_budgets(shape: PoolShape, budgets, zero: bool, skip: list | None) -> list:
    """The budgets (GB) that hold one token's experts in every layer of ``shape``. With
    ``skip``, one that does not is left out and its reason appended there (``TooSmall``
    only where none is left); without, its ``TooSmall`` is raised."""
    out = []
    for g in budgets:
        try:
            plan_budget(shape, g, zero)
            out.append(g)
        except TooSmall as e:
            if skip is None:
                raise
            skip.append(str(e))
    if budgets and not out:
        raise TooSmall("; ".join(skip))
    return out


@functools.cache
def _trunk_reserve(model: str) -> int:
    from ..model_builder import trunk_host_bytes
    from ..prep.hub import load_lazy, resolve_model_path

    return trunk_host_bytes(load_lazy(resolve_model_path(model))[0], "cuda")


def print_tiers(a, rows: list[dict], pol: str, what: str, skipped: list[str]) -> None:
    """The rows of ``plan_tiers`` (of every precision of ``--bits``), best first."""
    from ..core.io.tier import MARGIN

    if a.json:
        say_skipped(skipped)
        print(json.dumps(rows, indent=1))
        return
    bits = "bits" in rows[0]
    print(f"policy {pol}; {what} (the page cache, or the store's swap tier, each less "
          f"{MARGIN / 1e9:.2f} GB left to the process); best first")  # fmt: skip
    print(f"{'bits ' if bits else ''}{'slots':>5} {'beneath':<10} {'pool GB':>8} {'tier GB':>8} "
          f"{'pool':>6} {'tier':>6} {'disk':>6} {'disk MB/tok':>11} {'p10-p90':>15} "
          f"{'tok/s':>8} {'p10-p90':>15} {'serial':>8}  flags")  # fmt: skip
    for r in rows:
        print(f"{r['bits']:>4} " if bits else "", end="")
        print(f"{r['slots']:>5} {r['tier']:<10} {r['pool_gb']:>8.2f} {r['tier_gb']:>8.2f} "
              f"{r['pool_share']:6.3f} {r['tier_share']:6.3f} {r['disk_share']:6.3f} "
              f"{r['disk_mb_per_token']:>11.2f} {span(r['disk_mb_per_token_p10_p90']):>15} "
              f"{r['predicted_tok_per_s']:>8.2f} {span(r['tok_per_s_p10_p90']):>15} "
              f"{r['serial_tok_per_s']:>8.2f}  "
              f"{r['flags']}")  # fmt: skip
    print("(tok/s: the reads and copies hidden under compute; serial: after it, as a "
          "layer's misses wait for its routing without read-ahead)")  # fmt: skip
    print(say_window(a))
    if a.host_gb and not a.host_ms_per_call:
        print("(on CUDA the page cache runs the host path, whose own work per layer call "
              "these tok/s leave out: give --host-ms-per-call; a swap tier, whole or "
              "bounded, the device path)")  # fmt: skip
    if bits:
        say_bits(a, skipped)


def span(lo_hi: list[float]) -> str:
    """``[p10, p90]`` as ``lo-hi``, to the means' precision (``-``: too few stretches)."""
    return f"{lo_hi[0]:.2f}-{lo_hi[1]:.2f}" if lo_hi else "-"


def say_window(a) -> str:
    """Under a table: what its means and its spreads are."""
    return (f"(means over {a.tokens} tokens of held-out routing, what a long session sees; "
            f"p10-p90: over its stretches of {a.window} tokens (--window), what one run "
            "that long may see: routing differs from text to text)")  # fmt: skip


def say_bits(a, skipped: list[str]) -> None:
    """Under a table of ``--bits`` rows: the precisions skipped, and how to run a row."""
    for line in skipped:
        print(f"(skipped: {line})")
    timed = a.t_compute_ms or a.bench  # a compute time given: tok/s figures printed
    one_time = len(a.bits) > 1 and len(a.t_compute_ms or []) < 2 and timed
    group = f" --group-size {a.group_size}" if a.group_size else ""
    print(f"(a row at B bits runs on its experts requantized: mlx-streaming requantize "
          f"--src {a.expert_dir or a.model} --out <dir> --bits B{group}, then load with "
          f"--expert-dir <dir>"
          + ("; every row at one compute time: give --t-compute-ms one per precision, as "
             "bench measures each" if one_time else "")
          + ")")  # fmt: skip


def say_skipped(skipped: list[str]) -> None:
    """Beside JSON on stdout: the precisions skipped, on stderr."""
    for line in skipped:
        print(f"plan: skipped {line}", file=sys.stderr)


def tagged(rows: list[dict], bits: int | None, shape: PoolShape, t: float | None) -> list:
    if bits is None:
        return rows
    mb = round(float(np.mean(shape.slot_bytes)) / 1e6, 3)
    ms = t and round(t * 1e3, 3)
    return [{"bits": bits, "expert_mb": mb, "t_compute_ms": ms, **r} for r in rows]
