"""What each MoE layer's expert module receives on a forward pass: its input hidden
states and routing (for checks, quality measurements and calibration)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..core.discovery import find_expert_sites


class _Capture(nn.Module):
    """Stands in front of an expert module and keeps its inputs."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.seen: list[tuple[mx.array, mx.array]] = []

    def __call__(self, x, indices):
        self.seen.append((x.reshape(-1, x.shape[-1]), indices.reshape(-1, indices.shape[-1])))
        return self.inner(x, indices)


def capture_inputs(model: nn.Module, tokens: list[int]) -> dict[int, tuple[mx.array, mx.array]]:
    """``{layer: (x [N, D], indices [N, k])}``: what each MoE layer's expert module (stock
    or streamed) receives on one forward pass of ``tokens``."""
    sites = find_expert_sites(model)
    caps = {}
    for s in sites:
        current = s.streamed if s.streamed is not None else s.module
        caps[s.layer] = _Capture(current)
        s.parent.update_modules({s.attr: caps[s.layer]})
    try:
        mx.eval(model(mx.array(tokens)[None]))
    finally:
        for s in sites:
            s.parent.update_modules({s.attr: caps[s.layer].inner})
    out = {}
    for li, c in caps.items():
        xs, ids = zip(*c.seen)
        out[li] = (mx.concatenate(xs), mx.concatenate(ids))
        mx.eval(out[li])
    return out
