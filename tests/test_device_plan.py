"""The device path's planning step (``device_plan``): its numpy reference replays routing
exactly as the host's slot table and policy do (same hits, same victims, same slots, same
ranking state), for every policy; the CUDA kernel is checked against this reference in
``tests/test_cuda.py``."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_streaming.core.cache.device_plan import (
    EVICTIONS,
    HITS,
    MISSES,
    layer_arrays,
    plan_reference,
    table_to_arrays,
)
from mlx_streaming.core.cache.policy import POLICIES, make_policy
from mlx_streaming.core.cache.scored import WEIGHTS
from mlx_streaming.core.cache.slots import SlotCache


def skewed_routing(E, k, steps, tokens=1, seed=0):
    """Per step ``[tokens, k]`` distinct experts per token, skewed and drifting."""
    rng = np.random.default_rng(seed)
    hot = rng.permutation(E)
    w = 1.0 / (1 + np.arange(E)) ** 1.2
    for step in range(steps):
        order = np.roll(hot, step // 25)
        yield np.stack(
            [rng.choice(order, size=k, replace=False, p=w / w.sum()) for _ in range(tokens)]
        ).astype(np.uint32)


def handed_over(cache: SlotCache) -> dict:
    """The device's arrays as ``DevicePath.to_device`` fills them from a slot table."""
    arrays = layer_arrays(cache.num_experts, cache.capacity)
    table_to_arrays(arrays, cache)
    return arrays


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("pins,tokens", [(0, 1), (2, 1), (0, 3)])
def test_reference_equals_the_simulator(policy, pins, tokens):
    E, k, cap = 32, 4, 12
    sim = SlotCache(E, cap, make_policy(policy, E))
    pinned = np.arange(pins)
    sim.commit(sim.reserve(pinned, np.zeros(0, np.int64)))
    sim.pinned = set(pinned.tolist())
    for ids in skewed_routing(E, k, 20, tokens, seed=1):  # some history first
        sim.lookup(np.unique(ids))
    sim.flush()
    arrays = handed_over(sim)
    before = sim.stats.hits, sim.stats.misses, sim.stats.evictions
    for ids in skewed_routing(E, k, 300, tokens, seed=2):
        slots, fills = plan_reference(arrays, WEIGHTS[policy], ids)
        placed = sim.lookup(np.unique(ids))
        want = [len(placed)] + [v for e, s, _ in placed for v in (e, s)]
        assert fills.tolist() == want
        assert np.array_equal(slots, sim.slot_of[ids.astype(np.int64)])
    sim.flush()
    ctr = arrays["counters"]
    got = (ctr[HITS], ctr[MISSES], ctr[EVICTIONS])
    assert got == tuple(a - b for a, b in zip((sim.stats.hits, sim.stats.misses,
                                               sim.stats.evictions), before))  # fmt: skip
    assert np.array_equal(arrays["slot_of"], sim.slot_of)
    assert np.array_equal(arrays["expert_in"], sim.expert_in)
    for name, a in sim.policy.state.items():
        assert np.array_equal(arrays[name], a), name


def test_the_plan_kernel_reads_its_pointers_and_counters_only_by_name():
    """The kernel's view of ``p`` and of the counters is generated from ``POINTERS``, the
    arrays' dtypes and ``COUNTERS``; its hand-written body indexes neither by a literal,
    so a reordering on the host cannot silently disagree with the device."""
    import re

    from mlx_streaming.core.cache.device_plan import COUNTERS, POINTERS
    from mlx_streaming.core.cache.device_tier import TIER_PLAN
    from mlx_streaming.core.cache.plan_kernel import _PLAN_BODY, PLAN

    _PLAN_BODY = _PLAN_BODY.replace("TIER_PLAN", TIER_PLAN)

    assert not re.findall(r"\bp\[\d+\]", _PLAN_BODY)
    assert not re.findall(r"\bctr\s*(?:\[\s*\d|\+\s*\d)", _PLAN_BODY)
    assert len(re.findall(r"= \((?:const )?[a-z ]+\*\)p\[(\d+)\];", PLAN)) == len(POINTERS)
    used = set(re.findall(r"\bctr\s*(?:\[|\+)\s*([A-Z_]+)", _PLAN_BODY))
    assert used == set(COUNTERS), used ^ set(COUNTERS)  # each counter kept on the device


def test_no_kernel_declares_its_own_inputs_or_outputs():
    """MLX declares a CUDA kernel's inputs and outputs by name, so a source that declares
    one again fails to compile, and only on a CUDA machine (``prev`` did, 2026-12-04):
    the check refuses such a kernel on any machine, and both kernels pass it."""
    from mlx_streaming.core.cache.plan_kernel import PLAN, PLAN_NAMES
    from mlx_streaming.core.io.device_reader import _FILL, FILL_NAMES
    from mlx_streaming.core.io.kernels import check_names

    check_names("mlxs_plan", PLAN, [*PLAN_NAMES[0], *PLAN_NAMES[1]])
    check_names("mlxs_fill", _FILL, [*FILL_NAMES[0], *FILL_NAMES[1]])
    with pytest.raises(ValueError, match=r"mlxs_plan: \['nprev'\]"):
        check_names("mlxs_plan", PLAN, ["ids", "nprev"])


@pytest.mark.parametrize("policy", ["lru", "predictive"])
def test_a_swap_tier_holds_every_record_once(policy):
    """The swap tier's bookkeeping (``plan_reference(swap=True)``) against its data
    movement (``fill_reference``, the kernel's ``mlxs_copy`` on numpy): a pool full from
    load and a tier of the other ``E - S`` records, every miss trading places with its
    victim. After each call every slot holds the record its table names, every other
    expert's home holds its record, and the homes are the tier's slots, each once."""
    from mlx_streaming.core.io.device_reader import fill_reference

    E, k, cap, pins = 32, 4, 12, 2
    records = np.random.default_rng(3).integers(0, 256, (E, 40), dtype=np.uint8)
    arrays = layer_arrays(E, cap)
    arrays["slot_of"][:cap], arrays["expert_in"][:] = np.arange(cap), np.arange(cap)
    arrays["resident"][:cap], arrays["pinned"][:pins] = 1, 1
    arrays["home"][cap:] = np.arange(E - cap)
    pool, tier = records[:cap].copy(), records[cap:].copy()
    traded = 0
    for ids in skewed_routing(E, k, 300, seed=4):
        slots, fills = plan_reference(arrays, WEIGHTS[policy], ids, swap=True)
        fill_reference(fills, tier, pool, swap=True)
        traded += int(fills[0])
        slot_of, home = arrays["slot_of"], arrays["home"]
        assert np.array_equal(pool, records[arrays["expert_in"]])
        assert np.array_equal(pool[slots], records[ids.astype(np.int64)])
        out = np.flatnonzero(slot_of < 0)
        assert np.array_equal(np.flatnonzero(home >= 0), out)
        assert sorted(home[out].tolist()) == list(range(E - cap))
        assert np.array_equal(tier[home[out]], records[out])
        assert (slot_of[:pins] >= 0).all()  # the pinned never leave
    assert traded == arrays["counters"][EVICTIONS] == arrays["counters"][MISSES] > 100
