"""The user's benchmark script runs unmodified against the package and prints real values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_streaming.core.meta import load_meta

SEED = Path(
    os.environ.get(
        "MLX_STREAMING_SEED",
        Path(__file__).resolve().parents[1].parent / "shared" / "seed" / "bench_streaming.py",
    )
)


def run_seed(env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SEED)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    return json.loads(out[out.index("{\n") :])


@pytest.mark.skipif(not SEED.exists(), reason=f"seed script not found at {SEED}")
@pytest.mark.parametrize("pin_hot", [0, 2])
def test_seed_script_unmodified(models, tmp_path, pin_hot):
    ck = models.checkpoint("tiny-qwen3_next")
    ed = tmp_path / "experts"
    r = run_seed(
        {
            "MODEL": str(ck),
            "EXPERT_DIR": str(ed),
            "MAXTOK": "16",
            "REPEAT": "3",
            "PIN_HOT": str(pin_hot),
            "CAL_TOK": "8",
        }
    )
    meta = load_meta(ed)  # the script split the model itself
    n_layers = len(meta.moe_layers)
    assert r["mode"] == "streaming_filebacked" and r["model"] == str(ck)
    assert r["expert_bits"] == meta.dims["bits"] == 4
    assert r["expert_group"] == meta.dims["group_size"] == 64
    assert r["proj_bits"] is None and r["layered"] is False
    assert r["patched_moe_layers"] == n_layers == 3
    assert r["per_layer_slots"] == 8 and r["pool_profile"] is False
    assert meta.top_k * n_layers <= r["resident_experts"] <= 8 * n_layers
    assert r["pinned_experts"] == pin_hot * n_layers
    assert (r["cal_s"] > 0) == (pin_hot > 0)
    assert r["load_patch_s"] >= 0
    assert len(r["tok_per_s_runs"]) == 3 and all(t > 0 for t in r["tok_per_s_runs"])
    assert r["tok_per_s_minmax"] == [min(r["tok_per_s_runs"]), max(r["tok_per_s_runs"])]
    assert r["tok_per_s"] == sorted(r["tok_per_s_runs"])[1]
    for k in ("rss_gb_after_patch", "rss_gb_after_gen"):
        assert r[k] > 0, k
    # MLX memory of a tiny model rounds to 0.00 GB; it is measured (test_api checks bytes)
    assert r["mlx_active_gb_after_gen"] >= 0 and r["mlx_peak_gb"] >= 0
    lookups = r["expert_hits"] + r["expert_misses"]
    assert lookups > 0 and r["expert_misses"] > 0
    assert r["expert_hit_rate"] == round(r["expert_hits"] / lookups, 4)
    calls = r["gpu_fastpath"] + r["gpu_fallback"]
    assert calls > 0 and r["gpu_fallback"] > 0
    assert r["gpu_fastpath_frac"] == round(r["gpu_fastpath"] / calls, 4)
    assert isinstance(r["sample"], str) and r["sample"]


@pytest.mark.skipif(not SEED.exists(), reason=f"seed script not found at {SEED}")
def test_seed_all_resident_takes_the_device_path(models, tmp_path):
    ck, ed = models.experts("tiny-qwen3_next")
    r = run_seed(
        {
            "MODEL": str(ck),
            "EXPERT_DIR": str(ed),
            "MAXTOK": "8",
            "REPEAT": "1",
            "EXPERT_SLOTS": "16",
        }
    )
    assert r["expert_misses"] == 0 and r["expert_hit_rate"] == 1.0
    assert r["gpu_fallback"] == 0 and r["gpu_fastpath"] > 0
