"""The device path's planning step over a bounded swap tier, as numpy references: what a
plan kernel must do when the tier holds fewer records than the pools leave out (the
design in benchmarks/RESULTS.md, "The design this opens"; the kernel is not built yet).

A layer call's slots are chosen as over a whole tier (``device_plan.plan_reference``:
the slot table and its ``Scored`` ranking); then the tier's one rule
(``tier_moves.plan_moves``) says where each record goes: a miss in the tier trades
places with its victim; a miss outside it is read from its file (through the engine's
request ring, ``io.ring``), its victim going out to the first empty row, else the row of
the tier's coldest record (``heat``: ``SlotCache.heat``'s decayed lookups, kept here in
the same arithmetic), which is dropped. The tier's state (``tier_arrays``) is handed
between host and device whole, as the slot table's is.

``ops``, what the kernel's copy blocks do, in this order: ``[brought, sent, reads, (row,
slot) * (brought + sent), (expert, slot) * reads]``: the first ``brought`` pairs trade a
row and a slot; the next ``sent`` copy a victim from its slot out to a row (its record
dropped); then each read's record comes from staging (request ring entry ``j`` for the
``j``-th read) into its slot. ``copy_reference`` moves numpy rows that way.
"""

from __future__ import annotations

import numpy as np

from ..io.tier_moves import plan_moves
from .device_plan import plan_reference
from .slots import HEAT_DECAY

HEAT_LIMIT, HEAT_SHIFT = 1e100, -332  # SlotCache.access: scaled down, exactly, past this


def tier_arrays(num_experts: int, rows: int) -> dict[str, np.ndarray]:
    """A layer's bounded tier on the host side: each expert's row (-1: a slot or its file
    only), each row's record (-1: empty) and when it was written, the decayed lookups per
    expert, their current weight, and the tier's clock."""
    return {
        "home": np.full(num_experts, -1, np.int32),
        "owner": np.full(rows, -1, np.int32),
        "stamp": np.zeros(rows, np.int64),
        "heat": np.zeros(num_experts, np.float64),
        "heat_w": np.ones(1, np.float64),
        "clock": np.zeros(1, np.int64),
    }


def access_heat(tier: dict[str, np.ndarray], experts) -> None:
    """One call's lookups of distinct ``experts`` into ``tier["heat"]``, to the bit as
    ``SlotCache.access`` adds them."""
    w = tier["heat_w"][0] / HEAT_DECAY
    heat = tier["heat"]
    for e in np.asarray(experts, np.int64).tolist():
        heat[e] += w
    if w > HEAT_LIMIT:
        heat[:] = np.ldexp(heat, HEAT_SHIFT)
        w = np.ldexp(w, HEAT_SHIFT)
    tier["heat_w"][0] = w


def bounded_reference(
    layer: int, arrays: dict[str, np.ndarray], tier: dict[str, np.ndarray], weights, ids
) -> tuple[np.ndarray, np.ndarray]:
    """One planning step over a bounded tier, updating ``arrays`` (``layer_arrays``)
    and ``tier`` (``tier_arrays``) in place: ``(slot of each routed id, ops)`` (the
    module's text says what ``ops`` holds)."""
    held = arrays["expert_in"].tolist()  # each slot's record before the call: the victims
    slots, fills = plan_reference(arrays, weights, ids)
    access_heat(tier, np.unique(np.asarray(ids, np.int64)))
    tables = [tier["home"].tolist(), held, tier["owner"].tolist(), tier["stamp"].tolist()]
    moves = plan_moves(
        layer, tables, int(tier["clock"][0]), fills[1::2], fills[2::2],
        lambda: tier["heat"].tolist(), True,
    )  # fmt: skip
    home, _, owner, stamp = moves.tables
    tier["home"][:], tier["owner"][:], tier["stamp"][:] = home, owner, stamp
    tier["clock"][0] = moves.clock
    ops = [moves.brought, len(moves.trades) - moves.brought, len(moves.reads)]
    ops += [v for pair in [*moves.trades, *moves.reads] for v in pair]
    return slots, np.array(ops, np.int32)


def copy_reference(ops, rows: np.ndarray, pool: np.ndarray, files: np.ndarray) -> None:
    """``ops`` on numpy rows of whole records (``rows [R, stride]`` the tier, ``pool [S,
    stride]``, ``files [E, stride]`` every record as its file holds it), for tests."""
    brought, sent, reads = (int(v) for v in ops[:3])
    pairs = np.asarray(ops[3 : 3 + 2 * (brought + sent)], np.int64).reshape(-1, 2)
    for i, (r, s) in enumerate(pairs):
        if i < brought:
            rows[r], pool[s] = pool[s].copy(), rows[r].copy()
        else:
            rows[r] = pool[s]
    start = 3 + 2 * (brought + sent)
    for e, s in np.asarray(ops[start : start + 2 * reads], np.int64).reshape(-1, 2):
        pool[s] = files[e]
