"""Requantize an expert directory: fewer bits per expert, per projection or per layer.

Each projection of each expert is dequantized from its source format (affine 4/8-bit,
or float) and quantized again with MLX's own ``mx.quantize``; a projection whose target
equals its source format is copied byte for byte. The result is a complete expert
directory whose meta records ``bits``, ``group_size``, ``proj_bits`` and
``per_layer_proj_bits``, so streaming runs each projection at its own bits.
``model_out`` also writes a standard MLX model with the same experts stacked, which
stock mlx-lm loads (its config names the bits of every expert projection).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..core.format import (
    DTYPES,
    META_NAME,
    ExpertMeta,
    LayerLayout,
    Quant,
    mx_dtype_name,
    parts_of,
    plan_layout,
    summarize_dims,
    write_json_atomic,
)
from ..core.io.reader import RecordReader, aligned_buffer
from ..core.meta import load_meta
from .hub import resolve_model_path
from .split_experts import split_model
from .writer import prepare_out_dir, write_layer_file


def parse_proj_bits(spec: str | dict | None) -> dict[str, int] | None:
    """``"gate=2,up=2,down=3"`` (or a dict) -> ``{"gate_proj": 2, ...}``."""
    if spec is None or isinstance(spec, dict):
        return spec
    out = {}
    for item in spec.split(","):
        name, _, b = item.partition("=")
        if not b.isdigit():
            raise ValueError(f"--proj-bits entry {item!r} must look like gate=2")
        out[_proj_name(name)] = int(b)
    return out


def target_group(source, group_size: int | None) -> int:
    """The group size a projection is written at: the one asked for, else its source's
    (``source``: its ``Quant``, None when not quantized), else 64."""
    return group_size or (source.group_size if source else 64)


def _proj_name(name: str) -> str:
    """``gate`` -> ``gate_proj``; full names (and ``fc1``-style) as they are."""
    name = str(name).strip()
    return name if name.endswith("_proj") or name.startswith("fc") else f"{name}_proj"


def check_bit_specs(meta: ExpertMeta, proj_bits: dict | None, layer_bits: dict | None) -> dict:
    """Refuse, before anything is written, a ``proj_bits`` or ``layer_bits`` entry that
    would be ignored: an unknown projection or layer, or bits not given as a number;
    returns ``layer_bits`` keyed by layer with projection names completed."""
    projs = {p for lay in meta.layers.values() for p in lay.quant}
    for name in proj_bits or {}:
        if name not in projs:
            raise ValueError(f"--proj-bits names {name!r}: the projections are {sorted(projs)}")
    out = {}
    for key, v in (layer_bits or {}).items():
        if not str(key).isdigit() or int(key) not in meta.layers:
            raise ValueError(
                f"layer_bits names layer {key!r}: the MoE layers are {sorted(meta.layers)}"
            )
        if isinstance(v, dict):
            v = {_proj_name(n): b for n, b in v.items()}
            unknown = sorted(set(v) - projs)
            if unknown:
                raise ValueError(
                    f"layer_bits for layer {key} names {unknown}: the projections are "
                    f"{sorted(projs)}"
                )
            bad = [b for b in v.values() if isinstance(b, bool) or not isinstance(b, int)]
        else:
            bad = [v] if isinstance(v, bool) or not isinstance(v, int) else []
        if bad:
            raise ValueError(f"layer_bits for layer {key}: bits must be numbers, got {bad[0]!r}")
        out[int(key)] = v
    return out


def _targets(layout: LayerLayout, bits, group_size, proj_bits, layer_bits, mode) -> dict:
    """Target Quant of each projection of one layer."""
    want = {}
    lb = (layer_bits or {}).get(layout.layer)
    for proj in layout.quant:
        b = bits
        if proj_bits and proj in proj_bits:
            b = proj_bits[proj]
        if isinstance(lb, dict) and proj in lb:
            b = lb[proj]
        elif isinstance(lb, int):
            b = lb
        gs = target_group(layout.quant[proj], group_size)
        if b not in (2, 3, 4, 5, 6, 8):
            raise ValueError(
                f"bits {b} for layer {layout.layer} {proj} is not supported "
                "(use 2, 3, 4, 5, 6 or 8)"
            )
        want[proj] = Quant(int(b), int(gs), mode)
    return want


def requantize_expert(layout: LayerLayout, parts: dict, target: dict) -> dict[str, mx.array]:
    """New parts of one expert: each projection at its target quantization."""
    new = {}
    for proj, q_src in layout.quant.items():
        q = target[proj]
        w = parts[f"{proj}.weight"]
        if f"{proj}.bias" in parts:  # linear biases stay as they are
            new[f"{proj}.bias"] = parts[f"{proj}.bias"]
        if q_src == q:  # same format: the very bytes
            for n in ("weight", "scales", "biases"):
                if f"{proj}.{n}" in parts:
                    new[f"{proj}.{n}"] = parts[f"{proj}.{n}"]
            continue
        if q_src is not None:
            w = mx.dequantize(
                w,
                parts[f"{proj}.scales"],
                parts.get(f"{proj}.biases"),
                q_src.group_size,
                q_src.bits,
                mode=q_src.mode,
            )
        dtype = parts[f"{proj}.scales"].dtype if q_src is not None else w.dtype
        if w.shape[-1] % q.group_size:
            raise ValueError(
                f"{proj} input width {w.shape[-1]} is not a multiple of group size {q.group_size}"
            )
        qw, scales, *biases = mx.quantize(w.astype(dtype), q.group_size, q.bits, mode=q.mode)
        new[f"{proj}.weight"], new[f"{proj}.scales"] = qw, scales.astype(dtype)
        if biases:
            new[f"{proj}.biases"] = biases[0].astype(dtype)
    return new


class _RequantSource:
    """The split's ``rows(part, e0, e1)`` interface over requantized experts."""

    def __init__(self, reader, layer, src: LayerLayout, dst: LayerLayout, target):
        self.reader, self.layer, self.src, self.dst, self.target = reader, layer, src, dst, target
        self._block = None

    def _load(self, e0, e1):
        if self._block and self._block[0] == (e0, e1):
            return self._block[1]
        buf = aligned_buffer((e1 - e0) * self.src.stride).reshape(e1 - e0, self.src.stride)
        self.reader.read(self.layer, list(range(e0, e1)), buf)
        rows = {p.name: [] for p in self.dst.parts}
        for i in range(e1 - e0):
            new = requantize_expert(self.src, parts_of(self.src, buf[i]), self.target)
            mx.eval(new)
            for name, a in new.items():
                a = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
                rows[name].append(np.array(a).reshape(-1).view(np.uint8))
        block = {n: np.stack(v) for n, v in rows.items()}
        self._block = ((e0, e1), block)
        return block

    def rows(self, part, e0, e1):
        return self._load(e0, e1)[part.name]


def _dst_layout(src: LayerLayout, target: dict) -> LayerLayout:
    """Record layout after requantization (shapes from one expert run through it)."""
    dummy = {}
    for p in src.parts:
        dummy[p.name] = mx.zeros(p.shape, dtype=DTYPES[p.dtype][1])
    new = requantize_expert(src, dummy, target)
    tensors = [(n, a.shape, mx_dtype_name(a.dtype)) for n, a in sorted(new.items())]
    return plan_layout(src.layer, src.module, src.file, src.num_experts, tensors, target)


def requantized_layouts(
    layouts: dict[int, LayerLayout],
    bits: int,
    group_size: int | None = None,
    mode: str = "affine",
) -> dict[int, LayerLayout]:
    """Each layer's record layout as ``requantize`` would write it at ``bits`` (sizes only:
    one zero expert a layer runs through the requantization, nothing is read or written).

    Raises:
        ValueError: ``bits`` is not one MLX quantizes to, or a projection's width is not a
            multiple of the group size.
    """
    return {
        li: _dst_layout(lay, _targets(lay, bits, group_size, None, None, mode))
        for li, lay in layouts.items()
    }


def requantize(
    src: str | Path,
    out: str | Path,
    bits: int = 4,
    *,
    group_size: int | None = None,
    proj_bits: dict | str | None = None,
    layer_bits: dict | str | Path | None = None,
    mode: str = "affine",
    model_out: str | Path | None = None,
    model: str | Path | None = None,
    split_dir: str | Path | None = None,
    progress: bool | None = None,
) -> dict:
    """Requantize the experts of ``src`` (an expert directory, or a model to split first).

    Args:
        src: Expert directory or MLX model (directory or repo id).
        out: New expert directory.
        bits: Default bits of every projection.
        group_size: Quantization group size (default: the source's, else 64).
        proj_bits: ``{"gate_proj": 2, ...}`` or ``"gate=2,up=2,down=3"``.
        layer_bits: ``{layer: bits or {proj: bits}}``, or a JSON file of it.
        mode: MLX quantization mode.
        model_out: Also write a standard MLX model with these experts stacked.
        model: The source model (for ``model_out``; default: the one ``src`` was split from).
        split_dir: Where to split ``src`` when it is a model (``load``'s default expert
            directory when called from the command line).

    Returns:
        The new meta dict.
    """
    src = Path(src)
    if not (src / META_NAME).exists():
        if split_dir is None:
            raise ValueError(
                f"{src} is not an expert directory: give one, or pass split_dir "
                "to split the model there first"
            )
        model = model or src
        src = Path(split_dir)
        split_model(resolve_model_path(model), src, progress=progress)
    meta = load_meta(src)
    if isinstance(layer_bits, (str, Path)):
        try:
            layer_bits = json.loads(Path(layer_bits).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"layer bits file {layer_bits} is not valid JSON ({e})") from e
    proj_bits = parse_proj_bits(proj_bits)
    out = Path(out)
    if out.resolve() == Path(src).resolve():
        raise ValueError(
            "requantize writes a new expert directory: choose --out apart from the source"
        )
    if out.exists() and any(out.iterdir()) and not (out / META_NAME).exists():
        raise ValueError(f"--out {out} holds files but no expert directory: choose another")
    layer_bits = check_bit_specs(meta, proj_bits, layer_bits)
    targets = {  # every layer's, before anything is written
        li: _targets(meta.layers[li], bits, group_size, proj_bits, layer_bits, mode)
        for li in sorted(meta.layers)
    }
    final, out = out, out.with_name(out.name + ".partial")  # renamed once complete
    if out.exists():
        shutil.rmtree(out)
    prepare_out_dir(out)
    reader = RecordReader(threads=1)
    layouts = {}
    for li in tqdm(
        sorted(meta.layers),
        desc="requantize",
        unit="layer",
        disable=None if progress is None else not progress,
    ):
        lay = meta.layers[li]
        reader.open(li, meta.file(li), lay.stride)
        target = targets[li]
        dst = _dst_layout(lay, target)
        sums = write_layer_file(out / dst.file, _RequantSource(reader, li, lay, dst, target), dst)
        layouts[li] = LayerLayout(**{**dst.__dict__, "checksums": tuple(sums)})
    reader.close()
    dims = summarize_dims(layouts, meta.dims["hidden"], meta.dims["moe_inter"])
    dims["dtype"] = meta.dims.get("dtype")
    new = ExpertMeta(
        out,
        meta.fingerprint,
        meta.model_type,
        meta.moe_layers,
        meta.num_experts,
        meta.top_k,
        dims,
        layouts,
        meta.source,
        {"requantized_from": str(src)},
    )
    d = new.to_json()
    if model_out:
        write_model(model or meta.source, new, model_out)
    write_json_atomic(out / META_NAME, d)
    if final.exists():  # an expert directory (checked above), replaced only now
        shutil.rmtree(final)
    out.rename(final)
    return d


def write_model(model: str | Path, meta: ExpertMeta, out: str | Path) -> Path:
    """A standard MLX model: ``model``'s trunk with ``meta``'s experts stacked."""
    from mlx_lm.utils import make_shards, save_config

    model_dir = resolve_model_path(model)
    out = Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    quant = dict(config.get("quantization") or {})
    for li, lay in meta.layers.items():
        for name in [k for k in weights if k.startswith(lay.module + ".")]:
            del weights[name]
        data = np.fromfile(meta.file(li), dtype=np.uint8).reshape(lay.num_experts, lay.stride)
        for p in lay.parts:
            np_dt, mx_dt = DTYPES[p.dtype]
            a = mx.array(
                np.ascontiguousarray(data[:, p.offset : p.offset + p.nbytes])
                .view(np_dt)
                .reshape(lay.num_experts, *p.shape)
            )
            weights[f"{lay.module}.{p.name}"] = a.view(mx_dt) if a.dtype != mx_dt else a
        for proj, q in lay.quant.items():
            if q is not None:
                quant[f"{lay.module}.{proj}"] = {
                    "group_size": q.group_size,
                    "bits": q.bits,
                    "mode": q.mode,
                }
    if quant:
        first = next(q for lay in meta.layers.values() for q in lay.quant.values() if q)
        quant.setdefault("group_size", first.group_size)  # mlx-lm reads the defaults
        quant.setdefault("bits", first.bits)
        config["quantization"] = quant
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards = make_shards(weights)
    for i, shard in enumerate(shards):
        name = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        mx.save_safetensors(str(tmp / name), shard, metadata={"format": "mlx"})
    save_config(config, tmp / "config.json")
    for f in model_dir.iterdir():
        if (
            f.is_file()
            and not f.name.endswith(".safetensors")
            and f.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy(f, tmp / f.name)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
