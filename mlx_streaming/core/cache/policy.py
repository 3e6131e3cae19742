"""Eviction policies: which resident expert of a layer gives up its slot.

A policy sees the layer's lookups (``access``), admissions (``insert``) and removals, and
names victims among resident, unprotected experts. It knows nothing of slots, devices or
files, so the live store and the trace simulator run the very same objects.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class Policy:
    """Base class; subclasses keep their own order over resident experts."""

    name = "base"

    def access(self, experts: Iterable[int]) -> None:
        """Experts looked up by one layer call (hits and misses), after admission."""

    def insert(self, expert: int) -> None:
        """``expert`` became resident."""

    def remove(self, expert: int) -> None:
        """``expert`` left the pool."""

    def victims(self, n: int, protect: set[int]) -> list[int]:
        """``n`` resident experts not in ``protect`` to evict, best first."""
        raise NotImplementedError


class LRU(Policy):
    """Least recently used."""

    name = "lru"

    def __init__(self):
        self._order: OrderedDict[int, None] = OrderedDict()

    def access(self, experts):
        for e in experts:
            if e in self._order:
                self._order.move_to_end(e)

    def insert(self, expert):
        self._order[expert] = None
        self._order.move_to_end(expert)

    def remove(self, expert):
        self._order.pop(expert, None)

    def victims(self, n, protect):
        out = []
        for e in self._order:
            if len(out) == n:
                break
            if e not in protect:
                out.append(e)
        return out


POLICIES = {"lru": LRU}


def make_policy(name: str, **kwargs) -> Policy:
    """A policy by name (see ``POLICIES``)."""
    try:
        return POLICIES[name](**kwargs)
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {sorted(POLICIES)}") from None
