"""The swap tier's one rule (``tier.SwapTier`` moves the bytes; ``planning.tiers``
simulates it): which tier rows and slots trade places, which misses are read from the
files, and the tables they leave."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass
class Moves:
    """A load's moves (``SwapTier.plan``): ``trades`` (tier row, slot) exchanged first,
    the first ``brought`` of them bringing a miss in (the rest send a victim out to a row
    whose record is dropped), then ``reads`` (expert, slot) from the files; the tables
    they leave, and the clock."""

    trades: list[tuple[int, int]]
    brought: int
    reads: list[tuple[int, int]]
    tables: tuple
    clock: int


class TierError(RuntimeError):
    """The swap tier cannot say where a record is (the message says why); the model must
    be loaded again."""


def plan_moves(layer: int, tables, clock: int, experts, slots, heat, partial: bool) -> Moves:
    """The swap tier's one rule, for the store (``SwapTier.plan``) and its simulator
    (``planning.tiers``): ``Moves`` that bring ``experts`` into pool ``slots`` of
    ``layer``, given its ``tables`` (lists: each expert's row or -1, each slot's expert,
    each row's record or -1, when each row was written), which it changes. A miss in the
    tier trades places with its victim; a miss outside it (a ``partial`` tier) is read
    from the files, and its victim goes to the first empty row, else to the coldest
    record's row (``heat()``: decayed lookups per expert; the oldest written of equals)
    that the call has not traded into, whose record is dropped; with none, it is dropped."""
    home, held, owner, stamp = tables
    trades, reads, later = [], [], []
    for e, s in zip(np.asarray(experts).tolist(), np.asarray(slots).tolist()):
        v, h = held[s], home[e]
        if h < 0 and v == e:
            continue  # its record is in its slot
        if h < 0 and not partial:
            raise TierError(
                f"layer {layer}: expert {e} is in neither the swap tier nor slot {s} "
                "(a defect: please report it); load the model again"
            )
        if h < 0:
            later.append((e, s, v))  # after the trades: rows they free are not taken
            continue
        clock += 1
        trades.append((h, s))
        home[e], held[s], owner[h], stamp[h] = -1, e, v, clock
        if v >= 0:
            home[v] = h
    brought, rows = len(trades), None
    for e, s, v in later:
        held[s] = -1  # its content unknown until the read lands (``_Reads``)
        reads.append((e, s))
        if v < 0 or not owner:
            continue  # no victim, or no tier: the victim is dropped
        if rows is None:  # once a call: the rows the victims take, in turn
            need = sum(v >= 0 for _, _, v in later)
            rows = iter(_victim_rows(owner, stamp, {h for h, _ in trades}, heat(), need))
        h = next(rows, -1)
        if h < 0:
            continue
        clock += 1
        trades.append((h, s))
        if owner[h] >= 0:
            home[owner[h]] = -1  # dropped: it is in its file
        home[v], owner[h], stamp[h] = h, v, clock
    return Moves(trades, brought, reads, (home, held, owner, stamp), clock)


def _victim_rows(owner, stamp, used: set, heat, n: int) -> list[int]:
    """The ``n`` rows a call's victims go to, in turn: the empty ones, then the coldest
    record's (``heat`` per expert), the oldest written first of equals (then the lowest
    row), leaving out the rows the call traded into. Taking one does not change how the
    rest rank (their records stay), so one ranking serves the whole call."""

    def rank(h):
        e = owner[h]
        return (0, 0.0, stamp[h], h) if e < 0 else (1, heat[e], stamp[h], h)

    return heapq.nsmallest(n, (h for h in range(len(stamp)) if h not in used), key=rank)


def bounded_rows(
    rest: dict[int, int], strides: dict[int, int], limit: int | None
) -> dict[int, int]:
    """Each layer's rows in a tier of at most ``limit`` bytes (None: whole), for the
    experts its pool does not hold (``rest``) and its records' ``strides``: every layer
    the same share, rounded down, for the store and its simulator alike."""
    full = sum(n * strides[li] for li, n in rest.items())
    share = 1.0 if limit is None or limit >= full else max(0.0, limit / max(1, full))
    return {li: int(n * share) for li, n in rest.items()}
