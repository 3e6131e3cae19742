"""Reading an expert directory's ``_split_meta.json``: schema, types, ranges and paths
checked, each error naming the file and the fix."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .format import (
    ALIGN,
    CHECKSUM,
    DTYPES,
    FORMAT,
    META_NAME,
    QUANT_MODES,
    VERSION,
    ExpertDirError,
    ExpertMeta,
    LayerLayout,
    Part,
    Quant,
)

FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a plain file name


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
    if not FILE_RE.match(file) or ".." in file:
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
        part = Part(
            _req(p, "name", str, pw),
            _nonneg(_req(p, "offset", int, pw), "offset", pw),
            tuple(shape),
            dt,
        )
        if part.offset + part.nbytes > rb:
            raise ExpertDirError(
                f"{pw}: {part.name} ends at {part.offset + part.nbytes}, past record_bytes={rb}"
            )
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
        raise ExpertDirError(
            f"{w}: quant entries {sorted(quant)} do not match parts {sorted(projs)}"
        )
    sums = d.get("checksums", [])
    if (
        not isinstance(sums, list)
        or len(sums) not in (0, ne)
        or not all(isinstance(s, str) and re.fullmatch(r"[0-9a-f]{16}", s) for s in sums)
    ):
        raise ExpertDirError(f"{w}: checksums must be {ne} hex strings of 16 characters")
    module = _req(d, "module", str, w)
    return LayerLayout(li, module, file, ne, rb, stride, tuple(parts), quant, tuple(sums))


def meta_from_json(d: dict, root: Path, where: str = META_NAME) -> ExpertMeta:
    """Validate a parsed meta dict (schema, types, ranges, paths)."""
    if not isinstance(d, dict):
        raise ExpertDirError(f"{where}: not a JSON object")
    if d.get("format") != FORMAT:
        raise ExpertDirError(
            f"{where}: not an mlx_streaming expert directory meta "
            f"(format={d.get('format')!r}); split the model again"
        )
    version = _req(d, "version", int, where)
    if version != VERSION:
        raise ExpertDirError(
            f"{where}: format version {version}, this mlx_streaming reads "
            f"version {VERSION}: split the model again or upgrade"
        )
    if d.get("checksum", CHECKSUM) != CHECKSUM:
        raise ExpertDirError(f"{where}: unknown checksum {d.get('checksum')!r}")
    fp = _req(d, "fingerprint", dict, where)
    moe_layers = _req(d, "moe_layers", list, where)
    if not moe_layers or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in moe_layers
    ):
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
    model_layers = d.get("model_moe_layers", [])
    if not isinstance(model_layers, list) or not set(moe_layers) <= set(model_layers or moe_layers):
        raise ExpertDirError(f"{where}: model_moe_layers must list every layer in moe_layers")
    extra = {
        k: v
        for k, v in d.items()
        if k
        not in {
            "format",
            "version",
            "checksum",
            "source",
            "model_type",
            "fingerprint",
            "moe_layers",
            "num_experts",
            "top_k",
            "dims",
            "layers",
            "model_moe_layers",
        }
    }
    return ExpertMeta(
        root,
        fp,
        str(d.get("model_type", "")),
        tuple(moe_layers),
        ne,
        top_k,
        dims,
        layers,
        str(d.get("source", "")),
        extra,
        tuple(model_layers),
    )


def load_meta(expert_dir: str | Path, check_files: bool = True) -> ExpertMeta:
    """Read and validate ``expert_dir/_split_meta.json``.

    Raises:
        ExpertDirError: missing directory or meta, invalid meta, or (with ``check_files``)
            a layer file that is missing or shorter than its records.
    """
    root = Path(expert_dir)
    if not root.is_dir():
        raise ExpertDirError(
            f"expert directory {root} does not exist: split the model first "
            "(python -m mlx_streaming split MODEL --expert-dir DIR)"
        )
    path = root / META_NAME
    if not path.is_file():
        raise ExpertDirError(
            f"{path} is missing: {root} is not a complete expert directory "
            "(an interrupted split?); run the split again to finish it"
        )
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
