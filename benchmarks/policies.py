"""Cache policies on real routing: hit rates against LRU and Belady, held-out data.

Replays the second half of the DeepSeek-V2-Lite trace (the predictive policy's weights
were fitted on the first half) through the store's own slot tables and policies, at 8,
16 and 32 of 64 slots per layer, over six layers spread across the model; the same on a
top-1 variant and a 128-expert variant of the routing; how much of the LRU-to-Belady gap
each policy closes; what pinning the statically hottest experts does; and, for scale,
what an LRU told the next H tokens' experts in advance reaches (no online policy knows
more than the past).

    python benchmarks/policies.py --json benchmarks/results/policies.json
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict

import numpy as np
from harness import finish, log, parser

from mlx_streaming.core.cache.base_policy import Policy
from mlx_streaming.core.cache.policy import POLICIES
from mlx_streaming.core.cache.slots import SlotCache
from mlx_streaming.planning.simulate import layer_lookups, simulate, static_hot
from mlx_streaming.planning.trace import RoutingTrace


class LookaheadLRU(Policy):
    """LRU that first evicts experts not needed in the next ``h`` lookups (an oracle);
    pins hold as in every policy."""

    name = "lookahead"

    def __init__(self, num_experts, future, h):
        super().__init__(num_experts)
        self.future, self.h, self.t = future, h, 0
        self.order: OrderedDict[int, None] = OrderedDict()

    def access(self, experts):
        for e in experts:
            if e in self.order:
                self.order.move_to_end(e)
        self.t += 1

    def insert(self, e):
        self.order[e] = None

    def remove(self, e):
        self.order.pop(e, None)

    def victims(self, n, protect):
        soon = set()
        for j in range(1, self.h + 1):
            if self.t + j < len(self.future):
                soon.update(self.future[self.t + j].tolist())
        out = set(np.asarray(protect).tolist())
        cand = [e for e in self.order if e not in out and not self._pinned[e]]
        cand.sort(key=lambda e: e in soon)  # stable: LRU order within each class
        return cand[:n]


def lookahead(trace, slots, layers, tokens, h):
    hits = total = 0
    for li in layers:
        seq = layer_lookups(trace, li, 0, tokens)
        cache = SlotCache(trace.num_experts, slots, LookaheadLRU(trace.num_experts, seq, h))
        for need in seq:
            cache.lookup(need)
        hits += cache.stats.hits
        total += cache.stats.lookups
    return hits / total


def top1(t):
    return RoutingTrace(t.experts[:, :, :1].copy(), t.offsets, t.num_experts, t.model + " top-1")


def e128(t):
    """128 experts, top-12: layer l's experts beside layer l + L/2's, shifted by 64."""
    ex = t.experts.astype(np.int64)
    half = ex.shape[1] // 2
    merged = np.concatenate([ex[:, :half], ex[:, half : 2 * half] + t.num_experts], axis=2)
    return RoutingTrace(
        merged.astype(np.uint8), t.offsets, 2 * t.num_experts, t.model + " 128-expert"
    )


def main():
    p = parser(__doc__, preset=None, trace="required", workdir=None)
    p.add_argument("--tokens", type=int, default=20000)
    a = p.parse_args()
    t0 = time.perf_counter()
    trace = RoutingTrace.load(a.trace)
    fit, held = trace.split(0.5)
    names = [*POLICIES, "belady"]
    out = {"trace": a.trace, "held_out_tokens": a.tokens, "variants": {}}
    for name, tr, sizes in (
        ("deepseek-v2-lite", held, (8, 16, 32)),
        ("top-1", top1(held), (4, 8, 16)),
        ("128-experts", e128(held), (16, 32, 64)),
    ):
        layers = sorted({round(i * (tr.layers - 1) / 5) for i in range(6)})
        rows = {}
        for s in sizes:
            rates = {n: simulate(tr, n, s, layers=layers, tokens=a.tokens).hit_rate for n in names}
            gap = rates["belady"] - rates["lru"]
            rows[s] = {
                "hit_rate": {n: round(r, 4) for n, r in rates.items()},
                "gap_closed": {
                    n: round((rates[n] - rates["lru"]) / gap, 3) for n in POLICIES if gap > 0
                },
            }
            log(name, s, json.dumps(rows[s]))
        out["variants"][name] = {"layers": layers, "slots": rows}
    layers = sorted({round(i * (held.layers - 1) / 5) for i in range(6)})
    out["lookahead_lru"] = {
        str(s): {f"h{h}": round(lookahead(held, s, layers, a.tokens, h), 4) for h in (1, 2, 4)}
        for s in (8, 16)
    }
    log("lookahead", json.dumps(out["lookahead_lru"]))
    pins = {}
    for s in (8, 16, 32):
        pins[s] = {}
        for n in (0, 2):
            hot = static_hot(fit, n) if n else None
            for pol in ("lru", "predictive"):
                pins[s][f"{pol}_pin{n}"] = round(
                    simulate(held, pol, s, layers=layers, tokens=a.tokens, pins=hot).hit_rate, 4
                )
        hot = static_hot(fit, s)  # no cache policy at all: the hottest s, fixed
        pins[s]["static_hottest_only"] = round(
            np.mean([np.isin(held.experts[: a.tokens, li], hot[li]).mean() for li in layers]), 4
        )
    out["pinning"] = pins
    log("pinning", json.dumps(pins))
    finish(a, "policies", out, t0)


if __name__ == "__main__":
    main()
