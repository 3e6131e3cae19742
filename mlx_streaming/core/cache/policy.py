"""Eviction policies: which resident expert of a layer gives up its slot.

A policy sees one layer's lookups (``access``, once per layer call, with the call's
distinct experts), admissions (``insert``), removals (``remove``) and pins, and names
victims among resident experts outside the call being served. It knows nothing of slots,
devices or files, so the live store, the device path and the trace simulator run the
very same ranking. Time is counted in lookups of the layer.

The live policies are one ranking with three weightings (``scored.Scored``):

* ``lru``: least recently used.
* ``lfu``: least frequently used, counts aged by 0.9 per lookup.
* ``predictive`` (the default): a linear score of recency, counts over several windows,
  the aged count and the layer's expert-to-expert transitions (learned online).

``belady``, the offline optimum, needs the future: simulation only.
"""

from __future__ import annotations

import numpy as np

from .base_policy import Policy
from .scored import WEIGHTS, Scored

POLICIES = tuple(WEIGHTS)
DEFAULT_POLICY = "predictive"  # best on held-out traces (benchmarks/RESULTS.md)


class Belady(Policy):
    """The offline optimum: evict the expert whose next use is farthest away.

    ``future`` is the sequence of lookups this layer will see (distinct experts per
    call), so only a simulator can use it.
    """

    name = "belady"

    def __init__(self, num_experts: int, future: list[np.ndarray]):
        super().__init__(num_experts)
        T = len(future)
        self.next_use = np.full((T + 1, num_experts), np.iinfo(np.int64).max, dtype=np.int64)
        for t in range(T - 1, -1, -1):
            self.next_use[t] = self.next_use[t + 1]
            self.next_use[t, future[t]] = t
        self.t = 0
        self.resident: set[int] = set()

    def access(self, experts):
        self.t += 1

    def insert(self, expert):
        self.resident.add(expert)

    def remove(self, expert):
        self.resident.discard(expert)

    def victims(self, n, protect):
        out = set(np.asarray(protect).tolist())
        cand = [e for e in self.resident if e not in out and not self._pinned[e]]
        nxt = self.next_use[min(self.t + 1, len(self.next_use) - 1)]
        cand.sort(key=lambda e: -nxt[e])
        return cand[:n]


def make_policy(name: str, num_experts: int = 0, **kw) -> Policy:
    """A policy by name (see ``POLICIES``) for a layer of ``num_experts`` experts."""
    if name not in WEIGHTS:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {sorted(POLICIES)}")
    return Scored(num_experts, weights=name, **kw)
