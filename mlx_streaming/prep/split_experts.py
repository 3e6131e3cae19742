"""Split a checkpoint's experts into per-layer record files, once.

The checkpoint is read tensor by tensor (safetensors byte ranges, a block of experts at a
time), so a split never holds more than a block of one layer's experts in memory. Each
layer's file is written under a temporary name, fsync'd and renamed, with a sidecar that
records its layout and checksums; ``_split_meta.json`` is written last, atomically. An
interrupted split resumes from the layers that are complete; a complete directory
returns at once.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
from mlx.utils import tree_flatten
from tqdm import tqdm

from ..core.discovery import (
    expert_dims,
    find_expert_sites,
    fingerprint,
    fingerprint_mismatch,
    projections,
)
from ..core.format import (
    DTYPES,
    META_NAME,
    ExpertDirError,
    ExpertMeta,
    LayerLayout,
    Quant,
    mx_dtype_name,
    plan_layout,
    summarize_dims,
    write_json_atomic,
)
from ..core.io.safetensors import SafetensorsIndex
from ..core.meta import load_meta
from .hub import load_lazy, resolve_model_path
from .writer import LayerLocks, meta_lock, prepare_out_dir, write_layer_file


def _quant_of(proj) -> Quant | None:
    if "scales" not in proj:
        return None
    return Quant(proj.bits, proj.group_size, getattr(proj, "mode", "affine"))


def layer_layout(site, file: str) -> LayerLayout:
    """Record layout of one expert module, from its (lazy) parameters."""
    params = dict(tree_flatten(site.module.parameters()))
    e = site.num_experts
    tensors = []
    for name in sorted(params):
        arr = params[name]
        if arr.ndim == 0 or arr.shape[0] != e:
            raise ExpertDirError(
                f"{site.path}.{name} has shape {arr.shape}; expected a leading expert axis of {e}"
            )
        tensors.append((name, arr.shape[1:], mx_dtype_name(arr.dtype)))
    quant = {n: _quant_of(p) for n, p in projections(site.module)}
    return plan_layout(site.layer, site.path, file, e, tensors, quant)


class _ExpertSource:
    """Bytes of experts ``[e0, e1)`` of one part: straight from the safetensors byte range
    when the checkpoint stores the stacked tensor, else from the lazy mlx-lm parameter
    (checkpoints whose experts mlx-lm stacks in ``sanitize``)."""

    def __init__(self, index: SafetensorsIndex, site, layout: LayerLayout):
        self.index, self.site, self.layout = index, site, layout
        self.params = dict(tree_flatten(site.module.parameters()))
        self._evaluated: dict[str, np.ndarray] = {}

    def rows(self, part, e0: int, e1: int) -> np.ndarray:
        np_dtype = DTYPES[part.dtype][0]
        entry = self.index.get(f"{self.site.path}.{part.name}")
        full = (self.layout.num_experts, *part.shape)
        if entry is not None and entry.shape == full and entry.dtype == part.dtype:
            buf = self.index.read_rows(entry, e0, e1)
            return np.frombuffer(buf, dtype=np_dtype).reshape(e1 - e0, -1)
        if part.name not in self._evaluated:
            import mlx.core as mx

            arr = self.params[part.name]
            if arr.dtype == mx.bfloat16:
                arr = arr.view(mx.uint16)
            self._evaluated[part.name] = np.array(arr).reshape(full[0], -1)
        return self._evaluated[part.name][e0:e1]


def _sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def _done_layer(path: Path, layout: LayerLayout, fp: dict) -> tuple[str, ...] | None:
    """The checksums of a layer file finished by an earlier run, if it is complete."""
    side = _sidecar(path)
    if not (path.is_file() and side.is_file()):
        return None
    try:
        d = json.loads(side.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    want = layout.to_json()
    got = d.get("layout", {})
    same = d.get("fingerprint") == fp and all(
        got.get(k) == want[k] for k in want if k != "checksums"
    )
    sums = got.get("checksums", [])
    if (
        same
        and len(sums) == layout.num_experts
        and path.stat().st_size == layout.num_experts * layout.stride
    ):
        return tuple(sums)
    return None


def split_model(
    model_path: str | Path, out_dir: str | Path, *, progress: bool | None = None
) -> dict:
    """Split every MoE layer's experts of a checkpoint into ``out_dir``.

    A complete directory returns at once (its meta), checked against a local model's
    fingerprint (loaded lazily: only its first router's weights are read; ``load``
    checks any model); an interrupted split resumes from the layers that are complete.

    Args:
        model_path: MLX model directory or Hugging Face repo id.
        out_dir: Expert directory to create or complete.
        progress: Show a progress bar (default: only on a terminal).

    Returns:
        The meta dict, as written to ``out_dir/_split_meta.json``.

    Raises:
        ExpertDirError: ``out_dir`` holds another model's layer files, cannot be written,
            or the disk filled up.
        UnsupportedModelError: the architecture keeps no experts in SwitchGLU/SwitchMLP.
    """
    done = (Path(out_dir) / META_NAME).exists()
    meta = ensure_split(model_path, out_dir, progress=progress)
    if done and Path(model_path).is_dir():  # split before: by this model? (a hub id is
        model, config = load_lazy(Path(model_path))  # not fetched for it: load checks)
        bad = fingerprint_mismatch(
            meta.fingerprint, fingerprint(model, find_expert_sites(model, config), config)
        )
        if bad:
            raise ExpertDirError(
                f"{out_dir} holds the experts of another model ({meta.source}; fingerprint "
                f"differs in {bad}): choose another directory for {model_path}"
            )
    return meta.to_json()


def ensure_split(
    model_path: str | Path,
    out_dir: str | Path,
    *,
    layers=None,
    progress: bool | None = None,
    tick=None,
) -> ExpertMeta:
    """``split_model``, returning the parsed meta (``load`` parses it once this way).

    ``layers``: split only these MoE layers (a pipeline rank's share); the meta then
    lists the layers split so far and, until every layer is there, the model's others
    as missing. Processes that split into one directory at once (pipeline ranks on one
    host) take a lock per layer: no layer is written twice, and the meta is merged
    under a lock of its own. ``tick()`` after each layer (a pipeline's ``Pace.tick``:
    the other ranks hear from this one while it splits).
    """
    out = Path(out_dir)
    want = None if layers is None else set(layers)
    if (out / META_NAME).exists():
        meta = load_meta(out)
        if meta.complete or (want is not None and want <= set(meta.layers)):
            return meta
    model_dir = resolve_model_path(model_path)
    model, config = load_lazy(model_dir)
    sites = find_expert_sites(model, config)
    fp = fingerprint(model, sites, config)
    prepare_out_dir(out)
    top_k = next((s.top_k for s in sites if s.top_k), None)
    if top_k is None:
        raise ExpertDirError(
            f"cannot tell how many experts each token uses in {model_dir}: "
            "set num_experts_per_tok in its config.json"
        )
    mine = [s for s in sites if want is None or s.layer in want]
    index = SafetensorsIndex(model_dir)
    layouts = {}
    with LayerLocks(out) as locks:
        for site in tqdm(
            mine,
            desc="split experts",
            unit="layer",
            disable=(None if progress is None else not progress),
        ):
            with locks.hold(site.layer):
                layouts[site.layer] = _split_layer(out, site, index, fp)
            if tick is not None:
                tick()
    hidden, moe_inter = expert_dims(sites[0])
    meta = ExpertMeta(
        root=out,
        fingerprint=fp,
        model_type=str(config.get("model_type", "")),
        moe_layers=tuple(sorted(layouts)),
        num_experts=max(s.num_experts for s in sites),
        top_k=top_k,
        dims={"hidden": hidden, "moe_inter": moe_inter},
        layers=layouts,
        source=str(model_path),
        model_layers=tuple(s.layer for s in sites),
    )
    return _merge_meta(out, meta)


def _split_layer(out: Path, site, index: SafetensorsIndex, fp: dict) -> LayerLayout:
    """One layer's file (reused when complete: in the meta, or with its sidecar)."""
    name = f"layer_{site.layer:03d}.bin"
    layout = layer_layout(site, name)
    path = out / name
    done = _in_meta(out, layout, fp)
    if done is not None:
        return done
    sums = _done_layer(path, layout, fp)
    if sums is None:
        sums = write_layer_file(path, _ExpertSource(index, site, layout), layout)
    layout = LayerLayout(**{**layout.__dict__, "checksums": tuple(sums)})
    if not _sidecar(path).exists():
        write_json_atomic(_sidecar(path), {"fingerprint": fp, "layout": layout.to_json()})
    return layout


def _in_meta(out: Path, layout: LayerLayout, fp: dict) -> LayerLayout | None:
    """The layer's layout as a meta already on disk records it (another process split
    it), if that meta is of this model and the layout matches."""
    if not (out / META_NAME).exists():
        return None
    meta = load_meta(out, check_files=False)
    have = meta.layers.get(layout.layer)
    if have is None or meta.fingerprint != fp:
        return None
    want, got = layout.to_json(), have.to_json()
    same = all(got.get(k) == want[k] for k in want if k != "checksums")
    return have if same and (out / have.file).is_file() else None


def _merge_meta(out: Path, meta: ExpertMeta) -> ExpertMeta:
    """Write the meta with this process's layers and those already listed there."""
    with meta_lock(out):
        layers = dict(meta.layers)
        if (out / META_NAME).exists():
            old = load_meta(out, check_files=False)
            if old.fingerprint != meta.fingerprint:
                raise ExpertDirError(
                    f"{out} already holds a split of another model ({old.source}); split "
                    "this model into a new directory"
                )
            layers = {**old.layers, **layers}
        dims = summarize_dims(layers, meta.dims["hidden"], meta.dims["moe_inter"])
        scales = [p for lay in layers.values() for p in lay.parts if p.param == "scales"]
        weights = [p for lay in layers.values() for p in lay.parts if p.param == "weight"]
        dims["dtype"] = (scales or weights)[0].dtype
        merged = replace(meta, moe_layers=tuple(sorted(layers)), layers=layers, dims=dims)
        if merged.complete:
            merged = replace(merged, model_layers=())
        write_json_atomic(out / META_NAME, merged.to_json())
        if merged.complete:
            for layout in layers.values():
                _sidecar(out / layout.file).unlink(missing_ok=True)
    return merged
