"""Whether a bounded swap tier should give each layer its own number of rows.

The store's bounded tier gives every MoE layer the same rows (``io.tier_moves.bounded_rows``).
Layers route differently: some spread over many experts, some over few. This probe fits a
split from the trace's first half (each layer's disk reads per token at each row count,
replayed through the two-tier simulator one layer at a time; then rows moved, two at a
time, to the layer whose reads fall most, at the same total) and replays the held-out
half with both splits: disk MB per token, the uniform split's against the fitted one's.
Beside them, a tier whose rows any layer may take (``shared_tier``: a victim enters it,
and the coldest record of any layer leaves, heats compared at each layer's own call
weight), in a simpler model of the tier, checked against the uniform split in the same
model: how much any split across layers, fixed or moving, could gain.

    python benchmarks/probes/tier_rows.py --json /tmp/tier-rows.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from harness import finish, parser  # noqa: E402

from mlx_streaming.commands._args import positive_int  # noqa: E402
from mlx_streaming.core.cache.policy import DEFAULT_POLICY, make_policy  # noqa: E402
from mlx_streaming.core.cache.slots import SlotCache  # noqa: E402
from mlx_streaming.planning import tiers  # noqa: E402
from mlx_streaming.planning.simulate import layer_lookups  # noqa: E402
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


def shared_tier(trace, slots: int, rows: int, start: int, tokens: int, shared: bool) -> float:
    """Disk reads per token of a simple exclusive tier beneath the default policy's
    pools: a pool's victim enters it, a miss found there leaves it, and over its size
    (``rows`` a layer, or ``rows`` times the layers shared) the coldest record leaves."""
    E, L = trace.num_experts, trace.layers
    seqs = [layer_lookups(trace, li, start, tokens) for li in range(L)]
    caches = [SlotCache(E, slots, make_policy(DEFAULT_POLICY, E)) for _ in range(L)]
    held = [set(range(slots, slots + rows)) for _ in range(L)]  # as the store fills it
    for c in caches:
        c.commit(c.reserve(range(slots), protect=np.zeros(0, np.int64)))
    reads = 0

    def coldest(li: int) -> tuple[float, int, int]:
        h = caches[li].heat
        e = min(held[li], key=lambda x: h[x])
        return h[e] / caches[li].heat_weight, li, e  # comparable across layers

    for t in range(min(map(len, seqs))):
        for li in range(L):
            for e, _, v in caches[li].lookup(seqs[li][t]):
                reads += e not in held[li]
                held[li].discard(e)
                if v < 0:
                    continue
                held[li].add(v)
                if shared and sum(map(len, held)) > rows * L:
                    _, lj, x = min(coldest(lj) for lj in range(L) if held[lj])
                    held[lj].discard(x)
                elif not shared and len(held[li]) > rows:
                    held[li].discard(coldest(li)[2])
    return reads / max(1, min(map(len, seqs)))


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
    alone = shared_tier(trace, a.slots, a.rows, held, a.tokens, False)
    shared = shared_tier(trace, a.slots, a.rows, held, a.tokens, True)
    finish(a, "tier_rows", {
        "slots": a.slots, "rows": a.rows, "record_bytes": RECORD, "tokens": a.tokens,
        "fitted_rows": fitted, "uniform_disk_mb_per_token": round(uniform * RECORD / 1e6, 2),
        "fitted_disk_mb_per_token": round(split * RECORD / 1e6, 2),
        "fitted_vs_uniform": round(split / uniform, 4),
        "simple_model": {"uniform_disk_mb_per_token": round(alone * RECORD / 1e6, 2),
                         "shared_disk_mb_per_token": round(shared * RECORD / 1e6, 2),
                         "shared_vs_uniform": round(shared / alone, 4)},
    })  # fmt: skip


if __name__ == "__main__":
    main()
