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
from mlx_streaming.core.io import ring as ring_module
from mlx_streaming.core.meta import load_meta

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(backend() != "cuda", reason="needs MLX's CUDA backend"),
    # a case stuck in native code (a kernel, a copy) cannot take a signal: the thread
    # method dumps every stack and ends the run, inside the bound; the bound is the
    # case's own (func_only), the kernels having been compiled by the fixture below
    pytest.mark.timeout(240, method="thread", func_only=True),
    pytest.mark.usefixtures("kernels_compiled"),
]

TEXT = "A mixture of experts routes each token to a few experts out of many. " * 3
PRESETS = ["tiny-mixtral", "thresholds-qwen3_moe", "tiny-qwen3_next"]
WARMUP_S = 1200  # compiling every kernel on an empty cache (about 7 minutes on an H200)


@pytest.fixture(scope="session")
def kernels_compiled(models, tmp_path_factory):
    """Compile the suite's kernels once, in a process of their own bounded by
    ``WARMUP_S``, so that no case pays for compiling (or runs near its bound) on a
    machine with an empty kernel cache."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if backend() != "cuda":
        return
    jobs = [[p, *map(str, models.experts(p, dtype="bfloat16"))] for p in PRESETS]
    jobs.append(["tiny-qwen3_moe", *map(str, models.experts("tiny-qwen3_moe", dtype="bfloat16"))])
    from mlx_streaming.synthetic.train import trained_checkpoint  # the server's case

    trained = trained_checkpoint()
    if trained is not None:
        jobs.append(["trained", str(trained), str(tmp_path_factory.mktemp("trained-ed"))])
    only = os.environ.get("MLXS_WARMUP_ONLY")  # gpu_suite.sh warmup1: a first part alone
    if only:
        jobs = [j for j in jobs if j[0] in only.split(",")]
    stamp = _warmup_stamp([j[0] for j in jobs])
    if stamp is not None and stamp.exists():
        print(f"kernels compiled by this tree's warm-up on this machine ({stamp.name})")
        return
    kernel_file = tmp_path_factory.mktemp("kernels") / "k.json"
    script = Path(__file__).with_name("cuda_warmup.py")
    r = subprocess.run([sys.executable, str(script), json.dumps(jobs), TEXT, str(kernel_file)],
                       capture_output=True, text=True, timeout=WARMUP_S)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)
    if stamp is not None:
        stamp.touch()


def _warmup_stamp(presets):
    """Where a finished warm-up leaves its mark, so that a later pytest process on the
    same machine skips it (it replays every path of every preset: 120-176 s even on a
    warm cache, 2026-12-07g): in ``MLX_PTX_CACHE_DIR``, named by the presets, MLX's
    version and every source file of the package (Python and C), this suite (its prompt,
    its models' dtype) and the warm-up. None where that cache is not set (the warm-up
    then runs every time). ``gpu_suite.sh`` leaves the marks out of the cache it carries
    on: the next machine's driver has compiled nothing."""
    import hashlib
    import os
    from pathlib import Path

    cache = os.environ.get("MLX_PTX_CACHE_DIR")
    if not cache or not Path(cache).is_dir():
        return None
    h = hashlib.sha256(f"{mx.__version__} {sorted(presets)}".encode())
    root = Path(mlx_streaming.__file__).parent
    sources = [f for f in root.rglob("*") if f.suffix in (".py", ".c", ".h")]
    for f in sorted(sources) + [Path(__file__), Path(__file__).with_name("cuda_warmup.py")]:
        h.update(f.read_bytes())
    return Path(cache) / f"mlxs-warmup-{h.hexdigest()[:16]}.ok"


def test_kernels_compiled():
    """The session fixture compiled the suite's kernels (``gpu_suite.sh warmup`` runs
    this case alone, so that a fresh machine compiles in a call of its own)."""
    assert backend() == "cuda"


# cheapest first; Qwen3-Next's gated delta runs as ops on CUDA (slow to compile)
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("mode", ["device", "host", "pread"])
def test_streamed_equals_stock_on_cuda(models, tmp_path, preset, mode):
    """Greedy tokens and logits equal stock's, prompts in chunks of 8 and 64, at top-k,
    half and all slots. ``device`` (the default): the files mapped, decode steps on the
    device path, prompt chunks on the host path, both filled by the GPU from the
    mappings, the slot table handed between them; ``host``: every call on the host path,
    filled by the GPU; ``pread``: the files not mapped, records read by the native
    engine and copied in."""
    ck, ed = models.experts(preset, dtype="bfloat16")
    ref, tok = load(str(ck))
    ids = tok.encode(TEXT)
    want = {c: greedy_trace(ref, ids, 12, c) for c in (8, 64)}
    for c, trace in want.items():  # NaN logits would make any comparison meaningless
        assert np.isfinite(trace.logits).all(), f"stock mlx-lm gives NaN logits (chunk {c})"
    meta = load_meta(ed)
    for slots in (meta.top_k, meta.num_experts // 2, meta.num_experts):
        model, _, store = mlx_streaming.load(
            ck,
            ed,
            slots=slots,
            config=mlx_streaming.StreamConfig(
                kernel_check=True,
                kernel_check_file=tmp_path / "k.json",
                map_files=False if mode == "pread" else None,
                device_reads=False if mode == "host" else None,
            ),
        )
        rt = store.runtime
        assert rt.pool_mode == "cuda" and rt.mapped == (mode != "pread")
        assert rt.reader == ("native" if mode == "pread" else "device")
        assert rt.decode_path == ("device" if mode == "device" else "host")
        assert (store.device is not None) == (mode == "device")
        assert store.host.transfers is not None and not rt.reason("ids")  # their check passed
        for chunk, ref_trace in want.items():
            cmp = compare_traces(ref_trace, greedy_trace(model, ids, 12, chunk))
            assert cmp.exact, (slots, chunk, cmp.to_json())
        t = store.totals()
        if mode == "device":  # decode steps took the device path; its counters came back
            assert t["device_calls"] > 0 and t["hits"] + t["misses"] > 0, t
            if slots < meta.num_experts:  # a full pool is resident: no device-path call
                assert t["device_path_calls"] > 0 and t["device_s"] > 0, t  # its own host time
                assert 0 < t["device_kernel_s"] < t["device_s"], t  # MLX's part of it
        if slots < meta.num_experts:
            assert t["misses"] > 0 and t["bytes_read"] > 0, t
        store.close()


@pytest.mark.parametrize("size", ["whole", "bounded", "auto", "default", "host"])
def test_a_swap_tier_streams_exactly_on_cuda(models, size, monkeypatch):
    """The swap tier (opt-in): the experts outside the pools in page-locked host memory,
    each miss trading places with its victim on the GPU, decode steps on the device path
    and prompt chunks on the host path, the tier's tables handed between them; bounded
    (``swap_tier_gb``, a third of the rest): decode steps on the device path, the records
    beyond the tier asked of the request ring by the plan kernel itself, a prompt's from
    the host; ``auto`` (what memory holds: whole here, as the patch must agree);
    ``default`` (no option, memory made short of a whole tier: CUDA's default bounds one
    to it, the ring's staging beside it); ``host`` (bounded, ``device_reads=False``: the
    host path asks the ring for the records outside the tier, a record a round, and
    copies each from its staging after the trades). Greedy tokens and logits
    equal stock's at top-k and half the slots; then every record is held at most once,
    where the tables say (the tier's rows and a few slots checked byte for byte against
    the files)."""
    ck, ed = models.experts(PRESETS[0], dtype="bfloat16")
    ref, tok = load(str(ck))
    ids = tok.encode(TEXT)
    want = {c: greedy_trace(ref, ids, 12, c) for c in (8, 64)}
    meta = load_meta(ed)
    for slots in (meta.top_k, meta.num_experts // 2):
        rest = sum((lay.num_experts - slots) * lay.stride for lay in meta.layers.values())
        gb = {"whole": None, "auto": "auto", "default": None}.get(size, rest / 3e9)
        reads = False if size == "host" else None
        cfg = mlx_streaming.StreamConfig(swap_tier=True, swap_tier_gb=gb, device_reads=reads)
        if size == "default":  # O_DIRECT beneath it: the default, or asked for (the
            direct = True if slots == meta.top_k else None  # patch agrees with both)
            cfg = mlx_streaming.StreamConfig(direct_io=direct)
            # a ring of top-k entries (a decode call's reads; a prompt's in rounds): 16
            # records of staging beside so tiny a model would leave room for a whole tier
            monkeypatch.setattr(ring_module, "DEVICE_ENTRIES", meta.top_k)
            _short_of_a_whole_tier(monkeypatch, ck, meta, rest)
        if size == "host":  # a record a round: a call's reads in rounds, each copied first
            monkeypatch.setattr(ring_module, "DEVICE_ENTRIES", 1)
        bounded = size in ("bounded", "default", "host")
        model, _, store = mlx_streaming.load(ck, ed, slots=slots, config=cfg)
        rt, tier = store.runtime, store.reader.tier
        said, bound = rt.reason("reader"), "do not fit in half of memory, as large as memory"
        assert size != "default" or f"{bound} holds: bounded to" in said, said
        refused = "O_DIRECT refused" in rt.line()  # (a filesystem without it: the page cache)
        assert size != "default" or rt.direct_io or (refused and direct is None), rt.line()
        path = "host" if size == "host" else "device"
        assert (rt.mapped, rt.reader, rt.decode_path) == (False, "tier", path)
        assert (store.device is None) == (path == "host") and tier.partial == bounded
        assert size != "auto" or "as large as memory holds: whole" in rt.reason("reader")
        for chunk, ref_trace in want.items():
            cmp = compare_traces(ref_trace, greedy_trace(model, ids, 12, chunk))
            assert cmp.exact, (slots, chunk, cmp.to_json())
        t = store.totals()
        assert t["misses"] > 0 and (path == "host" or t["device_path_calls"] > 0), t
        if bounded:  # records came from the files through the ring, every one answered
            asked = store.reader.ring.counters()
            assert asked["requests"] > 0 and asked["failed"] == 0, asked
            assert asked["busy_ns"] > 0 and t["read_gbps"] > 0, (asked, t)  # measured
            files = store.reader.files  # the ring reads on its own threads, into its staging
            assert files.read_totals()[0] == 0 and files.threads == 0  # start: never called
        for li in store.layers:
            if store.device is not None:
                store.device.to_host(li)
            lay, cache, pool = meta.layers[li], store.caches[li], store.pool(li)
            assert np.array_equal(tier.held[li], cache.expert_in), li
            inside = np.flatnonzero(tier.home[li] >= 0)
            assert set(inside) <= set(np.flatnonzero(cache.slot_of < 0)), li
            raw = np.fromfile(meta.file(li), np.uint8)
            for e in inside.tolist():
                got = tier.slabs[li][tier.home[li][e], : lay.record_bytes]
                for p in lay.parts:
                    at = slice(p.offset, p.offset + p.nbytes)
                    assert np.array_equal(got[at], raw[e * lay.stride :][at]), (li, e)
            for s, e in list(enumerate(cache.expert_in.tolist()))[:3]:
                for p in lay.parts:
                    row = np.array(pool.arrays[p.name][s].view(mx.uint8) * 1).reshape(-1)
                    at = e * lay.stride + p.offset
                    assert np.array_equal(row, raw[at : at + p.nbytes]), (li, s, p.name)
        store.close()


def test_a_mapping_that_cannot_be_page_locked_falls_back_to_pread(models, monkeypatch):
    """Where the default maps the files and a mapping cannot be page-locked, the store
    warns, reads with the native engine on the host path, and says why in its runtime;
    asked for explicitly, the error stands."""
    from mlx_streaming import FileExpertStore
    from mlx_streaming.core.io.filemap import FileMaps

    def refuse(self, li):
        raise OSError(f"{self.meta.file(li)}: could not page-lock its mapping (injected)")

    _, ed = models.experts("tiny-qwen3_moe", dtype="bfloat16")
    monkeypatch.setattr(FileMaps, "_map", refuse)
    with pytest.warns(RuntimeWarning, match="injected.*reads with pread instead"):
        store = FileExpertStore(ed)
    rt = store.runtime
    assert (rt.mapped, rt.reader, rt.decode_path) == (False, "native", "host")
    assert "page-locked" in rt.reason("decode_path")
    store.close()
    with pytest.raises(OSError, match="injected"):
        FileExpertStore(ed, map_files=True)


def test_a_ring_that_cannot_start_leaves_the_page_cache(models, monkeypatch):
    """Where CUDA's default bounded tier's request ring cannot start, the store warns and
    reads through the page cache alone, saying why, and streams exactly; a tier asked
    for raises the error, naming the ring."""
    from mlx_streaming import FileExpertStore, patch_model_filebacked
    from mlx_streaming.core.io.ring import RequestRing, RingError

    def refuse(self, *a, **kw):
        raise OSError("injected: no ring")

    ck, ed = models.experts("tiny-qwen3_moe", dtype="bfloat16")
    meta = load_meta(ed)
    rest = sum((lay.num_experts - meta.top_k) * lay.stride for lay in meta.layers.values())
    asked = mlx_streaming.StreamConfig(swap_tier=True, swap_tier_gb=rest / 3e9)
    monkeypatch.setattr(RequestRing, "__init__", refuse)
    with pytest.raises(RingError, match="request ring could not start: injected: no ring"):
        FileExpertStore(ed, meta.top_k, config=asked)
    _short_of_a_whole_tier(monkeypatch, ck, meta, rest)
    with pytest.warns(RuntimeWarning, match="injected: no ring.*reads with pread instead"):
        store = FileExpertStore(ed, meta.top_k)
    try:
        rt = store.runtime
        assert (rt.reader, rt.decode_path, store.device) == ("native", "host", None)
        assert "request ring could not start" in rt.reason("reader"), rt.line()
        model, _ = load(str(ck))
        patch_model_filebacked(model, store)
        stock, _ = load(str(ck))
        ids = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
        assert mx.array_equal(model(ids), stock(ids))
    finally:
        store.close()


def _short_of_a_whole_tier(monkeypatch, ck, meta, rest: int) -> None:
    """Memory made short of a whole swap tier for ``ck``: a third of ``rest`` (the bytes
    the pools do not hold) beside a small margin, the trunk's load and the request
    ring's staging (the files, then, not in half of it)."""
    from mlx_streaming.core import mem
    from mlx_streaming.core.io import engine_lib
    from mlx_streaming.core.io import tier as swap
    from mlx_streaming.model_builder import trunk_host_bytes

    lazy, _ = load(str(ck), lazy=True)
    ring_staging = ring_module.DEVICE_ENTRIES * max(lay.stride for lay in meta.layers.values())
    held = 4096 + trunk_host_bytes(lazy) + rest // 3 + ring_staging
    assert held - trunk_host_bytes(lazy) < rest, "the ring's staging leaves room for all"
    monkeypatch.setattr(swap, "MARGIN", 4096)  # and no reader's staging
    wave = engine_lib.staging(meta)[0]
    monkeypatch.setattr(engine_lib, "staging", lambda meta, wave=wave: (wave, 0))
    monkeypatch.setattr(mem, "machine_memory", lambda held=held: (1 << 40, held))


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


@pytest.mark.parametrize("policy", ["lru", "predictive"])
def test_device_path_plans_as_the_reference_and_the_simulator(models, policy):
    """The device path's planning kernel equals its numpy reference call by call (the
    slot of every row, the misses and the slots they went to) and, over the run, the
    host's simulator with the same policy: hits, misses, evictions, the slot table and
    every array of the ranking's state. A stretch with recording on runs on the host path:
    the table and the ranking go to the host and back without losing a thing. The slots
    it filled hold the records' bytes."""
    from mlx_streaming import FileExpertStore
    from mlx_streaming.core.cache.device_plan import (
        layer_arrays,
        plan_reference,
        table_to_arrays,
    )
    from mlx_streaming.core.cache.policy import make_policy
    from mlx_streaming.core.cache.scored import WEIGHTS
    from mlx_streaming.core.cache.slots import SlotCache

    _, ed = models.experts("tiny-qwen3_moe", dtype="bfloat16")
    meta = load_meta(ed)
    E, k, cap = meta.num_experts, meta.top_k, meta.num_experts // 2
    store = FileExpertStore(ed, capacity=cap, map_files=True, device_reads=True, policy=policy)
    assert store.device is not None
    rng = np.random.default_rng(0)
    hot = rng.permutation(E)  # a skewed, drifting choice of k distinct experts per step
    sims = {li: SlotCache(E, cap, make_policy(policy, E)) for li in store.layers}
    refs: dict = {}  # the reference's arrays, handed over as the device's are
    for step in range(200):
        store.record = 80 <= step < 120  # recording reads the routing: the host path
        for li in store.layers:
            w = 1.0 / (1 + np.arange(E)) ** 1.2
            order = np.roll(hot, step // 25 + li)
            ids = rng.choice(order, size=k, replace=False, p=w / w.sum()).astype(np.uint32)
            on_device = li in store.device.on_device
            call = store.request(li, mx.array(ids[None]), overlap=False)
            assert (call.slots is None) == store.record
            if call.slots is None:
                refs.pop(li, None)
                slots = [store.step(call, i)[1] for i in range(len(call.steps))][-1]
                mx.eval(store.finish(call, store.ids(slots)))
            else:
                if not on_device or li not in refs:  # handed over just now
                    refs[li] = layer_arrays(E, cap)
                    table_to_arrays(refs[li], sims[li])
                want, _ = plan_reference(refs[li], WEIGHTS[policy], ids[None])
                mx.eval(call.slots)  # nothing here chains the calls: run each in turn
                assert np.array_equal(np.array(call.slots), want), (step, li)
                assert call.slots.dtype == mx.uint32  # the matmuls' index type: no cast
                store.finish(call, call.slots)
            sims[li].lookup(np.unique(ids))
    report = store.layer_report()  # the counters come back; the tables stay on the device
    for li in store.layers:
        store.device.to_host(li)  # now the tables too
        want = sims[li].stats
        got = report[li]
        assert (got["hits"], got["misses"], got["evictions"]) == (
            want.hits,
            want.misses,
            want.evictions,
        ), li
        cache = store.caches[li]
        sims[li].flush()
        assert np.array_equal(cache.slot_of, sims[li].slot_of), li
        for name, a in sims[li].policy.state.items():
            assert np.array_equal(cache.policy.state[name], a), (li, name)
    li = store.layers[0]  # a filled slot holds its record's bytes
    lay, pool, cache = meta.layers[li], store.pool(li), store.caches[li]
    raw = np.fromfile(meta.file(li), np.uint8)
    for e in np.flatnonzero(cache.slot_of >= 0)[:4].tolist():
        s = int(cache.slot_of[e])
        for p in lay.parts:
            got = np.array(pool.arrays[p.name][s].view(mx.uint8) * 1).reshape(-1)
            want = raw[e * lay.stride + p.offset : e * lay.stride + p.offset + p.nbytes]
            assert np.array_equal(got, want), (e, p.name)
    store.close()


def _device_copy(a: np.ndarray) -> tuple[mx.array, int]:
    """A fresh device buffer holding ``a``'s bytes, and its address."""
    from mlx_streaming.core.cache.pool import device_address
    from mlx_streaming.core.io import cuda

    mx.clear_cache()  # fresh device memory, not a recycled managed buffer
    buf = mx.zeros((a.nbytes,), mx.uint8)
    mx.eval(buf)
    addr = device_address(buf)
    cuda.copy_now(addr, np.ascontiguousarray(a).ctypes.data, a.nbytes)
    return buf, addr


def _host_copy(addr: int, like: np.ndarray) -> np.ndarray:
    from mlx_streaming.core.io import cuda

    out = np.empty_like(like)
    cuda.copy_now(out.ctypes.data, addr, out.nbytes, cuda.D2H)
    return out


def _device_state(state: dict) -> tuple[mx.array, int, dict, mx.array]:
    """``state`` (a layer's arrays, the constants, the scratch) packed as ``DevicePath``
    packs them, in a fresh device buffer: the buffer, its address, each array's offset,
    and the plan kernel's pointers."""
    from mlx_streaming.core.cache.device_path import _offsets
    from mlx_streaming.core.cache.device_plan import POINTERS

    off, end = _offsets(state)
    image = np.zeros(end, np.uint8)
    for name, a in state.items():
        image[off[name] : off[name] + a.nbytes] = a.reshape(-1).view(np.uint8)
    buf, base = _device_copy(image)
    return buf, base, off, mx.array(np.array([base + off[n] for n in POINTERS], np.uint64))


@pytest.mark.parametrize("policy", ["lru", "predictive"])
def test_the_swap_kernels_trade_records_as_the_reference(policy):
    """The plan and fill kernels' ``SWAP`` variants (a swap tier: each miss trades places
    with its victim; `--swap-tier` runs them) on device buffers, a pool full from
    load and a tier of the other records: call by call the plan kernel gives the
    reference's slots, and the pool, the tier and the homes equal the reference's
    (``plan_reference(swap=True)``, ``fill_reference``). Then the fill kernel's variant
    trades the pairs its list names."""
    from mlx_streaming.core.cache.device_plan import (
        constants,
        layer_arrays,
        plan_reference,
        scratch_arrays,
    )
    from mlx_streaming.core.cache.plan_kernel import BLOCKS, THREADS, plan_constants, plan_kernel
    from mlx_streaming.core.cache.scored import WEIGHTS
    from mlx_streaming.core.io import cuda
    from mlx_streaming.core.io.device_reader import _FILL, FILL_NAMES, copy_kernel, fill_reference

    E, k, cap, stride = 64, 6, 24, 1024
    rng = np.random.default_rng(5)
    records = rng.integers(0, 256, (E, stride), dtype=np.uint8)
    ref = layer_arrays(E, cap)
    ref["slot_of"][:cap] = np.arange(cap)
    ref["expert_in"][:] = np.arange(cap)
    ref["resident"][:cap] = 1
    ref["home"][cap:] = np.arange(E - cap)
    pool_np, tier_np = records[:cap].copy(), records[cap:].copy()
    pool, pool_at = _device_copy(pool_np)
    flat, tier_at = cuda.shared_host(tier_np.nbytes)  # as the tier's: mapped host memory
    tier = flat.reshape(tier_np.shape)
    tier[...] = tier_np
    state = {**ref, **constants(WEIGHTS[policy]), **scratch_arrays()}
    buf, base, off, ptrs = _device_state(state)
    meta = mx.array(np.array([tier_at, stride, 1, 0, stride, pool_at, stride], np.int64))
    consts = plan_constants(E, cap, k, WEIGHTS[policy], swap=True)
    plan = plan_kernel(16)(consts)
    out = mx.zeros((1,), mx.uint32)
    hot = rng.permutation(E)
    w = 1.0 / (1 + np.arange(E)) ** 1.2
    for step in range(120):
        order = np.roll(hot, step // 20)
        ids = rng.choice(order, size=k, replace=False, p=w / w.sum()).astype(np.uint32)
        want, fills = plan_reference(ref, WEIGHTS[policy], ids[None], swap=True)
        fill_reference(fills, tier_np, pool_np, swap=True)
        (out,) = plan(
            inputs=[mx.array(ids[None]), ptrs, meta, out],
            grid=(BLOCKS * THREADS, 1, 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[(1, k)],
            output_dtypes=[mx.uint32],
        )
        mx.eval(out)
        assert np.array_equal(np.array(out), want), step
        assert np.array_equal(_host_copy(pool_at, pool_np), pool_np), step
        assert np.array_equal(tier, tier_np), step
        assert np.array_equal(_host_copy(base + off["home"], ref["home"]), ref["home"]), step
    assert ref["counters"][3] > 20  # calls with misses: the trades were exercised
    fills = np.array([2, 0, 1, 3, 5], np.int32)  # tier rows 0 and 3 with slots 1 and 5
    fill_reference(fills, tier_np, pool_np, swap=True)
    fill = copy_kernel("mlxs_fill", _FILL, 16, *FILL_NAMES)((("N", 1), ("MODE", 1)))
    (done,) = fill(
        inputs=[mx.array(fills), mx.zeros((1,), mx.uint32), meta],
        grid=(64 * 256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.uint32],
    )
    mx.eval(done)
    assert np.array_equal(_host_copy(pool_at, pool_np), pool_np)
    assert np.array_equal(tier, tier_np)
    del buf, pool, tier, flat  # the buffers outlive every kernel that wrote them


def test_health_polled_while_eight_clients_stream_on_cuda():
    """``tests/test_server.py``'s case on CUDA: 8 streaming clients, 200 requests,
    /health polled every 50 ms while the device path owns the slot tables; every output
    equals stock's."""
    from serving import health_under_load

    health_under_load(200)


def test_auto_budget_sizes_the_pools_in_the_gpu_s_memory(models, capsys):
    """``budget_gb="auto"`` on CUDA: the pools, trunk and KV cache live in the GPU's
    memory, so the budget comes from its free memory (``cudaMemGetInfo``), not the
    host's (before: a GPU smaller than the host's RAM was given pools it could not hold)."""
    from mlx_streaming.core.io import cuda
    from mlx_streaming.core.mem import machine_memory, pool_memory

    total, free, whose = pool_memory()
    assert whose == "GPU"
    assert (total, free) == pytest.approx(cuda.device_memory(), rel=0.05)
    assert (total, free) != machine_memory()
    ck, ed = models.experts("tiny-qwen3_moe", dtype="bfloat16")
    _, _, store = mlx_streaming.load(ck, ed, budget_gb="auto", context=512, progress=False)
    try:
        err = capsys.readouterr().err
        assert f"(GPU {total / 1e9:.2f} GB)" in err, err
        assert store.pool_bytes() <= free
    finally:
        store.close()
