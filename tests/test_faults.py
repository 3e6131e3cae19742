"""Faults: interrupted or failing splits, corrupt or failing reads mid-generation, hostile
metas, bad configs. Each ends in a clear error and a consistent state; nothing half-done
is ever taken for complete."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm import load
from test_exactness import patched

from mlx_streaming import FileExpertStore, split_model
from mlx_streaming.analysis.verify import compare_traces, greedy_trace
from mlx_streaming.core.format import META_NAME, ExpertChecksumError, ExpertDirError
from mlx_streaming.core.meta import load_meta, meta_from_json
from mlx_streaming.synthetic import Preset, make_checkpoint

SPLIT = (
    "import sys; from mlx_streaming import split_model; "
    "split_model(sys.argv[1], sys.argv[2], progress=False)"
)


@pytest.fixture(scope="module")
def bigger(tmp_path_factory):
    """A checkpoint whose split takes a moment (for killing it midway)."""
    root = tmp_path_factory.mktemp("bigger")
    preset = Preset(
        "faults",
        {
            "model_type": "qwen3_moe",
            "hidden_size": 256,
            "num_hidden_layers": 8,
            "intermediate_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "num_experts": 64,
            "num_experts_per_tok": 4,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": 256,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "max_position_embeddings": 4096,
            "norm_topk_prob": True,
        },
        popularity=0.0,
    )
    ck = make_checkpoint(root / "model", preset)
    ref = root / "ref"
    split_model(ck, ref)
    return ck, ref


def files_of(d):
    return {f: (d / f).read_bytes() for f in sorted(os.listdir(d)) if f.endswith(".bin")}


def test_split_killed_at_random_points_resumes_identically(bigger, tmp_path):
    ck, ref = bigger
    out = tmp_path / "experts"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", SPLIT, str(ck), str(tmp_path / "timing")], check=True)
    span = time.perf_counter() - t0
    rng = random.Random(0)
    killed = 0
    for _ in range(10):
        p = subprocess.Popen([sys.executable, "-c", SPLIT, str(ck), str(out)])
        time.sleep(rng.uniform(0.0, span))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            killed += 1
        p.wait()
        if (out / META_NAME).exists():  # finished before the kill: start over
            meta = load_meta(out)  # a meta is only ever complete
            assert len(meta.layers) == 8
            shutil.rmtree(out)
        else:
            with pytest.raises(ExpertDirError):
                FileExpertStore(out, capacity=8)  # never taken for complete
    assert killed >= 5
    split_model(ck, out)
    assert files_of(out) == files_of(ref)
    assert load_meta(out).to_json()["layers"] == load_meta(ref).to_json()["layers"]


def test_full_disk_gives_clear_error_and_no_meta(bigger, tmp_path):
    ck, _ = bigger
    out = tmp_path / "experts"
    code = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (300000, 300000)); " + SPLIT
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(ck), str(out)], capture_output=True, text=True
    )
    assert r.returncode != 0
    assert "no space left writing" in r.stderr and "completed layers are kept" in r.stderr
    assert not (out / META_NAME).exists()
    assert not list(out.glob("*.partial"))  # no half-written file left behind
    split_model(ck, out)  # with room again, it completes
    assert len(load_meta(out).layers) == 8


def corrupt(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corrupt_record_mid_generation_then_recovery(models, tmp_path):
    ck, src = models.experts("tiny-qwen3_moe")
    ed = tmp_path / "experts"
    shutil.copytree(src, ed)
    meta = load_meta(ed)
    ref, tok = load(str(ck))
    ids = tok.encode("A long enough prompt to touch many experts in every layer, twice over.")
    want = greedy_trace(ref, ids, 16)
    model, store = patched(ck, ed, capacity=meta.top_k)
    layer = meta.moe_layers[-1]
    lay = meta.layers[layer]
    f = meta.file(layer)
    original = f.read_bytes()
    for e in range(lay.num_experts):  # every record of the last MoE layer goes bad
        corrupt(f, e * lay.stride + 7)
    with pytest.raises(ExpertChecksumError, match=f"layer {layer} .* split the model again"):
        greedy_trace(model, ids, 16)
    cache = store.caches[layer]
    assert (cache.slot_of < 0).all() and not cache.pending  # nothing bad resident
    f.write_bytes(original)  # the disk is good again (same inode, the store keeps its fd)
    assert compare_traces(want, greedy_trace(model, ids, 16)).exact
    store.close()


@pytest.mark.parametrize("reader", ["python", "native"])
def test_read_error_mid_generation_then_recovery(models, reader):
    ck, ed = models.experts("tiny-mixtral")
    meta = load_meta(ed)
    ref, tok = load(str(ck))
    ids = tok.encode("Reads fail sometimes; the store must stay consistent.")
    want = greedy_trace(ref, ids, 12)
    model, store = patched(ck, ed, capacity=meta.top_k, reader=reader)
    # the fault is injected where each reader meets the file: a piece, or the engine's
    # one call (a read started, or read at once)
    owner, name = (
        (store.reader.files, "_read_piece") if reader == "python" else (store.reader, "_begin")
    )
    real = getattr(owner, name)
    fails = {"n": 0}

    def flaky(*a, **kw):
        if fails["n"] < 3:
            fails["n"] += 1
            raise OSError(5, "Input/output error (injected)")
        return real(*a, **kw)

    setattr(owner, name, flaky)
    with pytest.raises(OSError, match="injected"):
        greedy_trace(model, ids, 12)
    for cache in store.caches.values():
        assert not cache.pending and cache.resident == int((cache.slot_of >= 0).sum())
    while fails["n"] < 3:  # let the injected faults run out
        fails["n"] += 1
    assert compare_traces(want, greedy_trace(model, ids, 12)).exact
    store.close()


def test_symlink_out_of_the_directory_is_refused(models, tmp_path):
    _, src = models.experts("tiny-mixtral")
    ed = tmp_path / "experts"
    shutil.copytree(src, ed)
    meta = load_meta(ed)
    victim = meta.file(meta.moe_layers[0])
    outside = tmp_path / "outside.bin"
    shutil.copy(victim, outside)
    victim.unlink()
    victim.symlink_to(outside)
    with pytest.raises(ExpertDirError, match="symlink leading out"):
        load_meta(ed)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_meta_loader_fuzz(models, data, tmp_path_factory):
    """Mutated metas are refused with ExpertDirError (or accepted if still valid), never
    any other exception."""
    _, ed = models.experts("tiny-olmoe")
    base = json.loads((ed / META_NAME).read_text())
    d = json.loads(json.dumps(base))
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-5, 10**9),
        st.floats(),
        st.text(max_size=8),
        st.lists(st.integers(-3, 3), max_size=3),
    )
    for _ in range(data.draw(st.integers(1, 4))):
        node = d
        path = []
        while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
            key = data.draw(
                st.sampled_from(sorted(node) if isinstance(node, dict) else list(range(len(node))))
            )
            path.append(key)
            parent, node = node, node[key]
        if path:
            if data.draw(st.booleans()) and isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent[path[-1]] = data.draw(scalars)
        else:
            d = data.draw(scalars)
    try:
        meta_from_json(d, ed)
    except ExpertDirError:
        pass


def test_bad_configs_and_missing_tokenizer(models, tmp_path):
    ck = models.checkpoint("tiny-mixtral")
    bad = tmp_path / "bad"
    shutil.copytree(ck, bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError):
        split_model(bad, tmp_path / "e1")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["model_type"] = "no_such_arch"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no_such_arch"):
        split_model(bad, tmp_path / "e2")
    notok = tmp_path / "notok"
    shutil.copytree(ck, notok)
    for f in notok.glob("tokenizer*"):
        f.unlink()
    import mlx_streaming

    with pytest.raises(Exception, match="(?i)tokenizer"):
        mlx_streaming.load(notok, tmp_path / "e3", slots=4)


def test_no_pickle_on_any_load_path():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for dirpath, _, names in os.walk(os.path.join(root, "mlx_streaming")):
        for n in names:
            if n.endswith(".py"):
                src = open(os.path.join(dirpath, n)).read()
                assert "import pickle" not in src and "torch.load" not in src, n
                for line in src.splitlines():
                    if "np.load(" in line:
                        assert "allow_pickle=False" in line, (n, line)
    assert np.__version__


def _store_call(store, layer, ids):
    call = store.request(layer, mx.array([ids], mx.int32), overlap=False)
    store.finish(call, mx.zeros((1,)))


@pytest.mark.parametrize("threads", [0, 2])
def test_an_interrupt_during_a_read_leaves_reader_and_store_usable(models, threads):
    """Ctrl-C (a BaseException) once the engine has started a read: the engine's read is
    finished before the interrupt leaves the reader, the reservation is undone, and every
    later call works (``chat`` catches Ctrl-C and goes on). Before: the reader refused
    every later read, and the slots stayed reserved."""
    from mlx_streaming.core.io import native

    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    store = FileExpertStore(ed, capacity=meta.top_k + 2, threads=threads, reader="native")
    layer, *others = meta.moe_layers
    real = native.Started.__init__

    def interrupted(self, *a):  # the engine has started the read; Python is interrupted
        native.Started.__init__ = real
        raise KeyboardInterrupt

    native.Started.__init__ = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            _store_call(store, layer, [0, 1, 2, 3])
    finally:
        native.Started.__init__ = real
    assert not store.caches[layer].pending
    for li in [*others, layer]:
        _store_call(store, li, [4, 5, 6, 7])
        assert all(store.caches[li].slot_of[e] >= 0 for e in (4, 5, 6, 7))
    store.close()


def test_pin_after_another_layers_read_ahead(models):
    """A read-ahead of one layer is still on the reader when another layer is pinned:
    the pin waits for it instead of being refused and orphaning it (which failed every
    later load of the other layers)."""
    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    store = FileExpertStore(ed, capacity=8, threads=2, overlap=False, reader="native")
    a, b = meta.moe_layers[:2]
    store.prefetch(a, list(range(8)))
    store.pin(b, [3])
    for _ in range(3):
        _store_call(store, b, [9, 10, 11, 12])
    _store_call(store, a, [0, 1, 2, 3])
    assert store.caches[a].stats.misses == 0  # the read-ahead landed and was kept
    store.close()


def test_a_failed_read_fails_its_call_though_another_load_finished_it(models, tmp_path):
    """A call's read fails, and a read-ahead of another layer, issued before the call
    finishes, finishes that read first: the call still raises (before: it computed on
    a slot that had been freed)."""
    _, src = models.experts("tiny-qwen3_moe")
    ed = tmp_path / "experts"
    shutil.copytree(src, ed)
    meta = load_meta(ed)
    a, b = meta.moe_layers[:2]
    lay = meta.layers[a]
    corrupt(meta.file(a), 9 * lay.stride + 7)
    # read-ahead on: the call is planned, and its reads started, at request
    store = FileExpertStore(ed, capacity=8, threads=2, reader="native", prefetch=True)
    call = store.request(a, mx.array([[9, 10, 11, 12]], mx.int32), overlap=False)
    assert call.steps  # planned early, not late
    store.prefetch(b, [0, 1])
    with pytest.raises(ExpertChecksumError, match=f"expert 9 of layer {a}"):
        for i in range(len(call.steps)):
            store.step(call, i)
        store.finish(call, mx.zeros((1,)))
    assert store.caches[a].slot_of[9] < 0 and not store.caches[a].pending
    store.close()


def test_writers_of_one_json_file_do_not_collide(tmp_path):
    """Processes writing one JSON file at once (a pipeline's ranks on one host write the
    kernel check's file) each go through a temporary file of their own: every write
    lands whole and none fails (before: one shared ``.tmp`` name, renamed away under the
    other writer), and no temporary file is left."""
    import threading

    from mlx_streaming.core.format import write_json_atomic

    path, errors = tmp_path / "known.json", []

    def write(w):
        try:
            for i in range(200):
                write_json_atomic(path, {"writer": w, "i": i, "pad": "x" * 4096})
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert json.loads(path.read_text())["i"] == 199
    assert [p.name for p in tmp_path.iterdir()] == ["known.json"]


def test_a_failed_read_ahead_is_counted_and_warned_once_then_read_on_demand(models, tmp_path):
    """A read-ahead of a corrupt record fails: the store counts it (``prefetch_failed``),
    warns once naming the layer and the error, and the later demand read of the same
    expert raises the checksum error for the call that needs it."""
    import warnings

    _, src = models.experts("tiny-qwen3_moe")
    ed = tmp_path / "experts"
    shutil.copytree(src, ed)
    meta = load_meta(ed)
    a = meta.moe_layers[0]
    corrupt(meta.file(a), 9 * meta.layers[a].stride + 7)
    store = FileExpertStore(ed, capacity=8, threads=2, reader="native")
    try:
        assert store.prefetch(a, [9, 10]) == 2
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            store.loads.finish_read_aheads(a, np.array([9, 10]))
            assert store.prefetch(a, [9]) == 1  # again: counted, not warned again
            store.loads.finish_read_aheads(a)
        said = [str(w.message) for w in seen if "read-ahead" in str(w.message)]
        assert len(said) == 1 and f"layer {a}" in said[0] and "expert 9" in said[0], said
        st = store.stats[a]
        assert (st.prefetched, st.prefetch_failed, st.prefetch_used) == (3, 3, 0)
        assert store.caches[a].slot_of[9] < 0 and not store.caches[a].pending
        with pytest.raises(ExpertChecksumError, match=f"expert 9 of layer {a}"):
            store.loads.fetch(a, np.array([9, 11], np.int64))
    finally:
        store.close()
