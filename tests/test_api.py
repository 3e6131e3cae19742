"""The one-call API, the seed's helpers and the commands."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate, load, stream_generate
from mlx_lm.models.cache import make_prompt_cache

import mlx_streaming
from mlx_streaming import FileExpertStore, config
from mlx_streaming.core import mem
from mlx_streaming.core.meta import load_meta
from mlx_streaming.model_builder import load_pool_profile
from mlx_streaming.planning.profiles import write_pool_profile

PROMPT = "Tell me how a mixture of experts model picks its experts."


def test_load_generate_stream_and_prompt_cache(models, tmp_path):
    ck = models.checkpoint("tiny-qwen3_moe")
    ref, tok = load(str(ck))
    model, tok2, store = mlx_streaming.load(ck, tmp_path / "ed", slots=4)
    assert generate(model, tok2, PROMPT, max_tokens=20) == generate(ref, tok, PROMPT, max_tokens=20)
    text = "".join(r.text for r in stream_generate(model, tok2, PROMPT, max_tokens=12))
    assert text == generate(ref, tok, PROMPT, max_tokens=12)
    # a prompt cache carried across two turns, as in mlx_lm.chat
    outs = []
    for m in (ref, model):
        cache = make_prompt_cache(m)
        a = generate(m, tok, PROMPT, max_tokens=6, prompt_cache=cache)
        b = generate(m, tok, " And then?", max_tokens=6, prompt_cache=cache)
        outs.append((a, b))
    assert outs[0] == outs[1]
    assert store.misses > 0 and 0 < store.hit_rate() < 1
    rep = store.layer_report()
    assert set(rep) == set(load_meta(tmp_path / "ed").moe_layers)
    assert all(r["bytes_read"] > 0 and r["read_s"] > 0 for r in rep.values())
    # demand reads in flight: from each issue to the wait's end, which holds the wait
    assert all(r["demand_s"] >= r["read_s"] for r in rep.values()), rep
    store.close()


def test_load_with_budget(models, tmp_path):
    ck = models.checkpoint("tiny-mixtral")
    _, ed = models.experts("tiny-mixtral")
    meta = load_meta(ed)
    from mlx_streaming.planning.budget import default_zero_slot, slot_bytes

    per_layer = slot_bytes(meta.layers[meta.moe_layers[0]])
    zero = int(default_zero_slot())  # GPUs: a zero slot for masked rows; CPU: none
    budget = (5 + zero) * per_layer * len(meta.moe_layers) / 1e9
    model, tok, store = mlx_streaming.load(ck, ed, budget_gb=budget)
    assert all(store.capacity(li) == 5 for li in store.layers)
    assert store.pool_bytes() <= budget * 1e9
    with pytest.raises(ValueError, match="either slots or budget_gb"):
        mlx_streaming.load(ck, ed, slots=4, budget_gb=1.0)
    store.close()


def test_every_flag_works_on_the_cpu(models, tmp_path):
    """Options that need each other are set together: masked rows get their zero slot;
    an unknown option is named."""
    from mlx_streaming.analysis.verify import compare_traces, greedy_trace

    ck, ed = models.experts("tiny-qwen3_moe")
    ref, tok = load(str(ck))
    ids = tok.encode(PROMPT)
    model, _, store = mlx_streaming.load(ck, ed, slots=5, rows="masked", progress=False)
    assert store.zero_slot
    assert compare_traces(greedy_trace(ref, ids, 6), greedy_trace(model, ids, 6)).exact
    store.close()
    with pytest.raises(TypeError, match="unknown streaming option.*'slot'.*fields"):
        mlx_streaming.load(ck, ed, slot=5)


def test_mem_snapshot_is_real():
    mem.reset_peak()
    a = mx.ones((1024, 1024))
    mx.eval(a)
    s = mem.snapshot()
    assert s.mlx_active_bytes >= a.nbytes and s.mlx_peak_bytes >= a.nbytes
    assert s.rss_bytes > 0 and s.peak_rss_bytes >= s.rss_bytes // 2
    del a
    mem.clear_cache()
    assert mem.snapshot().mlx_cache_bytes == 0


def test_prefill_chunk_env(monkeypatch):
    monkeypatch.delenv("PREFILL_CHUNK", raising=False)
    assert config.prefill_chunk() == 2
    monkeypatch.setenv("PREFILL_CHUNK", "0")
    assert config.prefill_chunk() == 0
    monkeypatch.setenv("PREFILL_CHUNK", "-3")
    with pytest.raises(ValueError, match="PREFILL_CHUNK"):
        config.prefill_chunk()


def test_pool_profile(tmp_path, monkeypatch):
    monkeypatch.delenv("EXPERT_POOL_PROFILE", raising=False)
    assert load_pool_profile(tmp_path) is None
    write_pool_profile(tmp_path / "pool_profile.json", {1: 5, 2: 6}, mode="test")
    assert load_pool_profile(tmp_path) == {1: 5, 2: 6}
    other = tmp_path / "other.json"
    write_pool_profile(other, {1: 7})
    monkeypatch.setenv("EXPERT_POOL_PROFILE", str(other))
    assert load_pool_profile(tmp_path) == {1: 7}
    monkeypatch.setenv("EXPERT_POOL_PROFILE", "none")
    assert load_pool_profile(tmp_path) is None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layers": {"1": -2}}))
    monkeypatch.setenv("EXPERT_POOL_PROFILE", str(bad))
    with pytest.raises(ValueError, match="bad.json.*positive slot count"):
        load_pool_profile(tmp_path)


def test_bench_command_compare_stock(models, tmp_path, capsys):
    from mlx_streaming.commands import bench

    ck, ed = models.experts("tiny-qwen3_next")
    out = tmp_path / "r.json"
    bench.main(
        [
            "--model",
            str(ck),
            "--expert-dir",
            str(ed),
            "--slots",
            "6",
            "--max-tokens",
            "12",
            "--repeat",
            "2",
            "--compare-stock",
            "--json",
            str(out),
            "--prompt",
            PROMPT,
        ]
    )
    r = json.loads(out.read_text())
    assert r["exact_vs_stock"] is True and r["exactness"]["max_abs_logit_diff"] == 0.0
    assert r["stock_tok_per_s"] > 0 and r["ratio_vs_stock"] > 0
    # stock and streamed alternate: one ratio per pair, the ratio their median
    pairs = r["ratio_pairs"]
    assert len(pairs) == 2 == len(r["stock_tok_per_s_runs"]) == len(r["paired_tok_per_s_runs"])
    assert abs(r["ratio_vs_stock"] - sum(pairs) / 2) < 1e-3
    assert r["generated_tokens"] == 12 and r["bytes_read"] > 0
    # the host path (CPU): each decode call waits for its routing, then plans
    assert r["decode_path"] == "host" and r["decode_host_us_per_layer_call"] > 0
    phases = r["decode_phases_us_per_layer_call"]
    assert set(phases) == {"beside_device", "routing_wait", "plan", "read_wait", "graph"}
    assert phases["plan"] == r["decode_host_us_per_layer_call"] and phases["routing_wait"] > 0
    assert 0 < r["decode_device_gap_share"] < 1
    rt = r["runtime"]  # every choice made by backend, and why, decided once at load
    assert (rt["backend"], rt["decode_path"], rt["reader"]) == ("cpu", "host", "native")
    assert rt["why"]["decode_path"]
    out = capsys.readouterr()
    assert json.loads(out.out) == r
    assert "mlx_streaming: cpu, host path (cpu: the routing is read on the host)" in out.err


def test_cli_split_and_bad_flags(models, tmp_path, capsys):
    from mlx_streaming.cli import main

    ck = models.checkpoint("tiny-olmoe")
    main(["split", str(ck), "--expert-dir", str(tmp_path / "ed")])
    assert json.loads(capsys.readouterr().out)["top_k"] == 4
    for flags in (["--slots", "-1"], ["--budget-gb", "nan"], ["--max-tokens", "0"]):
        with pytest.raises(SystemExit):
            main(["bench", "--model", str(ck), *flags])
        assert "must be" in capsys.readouterr().err


def test_cli_refuses_bad_serve_input_before_any_thread_and_takes_threads_0(tmp_path, capsys):
    """``serve`` with a port past 65535, or a local model path that is not there, stops
    with one message naming the value (no traceback, before any thread loads); the
    store flags take ``--threads 0`` (reading inline), as their help says; ``plan
    --bench`` takes a multi-budget ``bench --json`` result (a list)."""
    from mlx_streaming.cli import main
    from mlx_streaming.commands import generate

    with pytest.raises(SystemExit):
        main(["serve", "--model", "x", "--port", "70000"])
    assert "70000 is not a TCP port" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "nope not found" in err and "Traceback" not in err, err
    assert generate.setup_arg_parser().parse_args(["--model", "m", "--threads", "0"]).threads == 0
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps([{"t_compute_ms": 20.0, "storage_gbps": 2.0}, {}]))
    from mlx_streaming.commands.plan import _bounds

    class A:
        t_compute_ms, read_gbps = None, None

    A.bench = str(bench)
    assert _bounds(A) == (0.02, 2.0)


def test_resident_layers_count_hits_as_they_go(models):
    """Calls of several tokens to a layer holding every expert count their distinct
    experts on the device; those counts are folded in as they pile up, never held
    without bound until the stats are read (they once were: one lazy array a call)."""
    from mlx_streaming.core.cache.counts import PENDING

    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    store = FileExpertStore(ed, capacity=meta.num_experts)
    li = store.layers[0]
    rng = np.random.default_rng(0)
    first = mx.array(np.arange(meta.num_experts, dtype=np.uint32).reshape(-1, meta.top_k))
    store.finish(store.request(li, first), first)  # loads the whole layer: complete
    store.reset_stats()
    want = 0
    for _ in range(5 * PENDING):
        ids = np.stack([rng.choice(meta.num_experts, meta.top_k, replace=False) for _ in range(3)])
        call = store.request(li, mx.array(ids.astype(np.uint32)))
        assert call.path == "resident"
        want += len(np.unique(ids))
        assert store.counts.uncollected < PENDING
    assert store.hits == want and store.misses == 0
    store.close()


def test_the_timeline_marks_every_path(models):
    """One decode step's timeline has each layer call's phases on the resident path as on
    the host path (the resident and device paths marked nothing: a device-path
    timeline was empty); the host time of calls served on the device is counted apart
    (``device_s``: averaged with the prompt's host-path calls, it was read as the device
    path's cost)."""
    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    for capacity, path, phases in (
        (meta.num_experts, "resident", ["request", "planned", "built"]),
        (meta.top_k, "host", ["request", "routed", "grouped", "planned", "built"]),
    ):
        store = FileExpertStore(ed, capacity=capacity)
        li = store.layers[0]
        ids = mx.array(np.arange(meta.num_experts, dtype=np.uint32).reshape(-1, meta.top_k))
        if path == "resident":  # the first call loads the whole layer
            store.finish(store.request(li, ids), ids)
        store.reset_stats()
        store.timeline.start()
        call = store.request(li, ids[:1])
        assert call.path == path
        if path == "host":
            for i in range(len(call.steps)):
                store.step(call, i)
        store.finish(call, ids[:1])
        events = [e for e in store.timeline.stop() if e["layer"] == li]
        marks = [e["phase"] for e in events]
        assert [p for p in marks if p in phases] == phases, marks
        assert {e["path"] for e in events} == {path}
        t = store.totals()  # the device path's host time is apart (CUDA: test_cuda.py)
        assert t["device_s"] == 0 == t["device_path_calls"] and t["host_s"] > 0
        store.close()


def test_the_readme_lists_every_option_and_streaming_flag():
    """The README's ``StreamConfig(...)`` row names every field, and its streaming flags
    every flag the commands build from them (both drifted before)."""
    import argparse
    import dataclasses
    import re
    from pathlib import Path

    from mlx_streaming.commands._args import add_store_args

    text = (Path(__file__).parents[1] / "README.md").read_text()
    listed = re.search(r"`mlx_streaming\.StreamConfig\(([^)]*)\)`", text).group(1)
    fields = [f.name for f in dataclasses.fields(mlx_streaming.StreamConfig)]
    assert [x.strip() for x in listed.split(",")] == fields
    p = argparse.ArgumentParser()
    add_store_args(p)
    para = text[text.index("Streaming flags, the same for") :]
    para = para[: para.index("\n\n")]
    flags = {o for a in p._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
    missing = sorted(f for f in flags if not re.search(rf"{f}\b(?!-)", para))
    assert not missing, missing
