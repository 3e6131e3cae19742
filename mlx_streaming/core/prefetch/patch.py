"""Swap a model's stacked experts for file-backed ones.

Each MoE layer's ``SwitchGLU`` / ``SwitchMLP`` keeps its class, activation and code; only
its projections change, to mlx-lm's classes sized to the layer's pool of slots, backed by
the pool's arrays and calling the kernel stock's call would take (``dispatch``).
``StreamedExperts`` wraps it: per call it asks the store for the call's work (one
``request``), runs the wrapped module on slot ids, and completes the call. Every row is
the same matmul on the same bytes as in stock mlx-lm, so outputs are bit-identical.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache.expert_store import FileExpertStore
from ..cache.host_path import launched
from ..discovery import find_expert_sites, projections
from ..dispatch import KernelParityError, PoolQuantizedSwitchLinear, PoolSwitchLinear
from ..format import LayerLayout, mx_dtype_name
from ..ids import SLOT_IDS_NP
from ..options import StreamConfig
from ..runtime import resolve
from ..selftest import SORT_ROWS, cases_for, ensure_kernel_parity, pad_subset
from .predictor import Prefetcher, RouterPredictor
from .shared import SharedAhead, wrap_shared
from .validate import int_keys, validate

RUNTIME_FIELDS = ("rows", "overlap", "prefetch", "kernel_check", "zero_slot")


class StreamedExperts(nn.Module):
    """A MoE layer's expert module whose experts live in a ``FileExpertStore``."""

    is_streamed_experts = True

    def __init__(
        self,
        experts: nn.Module,
        store: FileExpertStore,
        layer: int,
        pos: int,
        overlap: bool,
        prefetcher: Prefetcher | None,
        masked_below: int,
        shared: SharedAhead | None = None,
    ):
        super().__init__()
        self.experts = experts  # the layer's SwitchGLU / SwitchMLP over pool slots
        self.layer, self.pos = layer, pos
        self._store, self._prefetcher = store, prefetcher
        object.__setattr__(self, "_shared", shared)  # the block's, not a child here
        self._masked_below = masked_below  # partial calls of fewer rows run masked
        # a masked call points the other rows at the pool's zero slot
        self._overlap = overlap and (not masked_below or store.pool(layer).dummy is not None)

    @property
    def num_experts(self) -> int:
        return self._store.caches[self.layer].num_experts

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        pf, store = self._prefetcher, self._store
        guess = pf.lazy(self.pos, x, indices) if pf else None
        beside = self._shared.start(x) if self._shared is not None else None
        call = store.request(self.layer, indices, self._overlap, guess, beside)
        if call.slots is not None:  # the ids are slots on the device
            if call.routing is None:  # no host work
                return store.finish(call, self.experts(x, call.slots))
            t0 = time.perf_counter()  # a late call: built while the routing computes
            y = self.experts(x, call.slots)
            store.stats[self.layer].graph_s += time.perf_counter() - t0
            return store.finish(call, y)
        t0, waited = time.perf_counter(), call.waited_s
        if pf:
            pf.step(self.pos, call.host_ids, call.also)
        y = None
        for i in range(len(call.steps)):
            rows, slots = store.step(call, i)
            y = self._rows(x, indices, rows, slots, y)
            if call.evaluate_each:
                launched(call)
                mx.eval(y)  # the next step may reuse these slots
            elif rows is not None and i == 0:  # an overlap split's resident rows:
                launched(call)
                mx.async_eval(y)  # they compute while the misses load
        y = store.finish(call, y)
        st = store.stats[self.layer]
        st.graph_s += time.perf_counter() - t0 - (call.waited_s - waited)
        if pf:  # this call's reads have landed: the next layer's guesses load meanwhile
            t1 = time.perf_counter()
            pf.issue(self.pos + 1)
            st.ahead_s += time.perf_counter() - t1  # work beside the device's, not the graph
        return y

    def _rows(self, x, indices, rows, slots, out):
        """``out`` with the experts' outputs filled in on ``rows`` (a boolean mask shaped
        like ``indices``; None: all), the rows' experts at ``slots``.

        Masked (calls below ``masked_below`` rows): every row runs, the others against the
        pool's zero slot, so the kernels get exactly stock mlx-lm's shapes. Subset: only
        the kept rows run. As mlx-lm sorts calls of 64 or more rows (and then takes other
        kernels), a subset of such a call is padded to 64 rows, on the zero slot where
        the pool has one, so that every expert's group of rows is stock's.
        """
        if rows is None:
            return self.experts(x, self._store.ids(slots))
        dummy = self._store.pool(self.layer).dummy
        if rows.size < self._masked_below:
            y = self.experts(x, self._store.ids(np.where(rows, slots, dummy)))
            return y if out is None else mx.where(mx.array(rows)[..., None], y, out)
        k = indices.shape[-1]
        xf, flat = x.reshape(-1, x.shape[-1]), slots.reshape(-1)  # [T, D], [T*k]
        keep = np.nonzero(rows.reshape(-1))[0]
        n = len(keep)
        tok, run = pad_subset(keep // k, flat[keep], flat.size, dummy)
        y = self.experts(xf[mx.array(tok)], mx.array(run.astype(SLOT_IDS_NP))[:, None])[
            :n, 0
        ]  # [n, D]
        if out is None:
            out = mx.zeros((*indices.shape, y.shape[-1]), dtype=y.dtype)
        flat_out = out.reshape(-1, y.shape[-1])
        flat_out[mx.array(keep)] = y
        return flat_out.reshape(out.shape)


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
        new = PoolQuantizedSwitchLinear(
            in_dims,
            out_dims,
            slots,
            bias=has_bias,
            group_size=q.group_size,
            bits=q.bits,
            mode=q.mode,
            **parity,
        )
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


def patch_model_filebacked(
    model: nn.Module,
    store: FileExpertStore,
    hidden: int | None = None,
    moe_inter: int | None = None,
    group_size: int | None = None,
    bits: int | None = None,
    proj_bits: dict | None = None,
    layer_proj_bits: dict | None = None,
    config: StreamConfig | None = None,
    model_fingerprint: dict | None = None,
    tick: Callable[[], None] | None = None,
) -> int:
    """Swap every MoE layer's experts for file-backed ones served by ``store``.

    The stacked expert weights are dropped without being read, so a model loaded with
    ``mlx_lm.load(path, lazy=True)`` never materializes its experts. The expert
    directory's meta says how the experts are quantized; the optional arguments (the
    seed script passes them) are checked against it.

    Args:
        model: An mlx-lm model (loaded lazily).
        store: The ``FileExpertStore`` over this model's expert directory.
        hidden, moe_inter: Expert input and hidden widths (checked).
        group_size, bits: Expert quantization (checked; None: the meta's).
        proj_bits: ``{projection: bits}`` when projections differ (checked).
        layer_proj_bits: ``{layer: {projection: bits}}`` when layers differ (checked).
        config: The streaming options; the patch reads ``predictor`` and
            ``kernel_check_file``, and the store's ``runtime`` for the rest (rows,
            overlap, read-ahead, kernel check; all give identical outputs).
        model_fingerprint: The whole model's ``fingerprint``, taken before mlx-lm's
            ``pipeline`` kept only this rank's layers (required for a pipelined model).
        tick: Called after each case of the kernel check (a pipeline's ``Pace.tick``).

    Returns:
        The number of patched MoE layers.

    Raises:
        ExpertDirError: the directory does not belong to this model, or the arguments
            disagree with its meta.
        UnsupportedModelError: the model has no SwitchGLU/SwitchMLP experts.
        KernelParityError: pool-shaped matmuls are not bit-identical to stock-shaped
            ones on this device (the kernel check). Where only the default rows'
            subsets differ, calls run masked instead.
    """
    options = config or StreamConfig()
    sites = find_expert_sites(model)
    if any(s.streamed is not None for s in sites):
        raise ValueError(
            "the model is already patched: load it again to patch it with another store"
        )
    validate(
        store,
        sites,
        model,
        {
            "hidden": hidden,
            "moe_inter": moe_inter,
            "group_size": group_size,
            "bits": bits,
            "proj_bits": proj_bits,
            "layer_proj_bits": int_keys(layer_proj_bits),
        },
        model_fingerprint,
    )
    rt = store.runtime
    if config is not None and rt.pool_mode == "cuda":
        # the choices memory made (mapping, swap tier), as the store made them: measured
        # again after it page-locked its files or tier, memory could say otherwise (and
        # refuse device_reads here)
        pinned = {"swap_tier": rt.reader == "tier"} if options.swap_tier is None else {}
        if rt.reader == "tier" and (options.swap_tier_gb == "auto" or options.swap_tier is None):
            tier = store.reader.tier  # the size it took; whole, it reads no files
            pinned["swap_tier_gb"] = tier.nbytes / 1e9 if tier.partial else None
            pinned.update({} if tier.partial else {"direct_io": False})
        if options.map_files is None and not options.direct_io:
            pinned["map_files"] = rt.mapped
        options = options.replace(**pinned)
    mine = resolve(options, store.meta, rt.backend) if config is not None else rt
    differ = [f for f in RUNTIME_FIELDS if getattr(mine, f) != getattr(rt, f)]
    if differ:
        raise ValueError(
            f"the patch's config sets {differ} otherwise than the store's: give "
            "FileExpertStore the same config (its runtime, which the patch reads, is "
            "resolved from it once)"
        )
    prefetcher = None
    if rt.prefetch:
        pred = options.predictor
        if pred == "router":
            pred = RouterPredictor([s.router for s in sites], store.top_k)
        prefetcher = Prefetcher(store, [s.layer for s in sites], pred)
    device = rt.backend
    rows = rt.rows
    if rt.kernel_check:
        try:
            check_kernels(
                model, store, options.kernel_check_file, subset=rows != "masked", tick=tick
            )
        except KernelParityError:
            if store.config.rows is not None or rows != "mixed":
                raise
            # the default's row subsets differ here (an MLX whose kernels read the row
            # count): every row runs masked instead, in stock's own shapes
            rows = "masked"
            check_kernels(model, store, options.kernel_check_file, tick=tick)
            store.runtime = rt.revised({"rows": "kernel check"}, rows=rows)
    masked_below = {"subset": 0, "masked": sys.maxsize, "mixed": SORT_ROWS}[rows]
    for pos, s in enumerate(sites):
        arrays = store.pool(s.layer).arrays
        lay = store.meta.layers[s.layer]
        new = {
            name: _pool_projection(name, lay, arrays, device) for name, _ in projections(s.module)
        }
        s.module.update_modules(new)
        shared = wrap_shared(s.parent)
        streamed = StreamedExperts(
            s.module, store, s.layer, pos, rt.overlap, prefetcher, masked_below, shared
        )
        s.parent.update_modules({s.attr: streamed})
    return len(sites)


_CHECKED: set = set()  # kernel-parity cases found exact in this process


def check_kernels(
    model: nn.Module,
    store: FileExpertStore,
    cache_file=None,
    subset: bool = False,
    tick: Callable[[], None] | None = None,
) -> None:
    """Check that every distinct pool of ``store`` computes exactly what stock's arrays
    would on this device (see ``selftest``); ``subset``: also long calls' row subsets;
    ``tick()`` after each case checked.

    Raises:
        KernelParityError: MLX picks another kernel for a pool than for stock.
    """
    from mlx.utils import tree_flatten

    x_dtype = next(
        mx_dtype_name(v.dtype)
        for _, v in tree_flatten(model.parameters())
        if mx.issubdtype(v.dtype, mx.floating)
    )
    cases = []
    for li in store.layers:
        pool = store.pool(li)
        cases += cases_for(
            store.meta.layers[li],
            pool.slots,
            pool.dummy is not None,
            store.top_k,
            x_dtype,
            subset,
        )
    todo = [c for c in dict.fromkeys(cases) if c not in _CHECKED]
    ensure_kernel_parity(todo, cache_file=Path(cache_file) if cache_file else None, tick=tick)
    _CHECKED.update(todo)
