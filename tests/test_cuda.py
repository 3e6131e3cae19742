"""On MLX's CUDA backend (skipped elsewhere): the pool modes, the start-up kernel
self-test and the verify command, on small synthetic models in bf16, the dtype of real
checkpoints. Run on a GPU machine with ``python -m pytest -m cuda``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

import mlx_streaming
from mlx_streaming.analysis.verify import compare_traces, greedy_trace
from mlx_streaming.core.dispatch import backend
from mlx_streaming.core.meta import load_meta

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(backend() != "cuda", reason="needs MLX's CUDA backend"),
    # a case stuck in native code (a kernel, a copy) cannot take a signal: the thread
    # method dumps every stack and ends the run, inside the bound
    pytest.mark.timeout(240, method="thread"),
]

TEXT = "A mixture of experts routes each token to a few experts out of many. " * 3


# cheapest first; Qwen3-Next's gated delta runs as ops on CUDA (slow to compile)
@pytest.mark.parametrize("preset", ["tiny-mixtral", "thresholds-qwen3_moe", "tiny-qwen3_next"])
@pytest.mark.parametrize("mode", ["cuda", "device", "mlx"])
def test_streamed_equals_stock_on_cuda(models, tmp_path, preset, mode):
    """Greedy tokens and logits equal stock's, prompts in chunks of 8 and 64, at top-k,
    half and all slots; ``device``: cuda pools with ``device_reads`` (the default: decode
    steps on the device path, prompt chunks on the host path, the slot table handed
    between them); ``cuda``: every call on the host path."""
    ck, ed = models.experts(preset, dtype="bfloat16")
    ref, tok = load(str(ck))
    ids = tok.encode(TEXT)
    want = {c: greedy_trace(ref, ids, 12, c) for c in (8, 64)}
    for c, trace in want.items():  # NaN logits would make any comparison meaningless
        assert np.isfinite(trace.logits).all(), f"stock mlx-lm gives NaN logits (chunk {c})"
    meta = load_meta(ed)
    for slots in (meta.top_k, meta.num_experts // 2, meta.num_experts):
        pread = mode == "cuda" and slots == meta.top_k  # else the files are mapped (default)
        model, _, store = mlx_streaming.load(
            ck,
            ed,
            slots=slots,
            pool_mode="cuda" if mode == "device" else mode,
            config=mlx_streaming.StreamConfig(
                kernel_check=True,
                kernel_check_file=tmp_path / "k.json",
                map_files=False if pread else None,
                device_reads=None if mode == "device" else False,
            ),
        )
        assert store.pool_mode == ("cuda" if mode == "device" else mode)
        if mode == "device":
            assert store.device is not None
        elif mode == "cuda":  # copies straight from page-locked mappings; routing read mapped
            assert (store.totals()["mapped_bytes"] > 0) == (not pread)
            assert store.host.mapped is not None
        for chunk, ref_trace in want.items():
            cmp = compare_traces(ref_trace, greedy_trace(model, ids, 12, chunk))
            assert cmp.exact, (slots, chunk, cmp.to_json())
        if mode == "device":  # decode steps took the device path; its counters came back
            t = store.totals()
            assert t["device_calls"] > 0 and t["hits"] + t["misses"] > 0, t
            if slots < meta.num_experts:
                assert t["misses"] > 0 and t["bytes_read"] > 0, t
        store.close()


def test_verify_on_cuda(models, capsys):
    from mlx_streaming.cli import main

    ck, ed = models.experts("thresholds-qwen3_moe", dtype="bfloat16")
    main(
        [
            "verify",
            "--model",
            str(ck),
            "--expert-dir",
            str(ed),
            "--slots",
            "16",
            "--max-tokens-per-call",
            "128",
        ]
    )
    assert capsys.readouterr().out.strip().endswith("exact")
    assert mx.default_device() != mx.cpu
