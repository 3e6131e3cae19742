"""Kernel-choice parity: every pool call takes the MLX kernel stock mlx-lm's call takes.

The rule (``core.dispatch``) is checked over a grid of experts, slots, top-k, tokens per
call and zero slot; the pool projections are checked to pass the rule's flag to MLX; the
start-up self-test is checked to pass where the rule holds and to fail, with a clear
error, on a backend that behaves like Metal when the rule is not applied.
"""

from __future__ import annotations

import itertools
import json
import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_streaming.core import dispatch, selftest
from mlx_streaming.core.dispatch import (
    GatherCall,
    KernelParityError,
    PoolQuantizedSwitchLinear,
    kernel,
    pool_sorted_flag,
    reads_experts,
)
from mlx_streaming.core.selftest import SORT_ROWS


def pool_experts(slots: int, experts: int, zero_slot: bool) -> int:
    """Experts in a pool's arrays, as FileExpertStore makes them."""
    return slots + int(zero_slot and slots < experts)


GRID = list(
    itertools.product(
        ("metal", "cuda", "cpu"),
        (True, False),  # backend, quantized
        (64, 128, 512),  # experts
        (2, 8, 10),  # top-k
        (True, False),  # zero slot
    )
)


@pytest.mark.parametrize("backend,quantized,experts,top_k,zero", GRID)
def test_pool_takes_stocks_kernel(backend, quantized, experts, top_k, zero):
    tokens = sorted(
        {1, 2, 3, 7, 8, 9, 16, 25, 26, 27, 51, 52, 53, 64, 100, 204, 205, 206, 256, 512, 1024, 2048}
    )
    for slots in sorted({top_k, 2 * top_k, experts // 4, experts // 2, experts - 1, experts}):
        E = pool_experts(slots, experts, zero)
        for T in tokens:
            B = T * top_k
            stock_sorted = B >= SORT_ROWS
            want = kernel(GatherCall(backend, quantized, 1, B, experts, stock_sorted))
            flag = pool_sorted_flag(backend, quantized, 1, B, experts, E, stock_sorted)
            assert kernel(GatherCall(backend, quantized, 1, B, E, flag)) == want, (slots, T, flag)


def test_the_rule_matters_on_metal():
    """Qwen3-Next, 512 experts, top-10, 64 slots + zero slot: between 26 and 204 tokens
    per call the pool would take the rhs kernel that stock does not take; the rule
    turns the sort flag off there and keeps it on where stock takes rhs."""
    E, k, P = 512, 10, 65
    naive = [
        T
        for T in range(1, 2049)
        if kernel(GatherCall("metal", True, 1, T * k, P, T * k >= 64))
        != kernel(GatherCall("metal", True, 1, T * k, E, T * k >= 64))
    ]
    assert naive[0] == 26 and naive[-1] == 204
    assert pool_sorted_flag("metal", True, 1, 300, E, P, True) is False
    assert pool_sorted_flag("metal", True, 1, 2100, E, P, True) is True
    # a zero slot beside every expert would miss stock's kernel at 4E..4E+3 rows
    with pytest.raises(KernelParityError, match="stock's kernel gather_qmm_rhs"):
        pool_sorted_flag("metal", True, 1, 4 * E, E, E + 1, True)
    # CUDA decides by rows alone
    assert kernel(GatherCall("cuda", True, 1, 7, 3, False)) == "qmv"
    assert kernel(GatherCall("cuda", True, 1, 8, 3, False)) == "qmm"


def test_pool_projection_passes_the_rules_flag(monkeypatch):
    seen = []
    real = mx.gather_qmm

    def spy(*a, sorted_indices=False, **kw):
        seen.append(sorted_indices)
        return real(*a, sorted_indices=sorted_indices, **kw)

    monkeypatch.setattr(mx, "gather_qmm", spy)
    proj = PoolQuantizedSwitchLinear(
        64, 32, 5, bias=False, group_size=32, bits=4, model_experts=64, backend="metal"
    )
    for rows, want in ((64, False), (256, True)):  # 64 // 5 >= 4 but 64 // 64 < 4
        x = mx.zeros((rows, 1, 64))
        proj(x, mx.zeros((rows,), mx.uint32), sorted_indices=True)
        assert seen[-1] is want


@pytest.mark.parametrize(
    "backend,quantized", list(itertools.product(("metal", "cuda", "cpu"), (True, False)))
)
def test_stocks_flag_serves_where_the_rule_reads_no_expert_count(backend, quantized):
    """Where ``reads_experts`` says no, the pool passes stock's flag unexamined: the
    rule must then give stock's kernel for any expert count, at every shape."""
    same = all(
        kernel(GatherCall(backend, quantized, M, B, E, s))
        == kernel(GatherCall(backend, quantized, M, B, 512, s))
        for M, B, E, s in itertools.product(
            (1, 2, 8), range(1, 300, 7), (3, 17, 65, 511), (True, False)
        )
    )
    assert same or reads_experts(backend, quantized)
    assert reads_experts(backend, quantized) == (backend == "metal" and quantized)


def test_a_pool_on_cuda_takes_no_flag_lookup(monkeypatch):
    monkeypatch.setattr(dispatch, "_flag", lambda *a: pytest.fail("looked up a flag"))
    proj = PoolQuantizedSwitchLinear(
        64, 32, 5, bias=False, group_size=32, bits=4, model_experts=64, backend="cuda"
    )
    assert proj.own_flag
    proj(mx.zeros((4, 1, 64)), mx.zeros((4,), mx.uint32), sorted_indices=False)
    with pytest.raises(ValueError, match="unknown backend 'vulkan'"):
        reads_experts("vulkan", True)


def test_full_pools_have_no_zero_slot(models):
    from mlx_streaming import FileExpertStore

    _, ed = models.experts("tiny-qwen3_moe")
    store = FileExpertStore(ed, capacity=16, layer_caps={1: 8}, zero_slot=True)
    assert store.pool(1).dummy == 8
    assert store.pool(2).dummy is None
    assert store.pool(2).arrays["gate_proj.weight"].shape[0] == 16
    store.close()


def test_token_counts_straddle_thresholds():
    ts = selftest.token_counts(8, 128, 17, 64)
    for rows in (8, 16, 64, 4 * 17, 4 * 128):
        t = math.ceil(rows / 8)
        assert {t - 1, t} & set(ts) == ({t - 1, t} & set(range(1, 65)))
    assert 1 in ts and 64 in ts


def _metal_like(monkeypatch):
    """On the CPU, a gather_qmm that, like Metal, computes differently in the rhs kernel:
    the pool's output differs from stock's exactly where their kernels differ."""
    real = mx.gather_qmm

    def fake(x, w, *a, rhs_indices=None, sorted_indices=False, **kw):
        y = real(x, w, *a, rhs_indices=rhs_indices, sorted_indices=sorted_indices, **kw)
        B = math.prod(np.broadcast_shapes(tuple(x.shape[:-2]), tuple(rhs_indices.shape)))
        if (
            kernel(GatherCall("metal", True, x.shape[-2], B, w.shape[0], sorted_indices))
            == "gather_qmm_rhs"
        ):
            return y * (1 + 2.0**-8)
        return y

    monkeypatch.setattr(mx, "gather_qmm", fake)
    monkeypatch.setattr(selftest, "backend", lambda: "metal")


CASE = selftest.ProjectionCase(
    "gate_proj",
    (
        ("weight", (32, 16), "uint32"),
        ("scales", (32, 2), "float32"),
        ("biases", (32, 2), "float32"),
    ),
    (4, 64, "affine"),
    "float32",
    128,
    16,
    True,
    8,
)


def test_self_test_passes_with_the_rule(monkeypatch, tmp_path):
    _metal_like(monkeypatch)
    cache = tmp_path / "parity.json"
    ticks = []
    selftest.ensure_kernel_parity([CASE], 80, cache, tick=lambda: ticks.append(1))
    assert json.loads(cache.read_text()) == {CASE.key(): "exact"}
    assert ticks == [1]  # after the case (a pipeline's Pace.tick)
    selftest.ensure_kernel_parity([CASE], 80, cache, tick=lambda: ticks.append(1))
    assert ticks == [1]  # a case known exact is not checked again


def test_self_test_catches_a_kernel_mismatch(monkeypatch, tmp_path):
    _metal_like(monkeypatch)
    monkeypatch.setattr(dispatch, "pool_sorted_flag", lambda *a: a[-1])  # no rule
    cache = tmp_path / "parity.json"
    with pytest.raises(KernelParityError, match=f"MLX {mx.__version__}.*differ"):
        selftest.ensure_kernel_parity([CASE], tokens_max=80, cache_file=cache)
    assert not cache.exists()  # a failure is not remembered as a pass
    # the cache is trusted once a case passed
    bad = selftest.check_case(CASE, [9, 10, 60])
    assert bad and all("differ" in b for b in bad)


def test_self_test_checks_row_subsets(monkeypatch):
    """Long calls' expert groups run as row subsets (rows='mixed'): exact on one-kernel
    backends, and caught where the kernel choice reads the row count (Metal's rule)."""
    from dataclasses import replace

    case = replace(CASE, subset=True)
    assert selftest.check_case(case, [9, 80]) == []  # CPU: one kernel
    _metal_like(monkeypatch)
    bad = selftest.check_case(case, [80])  # 640 rows: stock takes rhs, a quarter does not
    assert any("row subset" in b for b in bad), bad
    assert selftest.check_case(CASE, [80]) == []  # without subsets nothing differs


def test_patch_runs_the_self_test(models, tmp_path):
    from mlx_lm import load

    from mlx_streaming import FileExpertStore, patch_model_filebacked
    from mlx_streaming.core.options import StreamConfig

    ck, ed = models.experts("tiny-qwen3_moe")
    model, _ = load(str(ck), lazy=True)
    cache = tmp_path / "k.json"
    cfg = StreamConfig(rows="masked", kernel_check=True, kernel_check_file=cache)
    store = FileExpertStore(ed, capacity=6, config=cfg)
    patch_model_filebacked(model, store, 128, 64, 64, 4, config=cfg)
    assert len(json.loads(cache.read_text())) == 3  # gate, up and down projections
    store.close()


def test_default_rows_fall_back_to_masked_where_subsets_differ(models, monkeypatch):
    """Where the self-test finds row subsets inexact, the default 'mixed' rows become
    masked (stock's shapes) instead of refusing the model; asked-for rows still raise."""
    import sys

    from mlx_lm import load

    from mlx_streaming import FileExpertStore, patch_model_filebacked
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.core.options import StreamConfig
    from mlx_streaming.core.prefetch import patch
    from mlx_streaming.core.runtime import resolve

    monkeypatch.setattr(selftest, "_subset_same", lambda *a: False)
    monkeypatch.setattr(patch, "_CHECKED", set())
    ck, ed = models.experts("tiny-qwen3_moe")
    for rows in (None, "mixed"):
        model, _ = load(str(ck), lazy=True)
        cfg = StreamConfig(rows=rows, kernel_check=True)
        # CUDA's default rows (mixed), on this CPU
        rt = resolve(cfg, load_meta(ed)).replace(rows="mixed", zero_slot=True)
        store = FileExpertStore(ed, capacity=6, config=cfg, runtime=rt)
        if rows is None:
            patch_model_filebacked(model, store)
            layers = [m for _, m in model.named_modules() if getattr(m, "is_streamed_experts", 0)]
            assert layers and all(m._masked_below == sys.maxsize for m in layers)
            assert store.runtime.rows == "masked" and store.runtime.reason("rows")
        else:
            with pytest.raises(KernelParityError, match="differ"):
                patch_model_filebacked(model, store)
        store.close()


def test_rule_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend"):
        kernel(GatherCall("tpu", True, 1, 8, 8, False))
    assert np.all(
        [
            kernel(GatherCall("cpu", q, 1, b, 4, s)) == "cpu"
            for q, b, s in itertools.product((True, False), (1, 64, 999), (1, 0))
        ]
    )
