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

from ..core.format import ExpertMeta, parts_of
from ..core.io.reader import RecordReader, aligned_buffer
from ..planning.allocate import climb
from ..prep.requantize import target_group
from .capture import capture_inputs

QUALITY_TEXT = (
    "A mixture of experts model routes each token to a few experts. The experts that "
    "are not used stay on disk. Caches keep recently used experts close at hand, and a "
    "planner tells how much memory buys how much speed. " * 8
)


def capture_arrays(model, tokens: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``capture_inputs`` as float32 / int NumPy arrays."""
    return {
        li: (np.array(x.astype(mx.float32)), np.array(i))
        for li, (x, i) in capture_inputs(model, tokens).items()
    }


def _dense(parts: dict, layout, proj: str) -> mx.array:
    q = layout.quant[proj]
    w = parts[f"{proj}.weight"]
    if q is not None:
        w = mx.dequantize(
            w,
            parts[f"{proj}.scales"],
            parts.get(f"{proj}.biases"),
            q.group_size,
            q.bits,
            mode=q.mode,
        )
    return w.astype(mx.float32)


def _expert(meta: ExpertMeta, reader: RecordReader, layer: int, e: int) -> dict:
    lay = meta.layers[layer]
    buf = aligned_buffer(lay.stride).reshape(1, lay.stride)
    reader.read(layer, [e], buf)
    return parts_of(lay, buf[0])


def projection_errors(
    source: ExpertMeta, other: ExpertMeta, inputs: dict, experts_per_layer: int = 4
) -> dict[int, dict[str, float]]:
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
    return {
        "kl": max(0.0, float(kl.mean().item())),
        "kl_max": float(kl.max().item()),
        "top1_agreement": float(agree.astype(mx.float32).mean().item()),
        "positions": len(tokens),
    }


def error_table(
    source: ExpertMeta,
    inputs: dict,
    candidates=(2, 3, 4, 8),
    experts_per_layer: int = 4,
    group_size: int | None = None,
    progress: bool | None = None,
) -> dict:
    """``{layer: {proj: {bits: relative error}}}`` of quantizing the source's most routed
    experts to each candidate bit width (in memory, nothing written); a progress bar on
    a terminal."""
    from tqdm import tqdm

    from ..core.format import Quant
    from ..prep.requantize import requantize_expert

    reader = RecordReader(threads=1)
    for li in source.layers:
        reader.open(li, source.file(li), source.layers[li].stride)
    table = {}
    for li, (x, ids) in tqdm(
        inputs.items(),
        desc="calibrate bits",
        unit="layer",
        disable=None if progress is None else not progress,
    ):
        if li not in source.layers:
            continue
        lay = source.layers[li]
        counts = np.bincount(ids.reshape(-1), minlength=source.num_experts)
        acc: dict = {}
        for e in np.argsort(-counts)[:experts_per_layer]:
            rows = np.nonzero((ids == e).any(-1))[0][:128]
            if not len(rows):
                continue
            xe = mx.array(x[rows])
            a = _expert(source, reader, li, int(e))
            for b in candidates:
                tgt = {p: Quant(b, target_group(q, group_size)) for p, q in lay.quant.items()}
                new = requantize_expert(lay, a, tgt)
                for p in lay.quant:
                    wa = _dense(a, lay, p)
                    wb = _dense(new, type("L", (), {"quant": tgt})(), p)
                    xin = xe if wa.shape[-1] == xe.shape[-1] else None
                    if xin is None and "gate_proj" in lay.quant:
                        xin = nn.silu(xe @ _dense(a, lay, "gate_proj").T) * (
                            xe @ _dense(a, lay, "up_proj").T
                        )
                    if xin is None:
                        continue
                    ya, yb = xin @ wa.T, xin @ wb.T
                    err = (mx.linalg.norm(yb - ya) / mx.maximum(mx.linalg.norm(ya), 1e-12)).item()
                    acc.setdefault(p, {}).setdefault(b, []).append(err)
        table[li] = {p: {b: float(np.mean(v)) for b, v in d.items()} for p, d in acc.items()}
    reader.close()
    return table


def proj_bytes(layout, proj: str, bits: int, group_size: int) -> int:
    """Bytes one expert's projection takes at ``bits`` (packed weight, scales, biases)."""
    w = next(p for p in layout.parts if p.name == f"{proj}.weight")
    q = layout.quant[proj]
    out_dims = w.shape[0]
    in_dims = w.shape[1] * 32 // q.bits if q else w.shape[1]  # packed uint32 words (3, 5, 6
    # bits do not divide 32: a word holds 32 / bits values on average)
    scale_bytes = 2 if layout.parts[0].dtype in ("bfloat16", "float16") else 4
    for p in layout.parts:
        if p.name == f"{proj}.scales":
            scale_bytes = p.nbytes // (p.shape[0] * p.shape[1])
    return quantized_bytes(out_dims, in_dims, bits, group_size, scale_bytes)


def quantized_bytes(
    out_dims: int, in_dims: int, bits: int, group_size: int, scale_bytes: int
) -> int:
    """Bytes of an ``out_dims x in_dims`` matrix quantized at ``bits`` with affine
    groups: packed weights, then a scale and a bias per group."""
    return out_dims * in_dims * bits // 8 + 2 * out_dims * (in_dims // group_size) * scale_bytes


def allocate_bits(
    source: ExpertMeta, table: dict, target_bytes: int, group_size: int | None = None
) -> tuple[dict, dict]:
    """Bits per layer and projection minimising the summed error within ``target_bytes``
    of expert data (greedy upgrades by error saved per byte), and the uniform choice
    that fits the same bytes, for comparison: ``(layer_bits, report)``. Upgrades go
    greedily by error saved per byte (``planning.allocate.climb``)."""
    cands = sorted({b for d in table.values() for pd in d.values() for b in pd})
    E = source.num_experts
    keys = [(li, p) for li in sorted(table) for p in sorted(table[li])]
    size = {
        (li, p, b): proj_bytes(
            source.layers[li], p, b, target_group(source.layers[li].quant[p], group_size)
        )
        * E
        for li, p in keys
        for b in cands
    }
    floor = sum(size[(*k, cands[0])] for k in keys)
    if floor > target_bytes:
        raise ValueError(
            f"even {cands[0]}-bit experts need {floor / 1e9:.3f} GB; raise --target-gb"
        )
    at = climb(
        [len(cands)] * len(keys),
        lambda i, a: size[(*keys[i], cands[a])],
        lambda i, a: -table[keys[i][0]][keys[i][1]][cands[a]],
        target_bytes,
    )
    choice = {k: cands[a] for k, a in zip(keys, at)}
    used = sum(size[(*k, b)] for k, b in choice.items())
    uniform = max(
        (b for b in cands if sum(size[(*k, b)] for k in keys) <= target_bytes), default=None
    )
    err = float(np.mean([table[k[0]][k[1]][b] for k, b in choice.items()]))
    report = {"target_bytes": target_bytes, "bytes": used, "mean_error": err}
    if uniform is not None:
        report.update(
            uniform_bits=uniform,
            uniform_bytes=sum(size[(*k, uniform)] for k in keys),
            uniform_mean_error=float(np.mean([table[k[0]][k[1]][uniform] for k in keys])),
        )
    layer_bits: dict = {}
    for (li, p), b in choice.items():
        layer_bits.setdefault(str(li), {})[p] = b
    return layer_bits, report


def quality_report(
    model: str,
    expert_dir: str,
    source_expert_dir: str | None = None,
    tokens: int = 256,
    text: str | None = None,
) -> dict:
    """Per-projection errors and end-to-end KL/top-1 of the requantized ``expert_dir``
    against its source (stock ``model`` with its own experts)."""
    from mlx_lm import load as mlx_load

    from ..core.meta import load_meta
    from ..model_builder import load

    new = load_meta(expert_dir)
    src = load_meta(source_expert_dir or new.extra.get("requantized_from") or expert_dir)
    stock, tok = mlx_load(model)
    ids = tok.encode(text or QUALITY_TEXT)[:tokens]
    errors = projection_errors(src, new, capture_arrays(stock, ids))
    streamed, _, store = load(model, expert_dir, slots=new.num_experts)
    e2e = compare_distributions(stock, streamed, ids)
    store.close()
    return {
        "expert_dir": expert_dir,
        "dims": new.dims,
        "expert_bytes": new.expert_bytes(),
        "source_expert_bytes": src.expert_bytes(),
        "projection_error": {str(k): v for k, v in errors.items()},
        "mean_projection_error": {
            p: round(sum(v[p] for v in errors.values() if p in v) / len(errors), 6)
            for p in next(iter(errors.values()))
        },
        **e2e,
        "note": "random-weight models: a relative guide only",
    }


def choose_bits(
    src: str, target_gb: float, model: str | None = None, group_size: int | None = None
) -> tuple[dict, dict]:
    """Bits per layer and projection for ``requantize --target-gb``: the measured error of
    each width on real inputs, allocated under the byte target (``allocate_bits``)."""
    from ..core.meta import load_meta
    from ..model_builder import load

    meta = load_meta(src)
    streamed, tok, store = load(model or meta.source, src, slots=meta.num_experts)
    inputs = capture_arrays(streamed, tok.encode(QUALITY_TEXT)[:256])
    store.close()
    table = error_table(meta, inputs, group_size=group_size)
    return allocate_bits(meta, table, int(target_gb * 1e9), group_size)
