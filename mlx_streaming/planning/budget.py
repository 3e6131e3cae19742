"""Turn a memory budget for expert pools into slots per layer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..core.format import ExpertMeta


def slot_bytes(meta: ExpertMeta, layer: int) -> int:
    """Device bytes one slot of ``layer`` takes (its parts, no record padding)."""
    return sum(p.nbytes for p in meta.layers[layer].parts)


@dataclass
class BudgetPlan:
    budget_bytes: int
    slots: dict[int, int]  # layer -> slots
    slot_bytes: dict[int, int]  # layer -> bytes per slot
    weights: dict[int, float] = field(default_factory=dict)
    zero_slot: bool = True  # pools short of their layer's experts hold one zero slot
    num_experts: dict[int, int] = field(default_factory=dict)  # layer -> experts

    @property
    def pool_bytes(self) -> int:
        return sum(pool_slots(self.slots[li], self.num_experts.get(li, 0), self.zero_slot)
                   * self.slot_bytes[li] for li in self.slots)

    @property
    def default_slots(self) -> int:
        return min(self.slots.values())

    def to_json(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "pool_bytes": self.pool_bytes,
                "slots": {str(k): v for k, v in sorted(self.slots.items())}}


def pool_slots(slots: int, num_experts: int, zero_slot: bool) -> int:
    """Slots a pool allocates: ``slots``, plus the zero slot of a pool short of its
    layer's ``num_experts`` (as ``FileExpertStore`` makes them)."""
    return slots + int(zero_slot and slots < num_experts)


def plan_budget(meta: ExpertMeta, budget_gb: float, weights: dict[int, float] | None = None,
                zero_slot: bool | None = None) -> BudgetPlan:
    """Slots per layer so that all pools together fit ``budget_gb`` (10**9 bytes).

    ``weights`` (per layer, e.g. how diverse its routing is) shares the slots above the
    top-k minimum out unevenly; without them every layer gets the same share.
    ``zero_slot``: count each pool's zero slot (default: as ``FileExpertStore`` does).

    Raises:
        ValueError: the budget is not a positive number, or cannot hold one token's
            experts in every layer.
    """
    if not isinstance(budget_gb, (int, float)) or not math.isfinite(budget_gb) or budget_gb <= 0:
        raise ValueError(f"budget_gb must be a positive number of GB, got {budget_gb!r}")
    budget = int(budget_gb * 1e9)
    layers = sorted(meta.layers)
    sb = {li: slot_bytes(meta, li) for li in layers}
    if zero_slot is None:
        from ..core.cache.pool import default_zero_slot

        zero_slot = default_zero_slot()
    k = meta.top_k
    ne = {li: meta.layers[li].num_experts for li in layers}
    floor = sum(pool_slots(k, ne[li], zero_slot) * sb[li] for li in layers)
    if budget < floor:
        raise ValueError(
            f"budget {budget_gb} GB is below the {floor / 1e9:.3f} GB that one token's "
            f"{k} experts in each of {len(layers)} MoE layers need; raise --budget-gb to at "
            f"least {math.ceil(floor / 1e7) / 100:.2f}"
        )
    slots = {li: k for li in layers}
    w = {li: float((weights or {}).get(li, 1.0)) for li in layers}
    left = budget - floor
    if weights is None:  # uniform: whole rounds at once, the remainder greedily below
        rounds = min(left // sum(sb.values()), min(ne.values()) - k - 1)
        if rounds > 0:
            for li in layers:
                slots[li] += rounds
            left -= rounds * sum(sb.values())

    def cost(li):  # the last slot of a layer also drops its zero slot
        n = slots[li] + 1
        return (pool_slots(n, ne[li], zero_slot) - pool_slots(slots[li], ne[li], zero_slot)) \
            * sb[li]
    # Greedy: give a slot to the layer with the most weight per slot held, while it fits.
    while True:
        cands = [li for li in layers if slots[li] < ne[li] and cost(li) <= left]
        if not cands:
            break
        li = max(cands, key=lambda i: (w[i] / slots[i], -i))
        left -= cost(li)
        slots[li] += 1
    return BudgetPlan(budget, slots, sb, w, bool(zero_slot), ne)


@dataclass
class MemoryPlan:
    """Where a streamed model's memory goes: trunk, expert pools, MLX's buffer cache cap
    (the KV cache grows with the context on top of these)."""

    trunk_bytes: int
    pool_bytes: int
    cache_limit_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.trunk_bytes + self.pool_bytes + self.cache_limit_bytes

    def to_json(self) -> dict:
        return {"trunk_gb": round(self.trunk_bytes / 1e9, 3),
                "pools_gb": round(self.pool_bytes / 1e9, 3),
                "mlx_cache_limit_gb": round(self.cache_limit_bytes / 1e9, 3),
                "total_gb_before_kv": round(self.total_bytes / 1e9, 3)}


def default_cache_limit(pool_bytes: int) -> int:
    """MLX keeps freed buffers for reuse unless capped; cap them at 5% of the pools
    (at least 32 MB) so that memory the budget gives the experts stays theirs."""
    return max(32 << 20, pool_bytes // 20)
