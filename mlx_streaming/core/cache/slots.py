"""One MoE layer's slot table: which expert sits in which slot, pins, and the policy.

Pure bookkeeping on the host, shared by the live store (which adds reads and device
writes) and the trace simulator, so both count hits, misses and evictions identically.
Placing experts is two-phase: ``reserve`` evicts the victims and marks the chosen slots
pending (the data is not there yet), the caller loads the data, then ``commit`` makes
the experts resident, or ``abort`` frees the slots if the load failed. A slot is never
marked resident before its data is in place, or (the device reader) before its copy is
queued ahead of every computation that reads it.

A lookup's policy update (``access``) is queued and applied before the policy's next
event (or by ``flush``), so the live store can run it while the device computes
instead of on a layer call's critical path; the policy sees the same events in the
same order either way.

A decode step's lookups are a handful of ids: the tables are read and written one id
at a time from Python lists, not by numpy's fancy or boolean indexing, whose code
(cold between layer calls, behind the model's compute) costs ~50 µs a call here against
~5 µs for the lists (``benchmarks/RESULTS.md``, "numpy's cold indexing").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .policy import Policy

# each call's lookups weigh 1/HEAT_DECAY times the last's in ``SlotCache.heat`` (a half-
# life of ~23 calls): a bounded swap tier drops its coldest record first, 2-7% fewer disk
# reads a token than the oldest written on held-out DS2 routing, 17-22% in a CPU run's
# window (benchmarks/probes/tier_heat.py; RESULTS, 2026-12-06)
HEAT_DECAY = 0.97
HEAT_LIMIT, HEAT_SHIFT = 1e100, -332  # past this weight, all scaled by 2**SHIFT (exactly)


@dataclass
class CacheStats:
    calls: int = 0  # layer calls that looked experts up
    hits: int = 0  # lookups of a resident expert (one per distinct expert per call)
    misses: int = 0
    evictions: int = 0

    @property
    def lookups(self) -> int:
        return self.hits + self.misses


Placement = tuple[int, int, int]  # (expert, slot, evicted expert or -1)


class SlotCache:
    """Slot table of one layer with ``capacity`` slots for ``num_experts`` experts."""

    def __init__(self, num_experts: int, capacity: int, policy: Policy):
        self.num_experts = num_experts
        self.capacity = capacity
        self._policy = policy
        self._later: list[list[int]] = []  # lookups not yet told to the policy
        # the tables are arrays (the native engine may fill slots in them too): a slot
        # is free when it holds no expert and none is being loaded into it
        self.slot_of = np.full(num_experts, -1, dtype=np.int32)
        self.expert_in = np.full(capacity, -1, dtype=np.int32)
        self.pinned_mask = np.zeros(num_experts, dtype=np.uint8)
        self.pin_count = 0  # how many are pinned (set with ``pinned``)
        self.pending: dict[int, int] = {}  # expert -> slot being loaded
        self.heat = [0.0] * num_experts  # decayed lookups per expert (only their order
        self._weight = 1.0  # counts: a call adds this, growing by 1/HEAT_DECAY a call)
        self.stats = CacheStats()
        self._complete = False  # seen complete: only an eviction or new tables undo it

    @property
    def policy(self) -> Policy:
        """The eviction policy, up to date with every lookup."""
        self.flush()
        return self._policy

    def flush(self) -> None:
        """Tell the policy the lookups queued by ``access``."""
        while self._later:
            self._policy.access(self._later.pop(0))

    @property
    def pinned(self) -> frozenset[int]:
        """Experts never evicted."""
        return frozenset(np.flatnonzero(self.pinned_mask).tolist())  # a copy: set it whole

    @pinned.setter
    def pinned(self, experts) -> None:
        self.pinned_mask[:] = 0
        self.pinned_mask[list(experts)] = 1
        self.pin_count = int(self.pinned_mask.sum())
        self._policy.pin(np.flatnonzero(self.pinned_mask))

    @property
    def resident(self) -> int:
        return int((self.expert_in >= 0).sum()) - len(self.pending)

    @property
    def whole(self) -> bool:
        """A slot for every expert: the layer can be held whole."""
        return self.capacity >= self.num_experts

    @property
    def complete(self) -> bool:
        """Every expert is resident: no lookup can miss (asked once per layer call)."""
        if not self._complete:
            self._complete = self.whole and self.resident == self.num_experts
        return self._complete

    def set_tables(self, slot_of: np.ndarray, expert_in: np.ndarray) -> None:
        """Replace the slot table (one kept elsewhere, e.g. on the device, comes back)."""
        self.slot_of[:], self.expert_in[:] = slot_of, expert_in
        self._complete = False

    def set_heat(self, heat, weight: float) -> None:
        """Replace ``heat`` and its call weight (kept on the device with a bounded tier)."""
        self.heat, self._weight = [float(h) for h in heat], float(weight)

    @property
    def heat_weight(self) -> float:
        """What the next call's lookups will add to ``heat``, over ``HEAT_DECAY``."""
        return self._weight

    def split(self, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(resident, not resident) among distinct ``experts``."""
        experts = np.asarray(experts)
        slot_of, res, miss = self.slot_of, [], []
        for e in experts.tolist():
            (res if slot_of[e] >= 0 else miss).append(e)
        return np.array(res, experts.dtype), np.array(miss, experts.dtype)

    def fits(self, experts: np.ndarray) -> bool:
        """Can all of ``experts`` be resident at once?"""
        if not self.pin_count:
            return len(experts) <= self.capacity
        outside_pins = len(self.pinned.difference(experts.tolist()))
        return len(experts) + outside_pins <= self.capacity

    def groups(self, experts: np.ndarray, counts: np.ndarray | None = None) -> list[np.ndarray]:
        """Split distinct ``experts`` into groups that each fit in the pool.

        Resident and pinned experts come first (nothing to load), misses last and hottest
        last, so the experts a chunk used most stay resident after it.
        """
        if self.fits(experts):
            return [experts]
        counts = np.ones(len(experts)) if counts is None else counts
        pinned = self.pinned_mask[experts].astype(bool)
        resident = self.slot_of[experts] >= 0
        key = np.where(pinned, 0, np.where(resident, 1, 2))
        order = np.lexsort((counts, key))
        pins, rest = experts[order][pinned[order]], experts[order][~pinned[order]]
        room = self.capacity - len(self.pinned)
        assert room > 0, "pins leave no slot for other experts"
        out = [np.concatenate([pins, rest[:room]])]
        out += [rest[i : i + room] for i in range(room, len(rest), room)]
        return out

    def reserve(self, experts, protect: np.ndarray, limit: int | None = None) -> list[Placement]:
        """Take slots for ``experts`` (not resident, not pending): free slots first, then
        the policy's victims outside ``protect`` (the call's experts, sorted) and the
        pins. Victims leave now; the slots are pending until ``commit``/``abort``. With
        ``limit``, place at most that many (best effort, for prefetch); otherwise all or
        raise."""
        want = [int(e) for e in experts]
        n = len(want) if limit is None else min(len(want), limit)
        free = [s for s, e in enumerate(self.expert_in.tolist()) if e < 0][:n]
        slots = [(s, -1) for s in free]
        if len(slots) < n:
            victims = self.policy.victims(n - len(slots), protect)
            if len(victims) < n - len(slots) and limit is None:
                raise RuntimeError(
                    f"cannot place {len(want)} experts: {self.capacity} slots, "
                    f"{len(self.pinned)} pinned, {len(protect)} in use by this call; give "
                    "the layer more slots (--slots, --budget-gb) or pin fewer experts"
                )
            slots += [(int(self.slot_of[v]), v) for v in victims]
        placed = [(e, s, v) for e, (s, v) in zip(want, slots)]
        for e, s, v in placed:
            if v >= 0:
                self._complete = False
                self.slot_of[v] = -1
                self._policy.remove(v)
                self.stats.evictions += 1
            self.expert_in[s] = e
            self.pending[e] = s
        return placed

    def commit(self, placements: list[Placement]) -> None:
        """Reserved experts are loaded: make them resident."""
        policy = self.policy
        for e, s, _ in placements:
            del self.pending[e]
            self.slot_of[e] = s
            policy.insert(e)

    def abort(self, placements: list[Placement], restore: bool = False) -> None:
        """A load failed: nothing new becomes resident; its slots become free, or with
        ``restore`` (the slots were not touched) hold their victims again."""
        for e, s, v in placements:
            if self.pending.pop(e, None) is not None:
                self._complete = False
                self.expert_in[s] = -1
                if restore and v >= 0:
                    self.expert_in[s], self.slot_of[v] = v, s
                    self._policy.insert(v)
                    self.stats.evictions -= 1

    def access(self, experts: np.ndarray, n_misses: int) -> None:
        """Count one lookup of distinct ``experts`` of which ``n_misses`` missed (the
        policy hears of it at its next event, or at ``flush``)."""
        self.stats.calls += 1
        self.stats.hits += len(experts) - n_misses
        self.stats.misses += n_misses
        ids = experts.tolist()
        self._later.append(ids)
        w = self._weight = self._weight / HEAT_DECAY
        heat = self.heat
        for e in ids:
            heat[e] += w
        if w > HEAT_LIMIT:  # scaled down long before a float overflows, by a power of two
            self.heat = [math.ldexp(h, HEAT_SHIFT) for h in heat]  # (exact: the order stays)
            self._weight = math.ldexp(w, HEAT_SHIFT)

    def lookup(self, experts: np.ndarray) -> list[Placement]:
        """Simulate one call: reserve, commit and count. Returns the placements."""
        _, misses = self.split(experts)
        placed = self.reserve(misses, experts)
        self.commit(placed)
        self.access(experts, len(misses))
        return placed
