"""What the swap tier's rule (``tier_moves.plan_moves``) costs the host per layer call, at
DeepSeek-V2-Lite's width (64 experts) and Qwen3-Next's (512), on random misses into a
bounded tier: µs per call, the median of ``--rounds`` rounds of ``--calls`` calls (the
rule runs once per MoE layer call, on the host path's critical path).

    python benchmarks/probes/tier_rule_cost.py --json /tmp/tier-rule.json
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import finish, parser  # noqa: E402

from mlx_streaming.core.io.tier_moves import plan_moves  # noqa: E402

SHAPES = ((64, 16, 24, 6), (512, 64, 224, 10))  # experts, slots, tier rows, misses a call


def us_per_call(E: int, slots: int, rows: int, k: int, calls: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    home, held, owner, stamp = [-1] * E, list(range(slots)), [-1] * rows, [0] * rows
    for h, e in enumerate(range(slots, slots + rows)):
        home[e], owner[h] = h, e
    heat, clock, spent = [float(x) for x in rng.random(E)], 0, 0.0
    for _ in range(calls):
        out = np.setdiff1d(np.arange(E), held)
        experts = rng.choice(out, k, replace=False).tolist()
        slot = rng.choice(slots, k, replace=False).tolist()
        t0 = time.perf_counter()
        m = plan_moves(0, (home, held, owner, stamp), clock, experts, slot, lambda: heat, True)
        spent += time.perf_counter() - t0
        clock = m.clock
        for e, s in m.reads:
            held[s] = e
    return spent / calls * 1e6


def main(argv=None) -> dict:
    p = parser(__doc__, preset=None, trace=False, workdir=None)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for E, slots, n, k in SHAPES:
        runs = [us_per_call(E, slots, n, k, a.calls, r) for r in range(a.rounds)]
        rows.append({"experts": E, "slots": slots, "tier_rows": n, "misses_per_call": k,
                     "us_per_call": round(statistics.median(runs), 1),
                     "runs_us": [round(r, 1) for r in runs]})  # fmt: skip
    return finish(a, "tier_rule_cost", {"rows": rows}, t0)


if __name__ == "__main__":
    main()
