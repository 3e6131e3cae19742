"""Whether a bounded swap tier should give each layer its own number of rows.

The store's bounded tier gives every MoE layer the same rows (``io.tier_moves.bounded_rows``).
Layers route differently: some spread over many experts, some over few. This probe fits a
split from the trace's first half (each layer's disk reads per token at each row count,
replayed through the two-tier simulator one layer at a time; then rows moved, two at a
time, to the layer whose reads fall most, at the same total) and replays the held-out
half with both splits: disk MB per token, the uniform split's against the fitted one's.

    python benchmarks/probes/tier_rows.py --json /tmp/tier-rows.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from harness import finish, parser  # noqa: E402

from mlx_streaming.commands._args import positive_int  # noqa: E402
from mlx_streaming.core.cache.policy import DEFAULT_POLICY  # noqa: E402
from mlx_streaming.planning import tiers  # noqa: E402
from mlx_streaming.planning.trace import RoutingTrace  # noqa: E402

RECORD = 4_866_048  # DS2-Lite's 4-bit expert record, bytes


def reads_per_token(trace, layer: int, slots: int, rows: int, start: int, tokens: int) -> float:
    """One layer's disk reads per token over a tier of ``rows`` rows beneath its pool."""

    class Rows(tiers._SwapRows):
        def __init__(self, layers, slots, _rows, num_experts):
            super().__init__(layers, slots, rows, num_experts)

    real, tiers._SwapRows = tiers._SwapRows, Rows
    try:
        r = tiers.simulate_tiers(trace, DEFAULT_POLICY, slots, 1, RECORD, layers=[layer],
                                 model_layers=1, start=start, tokens=tokens, exclusive=True)  # fmt: skip
    finally:
        tiers._SwapRows = real
    return r.disk_reads / max(1, r.tokens)


def main() -> None:
    p = parser(__doc__, preset=None, trace="required", workdir=None)
    p.add_argument("--slots", type=positive_int, default=16)
    p.add_argument("--rows", type=positive_int, default=36,
                   help="the uniform split's rows per layer (36: the H100 rows' 4.55 GB)")  # fmt: skip
    p.add_argument("--tokens", type=positive_int, default=6000, help="tokens per replay")
    a = p.parse_args()
    trace = RoutingTrace.load(a.trace)
    E, L = trace.num_experts, trace.layers
    if a.slots + a.rows > E:
        p.error(f"--slots {a.slots} and --rows {a.rows} exceed the layer's {E} experts")
    fit_start, held = trace.tokens // 4, trace.split(0.5)[0].tokens
    lo, hi = max(0, a.rows - 12), min(E - a.slots, a.rows + 12)
    grid = list(range(lo, hi + 1, 2))
    curve = np.array([[reads_per_token(trace, li, a.slots, n, fit_start, a.tokens)
                       for n in grid] for li in range(L)])  # fmt: skip
    at = np.zeros(L, int)  # each layer's place in the grid, from its least
    for _ in range((a.rows - lo) * L // 2):  # two rows at a time, where reads fall most
        gain = [curve[li, at[li]] - curve[li, at[li] + 1] if at[li] + 1 < len(grid) else -1
                for li in range(L)]  # fmt: skip
        at[int(np.argmax(gain))] += 1
    fitted = [grid[i] for i in at]
    uniform = sum(reads_per_token(trace, li, a.slots, a.rows, held, a.tokens) for li in range(L))
    split = sum(reads_per_token(trace, li, a.slots, fitted[li], held, a.tokens) for li in range(L))
    finish(a, "tier_rows", {
        "slots": a.slots, "rows": a.rows, "record_bytes": RECORD, "tokens": a.tokens,
        "fitted_rows": fitted, "uniform_disk_mb_per_token": round(uniform * RECORD / 1e6, 2),
        "fitted_disk_mb_per_token": round(split * RECORD / 1e6, 2),
        "fitted_vs_uniform": round(split / uniform, 4),
    })  # fmt: skip


if __name__ == "__main__":
    main()
