"""The native record reader (``engine.c``): records land in the slots asked for, bad
requests are refused with an exception (never a crash), corrupt or shrunken files name
the file and the expert, and the store reads the slots its policy chose whichever
reader it uses."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_streaming.core.format import ExpertChecksumError
from mlx_streaming.core.io.native import NativeReader, library, library_path
from mlx_streaming.core.io.reader import RecordReadError
from mlx_streaming.core.meta import load_meta

needs_library = pytest.mark.skipif(
    library() is None, reason="the compiled reader is not installed (pip install the package)"
)
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "deepseek-v2-lite.npz"


class HostRows:
    """Per-part host rows [slots, part bytes], standing in for a pool."""

    def __init__(self, layout, slots):
        self.slots = slots
        self.parts = [np.zeros((slots, p.nbytes), np.uint8) for p in layout.parts]

    def row_pointers(self):
        return [(a.ctypes.data, a.shape[1]) for a in self.parts]


def reader_over(ed, slots, **kw):
    meta = load_meta(ed)
    pools = {li: HostRows(meta.layers[li], slots) for li in meta.layers}
    return meta, pools, NativeReader(meta, pools, **kw)


def copied_experts(models, tmp_path):
    """A private copy of the tiny model's expert directory (to damage), its meta and the
    first MoE layer."""
    _, src = models.experts("tiny-qwen3_moe")
    ed = tmp_path / "e"
    shutil.copytree(src, ed)
    meta = load_meta(ed)
    return ed, meta, sorted(meta.layers)[0]


def record(meta, li, e):
    lay = meta.layers[li]
    with open(meta.file(li), "rb") as f:
        f.seek(e * lay.stride)
        return np.frombuffer(f.read(lay.record_bytes), np.uint8)


def assert_slot_holds(meta, pools, li, slot, e):
    rec = record(meta, li, e)
    for p, rows in zip(meta.layers[li].parts, pools[li].parts):
        assert np.array_equal(rows[slot], rec[p.offset : p.offset + p.nbytes]), (li, slot, e)


def test_library_is_built_into_the_package():
    """Not skipped: an installed package without its compiled reader is a defect."""
    path = library_path()
    assert path is not None and path.parent.name == "io" and library() is not None


@needs_library
def test_reads_records_into_the_slots_asked(models):
    _, ed = models.experts("tiny-qwen3_moe")
    meta, pools, reader = reader_over(ed, 12, threads=3, wave=4)  # 12 records: 3 waves
    rng = np.random.default_rng(0)
    for li in meta.layers:
        experts = rng.choice(meta.num_experts, 12, replace=False)
        slots = rng.permutation(12)
        assert reader.read(li, experts, slots) == 12 * meta.layers[li].record_bytes
        for e, s in zip(experts, slots):
            assert_slot_holds(meta, pools, li, s, e)
    reader.close()
    reader.close()  # idempotent


@needs_library
def test_bad_requests_raise_and_leave_the_reader_usable(models):
    _, ed = models.experts("tiny-qwen3_moe")
    meta, pools, reader = reader_over(ed, 4, threads=2)
    li = sorted(meta.layers)[0]
    E = meta.num_experts
    for experts, slots, what in [
        ([E], [0], "expert"),
        ([-1], [0], "expert"),
        ([0], [4], "slot"),
        ([0, 1], [2, 2], "named twice"),
    ]:
        with pytest.raises(ValueError, match=what):
            reader.read(li, experts, slots)
    with pytest.raises(KeyError):
        reader.read(10**6, [0], [0])
    reader.read(li, [3], [1])
    assert_slot_holds(meta, pools, li, 1, 3)
    reader.close()


@needs_library
@settings(max_examples=60, deadline=None)
@given(
    experts=st.lists(st.integers(-3, 40), min_size=0, max_size=10),
    slots=st.lists(st.integers(-3, 10), min_size=0, max_size=10),
)
def test_fuzzed_requests_never_crash(fuzz_reader, experts, slots):
    meta, pools, reader = fuzz_reader
    li = sorted(meta.layers)[0]
    n = min(len(experts), len(slots))
    experts, slots = experts[:n], slots[:n]
    ok = (
        all(0 <= e < meta.num_experts for e in experts)
        and all(0 <= s < 8 for s in slots)
        and len(set(slots)) == n
    )
    if ok:
        reader.read(li, experts, slots)
        for e, s in zip(experts, slots):
            assert_slot_holds(meta, pools, li, s, e)
    else:
        with pytest.raises(ValueError, match="refused"):
            reader.read(li, experts, slots)


@pytest.fixture(scope="module")
def fuzz_reader(models):
    _, ed = models.experts("tiny-qwen3_moe")
    meta, pools, reader = reader_over(ed, 8, threads=2, wave=3)
    yield meta, pools, reader
    reader.close()


@needs_library
def test_corrupt_record_names_file_and_expert(models, tmp_path):
    ed, meta, li = copied_experts(models, tmp_path)
    data = np.fromfile(meta.file(li), np.uint8)
    data[5 * meta.layers[li].stride + 100] ^= 0xFF
    data.tofile(meta.file(li))
    meta, pools, reader = reader_over(ed, 4, threads=2)
    with pytest.raises(ExpertChecksumError, match=r"layer_.*checksum mismatch.*expert 5 "):
        reader.read(li, [6, 5], [0, 1])
    reader.read(li, [6, 7], [0, 1])  # the next call works
    assert_slot_holds(meta, pools, li, 1, 7)
    # each record is checked the first time it is read: 6 and 7 passed, 5 never did
    assert reader.checked[li][[5, 6, 7]].tolist() == [0, 1, 1]
    with pytest.raises(ExpertChecksumError, match=r"expert 5 "):
        reader.read(li, [5], [2])  # a failed record is checked again
    reader.close()


@needs_library
def test_short_and_shrinking_files(models, tmp_path):
    ed, meta, li = copied_experts(models, tmp_path)
    lay = meta.layers[li]
    meta, pools, reader = reader_over(ed, 4, threads=2)
    os.truncate(meta.file(li), 3 * lay.stride)  # shrinks underneath the open reader
    with pytest.raises(RecordReadError, match=r"shrank.*expert 9 .*split the model again"):
        reader.read(li, [9], [0])
    reader.read(li, [1], [0])  # records still in the file read on
    reader.close()
    with pytest.raises(OSError, match="fewer than"):  # the meta was read before the cut
        NativeReader(meta, pools)


@needs_library
@pytest.mark.skipif(not TRACE.exists(), reason=f"no trace at {TRACE}")
@pytest.mark.parametrize("policy", ["predictive", "lru", "lfu"])
def test_native_and_python_readers_miss_alike_on_real_routing(models, policy):
    """The policy picks victims whichever reader reads: same misses, layer by layer."""
    from mlx_lm import stream_generate

    import mlx_streaming
    from mlx_streaming.planning.trace import RoutingTrace, apply_trace_routing

    ck, ed = models.experts("trace-deepseek_v2")
    trace = RoutingTrace.load(TRACE)
    got = {}
    for reader in ("native", "python"):
        model, tok, store = mlx_streaming.load(
            ck, ed, slots=16, policy=policy, reader=reader, progress=False
        )
        apply_trace_routing(model, trace, 5000)
        for _ in stream_generate(model, tok, "Streams experts from disk.", max_tokens=48):
            pass
        assert store.reader_name == reader
        got[reader] = {li: (r["hits"], r["misses"]) for li, r in store.layer_report().items()}
        store.close()
    assert got["native"] == got["python"]
    assert sum(m for _, m in got["native"].values()) > 0
