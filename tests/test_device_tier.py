"""The device path's plan over a bounded swap tier (``device_tier``), on numpy: it replays
routing exactly as the host's slot table and the tier's rule do (same slots, same trades,
same reads, same rows dropped, same heat to the bit), and its moves keep every record in
one place, holding what its tables say."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_streaming.core.cache.device_plan import FREE, layer_arrays
from mlx_streaming.core.cache.device_tier import access_heat, bounded_reference, copy_reference
from mlx_streaming.core.cache.policy import POLICIES, make_policy
from mlx_streaming.core.cache.scored import WEIGHTS
from mlx_streaming.core.cache.slots import SlotCache
from mlx_streaming.planning.tiers import _SwapRows

E, K, S, R = 48, 6, 12, 14  # a tier of 14 rows beneath pools of 12: 22 records in files only


def skewed_routing(steps, seed=0, tokens=1):
    """Per step ``[tokens, K]`` distinct experts per token, skewed and drifting."""
    rng = np.random.default_rng(seed)
    hot = rng.permutation(E)
    w = 1.0 / (1 + np.arange(E)) ** 1.1
    for step in range(steps):
        order = np.roll(hot, step // 20)
        yield np.stack(
            [rng.choice(order, size=K, replace=False, p=w / w.sum()) for _ in range(tokens)]
        ).astype(np.uint32)


def loaded(policy: str, S: int = S):
    """The host's simulator and the device's arrays, as a load leaves them: slot ``s``
    holds expert ``s``, row ``h`` expert ``S + h``."""
    sim = SlotCache(E, S, make_policy(policy, E))
    sim.commit(sim.reserve(range(S), protect=np.zeros(0, np.int64)))
    rows = _SwapRows([0], S, R, E)
    arrays = layer_arrays(E, S, R)
    arrays["slot_of"][:], arrays["expert_in"][:] = sim.slot_of, sim.expert_in
    sim.flush()
    for name, a in sim.policy.state.items():
        arrays[name][...] = a
    arrays["counters"][FREE] = 0
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
