"""The on-disk format of an expert directory.

An expert directory holds one file per MoE layer (``layer_XXX.bin``) whose record ``e``
is expert ``e``: all its projections' parts (weights, scales, biases, linear biases) back
to back, at offset ``e * stride``, with ``stride`` a multiple of 4 KiB so that one aligned
read fetches one expert. ``_split_meta.json``, written last and atomically, is the only
authority on the layout, the quantization and the checksums; nothing is guessed from
file names. This module reads, validates and writes that meta; it does no I/O on records.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
import xxhash

FORMAT = "mlx_streaming.experts"
VERSION = 1
META_NAME = "_split_meta.json"
ALIGN = 4096  # record stride alignment (O_DIRECT and page size)
PART_ALIGN = 64  # alignment of each part inside a record
CHECKSUM = "xxh3_64"
QUANT_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")

# dtype name -> (numpy storage dtype, mlx dtype)
DTYPES = {
    "uint32": (np.uint32, mx.uint32),
    "uint16": (np.uint16, mx.uint16),
    "uint8": (np.uint8, mx.uint8),
    "int8": (np.int8, mx.int8),
    "int32": (np.int32, mx.int32),
    "float32": (np.float32, mx.float32),
    "float16": (np.float16, mx.float16),
    "bfloat16": (np.uint16, mx.bfloat16),  # numpy has no bf16: raw 16-bit storage
}
_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class ExpertDirError(ValueError):
    """An expert directory is missing, incomplete, corrupt or from another model."""


def mx_dtype_name(dtype) -> str:
    for name, (_, mdt) in DTYPES.items():
        if mdt == dtype:
            return name
    raise ExpertDirError(f"dtype {dtype} cannot be stored in an expert record")


def record_checksum(buf) -> str:
    """Checksum of one record's bytes (the padding after them excluded)."""
    return xxhash.xxh3_64_hexdigest(buf)


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Part:
    """One tensor of an expert record: ``gate_proj.weight``, ``down_proj.scales``..."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        nb = math.prod(self.shape) * np.dtype(DTYPES[self.dtype][0]).itemsize
        object.__setattr__(self, "nbytes", nb)

    @property
    def projection(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def param(self) -> str:
        return self.name.rsplit(".", 1)[1]


@dataclass(frozen=True)
class Quant:
    """How a projection's weight is quantized (absent for float weights)."""

    bits: int
    group_size: int
    mode: str = "affine"


@dataclass(frozen=True)
class LayerLayout:
    """Record layout of one MoE layer's expert file."""

    layer: int
    module: str  # dotted path of the expert module in the model
    file: str
    num_experts: int
    record_bytes: int
    stride: int
    parts: tuple[Part, ...]
    quant: dict  # projection name -> Quant | None (float)
    checksums: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def part(self, name: str) -> Part:
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(name)

    def proj_bits(self) -> dict[str, int | None]:
        return {n: (q.bits if q else None) for n, q in self.quant.items()}

    def to_json(self) -> dict:
        return {
            "module": self.module,
            "file": self.file,
            "num_experts": self.num_experts,
            "record_bytes": self.record_bytes,
            "stride": self.stride,
            "parts": [
                {"name": p.name, "offset": p.offset, "shape": list(p.shape), "dtype": p.dtype}
                for p in self.parts
            ],
            "quant": {
                n: ({"bits": q.bits, "group_size": q.group_size, "mode": q.mode} if q else None)
                for n, q in self.quant.items()
            },
            "checksums": list(self.checksums),
        }


def plan_layout(layer: int, module: str, file: str, num_experts: int,
                tensors: list[tuple[str, tuple[int, ...], str]], quant: dict) -> LayerLayout:
    """Lay out one expert's tensors ``(name, per-expert shape, dtype)`` in a record."""
    parts, off = [], 0
    for name, shape, dtype in tensors:
        off = align_up(off, PART_ALIGN)
        p = Part(name, off, tuple(int(s) for s in shape), dtype)
        parts.append(p)
        off += p.nbytes
    return LayerLayout(layer, module, file, num_experts, off, align_up(off, ALIGN),
                       tuple(parts), dict(quant))


@dataclass(frozen=True)
class ExpertMeta:
    """The validated contents of ``_split_meta.json``."""

    root: Path
    fingerprint: dict
    model_type: str
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    dims: dict
    layers: dict  # layer index -> LayerLayout
    source: str = ""
    extra: dict = field(default_factory=dict)

    def file(self, layer: int) -> Path:
        return self.root / self.layers[layer].file

    def expert_bytes(self, layer: int | None = None) -> int:
        """Bytes one expert occupies in a pool slot (records without padding)."""
        if layer is None:
            return max(lay.record_bytes for lay in self.layers.values())
        return self.layers[layer].record_bytes

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "checksum": CHECKSUM,
            "source": self.source,
            "model_type": self.model_type,
            "fingerprint": self.fingerprint,
            "moe_layers": list(self.moe_layers),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "dims": self.dims,
            "layers": {str(k): v.to_json() for k, v in sorted(self.layers.items())},
            **self.extra,
        }


def parts_of(layout: LayerLayout, record: np.ndarray) -> dict[str, mx.array]:
    """The parts of one record's bytes as MLX arrays ``{part name: array}``."""
    out = {}
    for p in layout.parts:
        np_dt, mx_dt = DTYPES[p.dtype]
        a = mx.array(record[p.offset:p.offset + p.nbytes].view(np_dt).reshape(p.shape))
        out[p.name] = a.view(mx_dt) if a.dtype != mx_dt else a
    return out


def summarize_dims(layouts: dict, hidden: int, moe_inter: int) -> dict:
    """The seed-facing ``dims`` entry: dominant bits / group size plus mixed precision."""
    per_layer = {li: lay.proj_bits() for li, lay in layouts.items()}
    quants = [q for lay in layouts.values() for q in lay.quant.values() if q]
    bits_list = [q.bits for q in quants]
    dims = {
        "hidden": hidden,
        "moe_inter": moe_inter,
        "bits": max(set(bits_list), key=bits_list.count) if quants else None,
        "group_size": quants[0].group_size if quants else None,
        "mode": quants[0].mode if quants else None,
        "dtype": None,
    }
    distinct = {json.dumps(v, sort_keys=True) for v in per_layer.values()}
    if len(distinct) > 1:
        dims["per_layer_proj_bits"] = {str(k): v for k, v in sorted(per_layer.items())}
    first = next(iter(per_layer.values()))
    if len(set(first.values())) > 1 or len(distinct) > 1:
        dims["proj_bits"] = first
    return dims


# ---------------------------------------------------------------- validation


def _req(d: dict, key: str, typ, where: str):
    if key not in d:
        raise ExpertDirError(f"{where}: missing '{key}'")
    v = d[key]
    ok = isinstance(v, typ) and not (typ is int and isinstance(v, bool))
    if not ok:
        raise ExpertDirError(f"{where}: '{key}' must be {getattr(typ, '__name__', typ)}, got {v!r}")
    return v


def _nonneg(v, what: str, where: str):
    if v < 0:
        raise ExpertDirError(f"{where}: {what} must be >= 0, got {v}")
    return v


def _layer_from_json(li: int, d: dict, where: str, root: Path) -> LayerLayout:
    if not isinstance(d, dict):
        raise ExpertDirError(f"{where}: layer {li} must be an object")
    w = f"{where} layer {li}"
    file = _req(d, "file", str, w)
    if not _FILE_RE.match(file) or ".." in file:
        raise ExpertDirError(
            f"{w}: file name {file!r} is not a plain name inside the expert directory "
            "(no '/', '..' or absolute paths); the meta is corrupt or hostile: split again"
        )
    path = root / file
    if path.is_symlink() and root.resolve() not in path.resolve().parents:
        raise ExpertDirError(f"{w}: {path} is a symlink leading out of {root}; refusing it")
    ne = _req(d, "num_experts", int, w)
    rb = _req(d, "record_bytes", int, w)
    stride = _req(d, "stride", int, w)
    if ne <= 0 or rb <= 0 or stride < rb or stride % ALIGN:
        raise ExpertDirError(
            f"{w}: bad record geometry num_experts={ne} record_bytes={rb} stride={stride} "
            f"(stride must be >= record_bytes and a multiple of {ALIGN})"
        )
    parts = []
    for i, p in enumerate(_req(d, "parts", list, w)):
        pw = f"{w} part {i}"
        if not isinstance(p, dict):
            raise ExpertDirError(f"{pw}: must be an object")
        dt = _req(p, "dtype", str, pw)
        if dt not in DTYPES:
            raise ExpertDirError(f"{pw}: unknown dtype {dt!r} (known: {sorted(DTYPES)})")
        shape = _req(p, "shape", list, pw)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape):
            raise ExpertDirError(f"{pw}: shape must be a list of positive ints, got {shape!r}")
        part = Part(_req(p, "name", str, pw), _nonneg(_req(p, "offset", int, pw), "offset", pw),
                    tuple(shape), dt)
        if part.offset + part.nbytes > rb:
            raise ExpertDirError(f"{pw}: {part.name} ends at {part.offset + part.nbytes}, "
                                 f"past record_bytes={rb}")
        parts.append(part)
    if not parts:
        raise ExpertDirError(f"{w}: no parts")
    quant = {}
    for name, q in _req(d, "quant", dict, w).items():
        if q is None:
            quant[name] = None
            continue
        qw = f"{w} quant {name}"
        if not isinstance(q, dict):
            raise ExpertDirError(f"{qw}: must be an object or null")
        bits = _req(q, "bits", int, qw)
        gs = _req(q, "group_size", int, qw)
        mode = q.get("mode", "affine")
        if bits not in (2, 3, 4, 5, 6, 8) or gs not in (16, 32, 64, 128) or mode not in QUANT_MODES:
            raise ExpertDirError(
                f"{qw}: unsupported quantization bits={bits} group_size={gs} mode={mode!r} "
                "(bits 2-8, group size 16/32/64/128)"
            )
        quant[name] = Quant(bits, gs, mode)
    projs = {p.projection for p in parts}
    if set(quant) != projs:
        raise ExpertDirError(f"{w}: quant entries {sorted(quant)} do not match parts {sorted(projs)}")
    sums = d.get("checksums", [])
    if not isinstance(sums, list) or len(sums) not in (0, ne) or not all(
        isinstance(s, str) and re.fullmatch(r"[0-9a-f]{16}", s) for s in sums
    ):
        raise ExpertDirError(f"{w}: checksums must be {ne} hex strings of 16 characters")
    module = _req(d, "module", str, w)
    return LayerLayout(li, module, file, ne, rb, stride, tuple(parts), quant, tuple(sums))


def meta_from_json(d: dict, root: Path, where: str = META_NAME) -> ExpertMeta:
    """Validate a parsed meta dict (schema, types, ranges, paths)."""
    if not isinstance(d, dict):
        raise ExpertDirError(f"{where}: not a JSON object")
    if d.get("format") != FORMAT:
        raise ExpertDirError(f"{where}: not an mlx_streaming expert directory meta "
                             f"(format={d.get('format')!r}); split the model again")
    version = _req(d, "version", int, where)
    if version != VERSION:
        raise ExpertDirError(f"{where}: format version {version}, this mlx_streaming reads "
                             f"version {VERSION}: split the model again or upgrade")
    if d.get("checksum", CHECKSUM) != CHECKSUM:
        raise ExpertDirError(f"{where}: unknown checksum {d.get('checksum')!r}")
    fp = _req(d, "fingerprint", dict, where)
    moe_layers = _req(d, "moe_layers", list, where)
    if not moe_layers or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                 for x in moe_layers):
        raise ExpertDirError(f"{where}: moe_layers must be a non-empty list of layer indices")
    ne = _req(d, "num_experts", int, where)
    top_k = _req(d, "top_k", int, where)
    if ne <= 0 or not 0 < top_k <= ne:
        raise ExpertDirError(f"{where}: need 0 < top_k <= num_experts, got {top_k}, {ne}")
    dims = _req(d, "dims", dict, where)
    for key in ("hidden", "moe_inter"):
        v = _req(dims, key, int, f"{where} dims")
        if v <= 0:
            raise ExpertDirError(f"{where} dims: {key} must be positive, got {v}")
    layers_d = _req(d, "layers", dict, where)
    layers = {}
    for k, v in layers_d.items():
        if not k.isdigit():
            raise ExpertDirError(f"{where}: layer key {k!r} is not a layer index")
        layers[int(k)] = _layer_from_json(int(k), v, where, root)
    if sorted(layers) != sorted(moe_layers):
        raise ExpertDirError(f"{where}: layers {sorted(layers)} != moe_layers {sorted(moe_layers)}")
    extra = {k: v for k, v in d.items() if k not in {
        "format", "version", "checksum", "source", "model_type", "fingerprint", "moe_layers",
        "num_experts", "top_k", "dims", "layers"}}
    return ExpertMeta(root, fp, str(d.get("model_type", "")), tuple(moe_layers), ne, top_k,
                      dims, layers, str(d.get("source", "")), extra)


def load_meta(expert_dir: str | Path, check_files: bool = True) -> ExpertMeta:
    """Read and validate ``expert_dir/_split_meta.json``.

    Raises:
        ExpertDirError: missing directory or meta, invalid meta, or (with ``check_files``)
            a layer file that is missing or shorter than its records.
    """
    root = Path(expert_dir)
    if not root.is_dir():
        raise ExpertDirError(f"expert directory {root} does not exist: split the model first "
                             "(python -m mlx_streaming split MODEL --expert-dir DIR)")
    path = root / META_NAME
    if not path.is_file():
        raise ExpertDirError(f"{path} is missing: {root} is not a complete expert directory "
                             "(an interrupted split?); run the split again to finish it")
    try:
        with open(path) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExpertDirError(f"{path} is not valid JSON ({e}); split the model again") from e
    meta = meta_from_json(d, root, str(path))
    if check_files:
        for lay in meta.layers.values():
            f = root / lay.file
            if not f.is_file():
                raise ExpertDirError(f"{f} is missing; split the model again into {root}")
            need = lay.num_experts * lay.stride
            size = f.stat().st_size
            if size < need:
                raise ExpertDirError(
                    f"{f} is truncated ({size} bytes, its {lay.num_experts} records need "
                    f"{need}); split the model again into a fresh directory"
                )
    return meta


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write JSON to ``path`` through a temporary file, fsync'd, then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def config_hash(config: dict) -> str:
    """Hash of a model config, ignoring how its weights are quantized."""
    skip = {"quantization", "quantization_config", "_name_or_path"}
    canon = json.dumps({k: v for k, v in config.items() if k not in skip}, sort_keys=True,
                       default=str)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def shapes_hash(shapes: dict) -> str:
    """Hash of ``{name: shape}`` of a model's trunk parameters."""
    canon = json.dumps({k: list(v) for k, v in sorted(shapes.items())})
    return hashlib.sha256(canon.encode()).hexdigest()[:16]
