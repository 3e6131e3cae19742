"""How a short beyond-RAM run's disk bytes depend on where in the routing it starts.

``speed.py --beyond-ram`` decodes a few runs of a few tokens from one point of the
trace's held-out half (``--trace-start``). Each run reads what its stretch of text asks,
and stretches differ widely. This probe replays the same run shape (``beyond_ram.run_calls``:
the prompt, then each run's decode) from each start through the two-tier simulator (the
default policy's pools over a bounded swap tier, or over nothing: O_DIRECT), the model
the rows' ``predicted_disk_bytes_per_token`` comes from (it matched the H100's disk to
0.1%, 2026-12-07h). Each start's disk MB per token sits beside the held-out routing's
(``beyond_ram.typical_run``: 4,000 tokens from the held-out half's first, one a step) as
``stretch_vs_typical``, with the share of that routing's stretches as long that read
less (``stretch_percentile``), as each ``speed.py --beyond-ram`` row now reports. The
start nearest the typical is one to measure a headline at.

    python benchmarks/probes/stretches.py --trace .gpu/deepseek-v2-lite.npz
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from beyond_ram import run_calls, stretch, typical_run  # noqa: E402
from harness import finish, held_out_span, numbers, parser  # noqa: E402

from mlx_streaming.commands._args import nonneg_float, positive_float, positive_int  # noqa: E402
from mlx_streaming.core.cache.policy import DEFAULT_POLICY  # noqa: E402
from mlx_streaming.planning.tiers import simulate_tiers  # noqa: E402
from mlx_streaming.planning.trace import RoutingTrace  # noqa: E402


def main() -> None:
    p = parser(__doc__, preset=None, trace="required", workdir=None)
    p.add_argument("--expert-mb", type=positive_float, default=4.866,
                   help="a record's MB (DS2-Lite at 4 bits: 4.866; 3 bits: 3.785)")  # fmt: skip
    p.add_argument("--slots", type=positive_int, default=16, help="pool slots per layer")
    p.add_argument("--tier-gb", type=nonneg_float, default=4.555,
                   help="the bounded swap tier's GB (0: none, O_DIRECT)")  # fmt: skip
    p.add_argument("--moe-layers", type=positive_int, default=26)
    p.add_argument("--prompt-tokens", type=positive_int, default=32)
    p.add_argument("--tokens", type=positive_int, default=96, help="decode tokens a run")
    p.add_argument("--repeat", type=positive_int, default=3, help="timed runs after the first")
    p.add_argument("--starts", type=numbers(int, 0),
                   help="trace tokens to start at, as speed.py's --trace-start (default: "
                   "every 2,000 tokens of the held-out half)")  # fmt: skip
    a = p.parse_args()
    trace = RoutingTrace.load(a.trace)
    calls, counted = run_calls(a.prompt_tokens, a.tokens, a.repeat)
    first, last = held_out_span(trace, sum(calls))
    starts = a.starts or list(range(first, last + 1, 2000))
    if not starts or not first <= min(starts) <= max(starts) <= last:
        p.error(f"--starts: give {first} to {last} (as speed.py's --trace-start)")
    record = int(a.expert_mb * 1e6)
    bounded = a.tier_gb > 0
    sim = dict(layers=range(min(a.moe_layers, trace.layers)), model_layers=a.moe_layers,
               exclusive=bounded)  # fmt: skip
    args = (trace, DEFAULT_POLICY, a.slots, int(a.tier_gb * 1e9), record)
    typical = typical_run(trace, args, sim)
    rows = []
    for s in starts:
        run = simulate_tiers(*args, start=s, calls=calls, counted=counted, **sim)
        rows.append({"start": s, "disk_mb_per_token": round(run.disk_bytes_per_token / 1e6, 3),
                     **stretch(run, typical)})  # fmt: skip
        print(rows[-1], file=sys.stderr)
    near = min(rows, key=lambda r: abs(r.get("stretch_vs_typical", 1) - 1))
    finish(a, "stretches", {
        "trace": a.trace, "expert_mb": a.expert_mb, "slots": a.slots, "tier_gb": a.tier_gb,
        "moe_layers": a.moe_layers, "policy": DEFAULT_POLICY,
        "run": {"prompt_tokens": a.prompt_tokens, "tokens": a.tokens, "repeat": a.repeat},
        "typical_disk_mb_per_token": round(typical.disk_bytes_per_token / 1e6, 3),
        "start_nearest_typical": near["start"], "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
