"""Streamed greedy generation equals stock mlx-lm: identical tokens and logits (max abs
difference 0) for every supported architecture and every pool configuration."""

from __future__ import annotations

import functools
import os
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from mlx_streaming import FileExpertStore, patch_model_filebacked
from mlx_streaming.analysis.verify import compare_traces, greedy_trace
from mlx_streaming.core.meta import load_meta
from mlx_streaming.core.options import StreamConfig
from mlx_streaming.prep.split_experts import split_model
from mlx_streaming.synthetic import TINY_ARCHS
from mlx_streaming.synthetic.train import trained_checkpoint

NEW_TOKENS = 32
PREFILL = 16  # the longest prompt spans several prefill chunks
TEXTS = [
    "Hi",
    "Experts stream from disk when the pool is small.",
    "A mixture of experts model routes each token to a few experts out of many; "
    "the rest stay on disk until they are needed, and the cache keeps what was used.",
]


def patched(ck, ed, config=None, **store_kw):
    """The model patched by hand, as the seed script does (the quantization comes from
    the meta)."""
    model, _ = load(str(ck), lazy=True)
    store = FileExpertStore(ed, config=config, **store_kw)
    patch_model_filebacked(model, store, config=config)
    return model, store


@functools.cache
def reference(ck):
    model, tok = load(str(ck))
    prompts = [tok.encode(t) for t in TEXTS]
    traces = [greedy_trace(model, p, NEW_TOKENS, PREFILL) for p in prompts]
    n = min(len(prompts[1]), len(prompts[2]))
    batch = [prompts[1][:n], prompts[2][:n]]
    return prompts, traces, batch, greedy_trace(model, batch, NEW_TOKENS, PREFILL)


def assert_exact(model, ck):
    prompts, traces, batch, batch_trace = reference(ck)
    assert len(prompts[2]) > 2 * PREFILL
    for p, ref in zip(prompts, traces):
        cmp = compare_traces(ref, greedy_trace(model, p, NEW_TOKENS, PREFILL))
        assert cmp.tokens_equal, f"tokens differ from step {cmp.first_token_diff}"
        assert cmp.logits_equal, f"logits differ by up to {cmp.max_abs_diff}"
    return batch, batch_trace


def _rest_gb(meta, slots: int) -> float:
    """GB of the records pools of ``slots`` per layer do not hold."""
    return (
        sum(
            (lay.num_experts - min(slots, lay.num_experts)) * lay.stride
            for lay in meta.layers.values()
        )
        / 1e9
    )


CONFIGS = {
    "slots=top_k": lambda m: {"capacity": m.top_k},
    "slots=2top_k": lambda m: {"capacity": 2 * m.top_k},
    "slots=all": lambda m: {"capacity": m.num_experts},
    "layer_caps": lambda m: {
        "capacity": m.top_k,
        "layer_caps": {m.moe_layers[0]: m.num_experts, m.moe_layers[-1]: m.top_k + 1},
    },
    "clear_on_evict": lambda m: {"capacity": m.top_k + 1, "clear_on_evict": True},
    "python_reader": lambda m: {"capacity": m.top_k + 1, "reader": "python"},
    "direct_io": lambda m: {"capacity": m.top_k + 1, "direct_io": True},
    "no_overlap": lambda m: {"capacity": m.top_k + 1, "config": StreamConfig(overlap=False)},
    # the tiny models' records are under INLINE_BYTES: the split is asked for
    "overlap": lambda m: {"capacity": m.top_k + 1, "config": StreamConfig(overlap=True)},
    # and read inline: the engine's threads, the default from INLINE_BYTES, as asked
    "overlap_threads": lambda m: {
        "capacity": m.top_k + 1,
        "config": StreamConfig(overlap=True, threads=4),
    },
    "threads": lambda m: {"capacity": m.top_k + 1, "config": StreamConfig(threads=2)},
    "overlap_python_reader": lambda m: {
        "capacity": m.top_k + 1,
        "reader": "python",
        "config": StreamConfig(overlap=True),
    },
    "masked_rows": lambda m: {
        "capacity": m.top_k + 1,
        "zero_slot": True,
        "config": StreamConfig(rows="masked"),
    },
    "mixed_rows": lambda m: {
        "capacity": m.top_k + 1,
        "zero_slot": True,
        "config": StreamConfig(rows="mixed"),
    },
    "metal_like": lambda m: {  # Metal's runtime: the Python reader, masked rows, no overlap
        "capacity": 2 * m.top_k,
        "reader": "python",
        "config": StreamConfig(rows="masked", overlap=False),
    },
    "prefetch": lambda m: {
        "capacity": 2 * m.top_k,
        "config": StreamConfig(prefetch=True),
    },
    # the experts outside the pools in a swap tier, each miss trading with its victim
    "swap_tier": lambda m: {"capacity": m.top_k + 1, "config": StreamConfig(swap_tier=True)},
    # a tier of a third of the rest: the hottest records the pools gave up; the others read
    "swap_tier_bounded": lambda m: {
        "capacity": m.top_k + 1,
        "config": StreamConfig(swap_tier=True, swap_tier_gb=_rest_gb(m, m.top_k + 1) / 3),
    },
    "swap_tier_bounded_direct_io": lambda m: {
        "capacity": m.top_k + 1,
        "config": StreamConfig(
            swap_tier=True, swap_tier_gb=_rest_gb(m, m.top_k + 1) / 3, direct_io=True
        ),
    },
    "swap_tier_layer_caps": lambda m: {
        "capacity": m.top_k,
        "layer_caps": {m.moe_layers[0]: m.num_experts, m.moe_layers[-1]: m.top_k + 1},
        "config": StreamConfig(swap_tier=True),
    },
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_streamed_equals_stock(models, arch, config):
    ck, ed = models.experts(arch)
    meta = load_meta(ed)
    model, store = patched(ck, ed, **CONFIGS[config](meta))
    assert_exact(model, ck)
    assert store.misses > 0 and store.hits > 0
    if config == "prefetch":
        t = store.totals()
        assert t["prefetched"] > 0 and t["prefetch_used"] > 0
        assert 0 < t["prediction_precision"] <= 1 and 0 < t["prediction_recall"] <= 1
    if config == "slots=all":
        assert store.hit_rate() > 0.9  # after one load per layer, nothing misses
    store.close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The trained model committed with the repository, its experts split for the test."""
    ck = trained_checkpoint()
    assert ck is not None, "checkpoints/tiny-stdlib-moe is missing from the checkout"
    ed = tmp_path_factory.mktemp("trained") / "experts"
    split_model(ck, ed)
    return ck, ed


@pytest.mark.parametrize("config", list(CONFIGS))
def test_trained_model_streams_exactly(trained, config):
    """The same suite on a model with learned routing (skewed, with locality)."""
    ck, ed = trained
    model, store = patched(ck, ed, **CONFIGS[config](load_meta(ed)))
    assert_exact(model, ck)
    assert store.misses > 0 and store.hits > 0
    store.close()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_pinned_and_batched(models, arch):
    ck, ed = models.experts(arch)
    meta = load_meta(ed)
    model, store = patched(ck, ed, capacity=2 * meta.top_k, record=True)
    batch, batch_trace = assert_exact(model, ck)
    for li in store.recorded_layers():
        store.pin(li, store.hot(li, 2))
    store.record = False
    assert store.pinned_count() == 2 * len(meta.moe_layers)
    assert_exact(model, ck)
    # a batch of two prompts: more distinct experts per call than slots at top-k
    model2, store2 = patched(ck, ed, capacity=meta.top_k)
    got = greedy_trace(model2, batch, NEW_TOKENS, PREFILL)
    cmp = compare_traces(batch_trace, got)
    assert cmp.exact, cmp.to_json()
    store.close()
    store2.close()


def _bytes_read() -> int | None:
    """Bytes this process has read from files so far (Linux's ``rchar``; else None)."""
    import os

    if not os.path.exists("/proc/self/io"):
        return None
    with open("/proc/self/io") as f:
        return int(next(x for x in f if x.startswith("rchar")).split()[1])


def assert_each_record_once(store, meta) -> None:
    """A swap tier's pools and tier hold every record of every layer once, where the
    tables say: each slot the bytes of the expert the slot table names (and the tier's
    table agrees), every other expert's home its record."""
    tier = store.reader.tier
    for li in store.layers:
        lay, pool, cache = meta.layers[li], store.pool(li), store.caches[li]
        raw = np.fromfile(meta.file(li), np.uint8)

        def rec(e, p, raw=raw, stride=lay.stride):
            return raw[e * stride + p.offset : e * stride + p.offset + p.nbytes]

        assert np.array_equal(tier.held[li], cache.expert_in), li
        out, home = np.flatnonzero(cache.slot_of < 0), tier.home[li]
        inside = np.flatnonzero(home >= 0)  # a partial tier: the others in their files
        assert set(inside) <= set(out) and (tier.partial or len(inside) == len(out)), li
        assert np.array_equal(tier.owner[li][home[inside]], inside), li  # each row once
        assert len(inside) == (tier.owner[li] >= 0).sum() <= tier.rows[li], li
        for e in inside.tolist():
            for p in lay.parts:
                got = tier.slabs[li][tier.home[li][e], p.offset : p.offset + p.nbytes]
                assert np.array_equal(got, rec(e, p)), (li, e, p.name)
        for s, e in enumerate(cache.expert_in.tolist()):
            for p in lay.parts:
                got = np.array(pool.arrays[p.name][s]).reshape(-1).view(np.uint8)
                assert np.array_equal(got, rec(e, p)), (li, s, p.name)


@pytest.mark.parametrize("arch", ["tiny-qwen3_moe", "tiny-deepseek_v2"])
def test_a_swap_tier_streams_exactly_and_holds_each_record_once(models, arch):
    """With pins, then a batch of two prompts at top-k slots (more distinct experts per
    call than slots: each call trades in groups): stock's tokens and logits, every record
    held once and where the tables say, and no record read from a file after load."""
    ck, ed = models.experts(arch)
    meta = load_meta(ed)
    cfg = StreamConfig(swap_tier=True)
    model, store = patched(ck, ed, config=cfg, capacity=2 * meta.top_k, record=True)
    assert store.runtime.reader == "tier"  # its pools full from load
    assert store.resident_count() == sum(store.capacity(li) for li in store.layers)
    batch, batch_trace = assert_exact(model, ck)
    for li in store.recorded_layers():
        store.pin(li, store.hot(li, 2))
    store.record = False
    read = _bytes_read()
    assert_exact(model, ck)  # the trunk's weights are in since the first prompts
    if read is not None:  # no record
        assert _bytes_read() - read < meta.layers[meta.moe_layers[0]].record_bytes
    assert store.misses > 0
    assert_each_record_once(store, meta)
    model2, store2 = patched(ck, ed, config=cfg, capacity=meta.top_k)
    for li in store2.layers:  # what the fill read is not held twice: the page cache let go
        share = page_cache_share(meta.file(li))
        assert share is None or share < 0.5, (li, share)
    cmp = compare_traces(batch_trace, greedy_trace(model2, batch, NEW_TOKENS, PREFILL))
    assert cmp.exact, cmp.to_json()
    assert_each_record_once(store2, meta)
    store.close()
    store2.close()


def page_cache_share(path) -> float | None:
    """The share of ``path``'s pages in the page cache (``mincore``; None where there is
    none, off Linux)."""
    import ctypes
    import mmap

    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mincore.restype = ctypes.c_void_p, ctypes.c_int
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    size, fd = os.path.getsize(path), os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    try:
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
    finally:
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    return sum(v & 1 for v in vec) / pages


def test_pinned_experts_are_never_evicted(models):
    ck, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    model, store = patched(ck, ed, capacity=meta.top_k + 2)
    layer = meta.moe_layers[0]
    store.pin(layer, [0, 1])
    slots = store.caches[layer].slot_of[[0, 1]].copy()
    assert (slots >= 0).all()
    assert_exact(model, ck)
    assert (store.caches[layer].slot_of[[0, 1]] == slots).all()
    assert store.caches[layer].stats.evictions > 0
    store.close()


def test_mlx_generate_text_matches(models):
    """The async step-ahead path of mlx_lm.generate gives the same text."""
    from mlx_lm import generate

    ck, ed = models.experts("tiny-qwen3_next")
    meta = load_meta(ed)
    ref, tok = load(str(ck))
    want = generate(ref, tok, prompt=TEXTS[2], max_tokens=24, prefill_step_size=8)
    for cap in (meta.top_k, meta.num_experts):
        model, store = patched(ck, ed, capacity=cap)
        assert generate(model, tok, prompt=TEXTS[2], max_tokens=24, prefill_step_size=8) == want
        store.close()


def test_pool_updates_in_place(models):
    """Loading experts writes their slots in place: the pool's buffer never moves."""
    ck, ed = models.experts("tiny-mixtral")
    meta = load_meta(ed)
    model, store = patched(ck, ed, capacity=meta.top_k)
    layer = meta.moe_layers[0]
    arr = store.pool(layer).arrays["gate_proj.weight"]
    greedy_trace(model, reference(ck)[0][0], 2)  # first writes (the zeros buffer is replaced)
    mx.eval(arr)
    addr = np.array(arr, copy=False).ctypes.data
    before = store.caches[layer].stats.evictions
    assert_exact(model, ck)
    assert store.caches[layer].stats.evictions - before > 10
    assert np.array(arr, copy=False).ctypes.data == addr
    store.close()


@pytest.mark.parametrize(
    "kw", [{"bits": 8}, {"bits": None}, {"dtype": "bfloat16"}, {"bits": 8, "group_size": 32}]
)
def test_other_precisions(models, kw):
    """8-bit, unquantized (float experts) and bf16 checkpoints stream exactly too."""
    ck, ed = models.experts("tiny-qwen3_moe", **kw)
    meta = load_meta(ed)
    assert meta.dims["bits"] == kw.get("bits", 4)
    model, store = patched(ck, ed, capacity=meta.top_k + 1)
    assert_exact(model, ck)
    store.close()


def test_stacked_experts_are_dropped(models):
    """After patching, no parameter holds all of a layer's experts: only pool slots."""
    from mlx.utils import tree_flatten

    ck, ed = models.experts("tiny-deepseek_v3")
    meta = load_meta(ed)
    model, store = patched(ck, ed, capacity=meta.top_k)
    for path, arr in tree_flatten(model.parameters()):
        if any(path.startswith(lay.module) for lay in meta.layers.values()):
            assert ".experts." in path, path
            assert arr.shape[0] == meta.top_k + store.zero_slot, path
    store.close()


def test_transition_prefetch_with_trace_routing(models, tmp_path):
    """Trace replay + a transition predictor learned from the trace: still exact."""
    from mlx_streaming.core.prefetch.predictor import TransitionPredictor
    from mlx_streaming.planning.trace import RoutingTrace, apply_trace_routing

    ck, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    rng = np.random.default_rng(0)
    L, E, k = len(meta.moe_layers), meta.num_experts, meta.top_k
    # a trace with locality: each token keeps most of the previous token's experts
    rows = [rng.choice(E, k, replace=False)]
    for _ in range(400):
        keep = rows[-1][: k - 1]
        new = rng.choice(np.setdiff1d(np.arange(E), keep), 1)
        rows.append(np.concatenate([keep[1:], new, keep[:1]]))
    experts = np.stack([np.roll(np.array(rows), li, axis=1) for li in range(L)], axis=1)
    trace = RoutingTrace(experts.astype(np.uint8), np.array([0, len(rows)]), E, "synthetic")
    trace.save(tmp_path / "t.npz")
    trace = RoutingTrace.load(tmp_path / "t.npz")
    ref, tok = load(str(ck))
    apply_trace_routing(ref, trace)
    ids = tok.encode(TEXTS[2])
    want = greedy_trace(ref, ids, NEW_TOKENS, PREFILL)
    opts = StreamConfig(prefetch=True, predictor=TransitionPredictor.from_trace(trace, k))
    model, store = patched(ck, ed, config=opts, capacity=k + 2)
    apply_trace_routing(model, trace)
    got = greedy_trace(model, ids, NEW_TOKENS, PREFILL)
    assert compare_traces(want, got).exact
    assert store.totals()["prefetch_used"] > 0
    store.close()


@pytest.mark.parametrize("rows", ["subset", "masked", "mixed"])
def test_kernel_thresholds(models, rows):
    """128 experts, top-8, prefill chunks of 8-64 tokens (64-512 routed rows): every row
    threshold of MLX's kernel choice is crossed, for pools of top-k, 2x, half and all
    the experts, with the start-up kernel self-test on."""
    ck, ed = models.experts("thresholds-qwen3_moe")
    meta = load_meta(ed)
    ref, tok = load(str(ck))
    ids = tok.encode(" ".join(TEXTS * 3))[:150]
    want = {c: greedy_trace(ref, ids, 8, c) for c in (8, 16, 32, 64)}
    for cap in (meta.top_k, 2 * meta.top_k, meta.num_experts // 2, meta.num_experts):
        model, store = patched(
            ck,
            ed,
            capacity=cap,
            zero_slot=rows != "subset",
            config=StreamConfig(rows=rows, kernel_check=True),
        )
        for chunk, ref_trace in want.items():
            cmp = compare_traces(ref_trace, greedy_trace(model, ids, 8, chunk))
            assert cmp.exact, (cap, chunk, cmp.to_json())
        store.close()


@pytest.mark.parametrize("preset", ["tiny-deepseek_v2", "tiny-deepseek_v3", "tiny-qwen3_next"])
def test_shared_experts_start_beside_the_routing(models, preset, monkeypatch):
    """The shared experts, started with each call's routing, are the very output the MoE
    block uses (each start consumed, none computed twice), and the output stays exact."""
    from mlx_streaming.core.prefetch.shared import SharedAhead

    started, used = [], []
    start, call = SharedAhead.start, SharedAhead.__call__

    def spy_start(self, x):
        started.append(start(self, x))
        return started[-1]

    def spy_call(self, x):
        used.append(call(self, x))
        return used[-1]

    monkeypatch.setattr(SharedAhead, "start", spy_start)
    monkeypatch.setattr(SharedAhead, "__call__", spy_call)
    ck, ed = models.experts(preset)
    model, store = patched(ck, ed, capacity=load_meta(ed).top_k)
    assert_exact(model, ck)
    wrapped = [m for _, m in model.named_modules() if isinstance(m, SharedAhead)]
    assert len(wrapped) == len(store.layers)
    assert all(m.ahead for m in wrapped)
    assert started and len(started) == len(used)
    assert all(a is b for a, b in zip(started, used))  # the block got each started array
    store.close()


def test_shared_started_but_unused_switches_off():
    """A block that calls its shared experts on another input, or not after a start,
    gets their true output and stops the early start (no double work)."""
    import mlx.nn as nn

    from mlx_streaming.core.prefetch.shared import SharedAhead

    lin = nn.Linear(8, 8)
    x, x2 = mx.random.normal((1, 8)), mx.random.normal((1, 8))
    s = SharedAhead(lin)
    y = s.start(x)
    assert s(x) is y and s.ahead
    s.start(x)
    assert mx.array_equal(s(x2), lin(x2)) and not s.ahead
    assert s.start(x) is None
    t = SharedAhead(lin)
    t.start(x)
    assert t.start(x) is None and not t.ahead  # the first start was never asked for
    assert mx.array_equal(t(x), lin(x))


@pytest.mark.parametrize("capacity", ["all", "top_k+1"])
def test_slot_ids_need_no_cast(models, capacity):
    """Slot ids reach the matmuls in their own index type, uint32 like stock's routed ids
    (int32 ids cost MLX a cast per projection: three ops per layer call)."""
    ck, ed = models.experts("tiny-mixtral")
    meta = load_meta(ed)
    slots = meta.num_experts if capacity == "all" else meta.top_k + 1
    model, store = patched(ck, ed, capacity=slots)
    seen = []

    def spy(experts):
        def call(x, ids):
            seen.append(ids.dtype)
            return experts(x, ids)

        return call

    for m in model.modules():
        if getattr(m, "is_streamed_experts", False):
            m["experts"] = spy(m.experts)
    try:
        greedy_trace(model, reference(ck)[0][1], 4)
        assert seen and set(seen) == {mx.uint32}, set(seen)
    finally:
        store.close()


def test_a_bounded_swap_tier_reads_fewer_records_from_the_files(models):
    """A swap tier of a third of what the pools do not hold keeps the records they gave
    up last: with O_DIRECT (no page cache), the files give fewer bytes than without it,
    the output is stock's, and each record is held at most once, where the tables say."""
    if _bytes_read() is None:
        pytest.skip("counts reads through /proc/self/io")
    ck, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    slots, read, extra = meta.top_k + 1, {}, {}
    third = _rest_gb(meta, slots) / 3
    for name, cfg in (
        ("files", StreamConfig(direct_io=True)),
        ("tier", StreamConfig(swap_tier=True, swap_tier_gb=third, direct_io=True)),
    ):
        model, store = patched(ck, ed, config=cfg, capacity=slots)
        assert_exact(model, ck)  # the trunk in, the tiers warm
        before = _bytes_read()
        store.reset_stats()  # the trades' count too (before: kept from load on)
        assert_exact(model, ck)
        read[name] = _bytes_read() - before
        extra[name] = read[name] - store.totals()["file_bytes_read"]
        for li in meta.moe_layers:  # a record per record brought in (before: a victim
            st = store.stats[li]  # sent out to a dropped row counted as one brought in)
            assert st.bytes_read == st.records_read * meta.layers[li].record_bytes
        if name == "tier":
            assert store.runtime.decode_path == "host" and store.reader.tier.partial
            assert_each_record_once(store, meta)
        store.close()
    assert 0 < read["tier"] < 0.9 * read["files"], read
    # the store's count of the files' bytes leaves the trades out: it is the system's
    # count less the same share in both runs (O_DIRECT reads whole strides, the store
    # counts records' bytes)
    assert abs(extra["tier"] / read["tier"] - extra["files"] / read["files"]) < 0.005, extra


def test_a_swap_tier_that_does_not_fit_is_refused_before_it_allocates(models):
    """A tier larger than the memory left says both sizes and the fix, and takes nothing."""
    from mlx_streaming.core.cache.pool import make_pools
    from mlx_streaming.core.io.tier import MARGIN, SwapTier

    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    pools = make_pools(meta, {li: meta.top_k for li in meta.moe_layers}, "host", False)
    need = sum((meta.layers[li].num_experts - meta.top_k) * meta.layers[li].stride
               for li in meta.moe_layers)  # fmt: skip
    with pytest.raises(MemoryError, match=rf"needs {need / 1e9:.2f} GB .*--swap-tier"):
        SwapTier(meta, pools, available=need + MARGIN - 1)
    assert SwapTier(meta, pools, available=need + MARGIN).nbytes == need
    trunk = 30 << 20  # what the trunk's load still takes beside the tier
    with pytest.raises(MemoryError, match=r"0\.03 GB of them for the rest of the load"):
        SwapTier(meta, pools, available=need + MARGIN + trunk - 1, reserve=trunk)
    assert SwapTier(meta, pools, available=need + MARGIN + trunk, reserve=trunk).nbytes == need


def test_an_auto_swap_tier_takes_what_memory_holds_and_streams_exactly(models, monkeypatch):
    """``swap_tier_gb="auto"``: the tier takes what the available memory holds beside the
    ``MARGIN`` and the trunk's load: whole where that is enough, else the records the
    pools gave up (the hottest), the rest read from the files (a model loaded so streams exactly,
    saying so); where nothing is left, it says so."""
    from mlx_streaming import load as stream_load
    from mlx_streaming.core import mem
    from mlx_streaming.core.cache.pool import make_pools
    from mlx_streaming.core.io.tier import MARGIN, SwapTier

    ck, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    pools = make_pools(meta, {li: meta.top_k for li in meta.moe_layers}, "host", False)
    need = sum((meta.layers[li].num_experts - meta.top_k) * meta.layers[li].stride
               for li in meta.moe_layers)  # fmt: skip
    trunk = 30 << 20

    def auto(room: int) -> SwapTier:
        return SwapTier(meta, pools, available=room + MARGIN + trunk, limit="auto", reserve=trunk)

    whole = auto(need)
    assert not whole.partial and whole.nbytes == need
    whole.close()
    half = auto(need // 2)
    assert half.partial and need // 3 < half.nbytes <= need // 2
    half.close()
    with pytest.raises(MemoryError, match="no room for a swap tier.*a record for each layer"):
        auto(0)
    every = make_pools(meta, {li: meta.num_experts for li in meta.moe_layers}, "host", False)
    none = SwapTier(meta, every, available=0, limit="auto")  # the pools hold them all
    assert none.nbytes == 0 and not none.partial
    none.close()

    room = FileExpertStore(ed, meta.top_k, swap_tier=True, swap_tier_gb="auto", direct_io=True)
    try:  # this machine holds the whole tier: nothing is read from the files after load
        assert not room.reader.tier.partial
        whole = FileExpertStore(ed, meta.top_k, swap_tier=True, swap_tier_gb="auto")
        assert not whole.runtime.direct_io  # no file reads: the default's O_DIRECT off
        assert "no O_DIRECT (the tier is whole: no file reads)" in whole.runtime.line()
        whole.close()
        assert (
            "whole" in room.runtime.reason("reader") and "--direct-io unused" in room.runtime.line()
        )
    finally:
        room.close()
    real_open = os.open

    def no_direct(path, flags, *a):  # a filesystem that refuses O_DIRECT (e.g. tmpfs)
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)  # a whole tier's fill reads through the
    room = FileExpertStore(ed, meta.top_k, swap_tier=True, swap_tier_gb="auto", direct_io=True)
    assert not room.reader.tier.partial and "--direct-io unused" in room.runtime.line()
    room.close()  # page cache: nothing else reads the files
    monkeypatch.setattr(os, "open", real_open)
    big = FileExpertStore(ed, meta.top_k, swap_tier=True, swap_tier_gb=100.0, direct_io=True)
    try:  # a bound above what the pools leave: whole, and the line says so
        assert not big.reader.tier.partial and not big.runtime.direct_io
        assert "at most 100 GB: whole" in big.runtime.reason("reader")
        assert "nothing read from the files" in big.runtime.reason("reader")
        assert "no O_DIRECT (the tier is whole: no file reads, --direct-io unused)" in (
            big.runtime.line()
        )
    finally:
        big.close()
    total, _ = mem.machine_memory()
    lazy, _ = load(str(ck), lazy=True)
    from mlx_streaming.model_builder import host_reserve, trunk_host_bytes
    from mlx_streaming.planning.budget import kv_bytes

    # beside it: the trunk and, off CUDA, the KV cache of --context tokens (here a record
    # a layer's worth: the tier takes fewer rows), which grows after the tier is sized
    stride = max(lay.stride for lay in meta.layers.values())
    cfg = StreamConfig(slots=meta.top_k, swap_tier=True, swap_tier_gb="auto")
    cfg = cfg.replace(context=-(-len(meta.layers) * stride // sum(kv_bytes(lazy))))
    kv = cfg.context * sum(kv_bytes(lazy))
    assert host_reserve(lazy, cfg, "cpu") == trunk_host_bytes(lazy, "cpu") + kv
    assert kv >= len(meta.layers) * stride
    assert host_reserve(lazy, cfg, "cuda") == trunk_host_bytes(lazy, "cuda")  # on the GPU
    for other in (cfg.replace(swap_tier=None), cfg.replace(swap_tier_gb=1.0)):  # not auto
        assert host_reserve(lazy, other, "cpu") == trunk_host_bytes(lazy, "cpu")
    held = trunk_host_bytes(lazy) + kv + MARGIN + need // 2  # half the tier beside the rest
    monkeypatch.setattr(mem, "machine_memory", lambda: (total, held))
    model, _, store = stream_load(ck, ed, cfg, progress=False)
    try:
        assert store.reader.tier.partial and store.reader.tier.nbytes <= need // 2
        from mlx_streaming.core.io import engine_lib

        files = [meta.file(li) for li in meta.layers]  # the default beneath it: O_DIRECT,
        if sys.platform.startswith("linux") and not engine_lib.direct_refused(files):
            import fcntl  # where the filesystem takes it

            assert "leaves the page cache no room" in store.runtime.line()
            fds = store.reader.files._fds  # the files' reader opened them so
            assert fds and all(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT for fd in fds)
        staging = max(8, meta.top_k) * max(lay.stride for lay in meta.layers.values())
        assert store.reader.tier.nbytes <= need // 2 - staging  # the files' reader's, beside
        said = store.runtime.reason("reader")  # the size it took
        assert (
            f"as large as memory holds: bounded to {store.reader.tier.nbytes / 1e9:.2f} GB" in said
        )
        assert_exact(model, ck)
    finally:
        store.close()
    from mlx_streaming.core.runtime import resolve

    chosen = resolve(cfg, meta)  # bounded: as CUDA's default resolves it in that memory
    half = MARGIN + need // 2  # a store alone (no trunk beside it): half the tier
    monkeypatch.setattr(mem, "machine_memory", lambda: (total, half))
    default = FileExpertStore(ed, meta.top_k, config=StreamConfig(), runtime=chosen)
    try:  # the default's tier (swap_tier left None) takes what memory holds, as auto does
        assert default.reader.tier.partial and default.reader.files is not None
        said = default.runtime.reason("reader")
        assert said.startswith("the files do not fit in half of memory, as large as memory")
        assert f"bounded to {default.reader.tier.nbytes / 1e9:.2f} GB" in said
    finally:
        default.close()
    monkeypatch.setattr(mem, "machine_memory", lambda: (total, total))  # room again
    whole = FileExpertStore(ed, meta.top_k, config=StreamConfig(), runtime=chosen)
    try:  # resolved bounded, made whole: no file reads, so no O_DIRECT either
        assert not whole.reader.tier.partial and whole.reader.files is None
        assert not whole.runtime.direct_io and ", O_DIRECT" not in whole.runtime.line()
        assert whole.runtime.reason("direct_io") == "the tier is whole: no file reads"
    finally:
        whole.close()
    held = trunk_host_bytes(lazy) + kv + MARGIN + need  # a whole tier, and no reader's staging
    monkeypatch.setattr(mem, "machine_memory", lambda: (total, held))
    _, _, exact = stream_load(ck, ed, cfg, progress=False)
    try:  # whole, as the runtime said: the staging of reads beyond it counts only beside
        assert not exact.reader.tier.partial and exact.reader.files is None  # a bounded one
        assert "whole" in exact.runtime.reason("reader"), exact.runtime.reason("reader")
    finally:
        exact.close()


def test_the_default_s_swap_tier_falls_back_to_the_page_cache(models, monkeypatch):
    """The tier CUDA's default chose (``swap_tier`` left None) but that cannot be
    page-locked: the store warns and reads through the page cache, saying why, and
    streams exactly; a tier asked for, or a file's own error, is the answer instead."""
    from mlx_streaming.core.io import tier
    from mlx_streaming.core.runtime import resolve

    ck, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    chosen = resolve(StreamConfig(swap_tier=True), meta)  # as the default resolves it

    def refuse(*a, **kw):
        raise MemoryError("page-locked memory is short")

    monkeypatch.setattr(tier.SwapTier, "__init__", refuse)
    with pytest.warns(RuntimeWarning, match="page-locked memory is short"):
        store = FileExpertStore(ed, meta.top_k, config=StreamConfig(), runtime=chosen)
    try:
        assert store.runtime.reader != "tier"
        assert "the swap tier could not be page-locked" in store.runtime.reason("reader")
        model, _ = load(str(ck))
        patch_model_filebacked(model, store)
        ids = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
        stock, _ = load(str(ck))
        assert mx.array_equal(model(ids), stock(ids))
    finally:
        store.close()
    with pytest.raises(MemoryError, match="short"):  # asked for: the error is the answer
        FileExpertStore(ed, meta.top_k, config=StreamConfig(swap_tier=True), runtime=chosen)
    whole = chosen.replace(decode_path="device")  # the default's whole tier, as on CUDA
    with pytest.warns(RuntimeWarning) as said:  # bounded instead, and that short too
        store = FileExpertStore(ed, meta.top_k, config=StreamConfig(), runtime=whole)
    try:
        assert [str(w.message).endswith(end) for w, end in zip(said, ("bounded instead",
                "pread instead"))] == [True, True], [str(w.message) for w in said]  # fmt: skip
        assert store.runtime.reader != "tier" and store.runtime.decode_path == "host"
    finally:
        store.close()
    with pytest.raises(MemoryError, match="short"):  # the device path's reads: the answer
        FileExpertStore(ed, meta.top_k, config=StreamConfig(device_reads=True), runtime=whole)
    bounded = whole.replace(bounded=True)  # the default's bounded tier: not tried again
    with pytest.warns(RuntimeWarning) as said:
        store = FileExpertStore(ed, meta.top_k, config=StreamConfig(), runtime=bounded)
    try:
        assert [str(w.message)[-13:] for w in said] == ["pread instead"], said
        assert store.runtime.reader != "tier" and store.runtime.decode_path == "host"
    finally:
        store.close()

    def cut(*a, **kw):
        raise OSError("a file is cut short")

    monkeypatch.setattr(tier.SwapTier, "__init__", cut)
    with pytest.raises(OSError, match="cut short"):  # not a page-lock failure
        FileExpertStore(ed, meta.top_k, config=StreamConfig(), runtime=chosen)


@pytest.mark.parametrize("partial,direct", [(False, False), (True, False), (True, True)])
def test_a_swap_tier_filled_one_record_a_wave_holds_each_record(
    models, monkeypatch, partial, direct
):
    """The fill stages at most ``FILL_STAGING`` (one record a wave where records are
    larger): whole, or bounded and read through the page cache or with O_DIRECT (where
    the filesystem takes it), every pool slot and tier row then holds its record."""
    from mlx_streaming.core.cache import readers

    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    if readers.engine_lib.library() is None:
        pytest.skip("the native reader is not built (its wave is what is tested)")
    if direct and readers.engine_lib.direct_refused([meta.file(li) for li in meta.layers]):
        pytest.skip("this filesystem refuses O_DIRECT")
    from mlx_streaming.core.io import native

    monkeypatch.setattr(readers, "FILL_STAGING", 1)
    wave = readers.engine_lib.staging(meta)[0]
    assert readers.fill_wave(meta) == 1 < wave
    waves = []  # each native reader's wave, as made

    class Counted(native.NativeReader):
        def __init__(self, *a, **kw):
            waves.append((kw["wave"], kw["sequential"]))
            super().__init__(*a, **kw)

    monkeypatch.setattr(native, "NativeReader", Counted)
    rest = sum((lay.num_experts - meta.top_k) * lay.stride for lay in meta.layers.values())
    store = FileExpertStore(ed, meta.top_k, swap_tier=True, direct_io=direct,
                            swap_tier_gb=rest / 2e9 if partial else None)  # fmt: skip
    try:  # the pools' fill, the rows' fill, then (bounded) the reader of the rest
        assert waves == [(1, True), (1, True)] + [(wave, False)] * partial
        assert store.reader.tier.partial == partial and store.runtime.direct_io == direct
        assert store.runtime.files_reader == "native"
        assert_each_record_once(store, meta)
    finally:
        store.close()


def test_a_store_with_a_swap_tier_ticks_after_each_layer(models):
    """``FileExpertStore(tick=)`` (a pipeline's ``Pace.tick``): once after each layer's
    pool fill, once after its tier rows' and once after its adoption; none where the
    store reads the files."""
    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    for cfg, want in ((StreamConfig(swap_tier=True), 3), (StreamConfig(), 0)):
        ticks = []
        tick = functools.partial(ticks.append, 1)
        store = FileExpertStore(ed, meta.top_k, config=cfg, tick=tick)
        store.close()
        assert len(ticks) == want * len(meta.moe_layers), cfg


def test_the_memory_plan_and_the_expert_line_count_the_swap_tier(models):
    """The swap tier's host memory is in the memory plan's total and in ``generate``'s
    expert line, whose bytes say they include the trades, and the store counts the files'
    bytes apart (``bench``'s storage bound counts those; before: the trades too)."""
    import mlx_streaming
    from mlx_streaming.commands.generate import expert_line

    ck, ed = models.experts("tiny-qwen3_moe")
    meta, slots = load_meta(ed), 4
    rest = sum((meta.layers[li].num_experts - slots) * meta.layers[li].stride
               for li in meta.moe_layers)  # fmt: skip
    for tier in (True, False):
        cfg = mlx_streaming.StreamConfig(swap_tier=tier)
        model, _, store = mlx_streaming.load(ck, ed, slots=slots, config=cfg)
        plan = mlx_streaming.memory_plan(model, store)
        assert plan.swap_tier_bytes == (rest if tier else 0)
        assert plan.total_bytes == (
            plan.trunk_bytes + plan.pool_bytes + plan.cache_limit_bytes + plan.swap_tier_bytes
        )
        assert ("swap_tier_gb" in plan.to_json()) == tier
        greedy_trace(model, reference(ck)[0][1], 4)
        t = store.totals()  # a whole tier reads nothing from the files after load
        assert t["bytes_read"] > 0 and t["file_bytes_read"] == (0 if tier else t["bytes_read"])
        line = expert_line(store)
        assert ("read or traded" in line and f"swap tier {rest / 1e9:.3f} GB" in line) == tier
        store.close()


def _interrupt_after_trades(monkeypatch, model, ck, nth: int) -> None:
    """A prompt whose ``nth`` tier load is interrupted once its trades have moved, before
    its reads start."""
    from mlx_streaming.core.io.tier import SwapTier

    rest, calls = SwapTier.read_rest, []

    def interrupted(self, *a, **kw):
        calls.append(1)
        if len(calls) == nth:
            raise KeyboardInterrupt
        return rest(self, *a, **kw)

    monkeypatch.setattr(SwapTier, "read_rest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        assert_exact(model, ck)
    monkeypatch.setattr(SwapTier, "read_rest", rest)


def test_a_read_still_held_lands_before_the_tier_s_next_trades(models):
    """A read whose caller lost it (an interrupt before its load was waited for): the
    tier's next ``take`` finishes it first, so the next trades never move bytes from a
    slot the held read has yet to fill."""
    ck, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    slots = meta.top_k + 1
    cfg = StreamConfig(swap_tier=True, swap_tier_gb=_rest_gb(meta, slots) / 3, threads=2)
    model, store = patched(ck, ed, config=cfg, capacity=slots)
    assert_exact(model, ck)  # the pools full: every slot has a victim
    tier, files = store.reader.tier, store.reader.files

    def outside(li):  # a slot, its expert, and an expert in neither pool nor tier
        cache = store.caches[li]
        e = next(
            e for e in range(meta.num_experts) if cache.slot_of[e] < 0 and tier.home[li][e] < 0
        )
        return 0, int(cache.expert_in[0]), e

    def holds(li, s, e):
        raw = np.fromfile(meta.file(li), np.uint8)[e * meta.layers[li].stride :]
        pool = store.pool(li)
        return all(
            np.array_equal(np.array(pool.arrays[p.name][s]).reshape(-1).view(np.uint8),
                           raw[p.offset : p.offset + p.nbytes])
            for p in meta.layers[li].parts
        )  # fmt: skip

    la, lb = store.layers[:2]
    sa, va, ea = outside(la)
    sb, _, eb = outside(lb)
    assert holds(la, sa, va)
    held = tier.take(la, [ea], [sa], tier.trade_on_host, files)  # its caller never waits

    def move_now(layer, trades):
        assert holds(la, sa, ea), "the held read had not landed"
        tier.trade_on_host(layer, trades)

    later = tier.take(lb, [eb], [sb], move_now, files)
    rb = meta.layers[la].record_bytes
    assert held.result() == rb and later.result() == rb  # a read each (victims out: free)
    assert holds(la, sa, ea) and holds(lb, sb, eb) and tier.home[la][va] >= 0
    store.close()


def test_a_trade_cut_short_is_refused_after_and_a_failed_start_heals(models, monkeypatch):
    """A trade interrupted part way (bytes moved, tables not) leaves the tier refusing
    every later load with a clear error, rather than serving wrong bytes (before: the
    next prompts gave other tokens than stock's, silently). A start that fails before
    moving anything puts its victims back in their slots; the next loads stay exact."""
    from mlx_streaming.core.io.tier import SwapTier, TierError

    ck, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    cfg = StreamConfig(swap_tier=True)
    model, store = patched(ck, ed, config=cfg, capacity=meta.top_k + 1)
    trade, calls = SwapTier.trade_on_host, []

    def cut(self, layer, trades):  # the 5th trade: half the bytes, then an interrupt
        calls.append(layer)
        if len(calls) == 5:
            h, _ = trades[0]
            self.slabs[layer][h, :8] = 0
            raise KeyboardInterrupt
        trade(self, layer, trades)

    monkeypatch.setattr(SwapTier, "trade_on_host", cut)
    with pytest.raises(KeyboardInterrupt):
        assert_exact(model, ck)
    with pytest.raises(TierError, match="lost track of its records .*KeyboardInterrupt"):
        assert_exact(model, ck)
    store.close()
    monkeypatch.setattr(SwapTier, "trade_on_host", trade)

    model, store = patched(ck, ed, config=cfg, capacity=meta.top_k + 1)
    plan, calls = SwapTier.plan, []

    def fail_once(self, layer, experts, slots):
        calls.append(layer)
        if len(calls) == 3:
            raise OSError("injected before anything moved")
        return plan(self, layer, experts, slots)

    monkeypatch.setattr(SwapTier, "plan", fail_once)
    with pytest.raises(OSError, match="injected"):
        assert_exact(model, ck)
    assert all((store.caches[li].expert_in >= 0).all() for li in store.layers)  # restored
    assert_exact(model, ck)
    assert_each_record_once(store, meta)
    monkeypatch.setattr(SwapTier, "plan", plan)
    _interrupt_after_trades(monkeypatch, model, ck, 3)
    # the moved records keep their slots (before: freed, and a later miss given one of
    # them found its record in no slot: "a defect", the model to load again)
    assert all((store.caches[li].expert_in >= 0).all() for li in store.layers)
    assert_exact(model, ck)
    assert_each_record_once(store, meta)
    store.close()


def test_a_bounded_tier_survives_a_failed_read_and_an_interrupt(models, monkeypatch):
    """A bounded swap tier's file read that fails after writing garbage into its slots,
    then an interrupt after the trades and before the reads: the loads fail, and the next
    ones are exact, every record where the tables say (a read's slot is known to hold its
    record only once the read has landed)."""
    import ctypes

    from mlx_streaming.core.io.futures import Done

    ck, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    slots = meta.top_k + 1
    cfg = StreamConfig(swap_tier=True, swap_tier_gb=_rest_gb(meta, slots) / 3)
    model, store = patched(ck, ed, config=cfg, capacity=slots)
    files, start = store.reader.files, store.reader.files.start
    calls = []

    def garbage(layer, experts, slots_):  # the 3rd read: garbage, an error
        calls.append(layer)
        if len(calls) != 3:
            return start(layer, experts, slots_)
        pool = store.pool(layer)
        for s in slots_:
            for p, (addr, row) in zip(pool.layout.parts, pool.row_pointers()):
                ctypes.memset(addr + s * row, 7, p.nbytes)
        return Done(error=OSError("injected read error"))

    monkeypatch.setattr(files, "start", garbage)
    with pytest.raises(OSError, match="injected read error"):
        assert_exact(model, ck)
    monkeypatch.setattr(files, "start", start)
    _interrupt_after_trades(monkeypatch, model, ck, 2)
    assert_exact(model, ck)
    assert_each_record_once(store, meta)
    store.close()
