"""The ``verify`` command: streamed experts against stock mlx-lm, layer by layer."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from mlx_streaming.cli import main
from mlx_streaming.core.meta import load_meta


def test_verify_says_exact(models, tmp_path, capsys):
    ck, ed = models.experts("thresholds-qwen3_moe")
    out = tmp_path / "r.json"
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
            "80",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert text.strip().endswith("exact") and "DIFFERS" not in text
    rep = json.loads(out.read_text())
    assert rep["exact"] and [r["layer"] for r in rep["layers"]] == [0, 1, 2]
    # one token, the largest chunk, and both sides of 4 x 17 rows (the pool's rhs point)
    assert {1, 8, 9, 80} <= set(rep["layers"][0]["tokens"])


def test_verify_finds_the_first_differing_layer(models, tmp_path, capsys):
    """Experts altered on disk (checksums off): verify names the first altered layer."""
    ck, ed0 = models.experts("tiny-qwen3_moe")
    ed = tmp_path / "experts"
    shutil.copytree(ed0, ed)
    meta = load_meta(ed)
    lay = meta.layers[2]
    data = np.fromfile(meta.file(2), dtype=np.uint8)
    for e in range(lay.num_experts):  # nudge a weight byte of every expert's record
        data[e * lay.stride + lay.part("down_proj.weight").offset] ^= 0x11
    data.tofile(meta.file(2))
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "verify",
                "--model",
                str(ck),
                "--expert-dir",
                str(ed),
                "--no-checksums",
                "--layers",
                "1",
                "2",
                "3",
                "--max-tokens-per-call",
                "32",
            ]
        )
    assert exit_.value.code == 1
    text = capsys.readouterr().out
    assert "layer 1: exact" in text and "layer 2: DIFFERS" in text
    assert "first differing layer 2" in text


def test_verify_rejects_dense_layers(models, capsys):
    ck, ed = models.experts("tiny-qwen3_moe")
    with pytest.raises(SystemExit) as exit_:
        main(["verify", "--model", str(ck), "--expert-dir", str(ed), "--layers", "0"])
    assert exit_.value.code == 2
    assert "layers [0] are not MoE layers" in capsys.readouterr().err
