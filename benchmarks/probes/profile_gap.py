"""Does a per-layer pool profile close more of the LRU-to-Belady gap (issue 33, item 3)?

On the DeepSeek-V2-Lite trace: per-layer slots fitted on its first half by the package's
own profile builder (hit curves under ``predictive``, the one greedy allocator, equal
total slots), then demand caching on the held-out half. Misses per token, and the share
of the gap between uniform LRU and uniform Belady that each row closes. A simulation:
no model runs.

    python benchmarks/probes/profile_gap.py --json benchmarks/results/profile-gap.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import finish, log, parser  # noqa: E402


def main():
    p = parser(__doc__, preset=None, trace="required", workdir=None)
    p.add_argument("--slots", default="8,16,32", help="uniform slots per layer")
    p.add_argument("--tokens", type=int, default=4000, help="held-out tokens replayed")
    a = p.parse_args()
    from mlx_streaming.planning.budget import PoolShape
    from mlx_streaming.planning.profiles import build_profile
    from mlx_streaming.planning.simulate import simulate
    from mlx_streaming.planning.trace import RoutingTrace

    trace = RoutingTrace.load(a.trace)
    held = trace.split(0.5)[1]
    # one byte per slot and no zero slot: equal bytes are equal total slots
    shape = PoolShape([1] * trace.layers, trace.num_experts, trace.top_k)
    rows = []
    for u in (int(s) for s in a.slots.split(",")):
        prof = build_profile(trace, shape, slots=u, tokens=a.tokens, zero_slot=False)
        caps = prof.slots
        row = {"slots": u, "profile_slots": sorted(caps.values())}
        for name, policy, slots in (
            ("lru", "lru", u),
            ("belady", "belady", u),
            ("predictive", "predictive", u),
            ("profile_predictive", "predictive", caps),
            ("profile_lru", "lru", caps),
            ("profile_belady", "belady", caps),
        ):
            row[name] = round(simulate(held, policy, slots, tokens=a.tokens).misses_per_token(), 3)
        gap = row["lru"] - row["belady"]
        row["gap_closed"] = {
            n: round((row["lru"] - row[n]) / gap, 3)
            for n in ("predictive", "profile_predictive", "profile_lru", "profile_belady")
        }
        log(row)
        rows.append(row)
    finish(a, "profile_gap", {"trace": a.trace, "tokens": a.tokens, "rows": rows})


if __name__ == "__main__":
    main()
