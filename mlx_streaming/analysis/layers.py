"""Layer-by-layer check of a streamed model against stock mlx-lm on the user's machine.

For each MoE layer, the streamed expert module and the model's own stock module (mlx-lm's
``SwitchGLU`` / ``SwitchMLP`` with every expert, read from the checkpoint) run on the
same inputs, and their outputs are compared bit for bit. The inputs are real: the hidden
states and routing each layer receives on a short prompt, cut or repeated to one token
(decode) and to prefill chunks on both sides of every row threshold of MLX's kernel
choice. Only one layer's full experts are in memory at a time, so models that do not fit
whole can be checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from ..core.discovery import find_expert_sites, projections
from ..core.selftest import token_counts
from .capture import capture_inputs

DEFAULT_PROMPT = (
    "Explain, in a few sentences, how a mixture-of-experts language model "
    "chooses which experts process each token."
)


@dataclass
class LayerResult:
    layer: int
    tokens: list[int]  # tokens per call checked
    differ_at: int | None = None  # first token count whose output differed
    max_abs_diff: float = 0.0

    @property
    def exact(self) -> bool:
        return self.differ_at is None


@dataclass
class VerifyReport:
    layers: list[LayerResult] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return all(r.exact for r in self.layers)

    @property
    def first_difference(self) -> LayerResult | None:
        return next((r for r in self.layers if not r.exact), None)

    def to_json(self) -> dict:
        first = self.first_difference
        return {
            "exact": self.exact,
            "first_differing_layer": None if first is None else first.layer,
            "layers": [
                {
                    "layer": r.layer,
                    "exact": r.exact,
                    "tokens": r.tokens,
                    "differ_at_tokens": r.differ_at,
                    "max_abs_diff": r.max_abs_diff,
                }
                for r in self.layers
            ],
        }


def _rows(x: mx.array, idx: mx.array, tokens: int) -> tuple[mx.array, mx.array]:
    """``tokens`` rows of the captured inputs (repeated when the prompt is shorter),
    shaped as a [1, tokens] batch."""
    sel = mx.array(np.arange(tokens) % x.shape[0])
    return x[sel][None], idx[sel][None]


def _bits(a: mx.array) -> mx.array:
    return a.view({1: mx.uint8, 2: mx.uint16, 4: mx.uint32}[a.itemsize])


def verify_layers(
    streamed: nn.Module,
    stock: nn.Module,
    prompt_ids: list[int],
    layers: list[int] | None = None,
    max_tokens: int = 2048,
    progress=None,
) -> VerifyReport:
    """Compare each MoE layer of ``streamed`` (patched) with the same layer of ``stock``
    (the model loaded lazily with mlx-lm: its experts are read one layer at a time).

    Args:
        streamed: A model patched with streamed experts.
        stock: The same model as mlx-lm loads it with ``lazy=True``.
        prompt_ids: Token ids of a short prompt (the source of the inputs).
        layers: Model layer indices to check (default: every MoE layer).
        max_tokens: The largest call checked (the prefill chunk).
        progress: Called with each ``LayerResult`` as it is found.

    Raises:
        ValueError: ``layers`` names a layer that is not a MoE layer.
    """
    sites = {s.layer: s for s in find_expert_sites(streamed)}
    ref_sites = {s.layer: s for s in find_expert_sites(stock)}
    chosen = sorted(sites) if not layers else list(layers)
    unknown = [li for li in chosen if li not in sites]
    if unknown:
        raise ValueError(
            f"layers {unknown} are not MoE layers of this model (its MoE layers: {sorted(sites)})"
        )
    inputs = capture_inputs(streamed, prompt_ids)
    report = VerifyReport()
    for li in chosen:
        s, ref = sites[li], ref_sites[li].module
        pool_experts = projections(s.module)[0][1].weight.shape[0]
        top_k = inputs[li][1].shape[-1]
        tokens = token_counts(top_k, ref_sites[li].num_experts, pool_experts, max_tokens)
        mx.eval(ref.parameters())  # this layer's experts, from the checkpoint
        res = LayerResult(li, tokens)
        for t in tokens:
            x, idx = _rows(*inputs[li], t)
            want, got = ref(x, idx), s.streamed(x, idx)
            if not mx.array_equal(_bits(want), _bits(got)).item():
                res.differ_at = t
                res.max_abs_diff = float(
                    mx.abs(want.astype(mx.float32) - got.astype(mx.float32)).max().item()
                )
                break
        # drop this layer's stock experts before the next layer's are read
        ref.update(tree_map(lambda a: mx.zeros((0,), a.dtype), ref.parameters()))
        mx.clear_cache()
        report.layers.append(res)
        if progress is not None:
            progress(res)
    return report
