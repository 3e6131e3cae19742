"""How far ahead must an eviction policy see? Belady with a horizon, on held-out real
routing.

Issue 33's policy bar asks for half of the LRU-to-Belady gap. Belady knows every future
lookup; a predictor through the model's own routers (the next layer's, the next
token's) can know at best the next token or few. This probe gives each policy the exact
routing of the next ``H`` tokens of its layer: a resident expert used within them is
kept in order of its next use (the furthest evicted first, as Belady), and the experts
not used within them are evicted first, ranked by a history policy (``lru`` or the
default ``predictive``). ``H`` = 1 is the ceiling of any perfect next-token predictor,
however it is built. Demand caching per layer, six layers across the model, the trace's
second half; misses per token summed over the layers, and the share of the gap closed.

    python benchmarks/probes/horizon_eviction.py --json /tmp/horizon.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from harness import finish, held_out_gap, parser  # noqa: E402

from mlx_streaming.core.cache.base_policy import Policy  # noqa: E402
from mlx_streaming.core.cache.policy import Belady, make_policy  # noqa: E402
from mlx_streaming.core.cache.slots import SlotCache  # noqa: E402
from mlx_streaming.planning.simulate import layer_lookups  # noqa: E402
from mlx_streaming.planning.trace import RoutingTrace  # noqa: E402

HORIZONS = (1, 2, 4, 8, 16, 64)


class Horizon(Policy):
    """``base``'s ranking for experts not used within the next ``h`` lookups (evicted
    first), then the rest by their next use, the furthest first."""

    def __init__(self, num_experts: int, future: list[np.ndarray], h: int, base: str):
        super().__init__(num_experts)
        self.oracle, self.base, self.h = (
            Belady(num_experts, future),
            make_policy(base, num_experts),
            h,
        )
        self.name = f"horizon{h}+{base}"

    def access(self, experts):
        self.oracle.access(experts)
        self.base.access(experts)

    def insert(self, expert):
        self.oracle.insert(expert)
        self.base.insert(expert)

    def remove(self, expert):
        self.oracle.remove(expert)
        self.base.remove(expert)

    def victims(self, n, protect):
        o = self.oracle
        out = set(np.asarray(protect).tolist())
        cand = [e for e in o.resident if e not in out and not self._pinned[e]]
        # every candidate, best first (asked for all, a policy returns them unranked)
        ranked = self.base.victims(len(cand) - 1, protect) if len(cand) > 1 else cand
        ranked += [e for e in cand if e not in set(ranked)]
        now = o.t  # the lookup being served
        nxt = o.next_use[min(now + 1, len(o.next_use) - 1)]
        within = [e for e in ranked if nxt[e] - now <= self.h]
        beyond = [e for e in ranked if nxt[e] - now > self.h]
        within.sort(key=lambda e: -nxt[e])
        return (beyond + within)[:n]


def misses(seq, num_experts: int, slots: int, h: int, base: str) -> int:
    cache = SlotCache(num_experts, slots, Horizon(num_experts, seq, h, base))
    for need in seq:
        cache.lookup(need)
    return cache.stats.misses


def main():
    p = parser(__doc__, preset=None, trace="required", workdir=None)
    p.add_argument("--tokens", type=int, default=4000, help="held-out tokens replayed")
    a = p.parse_args()
    tr = RoutingTrace.load(a.trace)

    def horizons(slots, layers, start, n):
        seqs = {li: layer_lookups(tr, li, start, n) for li in layers}
        return {
            f"h{h}+{base}": sum(misses(seqs[li], tr.num_experts, slots, h, base) for li in layers)
            / n
            for base in ("lru", "predictive")
            for h in HORIZONS
        }

    finish(a, "horizon_eviction", held_out_gap(tr, a.tokens, horizons))


if __name__ == "__main__":
    main()
