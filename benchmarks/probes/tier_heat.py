"""Which record a full bounded swap tier should drop: the coldest (the store's, by the
slot tables' decayed lookups, ``SlotCache.heat``) against the one written longest ago
(before 2026-12-06), on real routing; and against the one whose expert is next used
furthest ahead (Belady's choice among the rows, which no store can know: the headroom
left to the tier's rule; the victim itself always takes a row, as in the store).

The two-tier simulator (``planning.tiers.simulate_tiers``, exclusive: the store's swap
tier, which the store matches call for call) replays the trace's second half through the
default policy's pools and a bounded tier beneath them, both ways, side by side; each row
is disk MB per token at DeepSeek-V2-Lite's record size and the ratio.

    python benchmarks/probes/tier_heat.py --json /tmp/tier-heat.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from harness import TRACE, finish, parser  # noqa: E402

from mlx_streaming.planning import tiers  # noqa: E402
from mlx_streaming.planning.simulate import layer_lookups  # noqa: E402
from mlx_streaming.planning.trace import RoutingTrace  # noqa: E402

RECORD = 4_866_048  # DS2-Lite's 4-bit expert record, bytes
SPLITS = ((8, 4.43), (16, 4.43), (16, 2.0), (32, 3.0))  # slots per layer, tier GB


class _Oldest(tiers._SwapRows):
    """The tier as it was: the row written longest ago out first (all equally cold)."""

    def keep(self, li, placed, found, heat):
        return super().keep(li, placed, found, [0.0] * len(heat))


class _Furthest(tiers._SwapRows):
    """The row whose expert is next used furthest ahead out first (one token a call, so
    a layer's k-th ``keep`` is its k-th call)."""

    seqs: dict = {}  # trace layer: each call's distinct experts (set by ``disk_mb``)

    def __init__(self, layers, slots, rows, num_experts):
        super().__init__(layers, slots, rows, num_experts)
        self.calls, self.next = dict.fromkeys(layers, 0), {}
        for li in layers:  # each call's next use per expert, strictly after it
            seq, ahead = self.seqs[li], np.full(num_experts, np.inf)
            self.next[li] = np.empty((len(seq), num_experts))
            for t in range(len(seq) - 1, -1, -1):
                self.next[li][t] = ahead
                ahead[seq[t]] = t

    def keep(self, li, placed, found, heat):
        t, self.calls[li] = self.calls[li], self.calls[li] + 1
        return super().keep(li, placed, found, -self.next[li][t])


def disk_mb(trace, slots: int, gb: float, start: int, tokens: int, rule: str) -> float:
    real = tiers._SwapRows
    layers = range(0, trace.layers, 2)
    _Furthest.seqs = {li: layer_lookups(trace, li, start, tokens) for li in layers}
    tiers._SwapRows = {"oldest": _Oldest, "coldest": real, "furthest": _Furthest}[rule]
    try:
        r = tiers.simulate_tiers(
            trace, "predictive", slots, int(gb * 1e9), RECORD, layers=layers,
            model_layers=trace.layers, start=start, tokens=tokens, exclusive=True,
        )  # fmt: skip
    finally:
        tiers._SwapRows = real
    return r.disk_bytes_per_token / 1e6


def main() -> None:
    p = parser(__doc__, preset=None)
    p.add_argument("--tokens", type=int, default=2000, help="tokens replayed per window")
    a = p.parse_args()
    trace = RoutingTrace.load(a.trace or TRACE)
    half = trace.tokens // 2
    rows = []
    for start in (half, half + (trace.tokens - half) // 2):  # two held-out windows
        for slots, gb in SPLITS:
            old, cold, far = (disk_mb(trace, slots, gb, start, a.tokens, rule)
                              for rule in ("oldest", "coldest", "furthest"))  # fmt: skip
            rows.append({
                "start": start, "slots": slots, "tier_gb": gb, "oldest_mb": round(old, 2),
                "coldest_mb": round(cold, 2), "ratio": round(cold / old, 3),
                "furthest_mb": round(far, 2), "furthest_ratio": round(far / cold, 3),
            })  # fmt: skip
            print(rows[-1], file=sys.stderr, flush=True)
    finish(a, "tier_heat", {"record_bytes": RECORD, "tokens": a.tokens, "rows": rows})


if __name__ == "__main__":
    main()
