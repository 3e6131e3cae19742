"""What requantized experts cost in quality.

* ``projection_errors``: per MoE layer and projection, the relative output error
  ``||f'(x) - f(x)|| / ||f(x)||`` of requantized experts against the source ones, on
  inputs captured from real forward passes (gate/up see the layer's MoE input; down sees
  the source expert's hidden activation).
* ``compare_distributions``: end to end, the KL divergence and top-1 agreement of the
  next-token distributions of two models over the same token stream.

On random-weight models these numbers are a relative guide only.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .core.format import ExpertMeta
from .core.io.reader import RecordReader, aligned_buffer
from .prep.requantize import _parts_of

QUALITY_TEXT = (
    "A mixture of experts model routes each token to a few experts. The experts that "
    "are not used stay on disk. Caches keep recently used experts close at hand, and a "
    "planner tells how much memory buys how much speed. " * 8
)


class _Capture(nn.Module):
    def __init__(self, inner, store: list):
        super().__init__()
        self.inner, self._store = inner, store

    def __call__(self, x, indices):
        self._store.append((np.array(x.reshape(-1, x.shape[-1]).astype(mx.float32)),
                            np.array(indices.reshape(-1, indices.shape[-1]))))
        return self.inner(x, indices)


def capture_inputs(model, tokens: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """MoE inputs and routing of each MoE layer on ``tokens`` (stock model)."""
    from .core.discovery import find_expert_sites

    sites = find_expert_sites(model)
    caught = {s.layer: [] for s in sites}
    for s in sites:
        s.parent.update_modules({s.attr: _Capture(s.module, caught[s.layer])})
    mx.eval(model(mx.array(tokens)[None]))
    for s in sites:
        s.parent.update_modules({s.attr: s.module})
    return {li: (np.concatenate([a for a, _ in v]), np.concatenate([b for _, b in v]))
            for li, v in caught.items()}


def _dense(parts: dict, layout, proj: str) -> mx.array:
    q = layout.quant[proj]
    w = parts[f"{proj}.weight"]
    if q is not None:
        w = mx.dequantize(w, parts[f"{proj}.scales"], parts.get(f"{proj}.biases"),
                          q.group_size, q.bits, mode=q.mode)
    return w.astype(mx.float32)


def _expert(meta: ExpertMeta, reader: RecordReader, layer: int, e: int) -> dict:
    lay = meta.layers[layer]
    buf = aligned_buffer(lay.stride).reshape(1, lay.stride)
    reader.read(layer, [e], buf)
    return _parts_of(lay, buf[0])


def projection_errors(source: ExpertMeta, other: ExpertMeta, inputs: dict,
                      experts_per_layer: int = 4) -> dict[int, dict[str, float]]:
    """Relative output error of each projection, per layer, over the most routed experts."""
    readers = []
    for meta in (source, other):
        r = RecordReader(threads=1)
        for li in meta.layers:
            r.open(li, meta.file(li), meta.layers[li].stride)
        readers.append(r)
    out = {}
    for li, (x, ids) in inputs.items():
        if li not in source.layers or li not in other.layers:
            continue
        counts = np.bincount(ids.reshape(-1), minlength=source.num_experts)
        errs: dict[str, list] = {}
        for e in np.argsort(-counts)[:experts_per_layer]:
            rows = np.nonzero((ids == e).any(-1))[0][:128]
            if not len(rows):
                continue
            xe = mx.array(x[rows])
            a = _expert(source, readers[0], li, int(e))
            b = _expert(other, readers[1], li, int(e))
            projs = list(source.layers[li].quant)
            ins = {p: xe for p in projs}
            if "down_proj" in projs and "gate_proj" in projs:
                g = xe @ _dense(a, source.layers[li], "gate_proj").T
                u = xe @ _dense(a, source.layers[li], "up_proj").T
                ins["down_proj"] = nn.silu(g) * u
            for p in projs:
                wa, wb = _dense(a, source.layers[li], p), _dense(b, other.layers[li], p)
                if ins[p].shape[-1] != wa.shape[-1]:
                    continue
                ya, yb = ins[p] @ wa.T, ins[p] @ wb.T
                err = mx.linalg.norm(yb - ya) / mx.maximum(mx.linalg.norm(ya), 1e-12)
                errs.setdefault(p, []).append(err.item())
        out[li] = {p: float(np.mean(v)) for p, v in errs.items()}
    for r in readers:
        r.close()
    return out


def compare_distributions(model_a, model_b, tokens: list[int]) -> dict:
    """KL(P_a || P_b) (mean over positions, nats) and top-1 agreement on ``tokens``."""
    x = mx.array(tokens)[None]
    la = model_a(x).astype(mx.float32)
    lb = model_b(x).astype(mx.float32)
    pa = la - mx.logsumexp(la, axis=-1, keepdims=True)
    pb = lb - mx.logsumexp(lb, axis=-1, keepdims=True)
    kl = (mx.exp(pa) * (pa - pb)).sum(-1)
    agree = mx.argmax(la, -1) == mx.argmax(lb, -1)
    mx.eval(kl, agree)
    return {"kl": max(0.0, float(kl.mean().item())), "kl_max": float(kl.max().item()),
            "top1_agreement": float(agree.astype(mx.float32).mean().item()),
            "positions": len(tokens)}
