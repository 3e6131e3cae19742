"""What every eviction policy is: the events it sees and the victims it names."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class Policy:
    """Base class. A policy sees one layer's lookups (``access``), admissions
    (``insert``), removals (``remove``) and pins (``pin``), and names victims among its
    resident, unpinned experts outside the call being served."""

    name = "base"

    def __init__(self, num_experts: int = 0):
        self.num_experts = num_experts
        self._pinned = np.zeros(num_experts, np.uint8)

    def access(self, experts: Iterable[int]) -> None:
        """Experts looked up by one layer call (hits and misses), after admission."""

    def insert(self, expert: int) -> None:
        """``expert`` became resident."""

    def remove(self, expert: int) -> None:
        """``expert`` left the pool."""

    def pin(self, experts: Iterable[int]) -> None:
        """Experts never to name as victims (replaces the previous set)."""
        self._pinned[:] = 0
        self._pinned[np.asarray(list(experts), np.int64)] = 1

    def victims(self, n: int, protect: np.ndarray) -> list[int]:
        """``n`` resident, unpinned experts not in ``protect`` (the call's experts,
        sorted) to evict, best first."""
        raise NotImplementedError
