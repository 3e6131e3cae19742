"""The on-disk format of an expert directory.

An expert directory holds one file per MoE layer (``layer_XXX.bin``) whose record ``e``
is expert ``e``: all its projections' parts (weights, scales, biases, linear biases) back
to back, at offset ``e * stride``, with ``stride`` a multiple of 4 KiB so that one aligned
read fetches one expert. ``_split_meta.json``, written last and atomically, is the only
authority on the layout, the quantization and the checksums; nothing is guessed from
file names. This module defines the layout and writes the meta (``meta`` reads and
validates it); it does no I/O on records.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field, replace
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


class ExpertDirError(ValueError):
    """An expert directory is missing, incomplete, corrupt or from another model."""


class ExpertChecksumError(ExpertDirError):
    """A record read from disk does not match its checksum."""


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


def plan_layout(
    layer: int,
    module: str,
    file: str,
    num_experts: int,
    tensors: list[tuple[str, tuple[int, ...], str]],
    quant: dict,
) -> LayerLayout:
    """Lay out one expert's tensors ``(name, per-expert shape, dtype)`` in a record."""
    parts, off = [], 0
    for name, shape, dtype in tensors:
        off = align_up(off, PART_ALIGN)
        p = Part(name, off, tuple(int(s) for s in shape), dtype)
        parts.append(p)
        off += p.nbytes
    return LayerLayout(
        layer, module, file, num_experts, off, align_up(off, ALIGN), tuple(parts), dict(quant)
    )


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
    # Every MoE layer of the model, where this directory holds only some (a pipeline
    # rank's share, split on its own host); empty: the directory holds them all.
    model_layers: tuple[int, ...] = ()

    @property
    def complete(self) -> bool:
        """Whether every MoE layer of the model is split here."""
        return not self.model_layers or set(self.model_layers) <= set(self.layers)

    def missing(self) -> list[int]:
        """The model's MoE layers that are not split here."""
        return sorted(set(self.model_layers) - set(self.layers))

    def subset(self, layers) -> ExpertMeta:
        """This meta restricted to ``layers`` (a pipeline rank's own MoE layers)."""
        keep = sorted(set(layers))
        absent = [li for li in keep if li not in self.layers]
        if absent:
            raise ExpertDirError(
                f"expert directory {self.root} holds no split of layers {absent}; split "
                "them with python -m mlx_streaming split (or load with this pipeline)"
            )
        return replace(
            self,
            moe_layers=tuple(keep),
            layers={li: self.layers[li] for li in keep},
            model_layers=self.model_layers or tuple(sorted(self.layers)),
        )

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
            **({} if self.complete else {"model_moe_layers": list(self.model_layers)}),
            **self.extra,
        }


def parts_of(layout: LayerLayout, record: np.ndarray) -> dict[str, mx.array]:
    """The parts of one record's bytes as MLX arrays ``{part name: array}``."""
    out = {}
    for p in layout.parts:
        np_dt, mx_dt = DTYPES[p.dtype]
        a = mx.array(record[p.offset : p.offset + p.nbytes].view(np_dt).reshape(p.shape))
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


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to ``path`` through a temporary file of its own (writers of one path,
    e.g. a pipeline's ranks on one host, never share one), fsync'd, then renamed: the
    path holds the old content or the new, never a part; nothing is left on failure."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # as open() would have made it, not mkstemp's 0o600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
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
    canon = json.dumps(
        {k: v for k, v in config.items() if k not in skip}, sort_keys=True, default=str
    )
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def shapes_hash(shapes: dict) -> str:
    """Hash of ``{name: shape}`` of a model's trunk parameters."""
    canon = json.dumps({k: list(v) for k, v in sorted(shapes.items())})
    return hashlib.sha256(canon.encode()).hexdigest()[:16]
