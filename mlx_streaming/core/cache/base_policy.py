"""What every eviction policy is: the events it sees and the victims it names
(``Policy``), and the policies that evict by a score over experts (``Scored``)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class Policy:
    """Base class; subclasses keep their own order over resident experts."""

    name = "base"

    def __init__(self, num_experts: int = 0, capacity: int | None = None):
        self.num_experts = num_experts
        self.c = capacity or max(1, num_experts // 2)  # slots, for policies that size lists

    def access(self, experts: Iterable[int]) -> None:
        """Experts looked up by one layer call (hits and misses), after admission."""

    def insert(self, expert: int) -> None:
        """``expert`` became resident."""

    def remove(self, expert: int) -> None:
        """``expert`` left the pool."""

    def victims(self, n: int, protect: set[int]) -> list[int]:
        """``n`` resident experts not in ``protect`` to evict, best first."""
        raise NotImplementedError


class Scored(Policy):
    """Evicts the resident experts with the lowest ``scores()``; ties go to the least
    recently used."""

    def __init__(self, num_experts: int, capacity: int | None = None):
        super().__init__(num_experts, capacity)
        self.t = 0
        self.last = np.full(num_experts, -1, dtype=np.int64)
        self.resident = np.zeros(num_experts, dtype=bool)

    def insert(self, expert):
        self.resident[expert] = True

    def remove(self, expert):
        self.resident[expert] = False

    def access(self, experts):
        idx = np.asarray(experts, dtype=np.int64)
        self._observe(idx)
        self.last[idx] = self.t
        self.t += 1

    def _observe(self, idx: np.ndarray) -> None:
        pass

    def scores(self) -> np.ndarray:
        raise NotImplementedError

    def victims(self, n, protect):
        ok = self.resident.copy()
        if protect:
            ok[np.fromiter(protect, dtype=np.int64, count=len(protect))] = False
        cand = np.flatnonzero(ok)
        if len(cand) <= n:
            return cand.tolist()
        s = self.scores()[cand]
        order = np.lexsort((self.last[cand], s))  # lowest score, then oldest
        return cand[order[:n]].tolist()
