"""Eviction policies: which resident expert of a layer gives up its slot.

A policy sees one layer's lookups (``access``, once per layer call, with the call's
distinct experts), admissions (``insert``) and removals (``remove``), and names victims
among resident experts outside ``protect``. It knows nothing of slots, devices or files,
so the live store and the trace simulator run the very same objects. Time is counted in
lookups of the layer.

* ``lru``: least recently used.
* ``lfu``: least frequently used with exponential aging (decayed counts kept for every
  expert, resident or not, so a returning expert keeps its history).
* ``arc``: adaptive replacement cache (recency and frequency lists with ghosts).
* ``s3fifo``: small FIFO for new arrivals, main FIFO with reinsertion, ghost queue.
* ``predictive``: scores each expert's chance of being needed soon from its recency,
  its counts over several windows, an aged count and the layer's expert-to-expert
  transitions between consecutive tokens (learned online), and evicts the lowest.
* ``belady``: the offline optimum (needs the future; simulation only).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .base_policy import Policy, Scored
from .predictive import Predictive


class LRU(Policy):
    """Least recently used."""

    name = "lru"

    def __init__(self, num_experts: int = 0, capacity: int | None = None):
        super().__init__(num_experts, capacity)
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


class LFU(Scored):
    """Least frequently used, counts aged by ``decay`` per lookup of the layer."""

    name = "lfu"

    def __init__(self, num_experts: int, capacity: int | None = None, decay: float = 0.95):
        super().__init__(num_experts, capacity)
        self.decay = decay
        self.count = np.zeros(num_experts)
        self.stamp = np.zeros(num_experts, dtype=np.int64)

    def _observe(self, idx):
        self.count[idx] = self.count[idx] * self.decay ** (self.t - self.stamp[idx]) + 1
        self.stamp[idx] = self.t

    def scores(self):
        return self.count * self.decay ** (self.t - self.stamp)


class ARC(Policy):
    """Adaptive replacement cache (Megiddo & Modha), victims chosen on demand."""

    name = "arc"

    def __init__(self, num_experts: int = 0, capacity: int | None = None):
        super().__init__(num_experts, capacity)
        self.t1: OrderedDict[int, None] = OrderedDict()  # seen once recently
        self.t2: OrderedDict[int, None] = OrderedDict()  # seen at least twice
        self.b1: OrderedDict[int, None] = OrderedDict()  # ghosts of t1
        self.b2: OrderedDict[int, None] = OrderedDict()  # ghosts of t2
        self.p = 0.0
        self._fresh: set[int] = set()  # inserted by this lookup: not a second use

    def access(self, experts):
        for e in experts:
            if e in self._fresh:
                continue
            if e in self.t1:
                del self.t1[e]
                self.t2[e] = None
            elif e in self.t2:
                self.t2.move_to_end(e)
        self._fresh.clear()

    def insert(self, expert):
        self._fresh.add(expert)
        if expert in self.b1:
            self.p = min(self.c, self.p + max(len(self.b2) / max(len(self.b1), 1), 1))
            del self.b1[expert]
            self.t2[expert] = None
        elif expert in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / max(len(self.b2), 1), 1))
            del self.b2[expert]
            self.t2[expert] = None
        else:
            self.t1[expert] = None
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.c:
                ghost.popitem(last=False)

    def remove(self, expert):
        if self.t1.pop(expert, 0) is None:
            self.b1[expert] = None
        elif self.t2.pop(expert, 0) is None:
            self.b2[expert] = None

    def victims(self, n, protect):
        out = []
        t1 = [e for e in self.t1 if e not in protect]
        t2 = [e for e in self.t2 if e not in protect]
        while len(out) < n and (t1 or t2):
            if t1 and (len(self.t1) > self.p or not t2):
                out.append(t1.pop(0))
            else:
                out.append(t2.pop(0))
        return out


class S3FIFO(Policy):
    """S3-FIFO (Yang et al. 2023): new experts enter a small FIFO; those used again move
    to the main FIFO, whose used entries get another round; a ghost queue remembers
    recent evictions from the small FIFO."""

    name = "s3fifo"

    def __init__(self, num_experts: int = 0, capacity: int | None = None, small: float = 0.1):
        super().__init__(num_experts, capacity)
        self.small_cap = max(1, round(small * self.c))
        self.small: OrderedDict[int, None] = OrderedDict()
        self.main: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}
        self._fresh: set[int] = set()

    def access(self, experts):
        for e in experts:
            if e in self.freq and e not in self._fresh:
                self.freq[e] = min(self.freq[e] + 1, 3)
        self._fresh.clear()

    def insert(self, expert):
        self._fresh.add(expert)
        self.freq[expert] = 0
        if expert in self.ghost:
            del self.ghost[expert]
            self.main[expert] = None
        else:
            self.small[expert] = None

    def remove(self, expert):
        self.freq.pop(expert, None)
        if self.small.pop(expert, 0) is None:
            self.ghost[expert] = None
            while len(self.ghost) > self.c:
                self.ghost.popitem(last=False)
        else:
            self.main.pop(expert, None)

    def victims(self, n, protect):
        out: list[int] = []
        small, main = list(self.small), list(self.main)
        freq = dict(self.freq)
        budget = 6 * (len(small) + len(main)) + n  # counts drain within 4 rounds
        while len(out) < n and (small or main) and budget > 0:
            budget -= 1
            if small and (len(small) >= self.small_cap or not main):
                e = small.pop(0)
                if e in protect:
                    main.append(e)
                elif freq.get(e, 0) > 0:
                    main.append(e)  # used again while small: promote
                else:
                    out.append(e)
            else:
                e = main.pop(0)
                if e in protect or freq.get(e, 0) > 0:
                    freq[e] = max(freq.get(e, 0) - 1, 0)
                    main.append(e)
                else:
                    out.append(e)
        return out


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
        cand = [e for e in self.resident if e not in protect]
        nxt = self.next_use[min(self.t + 1, len(self.next_use) - 1)]
        cand.sort(key=lambda e: -nxt[e])
        return cand[:n]


POLICIES = {"lru": LRU, "lfu": LFU, "arc": ARC, "s3fifo": S3FIFO, "predictive": Predictive}
DEFAULT_POLICY = "predictive"  # best on held-out traces (benchmarks/RESULTS.md)


def make_policy(name: str, num_experts: int = 0, capacity: int | None = None, **kw) -> Policy:
    """A policy by name (see ``POLICIES``) for a layer of ``num_experts`` experts."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {sorted(POLICIES)}")
    return cls(num_experts, capacity, **kw)
