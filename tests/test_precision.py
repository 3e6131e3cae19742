"""Hot and cold precision: hot sets, the byte-bounded LRU, fake-quantized models."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm import load
from test_policies import local_trace

from mlx_streaming.analysis.precision import (
    byte_lru_hit_rate,
    fake_quantized,
    hot_cold_study,
    hot_experts,
)
from mlx_streaming.analysis.quality import compare_distributions
from mlx_streaming.core.discovery import find_expert_sites
from mlx_streaming.planning.simulate import simulate
from mlx_streaming.planning.trace import apply_trace_routing


def test_byte_lru_with_equal_sizes_is_the_stores_lru():
    trace = local_trace(T=500, L=2, E=32, k=4)
    for li in range(2):
        for slots in (4, 8, 16):
            got, loaded = byte_lru_hit_rate(trace, li, np.full(32, 100), slots * 100)
            want = simulate(trace, "lru", slots, layers=[li])
            assert got == want.layer_hit_rate(li)
            assert loaded == 100 * want.misses[li] / 500


def test_smaller_cold_experts_raise_the_hit_rate_at_equal_bytes():
    trace = local_trace(T=800, L=1, E=32, k=4)
    hot = hot_experts(trace, 0.25, 0, 400)[0]
    assert len(hot) == 8
    counts = np.bincount(trace.experts[:400, 0].reshape(-1), minlength=32)
    assert counts[hot].min() >= np.delete(counts, hot).max()  # the most routed ones
    sizes = np.full(32, 50)
    sizes[hot] = 100
    mixed, _ = byte_lru_hit_rate(trace, 0, sizes, 800, 400)
    uniform, _ = byte_lru_hit_rate(trace, 0, np.full(32, 100), 800, 400)
    assert mixed > uniform


def test_fake_quantized_at_the_source_bits_changes_nothing(models):
    ck = models.checkpoint("tiny-deepseek_v2")
    ref, tok = load(str(ck))
    sites = find_expert_sites(ref)
    E, k = sites[0].num_experts, sites[0].top_k
    trace = local_trace(T=200, L=len(sites), E=E, k=k)
    text = tok.encode("Hot experts keep their bits, cold ones lose some.")
    base = fake_quantized(load(str(ck))[0], [None] * len(sites))
    same = fake_quantized(load(str(ck))[0], [np.full(E, 4)] * len(sites))
    cold = fake_quantized(load(str(ck))[0], [np.full(E, 2)] * len(sites))
    routes = [apply_trace_routing(m, trace) for m in (base, same, cold)]
    q_same = compare_distributions(base, same, text)
    for r in routes:
        r.cursor = 0
    q_cold = compare_distributions(base, cold, text)
    assert q_same["kl"] < 1e-9 and q_same["top1_agreement"] == 1.0
    assert q_cold["kl"] > 1e-6


def test_study_rows(models):
    ck = models.checkpoint("tiny-deepseek_v2")
    sites = find_expert_sites(load(str(ck), lazy=True)[0])
    trace = local_trace(T=600, L=len(sites), E=sites[0].num_experts, k=sites[0].top_k)
    out = hot_cold_study(
        ck, trace, fractions=(0.25,), budget_fraction=0.5, quality_tokens=32, sim_tokens=300
    )
    rows = {r["config"]: r for r in out["rows"]}
    u4, u2 = rows["uniform 4-bit"], rows["uniform 2-bit"]
    mix = rows["hot 25% at 4-bit, rest 2-bit"]
    assert u2["mean_expert_bytes"] < mix["mean_expert_bytes"] < u4["mean_expert_bytes"]
    assert u4["kl"] < 1e-9 and u2["kl"] > 0
    assert u2["hit_rate"] >= mix["hit_rate"] >= u4["hit_rate"]


def test_precision_beyond_takes_its_own_default_formats(monkeypatch):
    """``benchmarks/precision_beyond.py``'s default ``--formats`` (every format) parses:
    a format named with commas once made the script refuse its own default."""
    import importlib.util
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("precision_beyond", bench / "precision_beyond.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.chosen(",".join(mod.FORMATS)) == list(mod.FORMATS)
    assert mod.chosen("3-bit, 4-bit") == ["4-bit", "3-bit"]
    with pytest.raises(ValueError, match=r"unknown formats \['5-bit'\]"):
        mod.chosen("4-bit,5-bit")
