"""Pool profiles: slots per MoE layer, from recorded routing, in ``pool_profile.json``.

``build_profile`` shares a budget among layers by their hit-rate curves on the first half
of a trace (layers whose routing is more diverse get more slots), or in ``lossless``
mode caps each layer at the distinct experts it used, and judges the result on the
second half against uniform slots at equal bytes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..core.cache.policy import DEFAULT_POLICY
from ..core.format import ExpertMeta, write_json_atomic
from .allocate import climb
from .budget import PoolShape, default_zero_slot, plan_budget
from .simulate import simulate
from .trace import RoutingTrace

PROFILE_NAME = "pool_profile.json"
PROFILE_FORMAT = "mlx_streaming.pool_profile"


def read_pool_profile(path: str | Path) -> dict[int, int]:
    """``{layer: slots}`` from a pool profile file.

    Raises:
        ValueError: the file is not a valid pool profile (names the file).
    """
    return read_profile(path)[0]


def read_profile(path: str | Path) -> tuple[dict[int, int], list[int]]:
    """A pool profile file's ``{layer: slots}`` and its whole layers, read once.

    Raises:
        ValueError: the file is not a valid pool profile (names the file).
    """
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"pool profile {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"pool profile {path} is not valid JSON ({e})") from e
    layers = d.get("layers") if isinstance(d, dict) else None
    if not isinstance(layers, dict) or not layers:
        raise ValueError(
            f"pool profile {path} has no 'layers' object of {{layer: slots}}; "
            "write one with `python -m mlx_streaming profile`"
        )
    out = {}
    for k, v in layers.items():
        if not str(k).isdigit() or isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(
                f"pool profile {path}: entry {k!r}: {v!r} must map a layer "
                "index to a positive slot count"
            )
        out[int(k)] = v
    whole = d.get("whole_layers") or []
    ok = isinstance(whole, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in whole
    )
    if not ok:
        raise ValueError(
            f"pool profile {path}: whole_layers {whole!r} must be a list of layer indices; "
            "write the profile again with `python -m mlx_streaming profile`"
        )
    return out, list(whole)


def write_pool_profile(path: str | Path, caps: dict[int, int], **info) -> None:
    """Write ``{layer: slots}`` (plus descriptive ``info``) as a pool profile."""
    write_json_atomic(
        Path(path),
        {
            "format": PROFILE_FORMAT,
            "version": 1,
            **info,
            "layers": {str(k): int(v) for k, v in sorted(caps.items())},
        },
    )


def hit_curves(trace: RoutingTrace, layers, grid, policy: str, tokens: int) -> np.ndarray:
    """Hits per lookup of each layer (rows) at each slot count of ``grid`` (columns)."""
    out = np.zeros((len(layers), len(grid)))
    for j, s in enumerate(grid):
        r = simulate(trace, policy, int(s), layers=layers, tokens=tokens)
        for i, li in enumerate(layers):
            out[i, j] = r.hits[li] / max(1, r.tokens)
    return out


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
    whole_layers: list[int] = field(default_factory=list)  # layers holding every expert,
    # the one that misses most first

    def info(self) -> dict:
        d = asdict(self)
        d.pop("slots")
        return d


def build_profile(
    trace: RoutingTrace,
    meta: PoolShape | ExpertMeta,
    *,
    budget_gb: float | None = None,
    slots: int | None = None,
    mode: str = "budget",
    policy: str = DEFAULT_POLICY,
    tokens: int = 10000,
    step: int | None = None,
    zero_slot: bool | None = None,
    whole_layers: int = 0,
) -> Profile:
    """Per-layer slots for ``meta``'s MoE layers (an expert directory's meta, or a
    ``PoolShape``) from the first half of ``trace``, judged on its second half against
    uniform slots at equal bytes.

    Modes: ``budget`` shares ``budget_gb`` (through ``plan_budget``, the formula ``load``
    uses) or the bytes of ``slots`` uniform slots, by hit-rate curves; ``lossless`` caps
    each layer at the distinct experts it used (the seed's profile: same hits as
    unbounded pools on the calibration routing).

    ``whole_layers`` (budget mode): the layers that miss most at uniform slots on the
    calibration half hold every expert, and the others share what is left. A whole
    layer takes the resident path (no read, no planning, no kernel), so this trades
    hits for fewer streamed calls: it pays where a call's host cost, not the bytes,
    bounds a step (the CUDA device path with the experts in RAM).

    Raises:
        ValueError: no size given, or the budget cannot hold the whole layers and top-k
            slots for each other layer (the message gives both).
    """
    full = PoolShape.from_meta(meta) if isinstance(meta, ExpertMeta) else meta
    zero = default_zero_slot() if zero_slot is None else zero_slot
    L = min(len(full.layers), trace.layers)
    shape = PoolShape(
        full.slot_bytes[:L], full.num_experts[:L], full.top_k, full.layers[:L], full.strides[:L]
    )
    layers = list(range(L))
    calib, held = trace.split(0.5)
    k, ne = shape.top_k, shape.num_experts
    if whole_layers and mode != "budget":
        raise ValueError("whole layers share a budget: give --budget-gb or --slots, not --lossless")
    if not 0 <= whole_layers < L:
        raise ValueError(
            f"whole layers: {whole_layers}; give 0 to {L - 1} (the {L} MoE layers the "
            "trace and the model have in common, less one that streams)"
        )
    whole: list[int] = []
    if mode == "lossless":
        caps = [int(max(k, min(ne[i], len(np.unique(calib.experts[:tokens, i]))))) for i in layers]
        mean = sum(c * b for c, b in zip(caps, shape.slot_bytes)) / sum(shape.slot_bytes)
        uniform = max(k, round(mean))
    elif mode == "budget":
        if (budget_gb is None) == (slots is None):
            raise ValueError("give budget_gb or slots for a budget profile")
        uniform = slots if slots is not None else plan_budget(shape, budget_gb, zero).default_slots
        if uniform < k:
            raise ValueError(f"the budget gives {uniform} slots per layer, below top_k={k}")
        # curves around the uniform point: nothing moves further than 3x it
        top = min(min(ne), 3 * uniform)
        step = step or max(1, (top - k) // 16)
        grid = sorted(set(range(k, top + 1, step)) | {uniform, top})
        curves = hit_curves(calib, layers, grid, policy, tokens)
        budget = shape.pool_bytes({li: uniform for li in shape.layers}, zero)
        if whole_layers:  # the layers that miss most at uniform slots (fewest hits)
            at_uniform = curves[:, grid.index(uniform)]
            whole = sorted(layers, key=lambda i: at_uniform[i])[:whole_layers]
        rest = [i for i in layers if i not in whole]
        held_whole = shape.pool_bytes({shape.layers[i]: ne[i] for i in whole}, zero)
        least = held_whole + shape.pool_bytes({shape.layers[i]: k for i in rest}, zero)
        if least > budget:
            raise ValueError(
                f"{whole_layers} whole layers and top_k={k} slots for each other layer need "
                f"{least / 1e9:.4f} GB, the budget is {budget / 1e9:.4f} GB: fewer whole "
                "layers or a larger budget"
            )
        at = climb(
            [len(grid)] * len(rest),
            lambda j, a: shape.pool_bytes({shape.layers[rest[j]]: grid[a]}, zero),
            lambda j, a: curves[rest[j], a],
            budget - held_whole,
        )
        caps = [ne[i] for i in layers]
        for i, a in zip(rest, at):
            caps[i] = int(grid[a])
    else:
        raise ValueError(f"profile mode must be 'budget' or 'lossless', got {mode!r}")
    prof = simulate(held, policy, dict(zip(layers, caps)), layers=layers, tokens=tokens)
    uni = simulate(held, policy, uniform, layers=layers, tokens=tokens)
    uniform_bytes = shape.pool_bytes({li: uniform for li in shape.layers}, zero)
    return Profile(
        mode,
        dict(zip(shape.layers, caps)),
        policy,
        uniform_bytes,
        prof.hit_rate,
        uniform,
        uni.hit_rate,
        uniform_bytes=uniform_bytes,
        profile_bytes=shape.pool_bytes(dict(zip(shape.layers, caps)), zero),
        whole_layers=[shape.layers[i] for i in whole],  # most misses first
    )
