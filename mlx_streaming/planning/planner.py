"""What a memory budget buys, before running anything: the planner and pool profiles.

``plan`` replays a routing trace through each policy at each budget (the same slot
tables and policies the store uses) and predicts hit rate, miss bytes per token and
tok/s from a measured compute time and read bandwidth: ``1 / max(t_compute,
miss_bytes / B)`` when reads overlap compute, ``1 / (t_compute + miss_bytes / B)`` when
they do not. ``build_profile`` shares a budget among layers by their measured hit-rate
curves (layers whose routing is more diverse get more slots) and is judged on held-back
routing against uniform slots at equal bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..core.cache.policy import POLICIES
from .simulate import simulate, static_hot
from .trace import RoutingTrace


@dataclass
class Shape:
    """What the planner needs of a model: bytes per expert slot of each MoE layer (in
    trace layer order), experts per layer and top-k."""

    slot_bytes: list[int]
    num_experts: int
    top_k: int

    @classmethod
    def from_meta(cls, meta) -> Shape:
        from .budget import slot_bytes

        return cls([slot_bytes(meta, li) for li in sorted(meta.layers)], meta.num_experts,
                   meta.top_k)

    def slots_for(self, budget_gb: float) -> int:
        """Uniform slots per layer whose pools (plus each layer's zero slot) fit."""
        per = int(budget_gb * 1e9) // sum(self.slot_bytes) - 1
        return int(min(self.num_experts, per))


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

    def to_json(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def plan(trace: RoutingTrace, shape: Shape, *, budgets_gb=(), slots=(), policies=("lru",),
         t_compute_s: float | None = None, read_gbps: float | None = None,
         tokens: int = 20000, layer_sample: int | None = 6, pin_hot: int = 0,
         held_out: bool = True) -> list[PlanRow]:
    """Predicted hit rate, miss bytes and tok/s of each policy at each budget or slot count.

    The trace's second half is replayed (``held_out``) so that policies or pins fitted on
    its first half are judged on routing they have not seen.
    """
    L = min(len(shape.slot_bytes), trace.layers)
    if L == 0:
        raise ValueError("the trace and the model share no MoE layer")
    layers = list(range(L))
    if layer_sample and layer_sample < L:
        layers = sorted({round(i * (L - 1) / (layer_sample - 1)) for i in range(layer_sample)})
    fit_part, test = trace.split(0.5) if held_out else (trace, trace)
    pins = static_hot(fit_part, pin_hot) if pin_hot else None
    sizes = [(s, None) for s in slots] + [(shape.slots_for(g), g) for g in budgets_gb]
    rows = []
    for s, g in sizes:
        if s < shape.top_k:
            raise ValueError(f"{'budget ' + str(g) + ' GB' if g else str(s) + ' slots'} leaves "
                             f"{s} slots per layer, below top_k={shape.top_k}")
        for pol in policies:
            r = simulate(test, pol, s, layers=layers, tokens=tokens, pins=pins)
            # misses per token per sampled layer, extrapolated to every layer's bytes
            miss_rate = np.mean([r.misses[li] / max(1, r.tokens) for li in layers])
            miss_bytes = float(miss_rate * sum(shape.slot_bytes[:L]))
            row = PlanRow(pol, s, round((s + 1) * sum(shape.slot_bytes[:L]) / 1e9, 4)
                          if g is None else g, r.hit_rate, miss_bytes, pinned=pin_hot,
                          layers=layers)
            if t_compute_s and read_gbps:
                io = miss_bytes / (read_gbps * 1e9)
                row.predicted_tok_per_s = 1 / max(t_compute_s, io)
                row.serial_tok_per_s = 1 / (t_compute_s + io)
            rows.append(row)
    return rows


def resolve_policies(policy: str) -> list[str]:
    """``all``/``auto``: every policy; otherwise the one named; lru and belady always."""
    names = list(POLICIES) if policy in ("all", "auto") else [policy]
    for ref in ("lru", "belady"):
        if ref not in names:
            names.append(ref)
    return names


# ---------------------------------------------------------------- pool profiles


def hit_curves(trace: RoutingTrace, layers, grid, policy: str, tokens: int) -> np.ndarray:
    """Hits per lookup of each layer (rows) at each slot count of ``grid`` (columns)."""
    out = np.zeros((len(layers), len(grid)))
    for j, s in enumerate(grid):
        r = simulate(trace, policy, int(s), layers=layers, tokens=tokens)
        for i, li in enumerate(layers):
            out[i, j] = r.hits[li] / max(1, r.tokens)
    return out


def allocate(curves: np.ndarray, grid, slot_bytes, budget_bytes: int) -> list[int]:
    """Greedy: move each layer up the grid where it gains the most hits per byte."""
    L = len(slot_bytes)
    pos = [0] * L
    used = sum((grid[0] + 1) * b for b in slot_bytes)
    while True:
        best, best_gain = None, 0.0
        for i in range(L):
            if pos[i] + 1 >= len(grid):
                continue
            cost = (grid[pos[i] + 1] - grid[pos[i]]) * slot_bytes[i]
            if used + cost > budget_bytes:
                continue
            gain = (curves[i, pos[i] + 1] - curves[i, pos[i]]) / cost
            if best is None or gain > best_gain:
                best, best_gain = i, gain
        if best is None:
            break
        used += (grid[pos[best] + 1] - grid[pos[best]]) * slot_bytes[best]
        pos[best] += 1
    return [int(grid[p]) for p in pos]


@dataclass
class Profile:
    mode: str
    slots: dict[int, int]  # model layer -> slots
    policy: str
    budget_bytes: int
    heldout_hit_rate: float
    uniform_slots: int
    uniform_heldout_hit_rate: float
    uniform_bytes: int = 0
    profile_bytes: int = 0

    def info(self) -> dict:
        d = asdict(self)
        d.pop("slots")
        return d


def build_profile(trace: RoutingTrace, meta, *, budget_gb: float | None = None,
                  slots: int | None = None, mode: str = "budget", policy: str = "predictive",
                  tokens: int = 10000, step: int | None = None) -> Profile:
    """Per-layer slots for ``meta``'s MoE layers from the first half of ``trace``, judged
    on its second half against uniform slots at equal bytes.

    Modes: ``budget`` shares ``budget_gb`` (or the bytes of ``slots`` uniform slots) by
    hit-rate curves; ``lossless`` caps each layer at the distinct experts it used (the
    seed's profile: same hits as unbounded pools on the calibration routing).
    """
    shape = Shape.from_meta(meta)
    model_layers = sorted(meta.layers)
    L = min(len(model_layers), trace.layers)
    layers = list(range(L))
    calib, held = trace.split(0.5)
    sb = shape.slot_bytes[:L]
    if mode == "lossless":
        caps = []
        for li in layers:
            used = len(np.unique(calib.experts[:tokens, li]))
            caps.append(int(max(shape.top_k, min(shape.num_experts, used))))
        uniform = max(shape.top_k, round(sum(c * b for c, b in zip(caps, sb)) / sum(sb)))
    elif mode == "budget":
        if (budget_gb is None) == (slots is None):
            raise ValueError("give budget_gb or slots for a budget profile")
        uniform = slots if slots is not None else shape.slots_for(budget_gb)
        if uniform < shape.top_k:
            raise ValueError(f"the budget gives {uniform} slots per layer, below top_k="
                             f"{shape.top_k}")
        # curves around the uniform point: nothing moves further than 3x it
        top = min(shape.num_experts, 3 * uniform)
        step = step or max(1, (top - shape.top_k) // 16)
        grid = sorted(set(range(shape.top_k, top + 1, step)) | {uniform, top})
        curves = hit_curves(calib, layers, grid, policy, tokens)
        caps = allocate(curves, grid, sb, sum((uniform + 1) * b for b in sb))
    else:
        raise ValueError(f"profile mode must be 'budget' or 'lossless', got {mode!r}")
    prof = simulate(held, policy, dict(zip(layers, caps)), layers=layers, tokens=tokens)
    uni = simulate(held, policy, uniform, layers=layers, tokens=tokens)
    return Profile(mode, {model_layers[i]: caps[i] for i in layers}, policy,
                   sum((uniform + 1) * b for b in sb), prof.hit_rate, uniform, uni.hit_rate,
                   uniform_bytes=sum((uniform + 1) * b for b in sb),
                   profile_bytes=sum((c + 1) * b for c, b in zip(caps, sb)))
