"""Bad input raises an exception whose message names the file or value and the fix."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from mlx_lm import load

import mlx_streaming
from mlx_streaming import FileExpertStore, patch_model_filebacked, split_model
from mlx_streaming.analysis.verify import greedy_trace
from mlx_streaming.core.discovery import UnsupportedModelError
from mlx_streaming.core.format import META_NAME, ExpertChecksumError, ExpertDirError
from mlx_streaming.core.meta import load_meta


def _patch(ck, ed, **kw):
    model, tok = load(str(ck), lazy=True)
    store = FileExpertStore(ed, **kw)
    d = load_meta(ed).dims
    patch_model_filebacked(model, store, d["hidden"], d["moe_inter"], d["group_size"], d["bits"])
    return model, tok, store


@pytest.fixture
def copy_of(models, tmp_path):
    def make(arch="tiny-qwen3_moe"):
        ck, ed = models.experts(arch)
        dst = tmp_path / "experts"
        shutil.copytree(ed, dst)
        return ck, dst

    return make


def test_missing_directory(tmp_path):
    with pytest.raises(ExpertDirError, match=r"does not exist: split the model first"):
        FileExpertStore(tmp_path / "nope", capacity=4)


def test_missing_meta(copy_of):
    ck, ed = copy_of()
    (ed / META_NAME).unlink()
    with pytest.raises(ExpertDirError, match=r"_split_meta.json is missing.*run the split again"):
        FileExpertStore(ed, capacity=4)


def test_malformed_meta(copy_of):
    ck, ed = copy_of()
    (ed / META_NAME).write_text("{not json")
    with pytest.raises(ExpertDirError, match=r"not valid JSON"):
        FileExpertStore(ed, capacity=4)


def test_meta_from_another_model(models, copy_of):
    ck, ed = copy_of()
    other = models.checkpoint("tiny-qwen3_moe", seed=1)
    model, _ = load(str(other), lazy=True)
    store = FileExpertStore(ed, capacity=4)
    d = load_meta(ed).dims
    with pytest.raises(ExpertDirError, match=r"split from another model.*fingerprint differs"):
        patch_model_filebacked(
            model, store, d["hidden"], d["moe_inter"], d["group_size"], d["bits"]
        )
    # split into it is refused, as is loading another model over it
    with pytest.raises(ExpertDirError, match=r"holds the experts of another model"):
        split_model(other, ed)
    with pytest.raises(ExpertDirError, match=r"split from another model"):
        mlx_streaming.load(other, ed, slots=4)


def test_split_returns_at_once_on_a_complete_directory(copy_of, tmp_path):
    ck, ed = copy_of()
    missing = tmp_path / "no-such-model"  # never opened: the meta says it all
    assert split_model(missing, ed)["moe_layers"] == list(load_meta(ed).moe_layers)


def test_truncated_record_file(copy_of):
    ck, ed = copy_of()
    meta = load_meta(ed)
    f = meta.file(meta.moe_layers[-1])
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 100)
    with pytest.raises(ExpertDirError, match=rf"{f.name} is truncated.*split the model again"):
        FileExpertStore(ed, capacity=4)


@pytest.mark.parametrize("reader", ["native", "python"])
def test_checksum_mismatch_detected_on_read(copy_of, reader):
    ck, ed = copy_of()
    meta = load_meta(ed)
    layer = meta.moe_layers[0]
    lay = meta.layers[layer]
    # corrupt every expert of the first MoE layer: whichever is routed to is caught
    with open(meta.file(layer), "r+b") as fh:
        for e in range(lay.num_experts):
            fh.seek(e * lay.stride + lay.record_bytes // 2)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0xFF]))
    model, tok, store = _patch(ck, ed, capacity=meta.top_k, reader=reader)
    with pytest.raises(
        ExpertChecksumError, match=rf"layer {layer} in .*layer_.*fails its checksum"
    ):
        greedy_trace(model, tok.encode("hello experts"), 2)
    cache = store.caches[layer]
    assert cache.resident == 0 and (cache.slot_of < 0).all()  # nothing bad marked resident
    store.close()


def test_capacity_below_top_k(copy_of):
    ck, ed = copy_of()
    k = load_meta(ed).top_k
    with pytest.raises(ExpertDirError, match=rf"below top_k={k}.*use at least {k}"):
        FileExpertStore(ed, capacity=k - 1)
    with pytest.raises(ExpertDirError, match=r"positive integer"):
        FileExpertStore(ed, capacity=0)


def test_store_refuses_options_it_would_ignore(copy_of):
    """``FileExpertStore`` sizes its pools from ``capacity`` or ``slots``; the options
    that ``load`` applies around it (a budget, a pool profile, the context, MLX's cache
    limit) are refused with where they apply, not silently dropped; ``slots=0`` is
    refused as ``capacity=0`` is; ``capacity`` and ``slots`` that disagree are refused."""
    from mlx_streaming.core.options import StreamConfig

    _, ed = copy_of()
    for opt, value in (
        ("budget_gb", 0.5),
        ("pool_profile", "auto"),
        ("context", 1024),
        ("cache_limit_gb", 1.0),
    ):
        with pytest.raises(ValueError, match=rf"FileExpertStore does not apply {opt}.*load"):
            FileExpertStore(ed, **{opt: value})
    with pytest.raises(ValueError, match=r"budget_gb.*capacity"):
        FileExpertStore(ed, config=StreamConfig(budget_gb=0.5))  # nothing sized it
    with pytest.raises(ExpertDirError, match=r"positive integer"):
        FileExpertStore(ed, slots=0)
    with pytest.raises(ValueError, match=r"capacity=8 and slots=16"):
        FileExpertStore(ed, capacity=8, slots=16)
    store = FileExpertStore(ed, capacity=8, slots=8)  # the same: fine
    assert store.capacity(store.layers[0]) == 8
    store.close()
    store = FileExpertStore(ed, slots=8)
    assert store.capacity(store.layers[0]) == 8
    store.close()


def test_device_reads_needs_cuda_mappings(copy_of):
    """``device_reads`` off CUDA (or without mapped files) is refused with what it needs;
    nothing of the store stays open."""
    _, ed = copy_of()
    with pytest.raises(ValueError, match=r"device_reads: the GPU copies misses from page-locked"):
        FileExpertStore(ed, device_reads=True)


def test_layer_caps_errors(copy_of):
    ck, ed = copy_of()
    meta = load_meta(ed)
    with pytest.raises(ExpertDirError, match=r"layer_caps of 1 slots for layer"):
        FileExpertStore(ed, capacity=8, layer_caps={meta.moe_layers[0]: 1})
    with pytest.raises(ExpertDirError, match=r"not MoE layers"):
        FileExpertStore(ed, capacity=8, layer_caps={999: 8})


def test_unsupported_architecture(models, tmp_path):
    ck = models.checkpoint("tiny-llama-dense")
    with pytest.raises(UnsupportedModelError, match=r"model type 'llama' has no experts"):
        split_model(ck, tmp_path / "x")
    assert not (tmp_path / "x" / META_NAME).exists()


def test_bits_disagree_with_meta(copy_of):
    ck, ed = copy_of()
    model, _ = load(str(ck), lazy=True)
    store = FileExpertStore(ed, capacity=8)
    d = load_meta(ed).dims
    with pytest.raises(ExpertDirError, match=r"asked for bits=8.*stores bits=4.*authority"):
        patch_model_filebacked(model, store, d["hidden"], d["moe_inter"], d["group_size"], 8)
    with pytest.raises(ExpertDirError, match=r"hidden=7"):
        patch_model_filebacked(model, store, 7, d["moe_inter"], d["group_size"], d["bits"])


def test_meta_paths_confined(copy_of):
    ck, ed = copy_of()
    d = json.loads((ed / META_NAME).read_text())
    first = next(iter(d["layers"]))
    d["layers"][first]["file"] = "../../etc/passwd"
    (ed / META_NAME).write_text(json.dumps(d))
    with pytest.raises(ExpertDirError, match=r"not a plain name inside the expert directory"):
        FileExpertStore(ed, capacity=8)


def test_pin_limits(copy_of):
    ck, ed = copy_of()
    meta = load_meta(ed)
    store = FileExpertStore(ed, capacity=meta.top_k + 1)
    with pytest.raises(ValueError, match=r"leaves fewer than top_k"):
        store.pin(meta.moe_layers[0], [0, 1])
    with pytest.raises(ValueError, match=r"pin at most 1 or raise"):  # every expert, too
        store.pin(meta.moe_layers[0], range(meta.num_experts))
    with pytest.raises(ValueError, match=r"out of range"):
        store.pin(meta.moe_layers[0], [meta.num_experts])
    store.pin(meta.moe_layers[0], [0])
    assert store.pinned_count() == 1
    store.close()


def test_budget_too_small(copy_of):
    from mlx_streaming.planning.budget import plan_budget

    ck, ed = copy_of()
    meta = load_meta(ed)
    with pytest.raises(ValueError, match=r"raise --budget-gb to at least"):
        plan_budget(meta, 1e-6)
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"positive number"):
            plan_budget(meta, bad)
    plan = plan_budget(meta, 1.0)
    assert all(v == meta.num_experts for v in plan.slots.values())
    assert np.isfinite(plan.pool_bytes)
