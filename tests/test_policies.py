"""Cache policies, the trace simulator, the planner and pool profiles."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_streaming.core.cache.policy import DEFAULT_POLICY, POLICIES, Belady, make_policy
from mlx_streaming.core.cache.slots import SlotCache
from mlx_streaming.planning.budget import PoolShape, plan_budget
from mlx_streaming.planning.planner import plan
from mlx_streaming.planning.profiles import build_profile
from mlx_streaming.planning.simulate import simulate
from mlx_streaming.planning.trace import RoutingTrace, TraceError, TraceRecorder

ALL = [*POLICIES, "belady"]


def local_trace(T=600, L=3, E=32, k=4, seed=0, concentrated=()):
    """Routing with temporal locality; layers in ``concentrated`` use few experts."""
    rng = np.random.default_rng(seed)
    ex = np.zeros((T, L, k), np.int64)
    for li in range(L):
        pool = np.arange(E) if li not in concentrated else rng.choice(E, k + 1, replace=False)
        cur = rng.choice(pool, k, replace=False)
        for t in range(T):
            if rng.random() < 0.5:
                out = rng.integers(k)
                cur[out] = rng.choice(np.setdiff1d(pool, cur))
            ex[t, li] = cur
    return RoutingTrace(ex.astype(np.uint8), np.array([0, T // 2, T]), E, "synthetic")


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    cap=st.integers(4, 12),
    pins=st.integers(0, 2),
    policy=st.sampled_from(ALL),
)
def test_invariants(seed, cap, pins, policy):
    rng = np.random.default_rng(seed)
    E, k, T = 16, 4, 80
    seq = [np.unique(rng.choice(E, k, replace=False)) for _ in range(T)]
    pol = Belady(E, seq) if policy == "belady" else make_policy(policy, E)
    cache = SlotCache(E, cap, pol)
    pinned = np.arange(min(pins, cap - k))  # as the store allows: top_k slots stay free
    if len(pinned):
        cache.commit(cache.reserve(pinned, np.zeros(0, np.int64)))
        cache.pinned = set(pinned.tolist())
    for need in seq:
        cache.lookup(need)
        assert cache.resident <= cap  # capacity never exceeded
        assert (cache.slot_of[pinned] >= 0).all()  # pinned never evicted
        assert all(cache.slot_of[e] >= 0 for e in need)  # the call's experts resident
        slots = cache.slot_of[cache.slot_of >= 0]
        assert len(set(slots.tolist())) == len(slots)  # one expert per slot
    s = cache.stats
    assert s.hits + s.misses == sum(len(n) for n in seq)
    assert s.calls == T


DSV2 = Path(__file__).resolve().parents[2] / "shared" / "traces" / "deepseek-v2-lite.npz"


def test_belady_is_the_ceiling():
    trace = local_trace()
    rates = {p: simulate(trace, p, 8).hit_rate for p in ALL}
    assert all(rates["belady"] >= r - 1e-12 for r in rates.values())


@pytest.mark.skipif(not DSV2.exists(), reason=f"no trace at {DSV2}")
def test_default_policy_beats_lru_on_real_routing():
    _, held = RoutingTrace.load(DSV2).split(0.5)
    for slots in (8, 16):
        lru = simulate(held, "lru", slots, layers=[0, 12, 25], tokens=3000).hit_rate
        best = simulate(held, DEFAULT_POLICY, slots, layers=[0, 12, 25], tokens=3000).hit_rate
        assert best > lru + 0.01, (slots, lru, best)


def test_simulator_equals_live_store(models):
    """The store's live counters equal the simulator's on the routing it took."""
    from mlx_lm import load, stream_generate

    from mlx_streaming import FileExpertStore, patch_model_filebacked
    from mlx_streaming.core.meta import load_meta

    ck, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    for policy in ("lru", "predictive", "lfu"):
        model, tok = load(str(ck), lazy=True)
        store = FileExpertStore(ed, capacity=meta.top_k + 2, policy=policy)
        d = meta.dims
        patch_model_filebacked(
            model, store, d["hidden"], d["moe_inter"], d["group_size"], d["bits"]
        )
        rec = TraceRecorder(store.layers, meta.num_experts)
        store.observers.append(rec)
        for _ in stream_generate(
            model, tok, "How do experts stream from disk?", max_tokens=24, prefill_step_size=1
        ):  # one token per call, as simulated
            pass
        trace = rec.trace()
        sim = simulate(trace, policy, meta.top_k + 2)
        for pos, li in enumerate(store.layers):
            c = store.caches[li].stats
            assert (c.hits, c.misses, c.evictions) == (
                sim.hits[pos],
                sim.misses[pos],
                sim.evictions[pos],
            ), (policy, li)
        store.close()


def test_a_calls_reads_are_waited_for_once(models):
    """The host path commits a call's reads once; waiting again is the caller's bug and
    raises instead of passing silently."""
    import mlx.core as mx

    from mlx_streaming import FileExpertStore
    from mlx_streaming.core.meta import load_meta

    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    store = FileExpertStore(ed, capacity=meta.top_k + 2)
    try:
        li = store.layers[0]
        ids = mx.array(np.arange(meta.top_k, dtype=np.int32)[None, None])
        call = store.request(li, ids, overlap=False)
        assert call.routing is not None  # planned late: at finish
        store.finish(call, call.slots)
        assert call.misses == meta.top_k and call.wait_at_launch
        assert store.caches[li].slot_of[: meta.top_k].min() >= 0
        with pytest.raises(RuntimeError, match="waited twice"):
            store.host.wait(call)
    finally:
        store.close()


def test_a_read_ahead_waited_for_by_a_later_load_is_not_on_time(models, monkeypatch):
    """The reader takes one started read at a time: a load after a read-ahead that is
    still reading waits for it, so that read-ahead did not arrive ahead of its need."""
    import threading
    import time

    from mlx_streaming import FileExpertStore
    from mlx_streaming.core.io import reader as rd
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.core.options import StreamConfig

    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    monkeypatch.setattr(rd, "INLINE_BYTES", 0)  # the reads go to the threads
    real, slow = rd.RecordReader._read_piece, threading.Event()

    def piece(self, *a):
        if slow.is_set():
            time.sleep(0.3)
        return real(self, *a)

    monkeypatch.setattr(rd.RecordReader, "_read_piece", piece)
    cfg = StreamConfig(reader="python", threads=2)
    store = FileExpertStore(ed, capacity=meta.top_k + 2, config=cfg)
    try:
        a, b = store.layers[:2]
        ahead = np.arange(2, dtype=np.int64)
        slow.set()
        assert store.loads.prefetch(a, ahead) == 2
        slow.clear()
        store.loads.fetch(b, np.arange(meta.top_k, dtype=np.int64))  # waits for it
        store.loads.finish_read_aheads(a, ahead)
        st = store.stats[a]
        assert (st.prefetched, st.prefetch_used, st.prefetch_on_time) == (2, 2, 0)
    finally:
        store.close()


def test_two_threads_driving_one_store_are_refused(models):
    """A store is driven by one thread: a second thread's request, prefetch or pin while
    one is inside raises a clear error instead of racing on the slot tables (no lock
    guards them); the first call completes."""
    import threading

    import mlx.core as mx

    from mlx_streaming import FileExpertStore
    from mlx_streaming.core.meta import load_meta

    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    store = FileExpertStore(ed, capacity=meta.top_k + 2)
    inside, go, out = threading.Event(), threading.Event(), {}
    first = [True]

    def hold():  # a watch: runs inside request
        if first[0] and threading.current_thread().name == "first":
            first[0] = False
            inside.set()
            go.wait(10)

    store.watch(hold)
    ids = mx.array(np.arange(meta.top_k, dtype=np.int32)[None, None])
    li = store.layers[0]

    def call():
        c = store.request(li, ids, overlap=False)
        out["call"] = store.finish(c, c.slots)

    t = threading.Thread(target=call, name="first")
    t.start()
    try:
        assert inside.wait(10)
        with pytest.raises(
            RuntimeError,
            match=r"two threads called one store at once \(request while another thread "
            r"is in request",
        ):
            store.request(li, ids, overlap=False)
        with pytest.raises(
            RuntimeError,
            match=r"two threads called one store at once \(prefetch while another thread "
            r"is in request",
        ):
            store.prefetch(li, [meta.top_k, meta.top_k + 1])
        with pytest.raises(
            RuntimeError,
            match=r"two threads called one store at once \(pin while another thread is in request",
        ):
            store.pin(li, [0])
    finally:
        go.set()
        t.join(10)
    assert "call" in out  # the first thread's call was not disturbed
    c = store.request(li, ids, overlap=False)  # and the store serves again
    store.finish(c, c.slots)

    def reenter():  # a watch that calls back into the store, on the driving thread
        store.prefetch(li, [meta.top_k])

    store.watch(reenter)
    with pytest.raises(RuntimeError, match="prefetch was called from inside its own request"):
        store.request(li, ids, overlap=False)
    store.close()  # the guard was let go on the way out


def test_a_late_call_gathers_the_slots_the_host_plans(models):
    """A one-step call on a host pool is planned late: its graph, built on the pool's
    table before the routing is read, gives at launch the slot the plan gave each row,
    misses of the call included; calls that may split (overlap, or more rows than free
    slots) are planned before their graph."""
    import mlx.core as mx

    from mlx_streaming import FileExpertStore
    from mlx_streaming.core.meta import load_meta

    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    k, cap = meta.top_k, meta.top_k + 2
    store = FileExpertStore(ed, capacity=cap)
    try:
        li = store.layers[0]
        rng = np.random.default_rng(1)
        for _ in range(6):  # misses, hits and evictions
            ids = np.sort(rng.choice(meta.num_experts, k, replace=False)).astype(np.int32)
            call = store.request(li, mx.array(ids[None, None]), overlap=False)
            assert call.routing is not None and not call.steps
            got = store.finish(call, call.slots)
            assert call.routing is None and call.wait_at_launch
            assert np.array_equal(np.array(got)[0, 0], store.pool(li).slots_of(ids))
            assert (store.caches[li].slot_of[ids] >= 0).all()
        ids = mx.array(np.arange(k, dtype=np.int32)[None, None])
        call = store.request(li, ids, overlap=True)  # may split: planned now
        assert call.routing is None and call.slots is None and call.steps
        store.finish(call, mx.zeros(1))
        two = mx.array(np.arange(2 * k, dtype=np.int32).reshape(1, 2, k))  # 2k rows > cap
        call = store.request(li, two, overlap=False)
        assert call.routing is None and call.slots is None and call.steps
    finally:
        store.close()


def test_trace_roundtrip_and_validation(tmp_path):
    t = local_trace(T=50)
    t.save(tmp_path / "t.npz")
    back = RoutingTrace.load(tmp_path / "t.npz")
    assert np.array_equal(back.experts, t.experts) and back.num_experts == 32
    np.savez(
        tmp_path / "bad.npz", experts=t.experts, offsets=np.array([0, 7]), num_experts=np.int64(32)
    )
    with pytest.raises(TraceError, match="offsets"):
        RoutingTrace.load(tmp_path / "bad.npz")
    np.savez(
        tmp_path / "obj.npz",
        experts=np.array([object()]),
        offsets=np.array([0]),
        num_experts=np.int64(1),
    )
    with pytest.raises(TraceError, match="cannot read trace"):
        RoutingTrace.load(tmp_path / "obj.npz")  # pickled objects are refused


def test_plan_rows_and_budget_arithmetic():
    trace = local_trace(T=400, L=4)
    shape = PoolShape([1000] * 4, 32, 4)
    # 8 slots (+ the zero slot per layer where pools have one) fill 4 x 9000 bytes
    assert plan_budget(shape, 4 * 1000 * 9 / 1e9, zero_slot=True).slots == {i: 8 for i in range(4)}
    assert plan_budget(shape, 4 * 1000 * 9 / 1e9, zero_slot=False).slots == {i: 9 for i in range(4)}
    # a layer's last slot drops its zero slot: 32 slots cost what 31 + zero do
    assert plan_budget(shape, 4 * 1000 * 32 / 1e9, zero_slot=True).slots == {
        i: 32 for i in range(4)
    }
    rows = plan(
        trace,
        shape,
        slots=[6, 12],
        policies=["lru", "predictive", "belady"],
        t_compute_s=0.01,
        read_gbps=1.0,
        tokens=200,
        layer_sample=None,
    )
    assert {(r.policy, r.slots) for r in rows} == {
        (p, s) for p in ("lru", "predictive", "belady") for s in (6, 12)
    }
    for r in rows:
        assert 0 <= r.hit_rate <= 1 and r.miss_bytes_per_token >= 0
        assert r.predicted_tok_per_s >= r.serial_tok_per_s > 0
        assert abs(r.miss_bytes_per_token - (1 - r.hit_rate) * 4 * 4000) < 4000 * 4 * 0.5
    by = {(r.policy, r.slots): r.hit_rate for r in rows}
    assert by["belady", 12] >= by["predictive", 12] and by["lru", 12] >= by["lru", 6]
    with pytest.raises(ValueError, match="one token's 4 experts in each of 4 MoE layers"):
        plan(trace, shape, budgets_gb=[1e-6], policies=["lru"])
    with pytest.raises(ValueError, match="below top_k"):
        plan(trace, shape, slots=[3], policies=["lru"])


def test_plan_command_json(tmp_path, capsys):
    from mlx_streaming.commands import plan as cmd

    local_trace(T=300).save(tmp_path / "t.npz")
    cmd.main(
        [
            "--trace",
            str(tmp_path / "t.npz"),
            "--expert-bytes",
            "4096",
            "--slots",
            "8",
            "--policy",
            "lfu",
            "--tokens",
            "150",
            "--json",
            "--plot",
            str(tmp_path / "p.png"),
        ]
    )
    rows = json.loads(capsys.readouterr().out)
    assert {r["policy"] for r in rows} == {"lfu", "lru", "belady"}
    assert all({"policy", "slots", "hit_rate"} <= set(r) for r in rows)
    assert (tmp_path / "p.png").stat().st_size > 1000
    # each row's spread over stretches of --window tokens (default: a fifth of --tokens)
    for r in rows:
        lo, hi = r["miss_bytes_per_token_p10_p90"]
        assert r["window_tokens"] == 30 and lo <= r["miss_bytes_per_token"] <= hi
        assert r["tok_per_s_p10_p90"] == []  # no compute time or bandwidth given
    args = ["--trace", str(tmp_path / "t.npz"), "--expert-bytes", "4096", "--slots", "8",
            "--tokens", "150", "--window", "10", "--t-compute-ms", "1", "--read-gbps", "0.001"]  # fmt: skip
    cmd.main(args)
    table = capsys.readouterr().out
    cmd.main([*args, "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert "stretches of 10 tokens (--window)" in table
    for r in rows:  # the table's spread is the JSON's, in MB
        lo, hi = (v / 1e6 for v in r["miss_bytes_per_token_p10_p90"])
        assert f"{lo:.2f}-{hi:.2f}" in table and lo < hi
    with pytest.raises(ValueError, match="150 tokens replayed .* lower --window"):
        cmd.main([*args[:-6], "--tokens", "20000", "--window", "31"])  # held-out: 150
    with pytest.raises(ValueError, match="--window plans pools, not a pipeline's split"):
        cmd.main(["--machines-gb", "48,24", "--model", "x", "--window", "10"])
    trace = local_trace(T=300).split(0.5)[1]
    sim = simulate(trace, "lru", 8, tokens=150)
    assert sim.misses_by_token.sum() == sum(sim.misses.values())
    per = sim.window_misses(40)  # 3 stretches; the last 30 tokens left out
    want = sim.misses_by_token[:120].reshape(3, 40).sum(1) / 40 / trace.layers
    assert np.allclose(per, want) and not np.allclose(per, per[0])
    assert np.isclose(sim.window_misses(1000)[0], sim.misses_per_token() / 3)  # the run
    for other in (simulate(trace, "belady", 8, tokens=150),
                  simulate(trace, "lru", 8, tokens=150, ahead={0: trace.experts[:, 1]})):  # fmt: skip
        assert other.misses_by_token.sum() == sum(other.misses.values())  # (guesses: not)


def test_plan_splits_memory_between_pools_and_the_page_cache(tmp_path, capsys):
    """``plan --memory-gb``: each split of the memory between pools and the tier beneath
    them, the page cache or the swap tier, each less the ``MARGIN`` the process keeps:
    hits per tier and predicted tok/s, best first, and flags the store accepts in that
    memory; a whole swap tier reads nothing from the disk (the store fills it at load);
    without the bounds, or too little memory, a clear error."""
    from mlx_streaming.commands import plan as cmd
    from mlx_streaming.core.io.tier import MARGIN

    local_trace(T=400).save(tmp_path / "t.npz")
    rec, left = 4096 * 1000, MARGIN / 1e9  # 3 layers of 32 records of 4 MB, whole pages
    args = ["--trace", str(tmp_path / "t.npz"), "--expert-bytes", str(rec), "--memory-gb",
            str(left + 0.36), "--tokens", "200"]  # fmt: skip
    cmd.main([*args, "--t-compute-ms", "1", "--read-gbps", "1", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["predicted_tok_per_s"] == max(r["predicted_tok_per_s"] for r in rows)
    by = {(r["slots"], r["tier"]): r for r in rows}
    swaps = [r for r in rows if r["tier"] == "swap"]
    assert swaps and {r["tier"] for r in rows} == {"page cache", "swap"}
    for r in rows:
        assert abs(r["pool_share"] + r["tier_share"] + r["disk_share"] - 1) < 1e-3
        assert r["pool_gb"] == round(r["slots"] * 3 * rec / 1e9, 3)  # no zero slot here
        assert r["flags"].startswith(f"--slots {r['slots']}")
        if r["tier"] == "page cache":
            assert abs(r["tier_gb"] - max(0, 0.36 - r["pool_gb"])) < 2e-3
    for r in swaps:  # bounded here: the flag's GB fits beside the pools and the margin
        text = r["flags"].split("--swap-tier-gb ")[1]
        assert r["flags"] == f"--slots {r['slots']} --swap-tier --swap-tier-gb {text}"
        gb = float(text)
        assert r["slots"] * 3 * rec + gb * 1e9 + MARGIN <= (left + 0.36) * 1e9
        rows_per_layer = int((32 - r["slots"]) * gb * 1e9 / ((32 - r["slots"]) * 3 * rec))
        assert r["tier_gb"] == round(rows_per_layer * 3 * rec / 1e9, 3) <= gb
        # no record held twice: fewer disk reads than the page cache of that memory
        assert r["disk_mb_per_token"] < by[r["slots"], "page cache"]["disk_mb_per_token"]
    assert 32 not in {r["slots"] for r in swaps}  # whole pools: no tier
    cmd.main([*args[:-3], str(left + 0.5), *args[-2:], "--t-compute-ms", "1",
              "--read-gbps", "1", "--json"])  # fmt: skip
    whole = [r for r in json.loads(capsys.readouterr().out) if r["flags"].endswith("--swap-tier")]
    assert whole and all(r["disk_share"] == 0 for r in whole)  # filled at load
    for r in whole:
        assert r["tier_gb"] == round((32 - r["slots"]) * 3 * rec / 1e9, 3)
    cmd.main([*args, "--t-compute-ms", "1", "--read-gbps", "1"])
    table = capsys.readouterr().out
    assert "swap" in table and "--swap-tier" in table and "page cache" in table
    assert "p10-p90" in table and "stretches of 40 tokens (--window)" in table  # 200 / 5
    cmd.main([*args, "--t-compute-ms", "1", "--read-gbps", "1", "--window", "20", "--json"])
    spread = json.loads(capsys.readouterr().out)
    assert all(r["window_tokens"] == 20 for r in spread)
    for r in spread:  # the mean of 10 stretches within their 10th and 90th percentiles
        lo, hi = r["disk_mb_per_token_p10_p90"]
        assert lo <= r["disk_mb_per_token"] <= hi or lo == hi == r["disk_mb_per_token"] == 0
    with pytest.raises(ValueError, match="200 tokens replayed .* fewer than 5 stretches of "):
        cmd.main([*args, "--t-compute-ms", "1", "--read-gbps", "1", "--window", "41"])
    with pytest.raises(ValueError, match="--memory-gb needs a compute time"):
        cmd.main(args)
    with pytest.raises(
        ValueError, match=r"--memory-gb 0.01: .*beside the 1.07 GB .*takes 1.123 GB; raise it"
    ):
        cmd.main([*args[:-3], "0.01", *args[-2:], "--t-compute-ms", "1", "--read-gbps", "1"])
    with pytest.raises(ValueError, match="give --memory-gb .* or --host-gb .* not both"):
        cmd.main([*args, "--host-gb", "1", "--t-compute-ms", "1", "--read-gbps", "1"])
    args = ["--trace", str(tmp_path / "t.npz"), "--expert-bytes", "4096", "--memory-gb",
            "0.0004", "--tokens", "200"]  # fmt: skip
    bounds = ["--t-compute-ms", "1", "--read-gbps", "0.001"]
    with pytest.raises(
        ValueError, match="routes 4 of 32 experts.*model 2 of 32.*record the trace on this"
    ):
        cmd.main([*args, *bounds, "--top-k", "2"])  # a trace of another model's routing
    with pytest.raises(ValueError, match="layer_sample 1: sample at least 2"):
        cmd.main([*args, *bounds, "--layer-sample", "1"])


def test_profile_gives_diverse_layers_more_slots(models):
    from mlx_streaming.core.meta import load_meta

    _, ed = models.experts("tiny-qwen3_moe")  # 3 MoE layers, 16 experts, top-4
    meta = load_meta(ed)
    trace = local_trace(T=800, L=3, E=16, k=4, concentrated=(0, 2))
    prof = build_profile(trace, meta, slots=8, policy="lru", tokens=400)
    caps = [prof.slots[li] for li in sorted(meta.layers)]
    assert caps[1] > caps[0] and caps[1] > caps[2]  # the diverse layer gets more
    assert prof.profile_bytes <= prof.uniform_bytes
    assert prof.heldout_hit_rate > prof.uniform_heldout_hit_rate
    lossless = build_profile(trace, meta, mode="lossless", tokens=400)
    assert lossless.slots[sorted(meta.layers)[0]] == 5  # the k + 1 experts it used


@pytest.mark.parametrize("policy", ["lru", "predictive"])
def test_read_ahead_in_the_simulator(policy):
    """Guesses that are the truth leave no demand miss and read what would have missed;
    no guesses change nothing; wrong guesses only add reads."""
    trace = local_trace()
    L = trace.layers
    plain = simulate(trace, policy, 8)
    truth = {li: trace.experts[:, li].astype(np.int64) for li in range(L)}
    perfect = simulate(trace, policy, 8, ahead=truth)
    assert sum(perfect.misses.values()) == 0
    assert perfect.read_ahead == plain.misses  # the same loads, each made just ahead
    none = simulate(trace, policy, 8, ahead={li: np.full_like(truth[li], -1) for li in range(L)})
    assert none.misses == plain.misses and sum(none.read_ahead.values()) == 0
    wrong = {li: (truth[li] + 16) % trace.num_experts for li in range(L)}
    worse = simulate(trace, policy, 8, ahead=wrong)
    assert worse.reads_per_token() > plain.reads_per_token()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), cap=st.integers(4, 12), pins=st.integers(0, 2))
def test_lru_is_least_recently_used(seed, cap, pins):
    """``lru`` (the ranking with no weights: its ties decide) evicts exactly as a plain
    least-recently-used list does, a call's experts used in id order, pins kept."""
    from collections import OrderedDict

    rng = np.random.default_rng(seed)
    E, k = 16, 4
    cache = SlotCache(E, cap, make_policy("lru", E))
    pinned = np.arange(min(pins, cap - k))
    cache.commit(cache.reserve(pinned, np.zeros(0, np.int64)))
    cache.pinned = set(pinned.tolist())
    with pytest.raises(AttributeError):  # a copy: an edit of it would be lost, so none is
        cache.pinned.add(E - 1)
    order: OrderedDict = OrderedDict((int(e), None) for e in pinned)
    for _ in range(200):
        need = np.unique(rng.choice(E, k, replace=False))
        missing = [int(e) for e in need if e not in order]
        free = cap - len(order)
        old = [e for e in order if e not in need and e not in pinned]
        gone = old[: max(0, len(missing) - free)]
        placed = cache.lookup(need)
        assert sorted(v for _, _, v in placed if v >= 0) == sorted(gone)
        for e in gone:
            del order[e]
        for e in need.tolist():
            order.pop(e, None)
            order[e] = None


def test_queued_lookups_reach_the_policy():
    """A lookup's policy update is queued; the policy's next decision sees it."""
    cache = SlotCache(4, 2, make_policy("lru", 4))
    for e in ([0], [1], [0]):
        cache.lookup(np.array(e))
    assert cache.policy.victims(1, np.zeros(0, np.int64)) == [1]  # 0 was used last
    cache.lookup(np.array([2]))  # the reservation evicts the least recent: 1
    assert cache.slot_of[1] < 0 and cache.slot_of[0] >= 0


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200), st.integers(1, 64), st.integers(0, 2**31))
def test_host_path_set_helpers_equal_numpy(n, E, seed):
    """The host path's cheap ``distinct`` and ``member`` give numpy's answers, for a
    decode step's few ids and for long calls alike."""
    from mlx_streaming.core.cache.host_path import distinct, member

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, E, (max(1, n // 4), min(n, 8))).astype(np.uint32)
    got, counts = distinct(ids)
    want, want_counts = np.unique(ids, return_counts=True)
    assert got.dtype == want.dtype and np.array_equal(got, want)
    assert np.array_equal(counts, want_counts)
    some = rng.choice(E, rng.integers(0, E + 1), replace=False)
    got = member(ids, some, E)
    assert got.dtype == bool and np.array_equal(got, np.isin(ids, some))


def test_predictive_windows_count_the_latest_lookups():
    """The windowed counts (running-count differences) equal a direct count over the
    last 4, 16 and 64 lookups."""
    from mlx_streaming.core.cache.scored import WINDOWS, Scored

    rng = np.random.default_rng(1)
    p = Scored(16)
    seen = []
    for t in range(150):
        idx = np.sort(rng.choice(16, 3, replace=False))
        p.access(idx)
        seen.append(idx)
        for w, row in zip(WINDOWS, p.win):
            want = np.bincount(np.concatenate(seen[-w:]), minlength=16)
            assert np.array_equal(row, want), (t, w)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    E=st.sampled_from([8, 16, 64]),
    cap=st.integers(1, 12),
    pins=st.integers(0, 3),
    policy=st.sampled_from(POLICIES),
)
def test_native_ranking_equals_numpy(seed, E, cap, pins, policy):
    """The native ranking (policy.c) picks the numpy reference's victims, in the same
    order, and its state stays the reference's, on random routing with pins, for every
    policy's weights."""
    rng = np.random.default_rng(seed)
    cap = min(cap, E)
    caches = [SlotCache(E, cap, make_policy(policy, E, native=n)) for n in (True, False)]
    assert caches[0].policy.native and not caches[1].policy.native
    pinned = set(rng.choice(E, min(pins, cap - 1), replace=False).tolist()) if cap > 1 else set()
    for c in caches:
        c.pinned = pinned
    for _ in range(300):
        k = int(rng.integers(1, cap - len(pinned) + 1))
        need = np.sort(rng.choice(E, k, replace=False))
        got = [c.lookup(need) for c in caches]
        assert got[0] == got[1]
        p, q = caches[0].policy, caches[1].policy
        protect = np.sort(rng.choice(E, int(rng.integers(0, E)), replace=False))
        assert p.victims(3, protect) == q.victims(3, protect)
    for name, a in p.state.items():
        assert np.array_equal(a, q.state[name]), name


def test_native_policy_is_built_into_the_package():
    """Not skipped: an installed package without its compiled policy is a defect (the
    numpy fallback is exact but slower); under .ci/sanitize the build under test is the
    ASan/UBSan one."""
    import os

    from mlx_streaming.core.cache import native_policy
    from mlx_streaming.core.cache.scored import Scored

    path = native_policy.library_path()
    assert path is not None and path.parent.name == "cache"
    want = os.environ.get("MLX_STREAMING_TEST_POLICY") or str(path)
    assert native_policy.library()._name == want
    assert Scored(8).native


def test_native_ranking_refuses_bad_ids():
    """An expert id outside the layer is refused with an error, never written."""
    from mlx_streaming.core.cache.scored import Scored

    p = Scored(8)
    assert p.native
    for bad in ([8], [-1], list(range(9))):
        with pytest.raises(ValueError, match="out of range"):
            p.access(np.array(bad))
    with pytest.raises(ValueError, match="out of range"):
        p.victims(1, np.array([9]))
    assert p.t == 0 and not p.trans.any()


def test_complete_holds_until_the_table_changes():
    """A pool of every expert answers ``complete`` from a latch once all are resident;
    a slot table brought back (the device path's) or a failed load undoes it."""
    cache = SlotCache(4, 4, make_policy("lru", 4))
    placed = cache.lookup(np.arange(3))
    assert not cache.complete
    cache.lookup(np.array([3]))
    assert cache.complete
    slot_of, expert_in = cache.slot_of.copy(), cache.expert_in.copy()
    expert_in[slot_of[2]], slot_of[2] = -1, -1
    cache.set_tables(slot_of, expert_in)
    cache.policy.remove(2)  # as the device path's hand-back rebuilds the policy
    assert not cache.complete
    cache.lookup(np.array([2]))
    assert cache.complete and len(placed) == 3


def test_plan_the_host_tier_beneath_device_pools(tmp_path, capsys):
    """``plan --host-gb``: pools of their own (a GPU's, a zero slot each) at each
    ``--slots``, and beneath them the host memory less the ``MARGIN`` as the page cache or
    the swap tier; the swap tier with room for every record the pools do not hold runs
    whole (its own size) and reads nothing from the disk; a bounded one reads more, and
    leaves the request ring's staging beside it (the device path's); without pools, or
    with pools below top-k, a clear error."""
    from mlx_streaming.commands import plan as cmd
    from mlx_streaming.core.io.tier import MARGIN

    local_trace(T=400).save(tmp_path / "t.npz")
    rec = 4096 * 1000  # whole pages: the stride
    base = ["--trace", str(tmp_path / "t.npz"), "--expert-bytes", str(rec), "--tokens", "200",
            "--t-compute-ms", "1", "--read-gbps", "1"]  # fmt: skip
    rest = (32 - 8) * 3 * rec  # 3 layers: every record 8 slots per layer leave out
    host = (MARGIN + rest * 1.01) / 1e9
    cmd.main([*base, "--slots", "16", "8", "40", "--host-gb", str(host), "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert {(r["slots"], r["tier"]) for r in rows} == {
        (s, t) for s in (16, 8) for t in ("page cache", "swap")
    } | {(32, "page cache")}  # 40 slots: every expert's, no tier beneath
    by = {(r["slots"], r["tier"]): r for r in rows}
    for s in (16, 8):
        swap, cache = by[s, "swap"], by[s, "page cache"]
        assert swap["pool_gb"] == round((s + 1) * 3 * rec / 1e9, 3)  # a zero slot each
        assert swap["flags"] == f"--slots {s} --swap-tier"  # whole: room for the rest
        assert swap["tier_gb"] == round((32 - s) * 3 * rec / 1e9, 3)
        assert cache["tier_gb"] == round(rest * 1.01 / 1e9, 3)
        assert swap["disk_share"] == 0 < cache["disk_share"]
    cmd.main([*base, "--slots", "8", "--host-gb", str((MARGIN + rest / 2) / 1e9), "--json"])
    half = {r["tier"]: r for r in json.loads(capsys.readouterr().out)}
    # 147.5 MB less the ring's 16 records and the files' reader's one (69.6 MB): 6 rows a layer
    assert half["swap"]["flags"] == "--slots 8 --swap-tier --swap-tier-gb 0.0778"
    assert half["swap"]["tier_gb"] == round(6 * 3 * rec / 1e9, 3)
    assert half["swap"]["disk_mb_per_token"] > 0
    cmd.main([*base, "--slots", "8", "--host-gb", str(MARGIN / 1e9)])
    table = capsys.readouterr().out  # no room beyond the margin: no swap row
    assert "page cache" in table and "--swap-tier" not in table
    with pytest.raises(ValueError, match="--host-gb .* add --slots or --budget-gb"):
        cmd.main([*base, "--host-gb", "1"])
    with pytest.raises(ValueError, match="--slots 2 is below top_k=4.*--slots 4 or more"):
        cmd.main([*base, "--slots", "2", "--host-gb", "1"])


def test_plan_adds_the_host_path_s_own_work(tmp_path, capsys):
    """``plan --host-gb --host-ms-per-call``: each row the host path serves (the page
    cache) takes that much longer per MoE layer call, in series, on both its figures; a
    swap tier, whole or bounded (the device path: the ring reads beyond a bounded one),
    takes none. Without the flag the table says what it leaves out."""
    from mlx_streaming.commands import plan as cmd
    from mlx_streaming.core.io.tier import MARGIN

    local_trace(T=400).save(tmp_path / "t.npz")
    rec = 4096 * 1000
    base = ["--trace", str(tmp_path / "t.npz"), "--expert-bytes", str(rec), "--tokens", "200",
            "--t-compute-ms", "1", "--read-gbps", "1", "--slots", "16", "8"]  # fmt: skip
    host = (MARGIN + (32 - 12) * 3 * rec) / 1e9  # whole at 16 slots, bounded at 8

    def rows(*extra) -> dict:
        cmd.main([*base, "--host-gb", str(host), "--json", *extra])
        return {(r["slots"], r["tier"]): r for r in json.loads(capsys.readouterr().out)}

    alone, busy = rows(), rows("--host-ms-per-call", "2")
    assert alone.keys() == busy.keys() and "--swap-tier-gb" in alone[8, "swap"]["flags"]
    for key, r in busy.items():
        device = key[1] == "swap"
        extra = 0.0 if device else 2e-3 * 3  # 3 MoE layers, a call each per token
        assert r["host_ms_per_token"] == round(1e3 * extra, 3)
        for f in ("predicted_tok_per_s", "serial_tok_per_s"):
            assert 1 / r[f] == pytest.approx(1 / alone[key][f] + extra, rel=2e-3), (key, f)
    cmd.main([*base, "--host-gb", str(host)])
    assert "give --host-ms-per-call" in capsys.readouterr().out


def test_plan_leaves_the_trunk_s_load_beside_the_host_tier(models, tmp_path, capsys):
    """``plan --host-gb`` with ``--model``: the rows are those of the host memory less what
    loading the trunk takes beside the tier on CUDA (its largest block), and the header
    says so: a whole tier that fits only without that room is planned bounded."""
    from mlx_streaming.commands import plan as cmd
    from mlx_streaming.core.io.tier import MARGIN
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.model_builder import trunk_host_bytes
    from mlx_streaming.prep.hub import load_lazy

    ck, ed = models.experts("tiny-qwen3_moe")  # 3 MoE layers, 16 experts, top-4
    meta = load_meta(ed)
    reserve = trunk_host_bytes(load_lazy(ck)[0], "cuda")
    rest = sum((lay.num_experts - 6) * lay.stride for lay in meta.layers.values())
    local_trace(T=400, E=16).save(tmp_path / "t.npz")
    base = ["--trace", str(tmp_path / "t.npz"), "--slots", "6", "--tokens", "100",
            "--t-compute-ms", "1", "--read-gbps", "1", "--json"]  # fmt: skip
    host = MARGIN + rest + reserve // 2  # the whole tier fits only without the trunk's room

    def swap_row(*args) -> dict:
        cmd.main([*base, *args])
        return next(r for r in json.loads(capsys.readouterr().out) if r["tier"] == "swap")

    with_trunk = swap_row("--model", str(ck), "--host-gb", str(host / 1e9))
    assert "--swap-tier-gb" in with_trunk["flags"]  # bounded
    assert swap_row("--expert-dir", str(ed), "--host-gb", str((host - reserve) / 1e9)) == with_trunk
    assert swap_row("--expert-dir", str(ed), "--host-gb", str(host / 1e9))["flags"] == (
        "--slots 6 --swap-tier"  # whole, where nothing is left for the trunk
    )
    cmd.main([*base[:-1], "--model", str(ck), "--host-gb", str(host / 1e9)])
    assert f"less {reserve / 1e9:.2f} GB for the trunk as it loads" in capsys.readouterr().out


def test_a_planned_swap_tier_is_one_the_store_takes(models, tmp_path, capsys):
    """Each swap-tier row ``plan --memory-gb`` prints for an expert directory: the store's
    ``SwapTier``, given that row's slots and flags and the memory the pools leave, takes
    it (no ``MemoryError``), at the size the row says, bounded where the flag bounds it."""
    from mlx_streaming.commands import plan as cmd
    from mlx_streaming.core.cache.pool import make_pools
    from mlx_streaming.core.io.tier import MARGIN, SwapTier
    from mlx_streaming.core.meta import load_meta

    _, ed = models.experts("tiny-qwen3_moe")  # 3 MoE layers, 16 experts, top-4
    meta = load_meta(ed)
    lay = meta.layers[meta.moe_layers[0]]
    slot = lay.record_bytes  # less than a stride: the tier is whole from 10 slots up
    memory = MARGIN + 3 * (10 * slot + 6 * lay.stride)
    local_trace(T=400, E=16).save(tmp_path / "t.npz")
    cmd.main(["--trace", str(tmp_path / "t.npz"), "--expert-dir", str(ed), "--memory-gb",
              str(memory / 1e9), "--tokens", "100", "--t-compute-ms", "1", "--read-gbps", "1",
              "--json"])  # fmt: skip
    rows = [r for r in json.loads(capsys.readouterr().out) if r["tier"] == "swap"]
    assert {"--swap-tier-gb" in r["flags"] for r in rows} == {True, False}, rows
    for r in rows:
        s = r["slots"]
        pools = make_pools(meta, {li: s for li in meta.moe_layers}, "host", False)
        gb = r["flags"].split("--swap-tier-gb ")[1] if "-gb" in r["flags"] else None
        pool_bytes = sum(p.nbytes for p in pools.values())
        tier = SwapTier(meta, pools, limit=gb and int(float(gb) * 1e9),
                        available=memory - pool_bytes)  # fmt: skip
        try:
            assert tier.partial == (gb is not None)
            assert round(tier.nbytes / 1e9, 3) == r["tier_gb"]
        finally:
            tier.close()


def test_plan_sets_precisions_side_by_side(models, tmp_path, capsys):
    """``plan --bits 4 3``: each precision's rows, its experts' bytes those ``requantize``
    writes at those bits and group size (requantized here to check), each at its own
    compute time; with ``--memory-gb`` all rows best first, interleaved; a precision the
    memory (or budget) cannot hold said and skipped, on stderr beside JSON; in the budget
    mode fewer miss bytes at fewer bits for the same hits; bad input named."""
    from mlx_streaming.commands import plan as cmd
    from mlx_streaming.core.io.tier import MARGIN
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.planning.budget import PoolShape
    from mlx_streaming.prep.requantize import requantize, requantized_layouts

    _, ed = models.experts("tiny-qwen3_moe")  # 3 MoE layers, 16 experts, top-4
    requantize(ed, tmp_path / "q3", bits=3, progress=False)
    requantize(ed, tmp_path / "q3g32", bits=3, group_size=32, progress=False)
    three = PoolShape.from_meta(load_meta(tmp_path / "q3"))
    four = PoolShape.from_meta(load_meta(ed))
    source = dict(load_meta(ed).layers)
    for bits, group, written in ((3, None, "q3"), (3, 32, "q3g32")):  # to the byte
        want = PoolShape.from_meta(load_meta(tmp_path / written))
        got = PoolShape.from_layouts(requantized_layouts(source, bits, group), want.top_k)
        assert (got.slot_bytes, got.strides) == (want.slot_bytes, want.strides)
    local_trace(T=400, E=16).save(tmp_path / "t.npz")
    base = ["--trace", str(tmp_path / "t.npz"), "--expert-dir", str(ed), "--tokens", "100"]
    memory = MARGIN + 3 * 16 * (four.strides[0] + three.strides[0]) // 2  # between the two
    mem = ["--memory-gb", str(memory / 1e9), "--read-gbps", "0.001"]  # a slow disk
    cmd.main([*base, *mem, "--bits", "4", "3", "--t-compute-ms", "1", "1.5", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert {r["bits"] for r in rows} == {4, 3}
    tps = [r["predicted_tok_per_s"] for r in rows]
    assert tps == sorted(tps, reverse=True)
    assert sum(x["bits"] != y["bits"] for x, y in zip(rows, rows[1:])) >= 2  # interleaved
    for r in rows:
        shape = three if r["bits"] == 3 else four
        assert r["expert_mb"] == round(float(np.mean(shape.slot_bytes)) / 1e6, 3)
        assert r["t_compute_ms"] == (1.5 if r["bits"] == 3 else 1.0)
    whole = {r["bits"] for r in rows if r["tier"] == "swap" and r["disk_share"] == 0}
    assert whole == {3}  # this memory holds every 3-bit record beside the pools, not 4-bit's
    cmd.main([*base, *mem, "--bits", "4", "3", "--t-compute-ms", "1"])
    out = capsys.readouterr().out
    assert "bits slots" in out and f"requantize --src {ed} " in out and "--bits B" in out
    assert "every row at one compute time" in out
    cmd.main([*base, *mem, "--bits", "3", "--group-size", "32", "--t-compute-ms", "1", "--json"])
    g32 = PoolShape.from_meta(load_meta(tmp_path / "q3g32"))
    mb = {r["expert_mb"] for r in json.loads(capsys.readouterr().out)}
    assert (
        mb == {round(float(np.mean(g32.slot_bytes)) / 1e6, 3)} and g32.slot_bytes > three.slot_bytes
    )
    little = MARGIN + 3 * 4 * (four.slot_bytes[0] + three.slot_bytes[0]) // 2  # top-k slots
    tight = ["--memory-gb", str(little / 1e9), "--read-gbps", "1", "--t-compute-ms", "1"]
    cmd.main([*base, *tight, "--bits", "4", "3"])
    out = capsys.readouterr().out
    assert "(skipped: 4 bits: " in out and "raise it" in out and "\n   3 " in out
    assert "\n   4 " not in out
    cmd.main([*base, *tight, "--bits", "4", "3", "--json"])
    got = capsys.readouterr()
    assert {r["bits"] for r in json.loads(got.out)} == {3} and "plan: skipped 4 bits" in got.err
    with pytest.raises(ValueError, match="no precision of --bits fits: 4 bits: .*; 3 bits: "):
        cmd.main([*base, *tight[:1], str((MARGIN + 1000) / 1e9), *tight[2:], "--bits", "4", "3"])
    budget = 3 * 4 * (four.slot_bytes[0] + three.slot_bytes[0]) / 2e9  # top-k: 3-bit only
    cmd.main([*base, "--budget-gb", str(budget), "--bits", "4", "3", "--json"])
    got = capsys.readouterr()
    assert {r["bits"] for r in json.loads(got.out)} == {3} and "skipped 4 bits: budget" in got.err
    cmd.main([*base, "--budget-gb", str(budget), "1", "--bits", "4", "3", "--json"])
    got = capsys.readouterr()  # a budget one precision cannot hold: only that pair left out
    sizes = {(r["bits"], r["budget_gb"]) for r in json.loads(got.out)}
    assert sorted(b for b, _ in sizes) == [3, 3, 4] and "skipped 4 bits: budget" in got.err
    cmd.main([*base, "--slots", "6", "--bits", "4", "3", "--t-compute-ms", "1", "--json"])
    rows = json.loads(capsys.readouterr().out)
    by = {(r["bits"], r["policy"]): r for r in rows}
    for pol in {r["policy"] for r in rows}:
        assert by[3, pol]["hit_rate"] == by[4, pol]["hit_rate"]
        if by[4, pol]["miss_bytes_per_token"]:
            assert by[3, pol]["miss_bytes_per_token"] < by[4, pol]["miss_bytes_per_token"]
    assert sum(r["best"] for r in rows) == 2  # one best a precision
    cmd.main([*base, "--slots", "6", "--bits", "3", "--t-compute-ms", "1"])
    out = capsys.readouterr().out
    assert "at 3 bits (" in out and "one compute time" not in out  # one precision
    with pytest.raises(ValueError, match="--bits needs the experts' layouts"):
        cmd.main([*base[:2], "--expert-bytes", "4096", "--slots", "6", "--bits", "3"])
    with pytest.raises(ValueError, match=r"--t-compute-ms has 3 values: .* per precision"):
        cmd.main([*base, "--slots", "6", "--bits", "4", "3", "--t-compute-ms", "1", "2", "3"])
    with pytest.raises(ValueError, match=r"--t-compute-ms has 2 values: give one \(several"):
        cmd.main([*base, "--slots", "6", "--t-compute-ms", "1", "2"])
    with pytest.raises(ValueError, match="^20 slots exceed"):  # no precision's: raised as is
        cmd.main([*base, "--slots", "20", "--bits", "4", "3"])
    with pytest.raises(ValueError, match="--group-size sizes the precisions of --bits"):
        cmd.main([*base, "--slots", "6", "--group-size", "32"])
    with pytest.raises(ValueError, match="--bits 4 4 3: name each precision once"):
        cmd.main([*base, "--slots", "6", "--bits", "4", "4", "3"])
    with pytest.raises(ValueError, match="--bits 7: bits 7 for layer .* not supported"):
        cmd.main([*base, "--slots", "6", "--bits", "7"])
    with pytest.raises(ValueError, match="--plot draws one precision"):
        cmd.main([*base, "--slots", "6", "--bits", "4", "3", "--plot", str(tmp_path / "p.png")])
    with pytest.raises(ValueError, match="--memory-gb needs a compute time"):  # not "fits"
        cmd.main([*base, *mem[:2], "--bits", "4", "3"])


def test_the_page_cache_tier_beneath_the_pools():
    """``simulate_tiers``: with no page cache (O_DIRECT) every pool miss is a disk read
    and the pool's hits are the simulator's; with room for every record only the first
    touch of each goes to the disk; more page cache never reads more from the disk."""
    from mlx_streaming.core.io.tier import MARGIN
    from mlx_streaming.planning.tiers import best_split, simulate_tiers

    trace = local_trace()
    plain = simulate(trace, "lru", 8)
    none = simulate_tiers(trace, "lru", 8, 0, record_bytes=1000)
    assert none.pool_hits == sum(plain.hits.values()) and none.page_cache_hits == 0
    assert none.disk_reads == sum(plain.misses.values())
    everything = simulate_tiers(trace, "lru", 8, 10**9, record_bytes=1000)
    firsts = sum(len(np.unique(trace.experts[:, li])) for li in range(trace.layers))
    assert everything.disk_reads == firsts
    assert everything.page_cache_hits == none.disk_reads - firsts
    reads = [simulate_tiers(trace, "lru", 8, c * 1000, 1000).disk_reads for c in (0, 8, 32, 96)]
    assert reads == sorted(reads, reverse=True)
    rows = best_split(trace, "lru", MARGIN + 3 * 32 * 1000, slot_bytes=1000, record_bytes=1000,
                      top_k=4, t_compute=1e-3, mem_gbps=10, disk_gbps=0.001)  # fmt: skip
    assert rows[0]["predicted_tok_per_s"] == max(r["predicted_tok_per_s"] for r in rows)
    assert {r["slots"] for r in rows} >= {4, 32}
    # a pool with a slot per expert loads its whole layer at its first call, as the store
    # does (before: each expert was counted read at its first use, after the warm-up too)
    E = trace.num_experts
    whole = simulate_tiers(trace, "lru", E, 0, 1000)
    assert whole.disk_reads == E * trace.layers
    warm = [False, *[True] * 49]  # the first call fills the pools uncounted
    assert simulate_tiers(trace, "lru", E, 0, 1000, calls=[1] * 50, counted=warm).disk_reads == 0
    # each call's disk reads by layer: they sum to the total, an uncounted call's are 0,
    # and its bytes are every layer's where a share of the layers is replayed
    counted = [i % 3 > 0 for i in range(60)]
    some = simulate_tiers(trace, "lru", 8, 0, 1000, calls=[1] * 60, counted=counted)
    assert some.disk_by_call.shape == (60, trace.layers)
    assert some.disk_by_call.sum() == some.disk_reads > 0 and not some.disk_by_call[::3].any()
    half = simulate_tiers(trace, "lru", 8, 0, 1000, layers=[0], model_layers=2)
    assert half.disk_bytes_by_call().sum() == half.disk_reads * 2000


def test_the_simulator_s_stretches_tile_its_run():
    """``TierResult.windows``: stretches of a run's counted tokens, in order, whose
    token-weighted mean is the run's (uncounted calls, a prompt's, add no token and no
    byte); a stretch longer than the run is the run. ``window_rates`` gives the time
    model of each stretch; the plan rows give their 10th and 90th percentiles."""
    from mlx_streaming.planning.tiers import simulate_tiers, split_rows

    trace = local_trace(T=600, concentrated=(1,))
    r = simulate_tiers(trace, "lru", 8, 40 * 1000, 1000)
    copies, disk = r.windows(100)
    assert len(disk) == 6 and disk.min() < disk.max()
    assert np.isclose(disk.mean(), r.disk_bytes_per_token)
    assert np.isclose(copies.mean(), r.page_cache_bytes_per_token + r.tier_write_bytes_per_token)
    whole = r.windows(10_000)[1]
    assert len(whole) == 1 and np.isclose(whole[0], r.disk_bytes_per_token)
    calls = [20, *[1] * 99] * 3  # three runs: a prompt, then 99 tokens each
    counted = [False, *[True] * 99] * 3
    runs = simulate_tiers(trace, "lru", 8, 0, 1000, calls=calls, counted=counted)
    per_run = runs.windows(99)[1]
    assert len(per_run) == 3 and np.isclose(per_run.mean(), runs.disk_bytes_per_token)
    same, tps = r.window_rates(100, 1e-3, 1.0, 0.001)
    assert np.array_equal(same, disk)
    assert np.allclose(tps, 1 / np.maximum(1e-3, copies / 1e9 + disk / 1e6))
    row = split_rows(trace, "lru", [(8, 10**9)], 1000, 1000, 1e-3, 1.0, 0.001,
                     beneath=("page cache",), window=50)[0]  # fmt: skip
    lo, hi = row["disk_mb_per_token_p10_p90"]
    assert row["window_tokens"] == 50 and lo <= row["disk_mb_per_token"] <= hi
    assert row["tok_per_s_p10_p90"][0] <= row["tok_per_s_p10_p90"][1]


def test_a_run_s_stretch_against_the_held_out_routing(monkeypatch, tmp_path):
    """``beyond_ram.stretch``: a run's simulated disk bytes against a long replay's, and
    the share of its stretches as long that read less; ``harness.routing_trace`` takes
    ``--trace-start`` within the held-out half only (the first half trains predictors),
    leaving room for the runs."""
    import argparse
    import importlib

    from mlx_streaming.planning.tiers import simulate_tiers

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    beyond_ram, harness = importlib.import_module("beyond_ram"), importlib.import_module("harness")
    from mlx_streaming.planning.tiers import TierResult

    def result(per_call: list[int]) -> TierResult:  # one layer, one token a call
        n = len(per_call)
        return TierResult(n, 0, 0, sum(per_call), 0.0, sum(per_call) / n, 0.0,
                          np.array(per_call)[:, None], 1.0, np.zeros(n), np.ones(n))  # fmt: skip

    typical = result([1, 1, 3, 3, 5, 5, 7, 7, 9, 9])  # 5 a token; stretches of 2: 1,3,5,7,9
    assert beyond_ram.stretch(result([6, 6]), typical) == {
        "typical_disk_bytes_per_token": 5, "stretch_vs_typical": 1.2, "stretch_percentile": 0.6
    }  # fmt: skip
    few = beyond_ram.stretch(result([4, 4, 4]), typical)  # 3 stretches of 3: no percentile
    assert few["stretch_vs_typical"] == 0.8 and few["stretch_percentile"] is None
    trace = local_trace(T=600, concentrated=(1,))
    calls, counted = beyond_ram.run_calls(8, 20, 2)
    run = simulate_tiers(trace, "lru", 8, 0, 1000, start=300, calls=calls, counted=counted)
    whole = simulate_tiers(trace, "lru", 8, 10**9, 1000, exclusive=True)  # nothing read
    assert whole.disk_reads == 0 and beyond_ram.stretch(run, whole) == {}
    # the typical: TYPICAL tokens from the held-out half's first, after WARM uncounted
    big = local_trace(T=2 * (beyond_ram.WARM + beyond_ram.TYPICAL))
    got = beyond_ram.typical_run(big, (big, "lru", 8, 0, 1000), {})
    assert got.tokens == beyond_ram.TYPICAL and big.split(0.5)[0].tokens == 4064
    assert got.disk_by_call[: beyond_ram.WARM].sum() == 0  # the warm-up left out
    held = simulate_tiers(big, "lru", 8, 0, 1000, start=4064 + beyond_ram.WARM, tokens=4000)
    assert abs(got.disk_reads - held.disk_reads) < 0.05 * held.disk_reads  # (warm vs cold)
    long = RoutingTrace(np.zeros((10_000, 2, 4), np.uint8), np.array([0, 5000, 10_000]), 32)
    long.save(tmp_path / "t.npz")
    a = argparse.Namespace(trace=str(tmp_path / "t.npz"), trace_start=None)
    assert harness.routing_trace(a)[1] == 5000  # the held-out half's first token
    a.trace_start = 5904
    assert harness.routing_trace(a)[1] == 5904
    for bad in (4999, 5905):
        a.trace_start = bad
        with pytest.raises(SystemExit, match=f"--trace-start {bad}: give 5000 to 5904"):
            harness.routing_trace(a)


def test_an_exclusive_host_tier_holds_no_record_twice():
    """``simulate_tiers(exclusive=True)``: the store's swap tier. Its pools are full from
    load (slot ``s`` holds expert ``s``) and the pools behave as over any tier; with no
    row, every miss is read from the disk; with a row for every record the pools do not
    hold, none is (filled at load), and each miss is a trade: one record copied in, its
    victim out. More rows never read more, and each layer's rows are its own."""
    from mlx_streaming.planning.tiers import simulate_tiers

    trace, slots, E = local_trace(), 8, 32
    cold = simulate_tiers(trace, "lru", slots, 0, 1000)  # the page cache's pools: empty
    none = simulate_tiers(trace, "lru", slots, 0, 1000, exclusive=True)
    assert none.page_cache_hits == none.tier_write_bytes_per_token == 0
    assert none.lookups == cold.lookups and none.pool_hits > cold.pool_hits  # full at load
    rest = (E - slots) * trace.layers * 1000  # room for every record the pools do not hold
    whole = simulate_tiers(trace, "lru", slots, rest, 1000, exclusive=True)
    assert whole.disk_reads == 0 and whole.pool_hits == none.pool_hits
    assert whole.page_cache_hits == none.disk_reads
    assert whole.tier_write_bytes_per_token == whole.page_cache_bytes_per_token > 0
    reads = [
        simulate_tiers(trace, "lru", slots, c * 1000, 1000, exclusive=True).disk_reads
        for c in (0, 3, 30, 60, 72)  # 0, 1, 10, 20 rows per layer, every record
    ]
    assert reads == sorted(reads, reverse=True) and reads[0] > reads[2] > reads[-1] == 0


def test_a_slot_table_s_heat_ranks_recent_lookups_first():
    """``SlotCache.heat``: each call's lookups decayed by ``HEAT_DECAY`` a call, so the
    order is of recent use weighted by frequency; kept in scale past any float's range."""
    from mlx_streaming.core.cache.slots import HEAT_DECAY

    cache = SlotCache(4, 2, make_policy("lru", 4))
    for e in [0] * 5 + [1]:
        cache.access(np.array([e]), 0)
    h = cache.heat
    assert h[3] == 0 < h[1] < h[0]  # never; once, after five
    assert HEAT_DECAY**-1 * 4 < h[0] / h[1] < 5  # the five fade, a little
    for _ in range(100):
        cache.access(np.array([2]), 0)
    h = cache.heat
    assert h[1] < h[0] < h[2]  # the order of what was not looked up holds
    for _ in range(30):
        cache.access(np.array([1]), 0)
    assert cache.heat[0] < cache.heat[1]  # recent use beats old
    for _ in range(12_000):  # past 1e100 the counts are scaled back: finite, same order
        cache.access(np.array([1, 2]), 0)
    h = cache.heat
    assert all(np.isfinite(h)) and max(h) < 1e101 and h[3] == 0 < h[0] < h[1] == h[2]


def test_the_swap_tier_simulator_follows_the_store_s_tier(models):
    """``simulate_tiers(exclusive=True)`` against the store's own ``SwapTier`` tables,
    whole and bounded, driven as the store drives them (its slot tables filled at load,
    each call's misses planned, moved, the files' records landed, a full bounded tier
    dropping its coldest record as the store's loader has it): the same pool hits, trades
    and reads from the files, call for call; prompts' calls of more experts than slots in
    groups, each loaded before the next (``chunk`` tokens a call)."""
    from mlx_streaming.core.cache.pool import make_pools
    from mlx_streaming.core.io.tier import SwapTier
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.planning.tiers import simulate_tiers

    _, ed = models.experts("tiny-qwen3_moe")  # 3 MoE layers, 16 experts, top-4
    meta = load_meta(ed)
    layers, slots, E = meta.moe_layers, 6, 16
    trace, stride = local_trace(T=300, E=E), meta.layers[layers[0]].stride
    full = (E - slots) * stride * len(layers)
    for limit, chunk in ((None, 1), (full // 3, 1), (full // 3, 4)):
        pools = make_pools(meta, {li: slots for li in layers}, "host", False)
        tier, caches = SwapTier(meta, pools, limit=limit), {}
        tier.heat = lambda li, caches=caches: caches[li].heat  # as ``Loader`` gives it
        try:
            for li in layers:  # as the store adopts the pools the tier filled
                caches[li] = cache = SlotCache(E, slots, make_policy("lru", E))
                cache.commit(cache.reserve(range(slots), np.zeros(0, int)))
            hits = trades = reads = 0
            for t in range(0, trace.tokens - chunk + 1, chunk):
                for i, li in enumerate(layers):
                    rows = trace.experts[t : t + chunk, i]
                    cache = caches[li]
                    distinct, counts = np.unique(rows.astype(np.int64), return_counts=True)
                    for experts in cache.groups(distinct, counts):  # as the store groups them
                        _, misses = cache.split(experts)
                        placed = cache.reserve(misses, experts)
                        e_s = [e for e, _, _ in placed], [s for _, s, _ in placed]
                        moves = tier.plan(li, *e_s)
                        tier.moved(li, moves)
                        for e, s in moves.reads:  # landed
                            tier.held[li][s] = e
                        cache.commit(placed)
                        cache.access(experts, len(misses))
                        hits += len(experts) - len(misses)
                        trades, reads = trades + moves.brought, reads + len(moves.reads)
        finally:
            tier.close()
        calls = [chunk] * (trace.tokens // chunk)
        sim = simulate_tiers(
            trace, "lru", slots, limit or full, stride, exclusive=True, calls=calls
        )
        assert tier.partial == (limit is not None) and (reads > 0) == tier.partial
        assert (sim.pool_hits, sim.page_cache_hits, sim.disk_reads) == (hits, trades, reads)


def test_a_trace_of_one_sequence_splits_inside_it():
    """``generate --record-trace`` writes one sequence: its halves are cut inside it (the
    boundary split gave an empty first half, and profiles and pins fitted on nothing)."""
    from mlx_streaming.planning.trace import RoutingTrace

    one = local_trace(T=238)
    one = RoutingTrace(one.experts, np.array([0, 238]), one.num_experts)
    first, rest = one.split(0.5)
    assert (first.tokens, rest.tokens) == (119, 119)
    first.validate(), rest.validate()
    assert (np.concatenate([first.experts, rest.experts]) == one.experts).all()


def test_profile_command_refuses_a_profile_worse_than_uniform(models, tmp_path):
    """A profile that hits less on the held-out half than uniform slots is not written:
    ``load`` would pick it up from the expert directory unasked."""
    from mlx_streaming.commands import profile as cmd
    from mlx_streaming.planning.trace import RoutingTrace

    _, ed = models.experts("tiny-qwen3_moe")  # 3 MoE layers, 16 experts, top-4
    rng = np.random.default_rng(0)
    # the first half concentrated on layer 0's few experts, the second half the opposite:
    # a profile fitted on the first is wrong for the second
    T, E, k = 400, 16, 4
    ex = np.zeros((T, 3, k), np.uint8)
    for t in range(T):
        for li in range(3):
            few = (li == 0) == (t < T // 2)
            ex[t, li] = rng.choice(6 if few else E, k, replace=False)
    path = tmp_path / "shift.npz"
    RoutingTrace(ex, np.array([0, T // 2, T]), E).save(path)
    out = tmp_path / "p.json"
    args = ["--expert-dir", str(ed), "--trace", str(path), "--slots", "8", "--out", str(out)]
    with pytest.raises(ValueError, match="not written"):
        cmd.main([*args, "--policy", "lru"])
    assert not out.exists()


def test_a_pool_profile_scales_to_a_budget(models):
    """A pool profile with ``budget_gb``: its proportions, scaled to fill the budget
    (before: the profile was silently ignored and the budget split uniformly)."""
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.planning.budget import PoolShape, store_slots

    _, ed = models.experts("tiny-qwen3_moe")  # 3 MoE layers, 16 experts, top-4
    meta = load_meta(ed)
    a, b, c = sorted(meta.layers)
    shape = PoolShape.from_meta(meta)
    budget = shape.pool_bytes({li: 8 for li in shape.layers}, False)  # uniform 8 slots
    _, caps = store_slots(
        meta, budget_gb=budget / 1e9, layer_caps={a: 4, b: 12, c: 6}, zero_slot=False
    )
    assert caps[b] > caps[c] > caps[a] >= meta.top_k
    used = shape.pool_bytes(caps, False)
    assert budget - max(shape.slot_bytes) * 2 < used <= budget


def test_a_profile_with_whole_layers(models, tmp_path, capsys):
    """``whole_layers``: the layer that misses most holds every expert (its calls take the
    resident path), the others share what is left within the same bytes; a budget too
    small for it is refused by name; scaled to a budget, a whole layer stays whole; the
    command writes it though it hits less than uniform (the trade is asked for)."""
    from mlx_streaming.commands import profile as cmd
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.planning.budget import PoolShape, store_slots
    from mlx_streaming.planning.profiles import read_pool_profile, read_profile

    _, ed = models.experts("tiny-qwen3_moe")  # 3 MoE layers, 16 experts, top-4
    meta = load_meta(ed)
    a, b, c = sorted(meta.layers)
    trace = local_trace(T=800, L=3, E=16, k=4, concentrated=(0, 2))  # b misses most
    prof = build_profile(trace, meta, slots=8, policy="lru", tokens=400, whole_layers=1)
    assert prof.whole_layers == [b] and prof.slots[b] == 16
    assert meta.top_k <= prof.slots[a] < 16 and meta.top_k <= prof.slots[c] < 16
    assert prof.profile_bytes <= prof.uniform_bytes
    with pytest.raises(ValueError, match="2 whole layers and top_k=4 slots.*fewer whole"):
        build_profile(trace, meta, slots=8, policy="lru", tokens=400, whole_layers=2)
    with pytest.raises(ValueError, match="give 0 to 2"):
        build_profile(trace, meta, slots=8, tokens=400, whole_layers=3)
    with pytest.raises(ValueError, match="not --lossless"):
        build_profile(trace, meta, mode="lossless", tokens=400, whole_layers=1)

    shape = PoolShape.from_meta(meta)
    budget = shape.pool_bytes({li: 8 for li in shape.layers}, False)  # 16 + 4 + 4 fit
    prof = {a: 4, b: 16, c: 6}
    _, caps = store_slots(meta, None, budget / 1e9, prof, False, whole=[b])
    assert caps == {a: 4, b: 16, c: 4}  # before: b scaled down with the rest, to 14
    assert shape.pool_bytes(caps, False) <= budget
    _, caps = store_slots(meta, None, budget / 1e9, prof, False)  # not asked: scaled
    assert caps[b] < 16 and caps[c] > caps[a]
    ordinary = {a: 16, b: 16, c: 15}  # a profile that reaches every expert by its curves
    twelve = shape.pool_bytes({li: 12 for li in shape.layers}, False)
    assert store_slots(meta, None, twelve / 1e9, ordinary, False)[1] == {a: 12, b: 12, c: 12}
    small = shape.pool_bytes({li: 6 for li in shape.layers}, False)  # 16 + 4 + 4 > 18
    _, caps = store_slots(meta, None, small / 1e9, prof, False, whole=[b])
    assert caps[b] < 16 and shape.pool_bytes(caps, False) <= small
    # two asked, room for one: the first (it misses most) stays whole (before: neither)
    _, caps = store_slots(meta, None, budget / 1e9, {a: 4, b: 16, c: 16}, False, whole=[b, c])
    assert caps[b] == 16 and caps[c] < 16 and shape.pool_bytes(caps, False) <= budget

    path, out = tmp_path / "t.npz", tmp_path / "p.json"
    trace.save(path)
    args = ["--expert-dir", str(ed), "--trace", str(path), "--slots", "8", "--out", str(out)]
    cmd.main([*args, "--policy", "lru", "--tokens", "400", "--whole-layers", "1"])
    cap = capsys.readouterr()
    printed = json.loads(cap.out)
    assert printed["whole_layers"] == [b] and read_pool_profile(out)[b] == 16
    assert read_profile(out)[1] == [b]
    assert printed["heldout_hit_rate"] < printed["uniform_heldout_hit_rate"]  # the trade
    assert "uses a profile in the expert directory on every backend" in cap.err
    import mlx_streaming  # load reads the profile's whole layers and keeps them whole
    from mlx_streaming.planning.profiles import write_pool_profile

    ck, _ = models.experts("tiny-qwen3_moe")
    write_pool_profile(out, {a: 7, b: 16, c: 7}, whole_layers=[b])  # as at 10 slots
    _, _, store = mlx_streaming.load(
        ck, ed, budget_gb=budget / 1e9, pool_profile=str(out), zero_slot=False, progress=False
    )
    assert [store.capacity(li) for li in (a, b, c)] == [4, 16, 4]  # before: b cut to 13
    store.close()


def test_plan_refuses_a_trace_of_another_shape_and_impossible_sizes(models, tmp_path):
    """A trace recorded on another model (expert count or top-k), more slots than
    experts, a one-layer sample, negative expert ids: each named (before: accepted, or a
    ZeroDivisionError)."""
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.planning.budget import PoolShape
    from mlx_streaming.planning.planner import plan
    from mlx_streaming.planning.trace import RoutingTrace, TraceError

    _, ed = models.experts("tiny-qwen3_moe")  # 16 experts, top-4
    shape = PoolShape.from_meta(load_meta(ed))
    with pytest.raises(ValueError, match="6 of 64 experts.*4 of 16"):
        plan(local_trace(E=64, k=6), shape, slots=[8])
    with pytest.raises(ValueError, match="80 slots exceed"):
        plan(local_trace(E=16, k=4), shape, slots=[80])
    with pytest.raises(ValueError, match="at least 2 layers"):
        plan(local_trace(E=16, k=4), shape, slots=[8], layer_sample=1)
    bad = local_trace(E=16, k=4)
    with pytest.raises(TraceError, match=r"0\.\.15"):
        RoutingTrace(bad.experts.astype(np.int16) - 1, bad.offsets, 16).validate()


@pytest.mark.parametrize("reader", ["python", "native"])
def test_a_read_ahead_past_the_free_and_evictable_slots_places_what_fits(models, reader):
    """Read-ahead is best effort on every reader: more guesses than the slots it may take
    place as many as fit (the Python reader has no wave to cap them; it raised "cannot
    place" from inside the decode step before), and the store still serves."""
    from mlx_streaming import FileExpertStore
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.core.options import StreamConfig

    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    store = FileExpertStore(ed, capacity=meta.top_k, config=StreamConfig(reader=reader))
    try:
        a = store.layers[0]
        store.loads.fetch(a, np.arange(meta.top_k, dtype=np.int64))
        guesses = np.arange(meta.top_k, meta.num_experts, dtype=np.int64)
        issued = store.prefetch(a, guesses)
        assert 0 < issued <= meta.top_k
        store.loads.finish_read_aheads(a)
        assert (store.caches[a].slot_of >= 0).sum() == meta.top_k
        assert store.loads.fetch(a, np.arange(meta.top_k, dtype=np.int64)) > 0
    finally:
        store.close()


def _victim_rows_per_read(owner, stamp, used, heat, n):
    """The rows a call's victims take as the swap tier's rule chose them until
    2026-12-06c, ranked again for each read with the rows taken before it left out (the
    first empty row, oldest written first, else the coldest record's, the oldest of
    equals): the oracle of ``tier_moves._victim_rows``'s once-a-call ranking."""
    used, order, out = set(used), sorted(range(len(stamp)), key=stamp.__getitem__), []
    for _ in range(n):
        free = [h for h in order if h not in used]
        h = next((h for h in free if owner[h] < 0), -1)
        if h < 0 and free:
            h = min(free, key=lambda r: heat[owner[r]])
        if h < 0:
            break
        out.append(h)
        used.add(h)
    return out


@pytest.mark.parametrize("E,slots,rows", [(16, 4, 6), (64, 16, 24), (512, 64, 224)])
def test_the_swap_tier_rule_ranks_victims_rows_once_a_call_as_per_read(E, slots, rows):
    """``plan_moves`` ranks the rows a call's victims take once a call (empty first, then
    the coldest record's, the oldest written of equals): on random calls over a bounded
    tier with empty rows (at load, and written since, where a trade found an empty slot),
    ties in heat and in write times, and slots a failed read left empty (no victim), its
    trades, reads and tables are the per-read ranking's, call after call."""
    from mlx_streaming.core.io import tier_moves

    rng = np.random.default_rng(E)
    home, held = [-1] * E, list(range(slots))
    owner, stamp = [-1] * rows, [0] * rows
    for h, e in enumerate(range(slots, slots + rows - rows // 4)):  # a quarter empty
        home[e], owner[h] = h, e
    ref = tuple(list(t) for t in (home, held, owner, stamp))
    clock = ref_clock = 0
    for _ in range(400):
        heat = [float(x) for x in rng.integers(0, 4, E)]  # ties
        out = [e for e in range(E) if e not in held]  # misses, as the store asks
        experts = rng.choice(out, int(rng.integers(1, slots)), replace=False).tolist()
        slot = rng.choice(slots, len(experts), replace=False).tolist()
        got = tier_moves.plan_moves(0, (home, held, owner, stamp), clock, experts, slot,
                                    lambda heat=heat: heat, True)  # fmt: skip
        with pytest.MonkeyPatch.context() as m:  # the same calls, ranked per read
            m.setattr(tier_moves, "_victim_rows", _victim_rows_per_read)
            want = tier_moves.plan_moves(0, ref, ref_clock, experts, slot,
                                         lambda heat=heat: heat, True)  # fmt: skip
        assert (got.trades, got.reads) == (want.trades, want.reads)
        assert [list(t) for t in got.tables] == [list(t) for t in want.tables]
        clock, ref_clock = got.clock, want.clock
        for e, s in got.reads:  # landed, or (a fifth) failed: its slot left empty, so
            if rng.random() < 0.8:  # a later trade leaves a row empty, newly written
                held[s] = ref[1][s] = e
