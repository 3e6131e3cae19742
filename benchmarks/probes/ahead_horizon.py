"""How far ahead read-ahead must guess to move decode beyond RAM off the serial bound (a
model, calibrated by a measured run; issue 33).

A measured larger-than-RAM row (``speed.py --beyond-ram ... --json``) gives the setting
(residency, slots, swap tier, the calls of its runs over the trace) and the machine's
figures: ``t_compute`` (stock's time per token) and the disk's rate ``B`` (``bound_gbps``:
the request ring's queue full). The two-tier simulator replays the same calls and says
which layer of which decode step reads how many records from the disk. A step's timeline
is then played out: each MoE layer computes ``t_compute / layers``, its routing known
after ``--split`` of that; its misses are asked then (demand), and the disk reads one
record at a time at ``B`` (a lone record through 16 threads in 16 pieces read at the
disk's full rate on one H100, 2026-12-07e, but not on another, 2026-12-07g: the model
assumes it). With read-ahead, a guess for
layer ``j`` is asked ``lead`` layers earlier (after layer ``j - lead``'s routing; at the
step's start for the first ``lead`` layers): each miss was guessed with probability
``recall``; for each right guess ``1 / precision - 1`` wrong ones are read too (a guess
the pools or the tier hold reads nothing, so precision is over the guesses read). The
disk serves in order of asking (``fifo``) or demand first (``priority``: a guess waits
while a demand read is queued; a read begun is not cut).

Lead 0 is the row as measured (no read-ahead): its predicted tok/s against the row's
measured tok/s is the model's check. Real reads did not bear the model out at lead 1:
it gave 1.21x for a perfect guess and 1.15x at a router's quality, where the same
steps played through the real ring gave 1.03x and 0.96x on an H100's disk
(benchmarks/RESULTS.md, 2026-12-07f). The disk shares its rate among the reads in
flight, where the model serves one at a time; take its longer leads as an upper bound. The table: predicted tok/s by lead and guess
quality, against the overlap bound ``1 / max(t_compute, bytes / B)``.

    python benchmarks/probes/ahead_horizon.py --row results/gpu/.../speed-...json \
        --trace .gpu/deepseek-v2-lite.npz --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUALITIES = ((1.0, 1.0), (0.9, 0.9), (0.78, 0.78), (0.7, 0.5), (0.46, 0.2))
LEADS = (0, 1, 2, 4, 8, 26, 52)  # in layers: 26 a step ahead (DeepSeek-V2-Lite)


def decode_time(steps, c: float, split: float, r: float, lead: int, recall: float,
                precision: float, priority: bool, rng) -> float:  # fmt: skip
    """Seconds for the decode ``steps`` (each ``misses[j]``: disk reads at layer ``j``),
    played as one timeline of layers (see the module's text); ``c`` a layer's compute,
    ``r`` a record's read. A guess for a layer is asked ``lead`` layers before it, across
    steps where ``lead`` reaches back past the step's start (a guess of the next token's
    misses), else at the first step's start."""
    misses = np.concatenate([np.asarray(m, np.int64) for m in steps])
    n = len(misses)
    guessed = rng.binomial(misses, recall) if lead else np.zeros(n, np.int64)
    wasted = rng.poisson(guessed * (1 / precision - 1)) if lead else guessed
    queue = []  # (class, asked at, order, layer, needed); class 1: a guess, with priority
    pending = misses.copy()  # each layer's needed reads not yet in

    def ask(at: float, g: int, order: float) -> None:  # layer g's guesses
        queue.extend((int(priority), at, order, g, True) for _ in range(guessed[g]))
        queue.extend((int(priority), at, order, g, False) for _ in range(wasted[g]))

    def serve(until: float | None = None) -> float:
        """The disk reads its next record (in its order, among those asked by then) if it
        can begin before ``until``; the time it is in, else None."""
        nonlocal disk
        if not queue:
            return None
        q = min(queue, key=lambda q: (max(disk, q[1]), q[0], q[1], q[2]))
        begin = max(disk, q[1])
        if until is not None and begin >= until:
            return None
        queue.remove(q)
        disk = begin + r
        if q[4]:
            pending[q[3]] -= 1
        return disk

    for g in range(min(lead, n)):  # the first layers' guesses at the start
        ask(0.0, g, g)
    t = disk = 0.0
    for g in range(n):
        routed = t + split * c
        while serve(routed) is not None:  # the disk works while the layers compute
            pass
        if lead and g + lead < n:
            ask(routed, g + lead, g + lead)
        queue.extend((0, routed, g, g, True) for _ in range(misses[g] - guessed[g]))
        done = routed
        while pending[g]:  # then until layer g's reads are in
            done = max(done, serve())
        queue = [q for q in queue if q[3] > g]  # guesses for layers gone: taken back
        t = max(routed, done) + (1 - split) * c
    return t


def row_steps(path, trace_path):
    """A measured row's run and row (``speed.py --beyond-ram`` JSON), the simulator's
    replay of its calls, and each decode step's disk reads by layer (the module's text)."""
    from beyond_ram import run_calls

    from mlx_streaming.planning.tiers import simulate_tiers
    from mlx_streaming.planning.trace import RoutingTrace

    run = json.loads(Path(path).read_text())
    row = (run.get("rows") or run.get("results"))[0]
    trace = RoutingTrace.load(trace_path)
    layers = run["moe_layers"]
    calls, counted = run_calls(run["prompt_tokens"], run["tokens"], run["repeat"])
    bounded = bool(row["swap_tier_gb"]) and row["runtime"].get("bounded", False)
    sim = simulate_tiers(
        trace, row["runtime"]["policy"], row["slots"], int(row["swap_tier_gb"] * 1e9),
        run["record_bytes"], layers=range(min(layers, trace.layers)), model_layers=layers,
        start=run["trace_start"], calls=calls, counted=counted, exclusive=bounded,
    )  # fmt: skip
    steps = [sim.disk_by_call[i] for i, (n, on) in enumerate(zip(calls, counted)) if on and n == 1]
    return run, row, sim, steps


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--row", required=True, help="a speed.py --beyond-ram JSON (its first row)")
    p.add_argument("--trace", required=True, help="the routing trace the row replayed")
    p.add_argument("--split", type=float, default=0.5, help="a layer's compute before its routing")
    p.add_argument("--gbps", type=float, help="the disk's rate (default: the row's bound_gbps)")
    p.add_argument("--json", help="write the table here")
    a = p.parse_args()
    from mlx_streaming.bench.measure import bounds

    run, row, sim, steps = row_steps(a.row, a.trace)
    layers = run["moe_layers"]
    gbps = a.gbps or row.get("bound_gbps") or row["storage_gbps"]
    t_c = row["t_compute_ms"] / 1e3
    c, r = t_c / layers, run["record_bytes"] / (gbps * 1e9)
    reads = np.array([int(s.sum()) for s in steps])
    io = float(reads.mean()) * r
    b = bounds(t_c, io * gbps * 1e9, gbps, row["tok_per_s"], reads * run["record_bytes"])
    bound = b["bound_tok_per_s"]
    out = {
        "row": a.row, "measured_tok_per_s": row["tok_per_s"], "gbps": gbps,
        "t_compute_ms": round(t_c * 1e3, 3), "record_read_ms": round(r * 1e3, 3),
        "layer_compute_ms": round(c * 1e3, 3), "disk_reads_per_token": round(io / r, 2),
        "predicted_disk_mb_per_token": round(sim.disk_bytes_per_token / 1e6, 2),
        "measured_disk_mb_per_token": round(row["disk_bytes_per_token"] / 1e6, 2),
        "reads_per_step_p50_p90_max": [int(np.percentile(reads, 50)),
                                       int(np.percentile(reads, 90)), int(reads.max())],
        "overlap_bound_tok_per_s": bound, "step_bound_tok_per_s": b["step_bound_tok_per_s"],
        "serial_bound_tok_per_s": b["serial_bound_tok_per_s"], "rows": [],
    }  # fmt: skip
    print({k: v for k, v in out.items() if k != "rows"})
    cases = [(0, 0.0, 1.0, False)]  # no read-ahead: the row as measured
    cases += [(lead, rc, pr, pri) for rc, pr in QUALITIES for lead in LEADS[1:]
              for pri in (False, True)]  # fmt: skip
    for lead, recall, precision, priority in cases:
        rng = np.random.default_rng(0)
        tps = len(steps) / decode_time(steps, c, a.split, r, lead, recall, precision, priority, rng)
        res = {"lead": lead, "recall": recall, "precision": precision,
               "order": "priority" if priority else "fifo", "tok_per_s": round(tps, 2),
               "of_overlap_bound": round(tps / bound, 3)}  # fmt: skip
        out["rows"].append(res)
        print(res)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
