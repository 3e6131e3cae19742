"""Requantized and mixed-precision experts: exact against stock mlx-lm on the same
weights, identical bytes when nothing changes, and the quality metrics."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys

import numpy as np
import pytest
from mlx_lm import load

import mlx_streaming
from mlx_streaming.analysis.verify import compare_traces, greedy_trace
from mlx_streaming.core.meta import load_meta
from mlx_streaming.prep.requantize import requantize

PROMPT = "Requantized experts take fewer bytes per token, and the cache holds more of them."


def streamed(ck, ed, slots):
    model, _, store = mlx_streaming.load(ck, ed, slots=slots)
    return model, store


def test_same_format_gives_identical_bytes(models, tmp_path):
    ck, ed = models.experts("tiny-gpt_oss")  # 4-bit, group 64, with linear biases
    out = requantize(ed, tmp_path / "same", 4, group_size=64)
    for name in (f for f in os.listdir(ed) if f.endswith(".bin")):
        assert filecmp.cmp(ed / name, tmp_path / "same" / name, shallow=False)
    assert out["dims"]["bits"] == 4 and "proj_bits" not in out["dims"]


@pytest.mark.parametrize(
    "spec",
    [
        {"bits": 3},
        {"bits": 4, "proj_bits": "gate=2,up=2,down=3"},
        {"bits": 2, "layer_bits": {"2": 8, "3": {"down_proj": 3}}},
    ],
)
def test_requantized_streams_exactly(models, tmp_path, spec):
    ck, ed = models.experts("tiny-qwen3_moe")
    out = tmp_path / "rq"
    meta = requantize(ed, out, model_out=tmp_path / "model", model=ck, **spec)
    m = load_meta(out)
    if "proj_bits" in spec:
        assert m.dims["proj_bits"] == {"down_proj": 3, "gate_proj": 2, "up_proj": 2}
        assert all(lay.proj_bits() == m.dims["proj_bits"] for lay in m.layers.values())
    if "layer_bits" in spec:
        assert m.dims["per_layer_proj_bits"]["2"] == {"down_proj": 8, "gate_proj": 8, "up_proj": 8}
        assert m.layers[3].proj_bits() == {"down_proj": 3, "gate_proj": 2, "up_proj": 2}
    assert m.expert_bytes() < load_meta(ed).expert_bytes() or "layer_bits" in spec
    assert meta["fingerprint"] == load_meta(ed).to_json()["fingerprint"]
    ref, tok = load(str(tmp_path / "model"))  # stock mlx-lm on the requantized weights
    ids = tok.encode(PROMPT)
    want = greedy_trace(ref, ids, 24, 16)
    for slots in (m.top_k, m.num_experts):
        model, store = streamed(ck, out, slots)
        cmp = compare_traces(want, greedy_trace(model, ids, 24, 16))
        assert cmp.exact, cmp.to_json()
        store.close()


def test_seed_runs_on_requantized_directory(models, tmp_path):
    from test_seed import SEED, run_seed

    if not SEED.exists():
        pytest.skip("seed script not found")
    ck, ed = models.experts("tiny-qwen3_moe")
    requantize(ed, tmp_path / "rq", 4, proj_bits="gate=2,up=2,down=3")
    r = run_seed(
        {"MODEL": str(ck), "EXPERT_DIR": str(tmp_path / "rq"), "MAXTOK": "8", "REPEAT": "1"}
    )
    assert r["proj_bits"] == {"down_proj": 3, "gate_proj": 2, "up_proj": 2}
    assert r["tok_per_s"] > 0 and r["expert_misses"] > 0


def test_quality_metrics(models, tmp_path):
    from mlx_streaming.analysis.quality import compare_distributions, quality_report

    ck, ed = models.experts("tiny-qwen3_moe")
    ref, tok = load(str(ck))
    same = compare_distributions(ref, ref, tok.encode(PROMPT))
    assert same["kl"] == 0.0 and same["top1_agreement"] == 1.0
    requantize(ed, tmp_path / "q8", 8)
    requantize(ed, tmp_path / "q2", 2)
    q8 = quality_report(str(ck), str(tmp_path / "q8"), tokens=64)
    q2 = quality_report(str(ck), str(tmp_path / "q2"), tokens=64)
    assert 0 < q8["kl"] < q2["kl"]
    assert q8["top1_agreement"] >= q2["top1_agreement"]
    for p, e in q2["mean_projection_error"].items():
        assert e > q8["mean_projection_error"][p] > 0


def test_requantize_command_and_errors(models, tmp_path):
    ck, ed = models.experts("tiny-mixtral")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_streaming",
            "requantize",
            "--src",
            str(ed),
            "--out",
            str(tmp_path / "x"),
            "--bits",
            "7",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "bits 7" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(ValueError, match="gate=2"):
        requantize(ed, tmp_path / "y", 4, proj_bits="gate2")
    assert np.isfinite(load_meta(ed).expert_bytes())


def test_target_gb_allocation_beats_uniform(models, tmp_path):
    from mlx_streaming.analysis.quality import choose_bits

    ck, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    from mlx_streaming.analysis.quality import proj_bytes

    three = sum(
        proj_bytes(lay, p, 3, 64) * lay.num_experts
        for lay in meta.layers.values()
        for p in lay.quant
    )
    layer_bits, rep = choose_bits(str(ed), three * 1.05 / 1e9, str(ck), 64)
    assert rep["bytes"] <= rep["target_bytes"] and rep["uniform_bits"] == 3
    assert rep["mean_error"] <= rep["uniform_mean_error"]
    out = requantize(ed, tmp_path / "t", 4, layer_bits=layer_bits)
    assert sum(lay["record_bytes"] for lay in out["layers"].values()) > 0


def test_bad_bit_specs_are_refused_before_anything_is_written(models, tmp_path):
    """Every ``proj_bits`` / ``layer_bits`` entry is checked before the first file is
    written: an unknown projection or layer, or bits that are not numbers, name the
    entry; a good directory at ``--out`` survives a failed run whole (before: layers
    were overwritten until the bad one, and the directory no longer loaded)."""
    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    out = tmp_path / "rq"
    requantize(ed, out, bits=4)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    last = max(meta.layers)
    for kw, match in [
        ({"proj_bits": "gat=2"}, "'gat_proj'"),
        ({"layer_bits": {"1": {"gate": 2}, str(last): {"upp": 3}}}, "'upp_proj'"),
        ({"layer_bits": {"2": "2"}}, "bits must be numbers"),
        ({"layer_bits": {"99": 3}}, "layer '99'"),
        ({"layer_bits": {str(last): 7}}, "bits 7"),
    ]:
        with pytest.raises(ValueError, match=match):
            requantize(ed, out, bits=3, **kw)
        assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    requantize(ed, out, bits=3, layer_bits={"1": {"gate": 2}})  # the short names work
    assert load_meta(out).layers[1].quant["gate_proj"].bits == 2
    assert not (tmp_path / "rq.partial").exists()


def test_projection_sizes_from_any_source_precision(models, tmp_path):
    """``proj_bytes`` (what ``--target-gb`` sizes with) gives a projection's real bytes
    at 4 bits from a 6-bit source too (before: 32 // 6 words per value made it short)."""
    from mlx_streaming.analysis.quality import proj_bytes

    _, ed = models.experts("tiny-qwen3_moe")
    requantize(ed, tmp_path / "six", 6)
    requantize(ed, tmp_path / "four", 4)
    six, four = load_meta(tmp_path / "six"), load_meta(tmp_path / "four")
    for li, lay in six.layers.items():
        for p, q in lay.quant.items():
            real = sum(x.nbytes for x in four.layers[li].parts if x.name.startswith(p + "."))
            assert proj_bytes(lay, p, 4, q.group_size) == real, (li, p)


def test_requantize_a_model_to_a_byte_target(models, tmp_path):
    """``requantize --src MODEL --target-gb G``: the model is split first, then measured
    (before: refused as "not a complete expert directory")."""
    from mlx_streaming.commands import requantize as cmd

    ck = models.checkpoint("tiny-mixtral")
    env = {"MLX_STREAMING_HOME": str(tmp_path / "home")}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        cmd.main(["--src", str(ck), "--out", str(tmp_path / "t"), "--target-gb", "0.0005"])
    assert load_meta(tmp_path / "t").expert_bytes() <= 0.0005e9
