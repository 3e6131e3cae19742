"""Routing recording: how often each expert of each layer was routed to.

Counts feed ``FileExpertStore.hot`` (the seed's hot-expert pinning). ``hottest`` is the
one "most used experts" rule of the package: the store, the trace simulator and the
precision study all rank by it.
"""

from __future__ import annotations

import numpy as np


def hottest(counts: np.ndarray, n: int) -> np.ndarray:
    """Indices of the ``n`` largest ``counts`` (ties: lower index first), zero counts
    included; along the last axis for stacked counts."""
    order = np.argsort(-counts, axis=-1, kind="stable")
    return order[..., :n]


class RoutingCounts:
    """Per-layer routing counts, gathered while ``on``."""

    def __init__(self, num_experts: dict[int, int], on: bool = False):
        self.on = on
        self._counts = {li: np.zeros(e, np.int64) for li, e in num_experts.items()}

    def add(self, layer: int, experts: np.ndarray, counts: np.ndarray) -> None:
        self._counts[layer][experts] += counts

    def hot(self, layer: int, n: int) -> list[int]:
        """The ``n`` most routed experts of ``layer`` (never-routed ones left out)."""
        c = self._counts[layer]
        return [int(e) for e in hottest(c, n) if c[e] > 0]

    def layers(self) -> list[int]:
        """Layers that saw any routing."""
        return [li for li, c in sorted(self._counts.items()) if c.any()]
