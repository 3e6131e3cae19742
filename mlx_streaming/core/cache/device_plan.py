"""The device path's planning step: one layer call's lookup, victims and policy update,
and its numpy reference (the CUDA kernel that runs it is ``plan_kernel``'s).

The step does, on the device, what ``SlotCache.lookup`` does on the host with the layer's
``Scored`` policy: the call's distinct experts (sorted) are looked up in the slot table;
the misses take free slots (lowest first), then the slots of the ranking's victims
(resident, unpinned, outside the call; lowest score, then least recently used, then
lowest id), in ascending expert order; the ranking then sees the lookup. Its state is the
policy's own arrays (``scored.state_arrays``), copied to the device and back whole, so
the host and the device rank alike and hand the table to each other without losing
anything. The kernel's arithmetic is the reference's to the bit (round-to-nearest
intrinsics: no fused multiply-adds).

``plan_reference`` runs the same step on numpy arrays of the same layout; the CPU tests
replay routing through it against the host's simulator, the CUDA tests the kernel
against it.
"""

from __future__ import annotations

import numpy as np

from ..ids import DECODE_IDS, SLOT_IDS_NP
from .scored import AGE_POW, LOG1P_REC, WINDOWS, Scored, state_arrays

# counters kept on the device per layer: hits, misses, evictions, calls with misses,
# misses left without a slot (a defect), free slots left, blocks that gave up waiting for
# the plan or a read (a defect, or a read that failed; the kernel then traps), records
# read from the files (a bounded tier's misses outside it)
COUNTERS = ("HITS", "MISSES", "EVICTIONS", "MISSED_CALLS", "FAILED", "FREE", "LATE", "READS")
HITS, MISSES, EVICTIONS, MISSED_CALLS, FAILED, FREE, LATE, READS = range(len(COUNTERS))
N_COUNTERS = len(COUNTERS)


def layer_arrays(num_experts: int, capacity: int, rows: int = 0) -> dict[str, np.ndarray]:
    """The arrays of one layer's device state, host side: the slot table, each expert's
    home in a swap tier (read by the ``SWAP`` variants), a bounded tier's ``rows`` (each
    row's record, -1: empty, and when it was written; each expert's decayed lookups,
    ``SlotCache.heat``, their weight and the tier's clock: ``device_tier``), the counters
    and the ranking's state (the order of ``POINTERS``)."""
    return {
        "slot_of": np.full(num_experts, -1, np.int32),
        "expert_in": np.full(capacity, -1, np.int32),
        "home": np.full(num_experts, -1, np.int32),
        "owner": np.full(rows, -1, np.int32),
        "stamp": np.zeros(rows, np.int64),
        "heat": np.zeros(num_experts, np.float64),
        "heat_w": np.ones(1, np.float64),
        "clock": np.zeros(1, np.int64),
        "counters": np.zeros(N_COUNTERS, np.int64),
        **state_arrays(num_experts),
    }


def table_to_arrays(arrays: dict[str, np.ndarray], cache) -> None:
    """A layer's slot table and its policy's ranking state (``SlotCache``, its pending
    lookups told first) into its arrays, the device's image; the counters start anew,
    with its free slots."""
    cache.flush()
    arrays["slot_of"][:], arrays["expert_in"][:] = cache.slot_of, cache.expert_in
    for name, a in cache.policy.state.items():
        arrays[name][...] = a
    arrays["counters"][:] = 0
    arrays["counters"][FREE] = int((cache.expert_in < 0).sum())


def arrays_to_table(arrays: dict[str, np.ndarray], cache) -> None:
    """``table_to_arrays`` back, once the device is done with the layer."""
    for name, a in cache.policy.state.items():
        a[...] = arrays[name]
    cache.set_tables(arrays["slot_of"], arrays["expert_in"])


def scratch_arrays() -> dict[str, np.ndarray]:
    """A layer's scratch on the device, outside the state the host and the device hand
    over: the plan's fills list (read by the kernel's other blocks; a bounded tier's
    ``ops`` with each read's request number) and the flag they wait on with the count of
    blocks done (reset by the last block of each call)."""
    return {"fills": np.zeros(3 + 5 * DECODE_IDS, np.int32), "sync": np.zeros(4, np.int32)}


POINTERS = (
    *layer_arrays(1, 1),
    *("weights", "windows", "log1p_rec", "age_pow"),
    *scratch_arrays(),
)


def plan_reference(
    arrays: dict[str, np.ndarray], weights, ids: np.ndarray, swap: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """One planning step on ``arrays`` (a layer's, as ``layer_arrays``; updated in
    place) for routed ``ids``: ``(slot of each row, fills)``, fills ``[n, r0, s0, r1,
    s1...]``: the misses' records and the slots they go to.

    A record is the miss's expert id, or with ``swap`` its slot in the swap tier
    (``home``): the miss and its victim trade places, the victim taking the miss's home.
    """
    E = len(arrays["slot_of"])
    slot_of, expert_in, ctr = arrays["slot_of"], arrays["expert_in"], arrays["counters"]
    rank = Scored(E, weights=weights, native=False)
    rank.state.update({k: arrays[k] for k in rank.state})  # the arrays, not copies
    for k, a in rank.state.items():
        setattr(rank, f"_{k}" if k in ("t", "prev", "nprev", "pinned") else k, a)
    d = np.unique(ids.astype(np.int64))
    misses = d[slot_of[d] < 0]
    free = np.flatnonzero(expert_in < 0)[: len(misses)] if ctr[FREE] else np.zeros(0, np.int64)
    need = len(misses) - len(free)
    victims = rank.victims(need, d) if need > 0 else []
    ctr[FAILED] += need - len(victims) if need > 0 else 0
    targets = [*free.tolist(), *(int(slot_of[v]) for v in victims)]
    for v in victims:
        slot_of[v], arrays["resident"][v] = -1, 0
    placed = misses[: len(targets)]
    records = arrays["home"][placed].tolist() if swap else placed.tolist()
    assert min(records, default=0) >= 0, "a miss outside the swap tier"
    if swap:  # each victim takes the home of the miss that takes its slot
        arrays["home"][np.asarray(victims, np.int64)] = arrays["home"][placed[len(free) :]]
        arrays["home"][placed] = -1
    fills = [len(targets)]
    for e, r, s in zip(placed.tolist(), records, targets):
        expert_in[s], slot_of[e], arrays["resident"][e] = e, s, 1
        fills += [r, s]
    ctr[HITS] += len(d) - len(misses)
    ctr[MISSES] += len(targets)
    ctr[EVICTIONS] += len(victims)
    ctr[MISSED_CALLS] += len(misses) > 0
    ctr[FREE] -= len(free)
    rank.access(d)
    slots = np.maximum(slot_of[ids.astype(np.int64)], 0).astype(SLOT_IDS_NP)
    return slots, np.array(fills, np.int32)


def constants(weights) -> dict[str, np.ndarray]:
    """The arrays every layer's step reads and none writes."""
    return {
        "weights": np.asarray(weights, np.float64),
        "windows": np.asarray(WINDOWS, np.int64),
        "log1p_rec": LOG1P_REC,
        "age_pow": AGE_POW,
    }
