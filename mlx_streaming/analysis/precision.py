"""Hot and cold precision: frequently routed experts at more bits, rarely routed ones at
fewer, chosen from a recorded routing trace, and what that costs and buys.

* ``hot_experts``: per layer, the most routed experts of a trace span.
* ``byte_lru_hit_rate``: the hit rate of an LRU pool bounded in *bytes*, where experts
  have different sizes (cold ones are smaller, so more of them fit): the hit rate at
  equal memory.
* ``fake_quantized``: a copy of a model whose experts are float weights equal to each
  expert quantized at its own bits and dequantized; comparing two such models with
  ``quality.compare_distributions`` isolates what the bit widths cost.
* ``hot_cold_study``: the side-by-side table of uniform widths and hot/cold mixes.

A study, not a streaming mode: the expert-directory format and the pools keep one width
per layer and projection. On random-weight models the quality numbers are a relative
guide only; the hit rates come from the real trace.
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from ..core.cache.recording import hottest
from ..core.discovery import find_expert_sites, projections
from ..planning.simulate import routing_counts
from ..planning.trace import RoutingTrace


def hot_experts(
    trace: RoutingTrace, fraction: float, start: int = 0, tokens: int | None = None
) -> list[np.ndarray]:
    """Per trace layer, the ``ceil(fraction * num_experts)`` most routed experts of the
    span ``[start, start + tokens)``."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"hot fraction must be in [0, 1], got {fraction}")
    n = int(np.ceil(fraction * trace.num_experts))
    return [np.sort(h) for h in hottest(routing_counts(trace, start, tokens), n)]


def byte_lru_hit_rate(
    trace: RoutingTrace,
    layer: int,
    sizes: np.ndarray,
    budget: int,
    start: int = 0,
    tokens: int | None = None,
) -> tuple[float, float]:
    """(hit rate, bytes loaded per token) of demand LRU at one trace layer with a pool of
    ``budget`` bytes, expert ``e`` taking ``sizes[e]`` bytes. A token's experts are
    never evicted to make room for each other."""
    end = trace.tokens if tokens is None else min(trace.tokens, start + tokens)
    if budget < max(sizes) * trace.top_k:
        raise ValueError(
            f"a budget of {budget} bytes cannot hold one token's {trace.top_k} experts"
        )
    lru: OrderedDict[int, int] = OrderedDict()
    used = hits = misses = loaded = 0
    for t in range(start, end):
        need = [int(e) for e in np.unique(trace.experts[t, layer])]
        for e in need:
            if e in lru:
                hits += 1
                lru.move_to_end(e)
        for e in need:
            if e in lru:
                continue
            misses += 1
            loaded += int(sizes[e])
            while used + sizes[e] > budget:
                victim = next(v for v in lru if v not in need)
                used -= lru.pop(victim)
            lru[e] = int(sizes[e])
            used += int(sizes[e])
    return hits / max(1, hits + misses), loaded / max(1, end - start)


def expert_bytes(module: nn.Module, bits: int, group_size: int) -> int:
    """Bytes of one expert of ``module`` (a SwitchGLU / SwitchMLP) with every projection
    quantized at ``bits``, scales in the source's dtype."""
    from .quality import quantized_bytes

    total = 0
    for _, proj in projections(module):
        if isinstance(proj, QuantizedSwitchLinear):
            in_dims = proj.weight.shape[-1] * 32 // proj.bits
            scale_bytes = proj.scales.dtype.size
        else:
            in_dims, scale_bytes = proj.weight.shape[-1], proj.weight.dtype.size
        total += quantized_bytes(proj.weight.shape[1], in_dims, bits, group_size, scale_bytes)
    return total


def _dequantized(proj: nn.Module) -> mx.array:
    if isinstance(proj, QuantizedSwitchLinear):
        return mx.dequantize(
            proj.weight,
            proj.scales,
            proj.get("biases"),
            group_size=proj.group_size,
            bits=proj.bits,
            mode=proj.mode,
        )
    return proj.weight


def fake_quantized(
    model: nn.Module, bits: list[np.ndarray | None], group_size: int = 64
) -> nn.Module:
    """Give ``model`` (in place) float experts holding, for MoE layer ``i``, expert
    ``e``'s source weights quantized at ``bits[i][e]`` bits and dequantized (``None``,
    or the source's own width: the source weights, dequantized). Returns the model."""
    sites = find_expert_sites(model)
    if len(bits) != len(sites):
        raise ValueError(f"bits for {len(bits)} layers, the model has {len(sites)} MoE layers")
    for site, layer_bits in zip(sites, bits):
        new = {}
        for name, proj in projections(site.module):
            w = _dequantized(proj).astype(mx.float32)
            src_bits = proj.bits if isinstance(proj, QuantizedSwitchLinear) else None
            if layer_bits is not None:
                rows = []
                for e in range(w.shape[0]):
                    b = int(layer_bits[e])
                    if b == src_bits:  # the source's own width: its weights as they are
                        rows.append(w[e])
                        continue
                    q = mx.quantize(w[e], group_size=group_size, bits=b)
                    rows.append(mx.dequantize(*q, group_size=group_size, bits=b))
                w = mx.stack(rows)
            lin = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias="bias" in proj)
            lin.weight = w  # float32 whatever the model's dtype: the widths alone differ
            if "bias" in proj:
                lin.bias = proj.bias
            mx.eval(lin.parameters())
            new[name] = lin
        site.module.update_modules(new)
    return model


def hot_cold_study(
    model_path,
    trace: RoutingTrace,
    *,
    hot_bits: int = 4,
    cold_bits: int = 2,
    fractions=(0.125, 0.25, 0.5),
    uniform=(4, 3, 2),
    budget_fraction: float = 0.25,
    group_size: int = 64,
    quality_tokens: int = 128,
    sim_tokens: int = 20000,
) -> dict:
    """Uniform widths and hot/cold mixes side by side: mean bytes per expert, KL and
    top-1 agreement against the source model's own experts (dequantized), and the LRU
    hit rate and bytes loaded per token with a pool of equal bytes in every row
    (``budget_fraction`` of a layer's experts at ``hot_bits``).

    The hot sets come from the first half of the trace; hit rates are measured on the
    second half, and quality with the second half's routing.
    """
    from mlx_lm import load

    from ..planning.trace import apply_trace_routing
    from .quality import QUALITY_TEXT, compare_distributions

    ref, tok = load(str(model_path), lazy=True)
    sites = find_expert_sites(ref)
    if len(sites) > trace.layers:
        raise ValueError(f"{model_path} has {len(sites)} MoE layers, the trace {trace.layers}")
    size = {
        b: expert_bytes(sites[0].module, b, group_size) for b in {hot_bits, cold_bits, *uniform}
    }
    E = trace.num_experts
    budget = int(budget_fraction * E * size[hot_bits])
    half = trace.tokens // 2
    text = tok.encode(QUALITY_TEXT)[:quality_tokens]
    layers = list(range(len(sites)))

    base = fake_quantized(load(str(model_path))[0], [None] * len(sites))
    r_base = apply_trace_routing(base, trace, half)

    def row(name: str, bits_per_layer: list[np.ndarray]) -> dict:
        m = fake_quantized(load(str(model_path))[0], bits_per_layer, group_size)
        r = apply_trace_routing(m, trace, half)
        r_base.cursor = r.cursor = half
        q = compare_distributions(base, m, text)
        hit, loaded = [], []
        for li in layers:
            sizes = np.array([size[int(b)] for b in bits_per_layer[li]])
            h, by = byte_lru_hit_rate(trace, li, sizes, budget, half, sim_tokens)
            hit.append(h)
            loaded.append(by)
        mean_bytes = float(np.mean([size[int(b)] for bl in bits_per_layer for b in bl]))
        return {
            "config": name,
            "mean_expert_bytes": round(mean_bytes),
            "bytes_vs_hot": round(mean_bytes / size[hot_bits], 3),
            "kl": round(q["kl"], 6),
            "top1_agreement": round(q["top1_agreement"], 4),
            "hit_rate": round(float(np.mean(hit)), 4),
            "bytes_loaded_per_token": round(float(np.sum(loaded))),
        }

    rows = [row(f"uniform {b}-bit", [np.full(E, b) for _ in layers]) for b in uniform]
    for f in fractions:
        hot = hot_experts(trace, f, 0, half)
        bits = []
        for li in layers:
            b = np.full(E, cold_bits)
            b[hot[li]] = hot_bits
            bits.append(b)
        rows.append(row(f"hot {f:.0%} at {hot_bits}-bit, rest {cold_bits}-bit", bits))
    return {
        "model": str(model_path),
        "moe_layers": len(sites),
        "num_experts": E,
        "budget_bytes_per_layer": budget,
        "budget_fraction": budget_fraction,
        "expert_bytes": {str(b): s for b, s in sorted(size.items())},
        "hot_set_tokens": half,
        "eval_start": half,
        "quality_positions": len(text),
        "rows": rows,
        "note": "random-weight model: KL and agreement are a relative guide; hit "
        "rates replay the real trace",
    }
