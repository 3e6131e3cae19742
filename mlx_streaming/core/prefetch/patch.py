"""Swap a model's stacked experts for file-backed ones.

Each MoE layer's ``SwitchGLU`` / ``SwitchMLP`` keeps its class, activation and code; only
its projections change, to the same mlx-lm classes sized to the layer's pool of slots and
backed by the pool's arrays. ``StreamedExperts`` wraps it: it maps routed expert ids to
slots, loading misses first, and calls the wrapped module with slot ids. Every row is the
same matmul on the same bytes as in stock mlx-lm, so outputs are bit-identical.

Per call: a layer whose experts are all resident needs no host work at all (the ids are
remapped on the device). Otherwise the routing is read once (one host sync, together
with the next layer's predicted experts when prefetch is on), the misses are read on the
reader's threads while the resident experts' rows already compute, and the next layer's
predicted experts are read ahead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache.expert_store import FileExpertStore
from ..discovery import (
    ExpertSite,
    expert_dims,
    find_expert_sites,
    fingerprint,
    fingerprint_mismatch,
    projections,
)
from ..dispatch import PoolQuantizedSwitchLinear, PoolSwitchLinear, backend
from ..format import ExpertDirError, LayerLayout, mx_dtype_name
from ..selftest import cases_for, ensure_kernel_parity
from .predictor import Prefetcher, RouterPredictor

SORT_ROWS = 64  # mlx-lm's SwitchGLU/SwitchMLP sort the rows of calls with this many or more


@dataclass(frozen=True)
class StreamOptions:
    """How patched layers dispatch (all paths give identical outputs).

    overlap: compute the resident experts' rows while the misses load (None: where the
        pool is written without MLX, i.e. host and cuda modes).
    prefetch: read the next layer's predicted experts ahead.
    predictor: ``router`` (the next router on the current input) or a predictor object
        (e.g. ``TransitionPredictor``).
    prefetch_extra: predict ``top_k + prefetch_extra`` experts per token.
    rows: how a call that runs only some (token, choice) rows computes them. ``subset``
        runs just those rows (bit-identical on the CPU, whose kernels treat rows
        independently); ``masked`` runs every row, the others against a zero slot, so
        the kernels see the very shapes stock mlx-lm gives them (GPU kernels pick
        different algorithms for different row counts). None: subset on the CPU, masked
        on GPUs.
    kernel_check: before patching, check on the device that pool-shaped gather
        matmuls equal stock-shaped ones bit for bit (``selftest``). None: on GPU
        backends, where MLX picks kernels by shape.
    kernel_cache: a JSON file remembering the checks passed per device, MLX version
        and shape (None: remembered for this process only).
    """

    overlap: bool | None = None
    prefetch: bool = False
    predictor: object = "router"
    prefetch_extra: int = 0
    rows: str | None = None
    kernel_check: bool | None = None
    kernel_cache: str | Path | None = None


class StreamedExperts(nn.Module):
    """A MoE layer's expert module whose experts live in a ``FileExpertStore``."""

    is_streamed_experts = True

    def __init__(self, experts: nn.Module, store: FileExpertStore, layer: int, pos: int,
                 overlap: bool, prefetcher: Prefetcher | None, masked: bool):
        super().__init__()
        self.experts = experts  # the layer's SwitchGLU / SwitchMLP over pool slots
        self.layer, self.pos = layer, pos
        self._store, self._overlap, self._prefetcher = store, overlap, prefetcher
        self._masked = masked

    @property
    def num_experts(self) -> int:
        return self._store.caches[self.layer].num_experts

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        store, layer = self._store, self.layer
        pool = store.pool(layer)
        if store.device_path(layer):  # nothing can miss: no host sync at all
            store.note_device_call(layer, indices)
            return self.experts(x, pool.lut[indices])
        pf = self._prefetcher
        guess = pf.lazy(self.pos, x, indices) if pf else None
        if guess is not None:
            mx.eval(indices, guess)
        host = np.array(indices)  # the one host synchronisation of this layer
        groups = store.plan(layer, host)
        if len(groups) > 1:
            y = self._expert_major(x, indices, host, groups)
            if pf:
                pf.step(self.pos, host, None)
            return store.track_output(layer, y)
        ticket = store.begin(layer, groups[0])
        ahead = (lambda: pf.step(self.pos, host, None if guess is None else np.array(guess))) \
            if pf else None
        partial = self._overlap and (not self._masked or pool.dummy is not None)
        if len(ticket.misses) and partial and len(ticket.misses) < len(groups[0]):
            y = self._overlapped(x, indices, host, ticket, ahead)
        else:
            if ahead:
                ahead()
            ticket.wait()
            y = self.experts(x, pool.lut[indices])
        store.end_call(layer, len(ticket.misses))
        mx.async_eval(y)  # the device starts on it while the next layer is built
        return store.track_output(layer, y)

    def _part(self, x, indices, host, keep, out):
        """``out`` with the experts' outputs filled in on the rows where ``keep``
        (a boolean array shaped like ``indices``); other rows are left as they were.

        Masked: every row runs, the skipped ones against the pool's zero slot, so the
        kernels get exactly stock mlx-lm's shapes. Subset: only the kept rows run; as
        mlx-lm sorts calls of 64 or more rows (and then takes other kernels), a subset
        of such a call is padded to 64 rows so it takes the same ones.
        """
        pool = self._store.pool(self.layer)
        if self._masked:
            slots = np.where(keep, pool._lut_host[host], pool.dummy).astype(np.int32)
            y = self.experts(x, mx.array(slots))
            return y if out is None else mx.where(mx.array(keep)[..., None], y, out)
        k = indices.shape[-1]
        xf, flat = x.reshape(-1, x.shape[-1]), host.reshape(-1)  # [T, D], [T*k]
        rows = np.nonzero(keep.reshape(-1))[0]
        n = len(rows)
        if flat.size >= SORT_ROWS > n:
            rows = np.concatenate([rows, np.full(SORT_ROWS - n, rows[-1])])
        slots = pool.lut[mx.array(flat[rows])][:, None]  # [n, 1]
        y = self.experts(xf[mx.array(rows // k)], slots)[:n, 0]  # [n, D]
        if out is None:
            out = mx.zeros((*indices.shape, y.shape[-1]), dtype=y.dtype)
        flat_out = out.reshape(-1, y.shape[-1])
        flat_out[mx.array(rows[:n])] = y
        return flat_out.reshape(out.shape)

    def _overlapped(self, x, indices, host, ticket, ahead=None) -> mx.array:
        """Resident experts' rows compute while the misses are read."""
        miss = np.isin(host, ticket.misses)
        y = self._part(x, indices, host, ~miss, None)
        mx.async_eval(y)
        if ahead:  # read ahead for the next layer once this layer's work is queued
            ahead()
        ticket.wait()
        return self._part(x, indices, host, miss, y)

    def _expert_major(self, x, indices, host, groups) -> mx.array:
        """More distinct experts than slots: run the rows of one group at a time.

        Each expert is read at most once per call; rows are computed exactly as in the
        one-shot path and put back in their place.
        """
        store, layer = self._store, self.layer
        out, misses = None, 0
        for g in groups:
            misses += store.fetch(layer, g)
            out = self._part(x, indices, host, np.isin(host, g), out)
            mx.eval(out)  # the next group may reuse these slots
        store.end_call(layer, misses)
        return out


def _pool_projection(name: str, layout: LayerLayout, arrays: dict, device: str) -> nn.Module:
    """An mlx-lm SwitchLinear / QuantizedSwitchLinear over the pool's arrays that takes
    the kernel stock's call over all the layer's experts takes."""
    q = layout.quant[name]
    w = arrays[f"{name}.weight"]
    slots, out_dims = w.shape[0], w.shape[1]
    has_bias = f"{name}.bias" in arrays
    parity = {"model_experts": layout.num_experts, "backend": device}
    if q is None:
        new = PoolSwitchLinear(w.shape[2], out_dims, slots, bias=has_bias, **parity)
    else:
        in_dims = arrays[f"{name}.scales"].shape[-1] * q.group_size
        new = PoolQuantizedSwitchLinear(in_dims, out_dims, slots, bias=has_bias,
                                        group_size=q.group_size, bits=q.bits, mode=q.mode,
                                        **parity)
        new.scales = arrays[f"{name}.scales"]
        new.biases = arrays.get(f"{name}.biases")
        if f"{name}.global_scale" in arrays:
            new.global_scale = arrays[f"{name}.global_scale"]
    new.weight = w
    if has_bias:
        new.bias = arrays[f"{name}.bias"]
    if q is not None:
        new.freeze()
    return new


def _expected_bits(layer, layout, bits, proj_bits, layer_proj_bits) -> dict:
    if layer_proj_bits and layer in layer_proj_bits:
        want = dict(layer_proj_bits[layer])
    elif proj_bits:
        want = dict(proj_bits)
    else:
        want = {}
    return {n: want.get(n, bits) for n in layout.quant}


def _validate(store: FileExpertStore, sites: list[ExpertSite], model, hidden, moe_inter,
              group_size, bits, proj_bits, layer_proj_bits) -> None:
    meta = store.meta
    where = f"expert directory {meta.root}"
    got_layers = [s.layer for s in sites]
    if got_layers != sorted(meta.layers):
        raise ExpertDirError(
            f"the model's MoE layers {got_layers} differ from the {where}'s "
            f"{sorted(meta.layers)}: it was split from another model; split this model "
            "into a new directory"
        )
    bad = fingerprint_mismatch(meta.fingerprint, fingerprint(model, sites))
    if bad:
        raise ExpertDirError(
            f"the {where} was split from another model (fingerprint differs in "
            f"{', '.join(bad)}); split this model into a new directory with "
            "split_model(MODEL, NEW_DIR)"
        )
    if (hidden, moe_inter) != (meta.dims["hidden"], meta.dims["moe_inter"]):
        raise ExpertDirError(
            f"hidden={hidden}, moe_inter={moe_inter} do not match the {where} "
            f"(hidden={meta.dims['hidden']}, moe_inter={meta.dims['moe_inter']})"
        )
    for s in sites:
        if expert_dims(s) != (hidden, moe_inter):
            raise ExpertDirError(f"layer {s.layer}'s experts are {expert_dims(s)}, not "
                                 f"(hidden, moe_inter)=({hidden}, {moe_inter})")
        lay = meta.layers[s.layer]
        if s.num_experts != lay.num_experts:
            raise ExpertDirError(f"layer {s.layer} has {s.num_experts} experts, the {where} "
                                 f"{lay.num_experts}")
        want = _expected_bits(s.layer, lay, bits, proj_bits, layer_proj_bits)
        for name, q in lay.quant.items():
            have = q.bits if q else None
            if want[name] != have or (q and group_size is not None and group_size != q.group_size):
                raise ExpertDirError(
                    f"layer {s.layer} {name}: asked for bits={want[name]}, "
                    f"group_size={group_size} but the {where} stores bits={have}, "
                    f"group_size={q.group_size if q else None} (its _split_meta.json is the "
                    "authority): pass the meta's values (dims.bits, dims.group_size, "
                    "proj_bits, per_layer_proj_bits)"
                )


def patch_model_filebacked(model: nn.Module, store: FileExpertStore, hidden: int,
                           moe_inter: int, group_size: int | None, bits: int | None,
                           proj_bits: dict | None = None,
                           layer_proj_bits: dict | None = None,
                           options: StreamOptions | None = None) -> int:
    """Swap every MoE layer's experts for file-backed ones served by ``store``.

    The stacked expert weights are dropped without being read, so a model loaded with
    ``mlx_lm.load(path, lazy=True)`` never materializes its experts.

    Args:
        model: An mlx-lm model (loaded lazily).
        store: The ``FileExpertStore`` over this model's expert directory.
        hidden, moe_inter: Expert input and hidden widths.
        group_size, bits: Expert quantization (``bits=None`` for float experts).
        proj_bits: ``{projection: bits}`` when projections differ.
        layer_proj_bits: ``{layer: {projection: bits}}`` when layers differ.
        options: Dispatch options (overlap, prefetch); see ``StreamOptions``.

    Returns:
        The number of patched MoE layers.

    Raises:
        ExpertDirError: the directory does not belong to this model, or the arguments
            disagree with its meta (which is the authority).
        UnsupportedModelError: the model has no SwitchGLU/SwitchMLP experts.
    """
    options = options or StreamOptions()
    sites = find_expert_sites(model)
    if any(s.streamed is not None for s in sites):
        raise ValueError("the model is already patched: load it again to patch it with "
                         "another store")
    _validate(store, sites, model, hidden, moe_inter, group_size, bits, proj_bits,
              layer_proj_bits)
    prefetcher = None
    if options.prefetch:
        pred = options.predictor
        if pred == "router":
            pred = RouterPredictor([s.router for s in sites],
                                   store.top_k + options.prefetch_extra)
        prefetcher = Prefetcher(store, [s.layer for s in sites], pred)
    store.prefetcher = prefetcher
    overlap = options.overlap if options.overlap is not None else store.pool_mode != "mlx"
    rows = options.rows or ("subset" if mx.default_device() == mx.cpu else "masked")
    if rows not in ("subset", "masked"):
        raise ValueError(f"rows must be 'subset' or 'masked', got {rows!r}")
    if rows == "masked" and not store.zero_slot:
        raise ValueError("rows='masked' points skipped rows at a zero slot: create the store "
                         "with FileExpertStore(..., zero_slot=True)")
    device = backend()
    if options.kernel_check or (options.kernel_check is None and device != "cpu"):
        check_kernels(model, store, options.kernel_cache)
    for pos, s in enumerate(sites):
        arrays = store.pool(s.layer).arrays
        lay = store.meta.layers[s.layer]
        new = {name: _pool_projection(name, lay, arrays, device)
               for name, _ in projections(s.module)}
        s.module.update_modules(new)
        s.parent.update_modules({s.attr: StreamedExperts(s.module, store, s.layer, pos,
                                                         overlap, prefetcher,
                                                         rows == "masked")})
    return len(sites)


_CHECKED: set = set()  # kernel-parity cases found exact in this process


def check_kernels(model: nn.Module, store: FileExpertStore, cache_file=None) -> None:
    """Check that every distinct pool of ``store`` computes exactly what stock's arrays
    would on this device (see ``selftest``).

    Raises:
        KernelParityError: MLX picks another kernel for a pool than for stock.
    """
    from mlx.utils import tree_flatten

    x_dtype = next(mx_dtype_name(v.dtype) for _, v in tree_flatten(model.parameters())
                   if mx.issubdtype(v.dtype, mx.floating))
    cases = []
    for li in store.layers:
        pool = store.pool(li)
        cases += cases_for(store.meta.layers[li], pool.slots, pool.dummy is not None,
                           store.top_k, x_dtype)
    todo = [c for c in dict.fromkeys(cases) if c not in _CHECKED]
    ensure_kernel_parity(todo, cache_file=Path(cache_file) if cache_file else None)
    _CHECKED.update(todo)
