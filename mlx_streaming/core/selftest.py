"""Start-up check that pool-shaped gather matmuls equal stock-shaped ones, bit for bit.

``dispatch`` restates MLX's kernel choice from its source; this module checks the
result on the device at hand, at the model's own dimensions: one projection's gather
matmul over stock-shaped weights (every expert of the layer) and over pool-shaped ones
(the pool's slots, a zero slot where the pool has one), for the routed row counts a model
meets (one token, and prefill chunks on both sides of each threshold in ``dispatch``).
Weights and inputs are random; rows of experts the pool lacks point at its zero slot, as
in masked calls. The verdict is cached per device, MLX version and shape.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .dispatch import (
    MLX_RULE_SOURCE,
    KernelParityError,
    PoolQuantizedSwitchLinear,
    PoolSwitchLinear,
    backend,
)
from .format import DTYPES, LayerLayout
from .ids import SLOT_IDS_NP

SORT_ROWS = 64  # mlx-lm's SwitchGLU sorts the rows of calls this large
THRESHOLD_ROWS = (8, 16, SORT_ROWS)  # CUDA qmv/qmm; Metal rhs minimum; the sort


def pad_subset(tok: np.ndarray, run: np.ndarray, call_rows: int, pad_slot: int | None):
    """A row subset of a call of ``call_rows`` rows (``tok``: each kept row's token,
    ``run``: its slot), padded to ``SORT_ROWS`` rows when the call had that many, so that
    mlx-lm sorts it as it sorts the call (and MLX takes the same kernels). Padding rows
    point at ``pad_slot`` (the zero slot: every expert keeps stock's group of rows), or
    repeat the last row where there is none."""
    n = len(tok)
    if call_rows >= SORT_ROWS > n:
        pad = SORT_ROWS - n
        tok = np.concatenate([tok, np.full(pad, tok[-1])])
        run = np.concatenate([run, np.full(pad, run[-1] if pad_slot is None else pad_slot)])
    return tok, run


@dataclass(frozen=True)
class ProjectionCase:
    """One projection of one pool, as the self-test builds it."""

    name: str  # e.g. gate_proj
    parts: tuple  # ((param, per-expert shape, dtype name), ...) of the projection
    quant: tuple | None  # (bits, group_size, mode) or None for float weights
    x_dtype: str
    model_experts: int
    pool_slots: int  # slots holding experts
    zero_slot: bool
    top_k: int
    subset: bool = False  # long calls' expert groups run as padded row subsets

    def key(self) -> str:
        dev = mx.device_info().get("device_name", str(mx.default_device()))
        return json.dumps([dev, mx.__version__, asdict(self)], sort_keys=True)


def token_counts(
    top_k: int, model_experts: int, pool_experts: int, max_tokens: int = 2048
) -> list[int]:
    """Tokens per call to check: one, the largest chunk, and both sides of every row
    threshold of ``dispatch`` (8, 16, 64, 4 x experts of stock and of the pool)."""
    out = {1, max_tokens}
    for rows in (*THRESHOLD_ROWS, 4 * model_experts, 4 * pool_experts):
        t = math.ceil(rows / top_k)
        out |= {t - 1, t, t + 1}
    return sorted(t for t in out if 1 <= t <= max_tokens)


def cases_for(
    layout: LayerLayout, slots: int, zero_slot: bool, top_k: int, x_dtype: str, subset=False
) -> list[ProjectionCase]:
    """The distinct projections of one layer's pool."""
    out = []
    for name, q in sorted(layout.quant.items()):
        parts = tuple(
            (p.param, p.shape, p.dtype)
            for p in layout.parts
            if p.projection == name and p.param != "bias"
        )
        out.append(
            ProjectionCase(
                name,
                parts,
                (q.bits, q.group_size, q.mode) if q else None,
                x_dtype,
                layout.num_experts,
                slots,
                zero_slot,
                top_k,
                subset,
            )
        )
    return out


def _random(shape: tuple, dtype: str, key) -> mx.array:
    mx_dt = DTYPES[dtype][1]
    if mx.issubdtype(mx_dt, mx.floating):
        return (mx.random.normal(shape, key=key) * 0.02).astype(mx_dt)
    if mx_dt == mx.uint8:  # fp-mode scales: exponents well inside the finite range
        return mx.random.randint(118, 127, shape, key=key).astype(mx.uint8)
    # packed weights: any bit pattern (two 16-bit halves per word)
    halves = mx.random.randint(0, 1 << 16, (*shape[:-1], 2 * shape[-1]), key=key)
    return halves.astype(mx.uint16).view(mx_dt)


def _projection(case: ProjectionCase, arrays: dict, experts: int):
    w = arrays["weight"]
    kw = {"model_experts": case.model_experts, "backend": backend()}
    if case.quant is None:
        proj = PoolSwitchLinear(w.shape[2], w.shape[1], experts, bias=False, **kw)
    else:
        bits, group, mode = case.quant
        proj = PoolQuantizedSwitchLinear(
            arrays["scales"].shape[-1] * group,
            w.shape[1],
            experts,
            bias=False,
            group_size=group,
            bits=bits,
            mode=mode,
            **kw,
        )
        proj.scales = arrays["scales"]
        proj.biases = arrays.get("biases")
    proj.weight = w
    return proj


def _call(proj, x: mx.array, ids: mx.array) -> mx.array:
    """What mlx-lm's SwitchGLU does around one projection: sort large calls."""
    x = mx.expand_dims(x, (-2, -3))  # [T, 1, 1, K]
    if ids.size < SORT_ROWS:
        return proj(x, ids)
    k = ids.shape[-1]
    flat = ids.flatten()
    order = mx.argsort(flat)
    y = proj(x.flatten(0, -3)[order // k], flat[order], sorted_indices=True)
    return mx.unflatten(y[mx.argsort(order)], 0, ids.shape)


def check_case(case: ProjectionCase, tokens: list[int], seed: int = 0) -> list[str]:
    """Run the case for each token count; the differences found (empty: bit-exact)."""
    key = mx.random.key(seed)
    keys = mx.random.split(key, len(case.parts) + 3)
    E, S = case.model_experts, case.pool_slots
    stock = {p: _random((E, *shape), dt, keys[i]) for i, (p, shape, dt) in enumerate(case.parts)}
    rng = np.random.default_rng(seed)
    held = np.sort(rng.choice(E, S, replace=False))  # the experts the pool holds
    slot_of = np.full(E, -1, np.int64)
    slot_of[held] = rng.permutation(S)
    pool = {}
    for p, arr in stock.items():
        rows = arr[mx.array(held[np.argsort(slot_of[held])])]  # row s: the expert in slot s
        if case.zero_slot:
            rows = mx.concatenate([rows, mx.zeros((1, *rows.shape[1:]), rows.dtype)])
        pool[p] = rows
    mx.eval(stock, pool)
    stock_proj = _projection(case, stock, E)
    pool_proj = _projection(case, pool, S + case.zero_slot)
    K = stock_proj.input_dims
    x_dt = DTYPES[case.x_dtype][1]
    bad = []
    for T in tokens:
        k = case.top_k
        ids = np.stack([rng.choice(held, k, replace=False) for _ in range(T)])  # [T, k]
        slots = slot_of[ids]
        if case.zero_slot:  # masked call: rows of a few experts point at the zero slot
            masked = np.isin(ids, rng.choice(held, max(1, S // 4), replace=False))
            slots = np.where(masked, S, slots)
        else:
            masked = np.zeros(ids.shape, bool)
        x = (mx.random.normal((T, K), key=keys[-1]) * 0.5).astype(x_dt)
        want = _call(stock_proj, x, mx.array(ids.astype(np.uint32)))
        got = _call(pool_proj, x, mx.array(slots.astype(SLOT_IDS_NP)))
        keep = mx.array(~masked)[..., None, None]
        same = mx.all(mx.where(keep, _bits(want) == _bits(got), True)).item()
        if not same:
            bad.append(f"{case.name}: {T} tokens ({T * k} rows) differ")
        if (
            case.subset
            and ids.size >= SORT_ROWS
            and not _subset_same(
                pool_proj, x, ids, slot_of, want, S if case.zero_slot else None, rng
            )
        ):
            bad.append(f"{case.name}: a row subset of {T} tokens ({T * k} rows) differs")
    return bad


def _subset_same(pool_proj, x, ids, slot_of, want, zero, rng) -> bool:
    """Whether one expert group's rows, run alone as the store runs them (``pad_subset``),
    equal those rows of the stock-shaped call ``want``."""
    experts = np.unique(ids)
    group = rng.choice(experts, max(1, len(experts) // 4), replace=False)
    keep = np.nonzero(np.isin(ids.reshape(-1), group))[0]
    k = ids.shape[-1]
    tok, run = pad_subset(keep // k, slot_of[ids.reshape(-1)[keep]], ids.size, zero)
    got = _call(pool_proj, x[mx.array(tok)], mx.array(run.astype(SLOT_IDS_NP))[:, None])
    got = got[: len(keep), 0]
    ref = want.reshape(-1, *want.shape[2:])[mx.array(keep)]
    return mx.all(_bits(got) == _bits(ref)).item()


def _bits(a: mx.array) -> mx.array:
    return a.view({2: mx.uint16, 4: mx.uint32}[a.itemsize])


def ensure_kernel_parity(
    cases: list[ProjectionCase],
    tokens_max: int = 2048,
    cache_file: Path | None = None,
    tick: Callable[[], None] | None = None,
) -> None:
    """Check every case not yet known to be exact on this device and MLX version;
    ``tick()`` after each case (e.g. a pipeline's ``Pace.tick``: a case's compiles are
    the longest stretch without one).

    Raises:
        KernelParityError: a pool-shaped call differs from the stock-shaped one.
    """
    known = _read(cache_file)
    for case in dict.fromkeys(cases):
        key = case.key()
        if known.get(key) == "exact":
            continue
        tokens = token_counts(
            case.top_k, case.model_experts, case.pool_slots + case.zero_slot, tokens_max
        )
        bad = check_case(case, tokens)
        mx.clear_cache()
        if bad:
            raise KernelParityError(
                f"MLX {mx.__version__} on {mx.default_device()}: pool-shaped gather matmuls "
                f"are not bit-identical to stock-shaped ones ({'; '.join(bad[:3])}) for "
                f"{case.model_experts} experts in {case.pool_slots} slots. The kernel rule "
                f"was read from {MLX_RULE_SOURCE}; this MLX chooses differently. Install "
                "that MLX version, or run `python -m mlx_streaming verify` and report it"
            )
        known[key] = "exact"
        _write(cache_file, known)
        if tick is not None:
            tick()


def _read(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text())
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}  # an unreadable cache is checked again, not trusted


def _write(path: Path | None, known: dict) -> None:
    if path is None:
        return
    from .format import write_json_atomic

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, known)
    except OSError:
        pass  # a read-only cache folder costs a check at the next load, nothing more
