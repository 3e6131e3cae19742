"""The split: one aligned record per expert holding exactly the checkpoint's bytes,
meta written last, a complete directory a no-op, an interrupted split resumed."""

from __future__ import annotations

import filecmp
import os

import mlx.core as mx
import numpy as np
import pytest

import mlx_streaming.prep.split_experts as se
from mlx_streaming import split_model
from mlx_streaming.core.format import ALIGN, META_NAME
from mlx_streaming.core.meta import load_meta


@pytest.mark.parametrize("arch", ["tiny-gpt_oss", "tiny-deepseek_v3"])
def test_records_hold_the_experts(models, arch):
    ck, ed = models.experts(arch)
    meta = load_meta(ed)
    weights = {}
    for f in sorted(ck.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    for li, lay in meta.layers.items():
        assert lay.stride % ALIGN == 0 and lay.stride >= lay.record_bytes
        data = np.fromfile(meta.file(li), dtype=np.uint8)
        assert data.size == lay.num_experts * lay.stride
        for e in (0, lay.num_experts - 1):
            rec = data[e * lay.stride : (e + 1) * lay.stride]
            for p in lay.parts:
                w = weights[f"{lay.module}.{p.name}"][e]
                if w.dtype == mx.bfloat16:
                    w = w.view(mx.uint16)
                want = np.array(w).tobytes()
                assert rec[p.offset : p.offset + p.nbytes].tobytes() == want, p.name


def test_meta_describes_dims(models):
    ck, ed = models.experts("tiny-gpt_oss")
    meta = load_meta(ed)
    assert meta.top_k == 4 and meta.num_experts == 16
    assert meta.dims["hidden"] == 128 and meta.dims["moe_inter"] == 64
    assert meta.dims["bits"] == 4 and meta.dims["group_size"] == 64
    assert "proj_bits" not in meta.dims and "per_layer_proj_bits" not in meta.dims
    names = {p.name for p in meta.layers[0].parts}
    assert {"gate_proj.bias", "down_proj.bias", "up_proj.scales"} <= names  # expert biases
    assert set(meta.fingerprint) >= {"shapes", "experts", "router", "config"}


def test_rerun_is_noop(models):
    ck, ed = models.experts("tiny-mixtral")
    before = {p.name: p.stat().st_mtime_ns for p in ed.iterdir()}
    again = split_model(ck, ed)
    assert again == load_meta(ed).to_json()
    assert {p.name: p.stat().st_mtime_ns for p in ed.iterdir()} == before


def test_interrupted_split_resumes(models, tmp_path, monkeypatch):
    ck, ref = models.experts("tiny-qwen3_next")
    out = tmp_path / "experts"
    real = se.write_layer_file
    calls = {"n": 0}

    def dying(path, source, layout):
        calls["n"] += 1
        if calls["n"] == 2:
            # die mid-file: a partial file is left behind, as after a kill
            path.with_name(path.name + ".partial").write_bytes(b"\0" * 123)
            raise KeyboardInterrupt
        return real(path, source, layout)

    monkeypatch.setattr(se, "write_layer_file", dying)
    with pytest.raises(KeyboardInterrupt):
        split_model(ck, out)
    assert not (out / META_NAME).exists()  # never taken for a complete directory
    done = sorted(p.name for p in out.glob("layer_*.bin"))
    assert len(done) == 1
    mtime = (out / done[0]).stat().st_mtime_ns
    monkeypatch.setattr(se, "write_layer_file", real)
    split_model(ck, out)
    assert (out / done[0]).stat().st_mtime_ns == mtime  # the finished layer was kept
    for f in sorted(p.name for p in ref.glob("layer_*.bin")):
        assert filecmp.cmp(ref / f, out / f, shallow=False)
    assert load_meta(out).to_json()["layers"] == load_meta(ref).to_json()["layers"]
    assert not list(out.glob("*.partial"))


def test_read_only_destination(models, tmp_path):
    from mlx_streaming.core.format import ExpertDirError

    ck = models.checkpoint("tiny-mixtral")
    if os.geteuid() == 0:
        dest = "/proc/mlx_streaming_experts"  # read-only even for root
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        dest = ro / "x"
    with pytest.raises(ExpertDirError, match=r"cannot write the expert directory"):
        split_model(ck, dest)


def test_split_into_another_models_directory_is_refused(models, tmp_path):
    """``split`` of model B into A's complete expert directory names the mix-up (before:
    it returned A's meta and exited 0)."""
    from mlx_streaming.core.format import ExpertDirError

    a = models.checkpoint("tiny-qwen3_moe")
    b = models.checkpoint("tiny-qwen3_moe", seed=1)
    ed = tmp_path / "experts"
    split_model(a, ed)
    assert split_model(a, ed)["fingerprint"]  # the same model again: its meta
    with pytest.raises(ExpertDirError, match="another model"):
        split_model(b, ed)
