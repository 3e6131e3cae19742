"""Find the expert modules of an mlx-lm model, by type.

mlx-lm keeps routed experts in ``SwitchGLU`` or ``SwitchMLP`` modules, stored under names
that differ by architecture (``mlp.switch_mlp``, ``block_sparse_moe.switch_mlp``,
``mlp.experts``, ``feed_forward.experts``...). Finding them by type covers every
architecture built on those classes, with dense layers anywhere in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn
from mlx_lm.models.switch_layers import (
    QuantizedSwitchLinear,
    SwitchGLU,
    SwitchLinear,
    SwitchMLP,
)

EXPERT_TYPES = (SwitchGLU, SwitchMLP)
PROJECTION_TYPES = (SwitchLinear, QuantizedSwitchLinear)
_TOP_K_NAMES = ("top_k", "num_experts_per_tok", "moe_topk", "num_experts_per_token", "k")


class UnsupportedModelError(ValueError):
    """The model has no experts mlx_streaming can stream."""


@dataclass
class ExpertSite:
    """One MoE layer's expert module and what surrounds it."""

    layer: int  # index in model.layers
    path: str  # dotted parameter path of the expert module, e.g. model.layers.3.mlp.switch_mlp
    module: nn.Module  # the SwitchGLU / SwitchMLP
    parent: nn.Module  # the MoE block that routes into it
    attr: str  # name of the expert module inside parent
    router: nn.Module | None  # the parent's router (weight of shape [num_experts, hidden])
    top_k: int | None
    streamed: nn.Module | None = None  # the StreamedExperts wrapper, once patched

    @property
    def num_experts(self) -> int:
        if self.streamed is not None:  # the module holds pool slots, not all experts
            return self.streamed.num_experts
        return projections(self.module)[0][1].weight.shape[0]


def projections(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (name, SwitchLinear-like) children of an expert module, in a fixed order."""
    return [(n, m) for n, m in sorted(module.children().items()) if isinstance(m, PROJECTION_TYPES)]


def _model_type(model) -> str:
    return getattr(model, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1]


def _top_k(parent: nn.Module, router: nn.Module | None, config: dict | None) -> int | None:
    for obj in (parent, router):
        for name in _TOP_K_NAMES:
            v = getattr(obj, name, None) if obj is not None else None
            if isinstance(v, int) and v > 0:
                return v
    for name in _TOP_K_NAMES:
        v = (config or {}).get(name)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _router(parent: nn.Module, expert_attr: str, num_experts: int) -> nn.Module | None:
    for name, child in parent.children().items():
        if name == expert_attr or not isinstance(child, nn.Module):
            continue
        w = child.get("weight") if isinstance(child, dict) else None
        if w is None:
            continue
        rows = w.shape[0]
        if rows == num_experts:
            return child
    return None


def _numbered(model: nn.Module, layers) -> list[tuple[int, nn.Module]]:
    """``(index in the whole model, layer)`` for the layers this process runs. A model
    split by mlx-lm's ``pipeline`` lists only its own layers, from ``start_idx`` on (or
    keeps ``None`` in place of the others)."""
    if any(layer is None for layer in layers):
        return [(i, layer) for i, layer in enumerate(layers) if layer is not None]
    start = getattr(getattr(model, "model", None), "start_idx", 0) or 0
    return [(start + i, layer) for i, layer in enumerate(layers)]


def find_expert_sites(model: nn.Module, config: dict | None = None) -> list[ExpertSite]:
    """Every expert module of ``model``, one per MoE layer, in layer order.

    Raises:
        UnsupportedModelError: the model has no ``layers`` or no SwitchGLU/SwitchMLP.
    """
    layers = getattr(model, "layers", None)
    if layers is None:
        raise UnsupportedModelError(
            f"model type '{_model_type(model)}' exposes no `layers`; mlx_streaming streams "
            "mlx-lm models whose decoder layers are listed in model.layers"
        )
    full_names = {id(m): n for n, m in model.named_modules()}
    sites = []
    for li, layer in _numbered(model, layers):
        wrapped = [
            (n, m) for n, m in layer.named_modules() if getattr(m, "is_streamed_experts", False)
        ]
        found = wrapped or [(n, m) for n, m in layer.named_modules() if isinstance(m, EXPERT_TYPES)]
        if len(found) > 1:
            raise UnsupportedModelError(
                f"layer {li} of '{_model_type(model)}' has {len(found)} expert modules; "
                "mlx_streaming supports one per layer"
            )
        if not found:
            continue
        rel, module = found[0]
        streamed = None
        if wrapped:
            streamed, module = module, module.experts
        parent_rel, _, attr = rel.rpartition(".")
        parent = layer
        for part in parent_rel.split(".") if parent_rel else []:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        projs = projections(module)
        if not projs:
            raise UnsupportedModelError(f"{rel} in layer {li} has no SwitchLinear projections")
        num_experts = streamed.num_experts if streamed is not None else projs[0][1].weight.shape[0]
        router = _router(parent, attr, num_experts)
        sites.append(
            ExpertSite(
                layer=li,
                path=full_names.get(id(streamed or module), f"model.layers.{li}.{rel}"),
                module=module,
                parent=parent,
                attr=attr,
                router=router,
                top_k=_top_k(parent, router, config),
                streamed=streamed,
            )
        )
    if not sites:
        raise UnsupportedModelError(
            f"model type '{_model_type(model)}' has no experts that mlx_streaming can stream: "
            "it streams experts held in mlx-lm's SwitchGLU or SwitchMLP modules, and this "
            "model has none (a dense model, or experts in a custom module)"
        )
    return sites


def expert_dims(site: ExpertSite) -> tuple[int, int]:
    """``(hidden, moe_inter)``: input and output width of the first up projection."""
    m = site.module
    first = m.gate_proj if isinstance(m, SwitchGLU) else m.fc1
    return first.input_dims, first.output_dims


def fingerprint(model: nn.Module, sites: list[ExpertSite], config: dict | None = None) -> dict:
    """What identifies a model for an expert directory.

    ``shapes``: trunk parameter shapes (experts excluded, so requantized experts keep it);
    ``experts``: each MoE layer's expert count and widths; ``router``: a hash of the first
    router's bytes (tells apart models that share shapes); ``config``: the config's hash
    when the config is known.
    """
    import hashlib

    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from .format import config_hash, shapes_hash

    prefixes = tuple(s.path + "." for s in sites)
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters()) if not k.startswith(prefixes)}
    experts = [[s.layer, s.num_experts, *expert_dims(s)] for s in sites]
    fp = {"shapes": shapes_hash(shapes), "experts": shapes_hash({"e": experts})}
    router = next((s.router for s in sites if s.router is not None), None)
    if router is not None:
        w = router.weight
        if w.dtype == mx.bfloat16:
            w = w.view(mx.uint16)
        fp["router"] = hashlib.sha256(np.array(w).tobytes()).hexdigest()[:16]
    if config is not None:
        fp["config"] = config_hash(config)
    return fp


def fingerprint_mismatch(expected: dict, actual: dict) -> list[str]:
    """Keys present in both fingerprints whose values differ."""
    return [k for k in expected if k in actual and expected[k] != actual[k]]
