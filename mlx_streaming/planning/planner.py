"""What a memory budget buys, before running anything.

``plan`` replays a routing trace through each policy at each budget (the same slot
tables and policies the store uses) and predicts hit rate, miss bytes per token and
tok/s from a measured compute time and read bandwidth: ``1 / max(t_compute,
miss_bytes / B)`` when reads overlap compute, ``1 / (t_compute + miss_bytes / B)`` when
they do not. Budgets become slots through ``budget.plan_budget``, as in ``load``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..core.cache.policy import POLICIES
from .budget import PoolShape, default_zero_slot, plan_budget
from .simulate import p10_p90, simulate, static_hot
from .trace import RoutingTrace


@dataclass
class PlanRow:
    policy: str
    slots: int
    budget_gb: float
    hit_rate: float
    miss_bytes_per_token: float
    predicted_tok_per_s: float | None = None
    serial_tok_per_s: float | None = None
    pinned: int = 0
    layers: list = field(default_factory=list)
    window_tokens: int = 0
    # 10th and 90th percentiles over the stretches of window_tokens, what one run may see
    # (empty over fewer than 5 stretches)
    miss_bytes_per_token_p10_p90: list = field(default_factory=list)
    tok_per_s_p10_p90: list = field(default_factory=list)

    def to_json(self) -> dict:
        def rounded(v):
            return round(v, 4) if isinstance(v, float) else v

        return {k: [rounded(x) for x in v] if isinstance(v, list) else rounded(v)
                for k, v in asdict(self).items()}  # fmt: skip


def shared_layers(trace: RoutingTrace, shape: PoolShape) -> int:
    """How many MoE layers the trace and the model share (the first of each).

    Raises:
        ValueError: none, or the trace routes another count of experts than the model
            (recorded on another model).
    """
    L = min(len(shape.slot_bytes), trace.layers)
    if L == 0:
        raise ValueError("the trace and the model share no MoE layer")
    ne = max(shape.num_experts)
    if trace.num_experts != ne or trace.top_k != shape.top_k:
        raise ValueError(
            f"the trace routes {trace.top_k} of {trace.num_experts} experts per layer, the "
            f"model {shape.top_k} of {ne}: record the trace on this model"
        )
    return L


def sample_layers(L: int, layer_sample: int | None) -> list[int]:
    """``layer_sample`` of ``L`` layers spread evenly, first and last included (None or
    at least ``L``: every layer)."""
    if layer_sample is not None and layer_sample < 2:
        raise ValueError(
            f"layer_sample {layer_sample}: sample at least 2 layers, or all (None; "
            "--layer-sample 0)"
        )
    if not layer_sample or layer_sample >= L:
        return list(range(L))
    return sorted({round(i * (L - 1) / (layer_sample - 1)) for i in range(layer_sample)})


def plan(
    trace: RoutingTrace,
    shape: PoolShape,
    *,
    budgets_gb=(),
    slots=(),
    policies=("lru",),
    t_compute_s: float | None = None,
    read_gbps: float | None = None,
    tokens: int = 20000,
    layer_sample: int | None = 6,
    pin_hot: int = 0,
    held_out: bool = True,
    zero_slot: bool | None = None,
    window: int = 256,
) -> list[PlanRow]:
    """Predicted hit rate, miss bytes and tok/s of each policy at each budget or slot count.

    The trace's second half is replayed (``held_out``) so that policies or pins fitted on
    its first half are judged on routing they have not seen. ``zero_slot``: whether pools
    hold one (default: as ``load`` makes them here, ``Runtime.zero_slot``). Each row also
    gives the 10th and 90th percentiles of its miss bytes and tok/s over stretches of
    ``window`` tokens: what a run that long may see.
    """
    zero = default_zero_slot() if zero_slot is None else bool(zero_slot)
    L = shared_layers(trace, shape)
    ne = max(shape.num_experts)
    too_many = [s for s in slots if s > ne]
    if too_many:
        raise ValueError(f"{too_many[0]} slots exceed the layer's {ne} experts: at most {ne}")
    layers = sample_layers(L, layer_sample)
    fit_part, test = trace.split(0.5) if held_out else (trace, trace)
    pins = static_hot(fit_part, pin_hot) if pin_hot else None
    sizes = [(s, None) for s in slots] + [
        (plan_budget(shape, g, zero).default_slots, g) for g in budgets_gb
    ]
    rows = []
    for s, g in sizes:
        if s < shape.top_k:
            raise ValueError(
                f"{'budget ' + str(g) + ' GB' if g else str(s) + ' slots'} leaves "
                f"{s} slots per layer, below top_k={shape.top_k}"
            )
        for pol in policies:
            r = simulate(test, pol, s, layers=layers, tokens=tokens, pins=pins)
            # misses per token per sampled layer, extrapolated to every layer's bytes
            miss_rate = np.mean([r.misses[li] / max(1, r.tokens) for li in layers])
            miss_bytes = float(miss_rate * sum(shape.slot_bytes[:L]))
            gb = (
                g
                if g is not None
                else round(shape.pool_bytes({li: s for li in shape.layers}, zero) / 1e9, 4)
            )
            row = PlanRow(pol, s, gb, r.hit_rate, miss_bytes, pinned=pin_hot, layers=layers)
            spread = r.window_misses(window) * sum(shape.slot_bytes[:L])
            row.window_tokens = window
            row.miss_bytes_per_token_p10_p90 = p10_p90(spread)
            if t_compute_s and read_gbps:
                io = miss_bytes / (read_gbps * 1e9)
                row.predicted_tok_per_s = 1 / max(t_compute_s, io)
                row.serial_tok_per_s = 1 / (t_compute_s + io)
                tps = 1 / np.maximum(t_compute_s, spread / (read_gbps * 1e9))
                row.tok_per_s_p10_p90 = p10_p90(tps)
            rows.append(row)
    return rows


def resolve_policies(policy: str) -> list[str]:
    """``all``/``auto``: every policy; otherwise the one named; lru and belady always."""
    names = list(POLICIES) if policy in ("all", "auto") else [policy]
    for ref in ("lru", "belady"):
        if ref not in names:
            names.append(ref)
    return names
