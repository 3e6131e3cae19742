"""Eviction by each expert's estimated next use from its own reuse gaps (a renewal
estimate), against LRU, the default ``predictive`` and Belady, on held-out real routing.

Issue 33's policy bar asks for half of the LRU-to-Belady gap; Belady evicts the expert
used furthest ahead. This probe estimates that distance from history alone: for an
expert idle for ``a`` tokens, the mean of ``g - a`` over its past reuse gaps ``g > a``,
blended with the same over the layer's pooled gaps (weight ``--prior``); ``surv`` also
divides by the share of its gaps longer than ``a`` (how likely it comes back at all).
Demand caching per layer, six layers across the model, the trace's second half (the
renewal policies warmed on the 2,000 tokens before it); misses per token summed over the
layers, and the share of the gap each closes.

    python benchmarks/probes/renewal_eviction.py --json /tmp/renewal.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from harness import finish, held_out_gap, parser  # noqa: E402

from mlx_streaming.planning.simulate import layer_lookups  # noqa: E402
from mlx_streaming.planning.trace import RoutingTrace  # noqa: E402

WARM = 2000


def renewal_misses(seq, num_experts: int, slots: int, prior: float, surv: bool) -> int:
    """Demand misses after ``WARM`` lookups, evicting the largest estimated next use."""
    last = np.full(num_experts, -1)
    gaps: list[list[int]] = [[] for _ in range(num_experts)]
    pooled: list[int] = []
    resident: set[int] = set()
    misses = 0
    for t, need in enumerate(seq):
        need = set(need.tolist())
        pg = np.array(pooled[-4000:] or [1])
        for e in need - resident:
            misses += t >= WARM
            if len(resident) >= slots:
                best, worst = None, -1.0
                for x in resident - need:
                    a = t - last[x]
                    g = np.array(gaps[x][-64:], dtype=np.int64)
                    own, pool = g[g > a], pg[pg > a]
                    p = (pool - a).mean() if len(pool) else 2.0 * a + 1
                    est = ((own - a).sum() + prior * p) / (len(own) + prior)
                    if surv:
                        est /= (len(own) + 0.5) / (len(g) + 1.0)
                    if est > worst:
                        best, worst = x, est
                resident.discard(best)
            resident.add(e)
        for e in need:
            if last[e] >= 0:
                gaps[e].append(t - last[e])
                pooled.append(t - last[e])
            last[e] = t
    return misses


def main():
    p = parser(__doc__, preset=None, trace="required", workdir=None)
    p.add_argument("--tokens", type=int, default=4000, help="held-out tokens replayed")
    p.add_argument("--prior", type=float, default=4.0)
    a = p.parse_args()
    tr = RoutingTrace.load(a.trace)

    def renewals(slots, layers, start, n):
        return {
            name: sum(
                renewal_misses(
                    layer_lookups(tr, li, start - WARM, n + WARM),
                    tr.num_experts,
                    slots,
                    a.prior,
                    surv,
                )  # fmt: skip
                for li in layers
            )
            / n
            for name, surv in (("renewal", False), ("renewal+survival", True))
        }

    finish(a, "renewal_eviction", held_out_gap(tr, a.tokens, renewals))


if __name__ == "__main__":
    main()
