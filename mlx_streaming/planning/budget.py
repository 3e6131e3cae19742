"""Memory budgets: the one formula from a budget (or slot count) to slots per layer, and
where a streamed model's memory goes."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import numpy as np

from ..core.cache.pool import default_slots
from ..core.format import ALIGN, ExpertMeta, LayerLayout
from .allocate import climb


class TooSmall(ValueError):
    """A budget or memory that cannot hold one token's experts in every MoE layer."""


def slot_bytes(layout: LayerLayout) -> int:
    """Device bytes one slot of a layer laid out as ``layout`` takes (its parts, no
    record padding)."""
    return sum(p.nbytes for p in layout.parts)


def pool_slots(slots: int, num_experts: int, zero_slot: bool) -> int:
    """Slots a pool allocates: ``slots``, plus the zero slot of a pool short of its
    layer's ``num_experts`` (as ``FileExpertStore`` makes them)."""
    return slots + int(zero_slot and slots < num_experts)


def slots_for_share(share: float, num_experts: int, top_k: int) -> int:
    """Slots that hold at least ``share`` of a layer's ``num_experts``: rounded up, never
    below ``top_k`` (a share of 0 is top-k) nor above every expert. The one rule from a
    residency to slots."""
    if not 0 <= share <= 1:
        raise ValueError(f"a share of experts is within [0, 1], not {share!r}")
    return min(num_experts, max(top_k, math.ceil(round(share * num_experts, 6))))


def default_zero_slot(backend: str | None = None) -> bool:
    """Whether pools get a zero slot by default on ``backend`` (default: this machine's)
    (``Runtime.zero_slot``: on GPU backends, where rows are masked)."""
    from ..core.options import StreamConfig
    from ..core.runtime import pool_zero_slot

    return pool_zero_slot(StreamConfig(), backend)


@dataclass
class PoolShape:
    """What budgets need of a model: each MoE layer's bytes per slot and expert count,
    and top-k. ``layers`` are the model's layer indices (the keys of the plan)."""

    slot_bytes: list[int]
    num_experts: list[int]
    top_k: int
    layers: list[int] = field(default_factory=list)
    strides: list[int] = field(default_factory=list)  # bytes per record on disk

    def __post_init__(self):
        if isinstance(self.num_experts, int):
            self.num_experts = [self.num_experts] * len(self.slot_bytes)
        if not self.layers:
            self.layers = list(range(len(self.slot_bytes)))
        if not self.strides:  # a record's parts padded, at least: a page apiece
            self.strides = [-(-b // ALIGN) * ALIGN for b in self.slot_bytes]

    @classmethod
    def from_meta(cls, meta: ExpertMeta) -> PoolShape:
        return cls.from_layouts(meta.layers, meta.top_k)

    @classmethod
    def from_layouts(cls, layouts: dict, top_k: int) -> PoolShape:
        """The shape of records laid out as ``layouts`` (MoE layer -> ``LayerLayout``)."""
        layers = sorted(layouts)
        return cls(
            [slot_bytes(layouts[li]) for li in layers],
            [layouts[li].num_experts for li in layers],
            top_k,
            layers,
            [layouts[li].stride for li in layers],
        )

    def pool_bytes(self, slots: dict[int, int], zero_slot: bool) -> int:
        """Bytes of pools of ``slots`` (model layer -> slots)."""
        return sum(
            pool_slots(slots[li], e, zero_slot) * b
            for li, e, b in zip(self.layers, self.num_experts, self.slot_bytes)
            if li in slots
        )


@dataclass
class BudgetPlan:
    budget_bytes: int
    slots: dict[int, int]  # model layer -> slots
    pool_bytes: int
    zero_slot: bool

    @property
    def default_slots(self) -> int:
        return min(self.slots.values())

    def to_json(self) -> dict:
        return {
            "budget_bytes": self.budget_bytes,
            "pool_bytes": self.pool_bytes,
            "zero_slot": self.zero_slot,
            "slots": {str(k): v for k, v in sorted(self.slots.items())},
        }


def plan_budget(
    shape: PoolShape | ExpertMeta, budget_gb: float, zero_slot: bool | None = None
) -> BudgetPlan:
    """Slots per layer so that all pools together fit ``budget_gb`` (10**9 bytes).

    Every layer gets top-k slots; the rest of the budget goes out in equal shares, the
    remainder a slot at a time to the layers holding the fewest. A layer's zero slot
    (``zero_slot``, default: as ``FileExpertStore`` makes pools here) is counted while
    the layer is short of its experts. (Per-layer shares from routing: ``profiles``.)

    Raises:
        ValueError: the budget is not a positive number; ``TooSmall``, one that cannot
            hold one token's experts in every layer.
    """
    if not isinstance(budget_gb, (int, float)) or not math.isfinite(budget_gb) or budget_gb <= 0:
        raise ValueError(f"budget_gb must be a positive number of GB, got {budget_gb!r}")
    shape = PoolShape.from_meta(shape) if isinstance(shape, ExpertMeta) else shape
    zero = default_zero_slot() if zero_slot is None else bool(zero_slot)
    budget, k = int(budget_gb * 1e9), shape.top_k
    sb, ne, L = shape.slot_bytes, shape.num_experts, len(shape.layers)
    floor = sum(pool_slots(k, ne[i], zero) * sb[i] for i in range(L))
    if budget < floor:
        raise TooSmall(
            f"budget {budget_gb} GB is below the {floor / 1e9:.4g} GB that one token's "
            f"{k} experts in each of {L} MoE layers need; raise --budget-gb to at least "
            f"{floor / 1e9:.4g}"
        )
    rounds = min((budget - floor) // sum(sb), min(ne) - k - 1)  # whole rounds at once
    start = [max(0, rounds)] * L

    def cost(i, a):
        return pool_slots(k + a, ne[i], zero) * sb[i]

    harmonic = np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, max(ne) + 1))])

    def value(i, a):  # a slot is worth less the more slots its layer holds
        return harmonic[k + a] - harmonic[k]

    at = climb([e - k + 1 for e in ne], cost, value, budget, start)
    slots = {li: k + a for li, a in zip(shape.layers, at)}
    return BudgetPlan(budget, slots, shape.pool_bytes(slots, zero), zero)


def store_slots(
    meta: ExpertMeta,
    slots: int | None = None,
    budget_gb: float | None = None,
    layer_caps: dict[int, int] | None = None,
    zero_slot: bool | None = None,
    whole: list[int] = (),
) -> tuple[int, dict | None]:
    """``(capacity, layer_caps)`` for a ``FileExpertStore``: from ``budget_gb`` through
    ``plan_budget`` (pools with or without their ``zero_slot``; a pool profile's
    ``layer_caps`` scaled to fill the budget in their proportions, its ``whole`` layers
    kept whole), else ``slots`` (default: half the experts, at least top-k) with a pool
    profile's ``layer_caps``."""
    if slots is not None and budget_gb is not None:
        raise ValueError("give either slots or budget_gb, not both")
    if budget_gb is not None:
        plan = plan_budget(meta, budget_gb, zero_slot=zero_slot)
        if layer_caps:
            caps = scale_profile(meta, layer_caps, plan, whole)
            return min(caps.values()), caps
        return plan.default_slots, plan.slots
    if slots is None:
        slots = default_slots(meta)
    return slots, layer_caps


def scale_profile(
    meta: ExpertMeta, caps: dict[int, int], plan: BudgetPlan, whole: list[int] = ()
) -> dict[int, int]:
    """A pool profile's slots scaled by one factor, the largest whose pools fit
    ``plan``'s budget (each layer between top-k and its expert count; a layer the
    profile does not name weighs as in ``plan``). Of the ``whole`` layers (a profile's
    ``whole_layers``, in order) the most that leave the others top-k slots each stay
    whole."""
    shape = PoolShape.from_meta(meta)
    k, ne = shape.top_k, dict(zip(shape.layers, shape.num_experts))
    weight = {li: caps.get(li, plan.slots[li]) for li in shape.layers}
    asked = [li for li in whole if li in weight]
    whole = set()
    for li in asked:  # the longest prefix the budget holds with top-k for the others
        keep = whole | {li}
        least = {x: ne[x] if x in keep else k for x in weight}
        if shape.pool_bytes(least, plan.zero_slot) > plan.budget_bytes:
            break
        whole = keep
    if len(whole) < len(asked):
        print(
            f"pool profile: {plan.budget_bytes / 1e9:.3f} GB keeps {len(whole)} of layers "
            f"{asked} whole (top-k slots for the others); the rest scale",
            file=sys.stderr,
        )

    def at(f: float) -> dict[int, int]:
        return {
            li: ne[li] if li in whole else min(ne[li], max(k, round(f * w)))
            for li, w in weight.items()
        }

    lo, hi = 0.0, max(ne.values()) / min(weight.values())
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (
            (mid, hi)
            if shape.pool_bytes(at(mid), plan.zero_slot) <= plan.budget_bytes
            else (lo, mid)
        )
    return at(lo)


@dataclass
class MemoryPlan:
    """Where a streamed model's memory goes: trunk, expert pools, MLX's buffer cache cap,
    the swap tier's host memory (the KV cache grows with the context on top of these)."""

    trunk_bytes: int
    pool_bytes: int
    cache_limit_bytes: int
    swap_tier_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.trunk_bytes + self.pool_bytes + self.cache_limit_bytes + self.swap_tier_bytes

    def to_json(self) -> dict:
        tier = (
            {"swap_tier_gb": round(self.swap_tier_bytes / 1e9, 3)} if self.swap_tier_bytes else {}
        )
        return {
            "trunk_gb": round(self.trunk_bytes / 1e9, 3),
            "pools_gb": round(self.pool_bytes / 1e9, 3),
            "mlx_cache_limit_gb": round(self.cache_limit_bytes / 1e9, 3),
            **tier,
            "total_gb_before_kv": round(self.total_bytes / 1e9, 3),
        }


def default_cache_limit(pool_bytes: int) -> int:
    """MLX keeps freed buffers for reuse unless capped; cap them at 5% of the pools
    (at least 32 MB) so that memory the budget gives the experts stays theirs."""
    return max(32 << 20, pool_bytes // 20)


AUTO_HEADROOM_SHARE = 0.10  # of the available memory, left to the system and other work
AUTO_MIN_HEADROOM = 256 << 20
MARGIN_BYTES = 32 << 20  # what the budget leaves out: staging, reader buffers, slack


def pools_within(room: int) -> int:
    """The largest pools that fit ``room`` with what ``load`` adds to them: the margin
    and MLX's buffer-cache cap (``default_cache_limit``: 5% of the pools, at least its
    floor). At most 0 when nothing is left."""
    room -= MARGIN_BYTES
    return min(int(room / 1.05), room - default_cache_limit(0))


def kv_bytes_measured(model, step: int = 256) -> list[int] | None:
    """The KV cache one more token adds to each of ``model``'s prompt caches (one per
    layer in mlx-lm), measured on lazy graphs (nothing is evaluated, so no weight is
    loaded and no cache allocated): the caches' bytes after ``step + 1`` tokens less
    after 1, over ``step`` (mlx-lm allocates a cache ``step`` positions at a time).
    Right for every cache layout mlx-lm has (the latent caches of DeepSeek-V3's
    attention, hybrid models' fixed states, sliding windows); None where the model
    cannot be traced so."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    sizes = []
    try:
        for n in (1, step + 1):
            cache = make_prompt_cache(model)
            model(mx.zeros((1, n), mx.int32), cache=cache)
            sizes.append([c.nbytes for c in cache])
    except Exception:  # noqa: BLE001 - any model the trace does not suit: the formula
        return None
    per_layer = [max(0, (b - a) // step) for a, b in zip(*sizes)]
    return per_layer if sum(per_layer) > 0 else None


def kv_bytes(model) -> list[int]:
    """The KV cache one token adds, per layer of ``model`` (lazily loaded): measured
    (``kv_bytes_measured``), or where the model cannot be traced, the config's formula
    (``kv_bytes_per_token``)."""
    import dataclasses

    import mlx.core as mx
    from mlx.utils import tree_flatten

    n = len(model.layers)
    kv = kv_bytes_measured(model)
    if kv is not None:
        return kv if len(kv) == n else [sum(kv) // n] * n  # caches not one per layer
    args = model.args if isinstance(model.args, dict) else dataclasses.asdict(model.args)
    floats = [v for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    per_layer = kv_bytes_per_token(args, floats[0].dtype.size if floats else 2)
    return per_layer if len(per_layer) == n else [sum(per_layer) // n] * n


def kv_bytes_per_token(args: dict, dtype_bytes: int) -> list[int]:
    """The KV cache one token adds to each layer, from an mlx-lm model's config (where
    ``kv_bytes_measured`` cannot trace the model): multi-head latent attention caches
    every head's keys and values (DeepSeek-V2; DeepSeek-V3's caches its latent only, so
    this is an upper bound there); others ``2 x kv heads x head dim`` per attention
    layer (on hybrid models such as Qwen3-Next, layer ``i`` attends when ``i + 1`` is a
    multiple of ``full_attention_interval``; the others keep fixed-size states)."""
    layers = args["num_hidden_layers"]
    if args.get("kv_lora_rank"):
        width = args["num_attention_heads"] * (
            args["qk_nope_head_dim"] + args["qk_rope_head_dim"] + args["v_head_dim"]
        )
        return [width * dtype_bytes] * layers
    heads = args.get("num_key_value_heads") or args["num_attention_heads"]
    head_dim = args.get("head_dim") or args["hidden_size"] // args["num_attention_heads"]
    every = args.get("full_attention_interval") or 1
    return [2 * heads * head_dim * dtype_bytes * ((i + 1) % every == 0) for i in range(layers)]


@dataclass
class AutoBudget:
    """``budget_gb="auto"``: the pools get what the machine has left."""

    budget_bytes: int
    total: int
    available: int
    trunk: int
    kv: int
    context: int
    headroom: int
    cache_cap: int
    where: str = "machine"  # whose memory: the machine's, or (CUDA) the GPU's

    def why(self) -> str:
        gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
        return (
            f"--budget-gb auto: {gb(self.budget_bytes)} for the expert pools = "
            f"{gb(self.available)} available - trunk {gb(self.trunk)} - KV cache for "
            f"{self.context} tokens {gb(self.kv)} - MLX's buffer cache {gb(self.cache_cap)} - "
            f"headroom {gb(self.headroom + MARGIN_BYTES)} ({self.where} {gb(self.total)})"
        )


def auto_budget(
    trunk: int, kv_per_token: int, context: int, total: int, available: int,
    where: str = "machine",
) -> AutoBudget:  # fmt: skip
    """The largest pool budget whose peak (trunk + pools + KV for ``context`` tokens +
    MLX's buffer-cache cap + the margin) fits the available memory less a headroom; never
    more than physical memory.

    Raises:
        ValueError: the machine cannot hold the trunk and the KV cache (says how much
            is missing and what to change).
    """
    available = min(available, total)
    headroom = max(AUTO_MIN_HEADROOM, int(AUTO_HEADROOM_SHARE * available))
    kv = kv_per_token * context
    pools = pools_within(available - trunk - kv - headroom)
    if pools <= 0:
        raise ValueError(
            f"--budget-gb auto: this {where} has {available / 1e9:.2f} GB available; the "
            f"trunk needs {trunk / 1e9:.2f} GB and the KV cache for {context} tokens "
            f"{kv / 1e9:.2f} GB, plus {(headroom + MARGIN_BYTES) / 1e9:.2f} GB of headroom: "
            "nothing is left for expert pools; free memory, lower --context, or pass "
            "--budget-gb explicitly"
        )
    return AutoBudget(pools, total, available, trunk, kv, context, headroom,
                      default_cache_limit(pools), where)  # fmt: skip
