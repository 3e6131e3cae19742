"""The device path's plan over a bounded swap tier (``device_tier``), on numpy: it replays
routing exactly as the host's slot table and the tier's rule do (same slots, same trades,
same reads, same rows dropped, same heat to the bit), and its moves keep every record in
one place, holding what its tables say."""

from __future__ import annotations

import numpy as np
import pytest
import test_device_plan

from mlx_streaming.core.cache.device_plan import arrays_to_table, layer_arrays, table_to_arrays
from mlx_streaming.core.cache.device_tier import access_heat, bounded_reference, copy_reference
from mlx_streaming.core.cache.policy import POLICIES, make_policy
from mlx_streaming.core.cache.scored import WEIGHTS
from mlx_streaming.core.cache.slots import SlotCache
from mlx_streaming.planning.tiers import _SwapRows

E, K, S, R = 48, 6, 12, 14  # a tier of 14 rows beneath pools of 12: 22 records in files only


def skewed_routing(steps, seed=0, tokens=1):
    """Per step ``[tokens, K]`` distinct experts per token, skewed and drifting."""
    return test_device_plan.skewed_routing(E, K, steps, tokens, seed)


def loaded(policy: str, S: int = S):
    """The host's simulator and the device's arrays, as a load leaves them: slot ``s``
    holds expert ``s``, row ``h`` expert ``S + h``."""
    sim = SlotCache(E, S, make_policy(policy, E))
    sim.commit(sim.reserve(range(S), protect=np.zeros(0, np.int64)))
    rows = _SwapRows([0], S, R, E)
    arrays = layer_arrays(E, S, R)
    table_to_arrays(arrays, sim)
    arrays["home"][S : S + R], arrays["owner"][:] = np.arange(R), np.arange(S, S + R)
    return sim, rows, arrays


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("tokens", [1, 3])
def test_the_reference_replays_routing_as_the_host_does(policy, tokens):
    sim, rows, arrays = loaded(policy, S if tokens == 1 else 3 * K + 2)
    tier = arrays
    kinds = np.zeros(3, np.int64)
    for ids in skewed_routing(400, seed=1, tokens=tokens):
        slots, ops = bounded_reference(0, arrays, WEIGHTS[policy], ids)
        placed = sim.lookup(np.unique(ids))
        rows.keep(0, placed, [rows.find(0, int(e)) for e, _, _ in placed], sim.heat)
        assert np.array_equal(slots, sim.slot_of[ids.astype(np.int64)])
        home, held, owner, stamp = rows.tables[0]
        assert tier["home"].tolist() == home and tier["owner"].tolist() == owner
        assert tier["stamp"].tolist() == stamp and int(tier["clock"][0]) == rows.clock
        assert tier["heat"].tolist() == sim.heat and tier["heat_w"][0] == sim._weight
        assert arrays["expert_in"].tolist() == held == sim.expert_in.tolist()
        kinds += ops[:3]
    assert (kinds > 50).all(), kinds  # trades in, victims out to rows, and reads, each often


@pytest.mark.parametrize("policy", ["lru", "predictive"])
def test_the_moves_keep_every_record_in_one_place(policy):
    """``copy_reference`` applies each call's ops to bytes: after it every slot holds the
    record its table names, every row its owner's, no record is in two places, and a
    record left in neither is in its file only."""
    _, _, arrays = loaded(policy)
    files = np.random.default_rng(3).integers(0, 256, (E, 40), dtype=np.uint8)
    pool, rows = files[:S].copy(), files[S : S + R].copy()
    dropped = 0
    for ids in skewed_routing(400, seed=5):
        owners_before = set(arrays["owner"].tolist())
        slots, ops = bounded_reference(0, arrays, WEIGHTS[policy], ids)
        copy_reference(ops, rows, pool, files)
        slot_of, home, owner = arrays["slot_of"], arrays["home"], arrays["owner"]
        assert np.array_equal(pool[slots], files[ids.astype(np.int64)])
        assert np.array_equal(pool, files[arrays["expert_in"]])
        held = owner >= 0
        assert np.array_equal(rows[held], files[owner[held]])
        assert np.array_equal(home[owner[held]], np.flatnonzero(held))
        assert not ((home >= 0) & (slot_of >= 0)).any()  # never in a slot and a row
        assert (home >= 0).sum() == held.sum()
        dropped += len(owners_before - set(owner.tolist()) - set(arrays["expert_in"].tolist()))
    assert dropped > 50  # rows given over to victims, their records left in their files


def test_heat_is_the_slot_tables_to_the_bit_past_its_rescaling():
    """Past ~7,560 calls the weight passes 1e100 and both scale down by 2**-332."""
    sim, tier = SlotCache(E, S, make_policy("lru", E)), layer_arrays(E, S, R)
    rescaled = 0
    for ids in skewed_routing(8000, seed=7):
        d = np.unique(ids)
        w = tier["heat_w"][0]
        sim.access(d, 0)
        access_heat(tier, d)
        rescaled += tier["heat_w"][0] < w
    assert rescaled == 1
    assert tier["heat"].tolist() == sim.heat and tier["heat_w"][0] == sim._weight


def test_a_layer_handed_between_host_and_device_decides_as_the_host_alone():
    """The store's bounded tier (``io.tier.SwapTier``) and slot table, handed to the
    device's arrays and back (``tier_to_arrays``, ``arrays_to_tier``) between runs of
    calls: calls on the host (the slot table's lookup, the tier's ``plan`` and ``moved``,
    the reads landing) and on the device (``bounded_reference``) take the same slots and
    leave the same tables, stamps and heat as every call on the host."""
    from pathlib import Path

    from mlx_streaming.core.cache.device_tier import arrays_to_tier, tier_to_arrays
    from mlx_streaming.core.cache.pool import LayerPool
    from mlx_streaming.core.format import ExpertMeta, LayerLayout, Part
    from mlx_streaming.core.io.tier import SwapTier

    lay = LayerLayout(0, "mlp.experts", "f", E, 64, 64, (Part("w", 0, (64,), "uint8"),), {})
    meta = ExpertMeta(Path("."), {}, "x", (0,), E, K, {}, {0: lay})
    policy = "predictive"

    def store():
        cache = SlotCache(E, S, make_policy(policy, E))
        cache.commit(cache.reserve(range(S), protect=np.zeros(0, np.int64)))
        cache.flush()
        pools = {0: LayerPool(lay, S, "host")}
        tier = SwapTier(meta, pools, None, available=1 << 40, limit=R * lay.stride)
        tier.heat = lambda li: cache.heat
        return cache, tier

    def host_call(cache, tier, ids):
        placed = cache.lookup(np.unique(ids))
        moves = tier.plan(0, [e for e, _, _ in placed], [s for _, s, _ in placed])
        tier.moved(0, moves)
        for e, s in moves.reads:  # the reads land
            tier.held[0][s] = e
        return cache.slot_of[ids.astype(np.int64)].copy()

    alone, mixed = store(), store()
    assert alone[1].rows[0] == R and alone[1].partial
    arrays, on_device, kinds = layer_arrays(E, S, R), False, 0
    rng = np.random.default_rng(11)
    for step, ids in enumerate(skewed_routing(600, seed=4)):
        want = host_call(*alone, ids)
        cache, tier = mixed
        device = rng.random() < 0.7  # runs of calls on each side
        if device and not on_device:  # DevicePath.to_device's hand-over
            table_to_arrays(arrays, cache)
            tier_to_arrays(arrays, tier, cache, 0)
        if not device and on_device:  # to_host's
            arrays_to_table(arrays, cache)
            arrays_to_tier(arrays, tier, cache, 0)
        on_device, kinds = device, kinds + (device != on_device)
        if device:
            got, ops = bounded_reference(0, arrays, WEIGHTS[policy], ids)
        else:
            got = host_call(cache, tier, ids)
        assert np.array_equal(got, want), step
        if not device:
            for t in ("home", "held", "owner", "stamp"):
                assert np.array_equal(getattr(tier, t)[0], getattr(alone[1], t)[0]), (step, t)
            assert cache.heat == alone[0].heat and tier.clock == alone[1].clock, step
    assert kinds > 100  # handed over often
