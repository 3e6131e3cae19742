"""The native record reader (``engine.c``): records land in the slots asked for, bad
requests are refused with an exception (never a crash), corrupt or shrunken files name
the file and the expert, and the store reads the slots its policy chose whichever
reader it uses."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mlx_streaming.core.format import ExpertChecksumError
from mlx_streaming.core.io.engine_lib import COUNTERS, error_buffer, library, library_path
from mlx_streaming.core.io.filemap import FileMaps
from mlx_streaming.core.io.native import NativeReader
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
def test_a_library_of_other_calls_is_refused_not_called(monkeypatch):
    """A library built from sources whose calls took other arguments (its ``mlxs_abi``
    differs, or it has none) is out of date: ``library()`` refuses it and says to
    reinstall, instead of calling it with the wrong arguments."""
    from mlx_streaming.core.io import engine_lib

    monkeypatch.setattr(engine_lib, "_lib", None)
    monkeypatch.setattr(engine_lib, "ABI", engine_lib.ABI + 1)
    assert engine_lib.library() is None
    why = engine_lib.why_unavailable()
    assert "out of date" in why and "pip install the package again" in why, why
    assert f"this package's {engine_lib.ABI}" in why, why


def test_reads_records_into_the_slots_asked(models):
    _, ed = models.experts("tiny-qwen3_moe")
    meta, pools, reader = reader_over(ed, 12, threads=3, wave=4)  # 3 waves
    rng = np.random.default_rng(0)
    for li in meta.layers:
        experts = rng.choice(meta.num_experts, 12, replace=False)
        slots = rng.permutation(12)
        assert reader._read_waves(li, experts, slots) == 12 * meta.layers[li].record_bytes
        for e, s in zip(experts, slots):
            assert_slot_holds(meta, pools, li, s, e)
    c = dict(zip(COUNTERS, reader.counters.sum(0).tolist()))
    assert c["calls"] == len(meta.layers)  # one a read, however many waves it took
    assert c["records"] == 12 * len(meta.layers) and 0 < c["pread_ns"] <= c["read_ns"]
    assert c["bytes"] == 12 * sum(lay.record_bytes for lay in meta.layers.values())
    reader.close()
    reader.close()  # idempotent


@needs_library
def test_bad_requests_raise_and_leave_the_reader_usable(models):
    _, ed = models.experts("tiny-qwen3_moe")
    meta, pools, reader = reader_over(ed, 4, threads=2, wave=2)
    li = sorted(meta.layers)[0]
    E = meta.num_experts
    for experts, slots, what in [
        ([E], [0], "expert"),
        ([-1], [0], "expert"),
        ([0], [4], "slot"),
        ([0, 1], [2, 2], "named twice"),
        ([0, 1, 2], [0, 1, 0], "named twice"),  # in different waves
        ([0, 1], [0], "2 experts for 1 slots"),
    ]:
        with pytest.raises(ValueError, match=what):
            reader._read_waves(li, experts, slots)
    with pytest.raises(KeyError):
        reader._read_waves(10**6, [0], [0])
    reader._read_waves(li, [3], [1])
    assert_slot_holds(meta, pools, li, 1, 3)
    reader.close()


@needs_library
@pytest.mark.parametrize(
    "kw, why",
    [
        ({"threads": 64}, "64 reader threads: 0 to 63"),
        ({"threads": -1}, "-1 reader threads: 0 to 63"),
        ({"wave": 257}, "a wave of 257 records: 1 to 256"),
        ({"piece_bytes": 1000}, "pieces of 1000 bytes: 4096 to"),
    ],
)
def test_a_reader_that_cannot_be_made_says_why(models, kw, why):
    _, ed = models.experts("tiny-qwen3_moe")
    with pytest.raises(OSError, match=f"could not be created: {why}"):
        reader_over(ed, 4, **kw)


# Run in a child whose threads get 256 MiB stacks (RLIMIT_STACK at its start) and whose
# address space is then capped 384 MiB above what it uses: one thread fits, a second does
# not, so the second pthread_create fails for real (RLIMIT_AS binds root too).
THREADS_CHILD = """
import os, resource, sys
import numpy as np
if os.environ.get("MLX_STREAMING_TEST_ENGINE"):
    from mlx_streaming.core.io.engine_lib import use_library
    use_library(os.environ["MLX_STREAMING_TEST_ENGINE"])
from mlx_streaming.core.io.native import NativeReader
from mlx_streaming.core.meta import load_meta

class Rows:
    def __init__(self, layout):
        self.slots, self.parts = 2, [np.zeros((2, p.nbytes), np.uint8) for p in layout.parts]
    def row_pointers(self):
        return [(a.ctypes.data, a.shape[1]) for a in self.parts]

meta = load_meta(sys.argv[1])
pools = {li: Rows(meta.layers[li]) for li in meta.layers}
tasks = lambda: len(os.listdir("/proc/self/task"))
before = tasks()
vm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + 384 * 2**20, resource.RLIM_INFINITY))
try:
    r = NativeReader(meta, pools, threads=4, checksums=False)
    print("made with", r.threads, "threads")
    r.close()
except OSError as e:
    print("refused:", e)
print("threads left:", tasks() - before)
r = NativeReader(meta, pools, threads=1, checksums=False)  # room for one again: all freed
li = sorted(meta.layers)[0]
print("then:", r.threads, r._read_waves(li, [3], [1]) == meta.layers[li].record_bytes)
r.close()
"""


@needs_library
def test_threads_that_cannot_all_start_fail_the_reader(models):
    """A failed pthread_create fails the reader (saying how many threads were asked and
    what failed) instead of running fewer; the threads started are stopped and joined and
    everything is freed: the child can then start the one thread it has room for."""
    import resource
    import subprocess
    import sys

    _, ed = models.experts("tiny-qwen3_moe")

    def big_stacks():
        resource.setrlimit(resource.RLIMIT_STACK, (256 * 2**20, resource.RLIM_INFINITY))

    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", THREADS_CHILD, str(ed)], preexec_fn=big_stacks, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused: the native reader could not be created: "), lines
    assert "could not start 4 reader threads: thread 2 failed in pthread_create" in lines[0]
    assert lines[1:] == ["threads left: 0", "then: 1 True"], lines


@needs_library
def test_a_failed_call_keeps_its_own_message(models):
    """An engine call writes its message into its caller's buffer under the engine's
    lock: another caller's bad and good requests, made after the call returned and before
    its caller reads the message, leave that message naming its own request."""
    _, ed = models.experts("tiny-qwen3_moe")
    meta, pools, reader = reader_over(ed, 4, threads=2)
    lib, h, E = reader.lib, reader.handle, meta.num_experts
    pos = reader.pos[sorted(meta.layers)[0]]
    mine, theirs, good, slot, status = (np.array([v], np.int32) for v in (E + 7, E + 9, 3, 0, 0))
    err = error_buffer()
    assert lib.mlxs_start(h, pos, 1, mine.ctypes.data, slot.ctypes.data, 0, err, len(err)) == 4

    def other():
        e2 = error_buffer()
        for ids, rc in [(theirs, 4), (good, 0)]:
            got = lib.mlxs_start(h, pos, 1, ids.ctypes.data, slot.ctypes.data, 0, e2, len(e2))
            assert got == rc
        assert lib.mlxs_finish(h, status.ctypes.data, None, e2, len(e2)) == 0 and not e2.value

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert f"bad request: expert {E + 7} (of {E})" in err.value.decode()
    reader.close()


@needs_library
def test_concurrent_errors_name_their_own_request(models):
    """Two threads hammer one reader, each with its own bad requests (refused, naming
    that request's expert) between good reads (one thread reads, the other starts and
    waits for the result): every error names its own request and every good read lands."""
    _, ed = models.experts("tiny-qwen3_moe")
    meta, pools, reader = reader_over(ed, 8, threads=2, wave=2)
    li, E = sorted(meta.layers)[0], meta.num_experts
    wrong = []

    def hammer(t):
        for i in range(300):
            bad = E + 1 + 2 * i + t  # this thread's request, this time
            try:
                (reader._read_waves if t == 0 else reader.start)(li, [bad], [4 * t])
                wrong.append(f"expert {bad} was not refused")
            except ValueError as ex:
                if f"expert {bad} " not in str(ex):
                    wrong.append(f"expert {bad}: {ex}")
            if t == 0:
                reader._read_waves(li, [0, 2, 4], [1, 2, 3])  # two waves
            else:
                reader.start(li, [1, 3], [5, 6]).result()

    threads = [threading.Thread(target=hammer, args=(t,)) for t in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not wrong, (len(wrong), wrong[:3])
    for e, s in [(0, 1), (2, 2), (4, 3), (1, 5), (3, 6)]:
        assert_slot_holds(meta, pools, li, s, e)
    reader.close()


REQUEST = st.tuples(
    st.sampled_from(["read", "start", "result"]),
    st.lists(st.integers(-3, 40), max_size=10),
    st.lists(st.integers(-3, 10), max_size=10),
)


@needs_library
@settings(max_examples=80, deadline=None)
@given(ops=st.lists(REQUEST, min_size=1, max_size=6), trim=st.booleans())
# a wave's worth of experts for one slot more (the fixture's wave is 3): each wave's
# slice had as many of each, and the read landed (found by this test in CI, 2026-12-04)
@example(ops=[("read", [0, 0, 0], [0, 1, 2, 0])], trim=False)
def test_fuzzed_requests_never_crash(fuzz_reader, ops, trim):
    """Any sequence of reads (over several waves), starts and results: good requests land,
    bad ones (an expert or slot out of range, a slot twice, lengths that differ, more than
    a wave started) raise ValueError and are never followed; a read or a start finishes
    the started read first, which keeps its outcome (a caller interrupted before it kept
    its ``Started`` does not wedge the reader)."""
    meta, pools, reader = fuzz_reader
    li = sorted(meta.layers)[0]
    holds: dict[int, int] = {}  # slot -> expert it must hold
    nbytes = meta.layers[li].record_bytes
    started = []  # (Started, records)
    for kind, experts, slots in ops:
        if trim:  # mostly requests of matching lengths
            n = min(len(experts), len(slots))
            experts, slots = experts[:n], slots[:n]
        if kind == "result":
            for got, n in started:
                assert got.result() == n * nbytes and got.done()
            continue
        # a start of more than a wave is a read (finished before start returns; its
        # refusal raised by result())
        big = kind == "start" and len(experts) > reader.wave
        ok = (
            len(experts) == len(slots)
            and all(0 <= e < meta.num_experts for e in experts)
            and all(0 <= s < 8 for s in slots)
            and len(set(slots)) == len(slots)
        )
        op = reader._read_waves if kind == "read" else reader.start
        if ok:
            got = op(li, experts, slots)
            if kind == "start":
                assert got.done() or not big
                started.append((got, len(experts)))
            holds.update(zip(slots, experts))
        else:
            with pytest.raises(ValueError, match="refused"):
                got = op(li, experts, slots)
                if big:
                    got.result()
            for s in slots:  # a refused read's earlier waves may have landed
                holds.pop(s, None)
    for got, n in started:  # every one kept its outcome
        assert got.result() == n * nbytes
    for s, e in holds.items():
        assert_slot_holds(meta, pools, li, s, e)


@pytest.fixture(scope="module")
def fuzz_reader(models):
    _, ed = models.experts("tiny-qwen3_moe")
    meta, pools, reader = reader_over(ed, 8, threads=2, wave=3)
    yield meta, pools, reader
    reader.close()


@needs_library
def test_started_reads_land_like_reads(models, tmp_path):
    """``start`` returns at once and ``result()`` waits; one started read at a time (a
    second start, like a plain read, finishes the first, which keeps its outcome);
    errors come back on ``result()``; closing with a read in flight is clean."""
    ed, meta, li = copied_experts(models, tmp_path)
    meta, pools, reader = reader_over(ed, 8, threads=3, wave=4)
    r = reader.start(li, [3, 9, 4], [0, 1, 2])
    second = reader.start(li, [5], [3])
    assert r.done() and r.result() == 3 * meta.layers[li].record_bytes
    assert second.result() == meta.layers[li].record_bytes
    for e, s in [(3, 0), (9, 1), (4, 2), (5, 3)]:
        assert_slot_holds(meta, pools, li, s, e)
    big = reader.start(li, [1, 10, 11, 12, 13], [0, 1, 2, 3, 4])  # over a wave: read now
    assert big.done() and big.result() == 5 * meta.layers[li].record_bytes
    r = reader.start(li, [6], [3])
    reader._read_waves(li, [7, 8], [4, 5])  # waits for the started read first, keeps its outcome
    assert r.result() == meta.layers[li].record_bytes
    for e, s in [(6, 3), (7, 4), (8, 5)]:
        assert_slot_holds(meta, pools, li, s, e)
    assert reader.lib.mlxs_finish(reader.handle, None, None, None, 0) == 4  # nothing started
    data = np.fromfile(meta.file(li), np.uint8)
    data[2 * meta.layers[li].stride + 5] ^= 0xFF
    data.tofile(meta.file(li))
    r = reader.start(li, [2], [6])
    with pytest.raises(ExpertChecksumError, match="expert 2 of"):
        r.result()
    with pytest.raises(ExpertChecksumError):  # the same error again, not a new wait
        r.result()
    reader.start(li, [1], [7])
    reader.close()  # the workers finish the started read, then stop


@needs_library
def test_corrupt_record_names_file_and_expert(models, tmp_path):
    ed, meta, li = copied_experts(models, tmp_path)
    data = np.fromfile(meta.file(li), np.uint8)
    data[5 * meta.layers[li].stride + 100] ^= 0xFF
    data.tofile(meta.file(li))
    meta, pools, reader = reader_over(ed, 4, threads=2)
    with pytest.raises(ExpertChecksumError, match=r"expert 5 of layer .* in .*layer_.*fails its"):
        reader._read_waves(li, [6, 5], [0, 1])
    reader._read_waves(li, [6, 7], [0, 1])  # the next call works
    assert_slot_holds(meta, pools, li, 1, 7)
    # each record is checked the first time it is read: 6 and 7 passed, 5 never did
    assert reader.checked[li][[5, 6, 7]].tolist() == [0, 1, 1]
    with pytest.raises(ExpertChecksumError, match=r"expert 5 of"):
        reader._read_waves(li, [5], [2])  # a failed record is checked again
    reader.close()


class FakeCuda:
    """Stands in for ``io.cuda``: records what is page-locked; refuses the ``fail``-th file."""

    def __init__(self, fail=None):
        self.registered, self.fail = {}, fail

    def register_read_only(self, addr, nbytes):
        if len(self.registered) == self.fail:
            raise RuntimeError("cudaHostRegister: out of memory (injected)")
        self.registered[addr] = nbytes

    def unregister(self, addr):
        del self.registered[addr]


def test_file_maps_map_verify_and_close(models, tmp_path):
    """Each layer's file mapped (nothing page-locked without cuda); ``verify`` checks the
    unchecked records on the host and names the first corrupt one; ``close`` twice is
    fine; a file shorter than its records is refused."""
    ed, meta, li = copied_experts(models, tmp_path)
    lay, layers = meta.layers[li], sorted(meta.layers)
    data = np.fromfile(meta.file(li), np.uint8)
    data[5 * lay.stride + 100] ^= 0xFF
    data.tofile(meta.file(li))
    maps = FileMaps(meta, layers)
    assert sorted(maps.sources) == layers
    assert maps.nbytes == sum(meta.file(x).stat().st_size for x in layers)
    for x in layers:  # each address holds its file's bytes
        n = meta.file(x).stat().st_size
        got = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(maps.sources[x]))
        assert np.array_equal(got, np.fromfile(meta.file(x), np.uint8))
    checked = np.zeros(lay.num_experts, np.uint8)
    with pytest.raises(ExpertChecksumError, match=rf"expert 5 of layer {li} in .*layer_.*fails"):
        maps.verify(li, checked)
    assert checked.tolist() == [1] * 5 + [0] * (lay.num_experts - 5)
    checked[5] = 1  # taken as checked: not checked again
    maps.verify(li, checked)
    assert checked.all()
    maps.close()
    maps.close()
    assert maps.sources == {} and maps.nbytes == 0
    os.truncate(meta.file(li), lay.num_experts * lay.stride - 1)
    with pytest.raises(OSError, match=rf"{re.escape(str(meta.file(li)))} holds .* needed"):
        FileMaps(meta, layers)


def test_file_maps_page_lock_with_cuda_and_release_on_failure(models):
    """With cuda every mapping is page-locked and unlocked on close, ``tick()`` after each
    (a pipeline's ``Pace.tick``); one that cannot be names its file and what to do, and
    the maps made before it are released."""
    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    layers = sorted(meta.layers)
    cuda, locked = FakeCuda(), []
    with FileMaps(
        meta, layers, cuda=cuda, tick=lambda: locked.append(len(cuda.registered))
    ) as maps:
        assert cuda.registered == {maps.sources[x]: meta.file(x).stat().st_size for x in layers}
    assert locked == list(range(1, len(layers) + 1))
    assert cuda.registered == {}
    cuda = FakeCuda(fail=1)
    where = re.escape(str(meta.file(layers[1])))
    with pytest.raises(
        OSError, match=rf"{where}: could not page-lock.*injected.*without map_files"
    ):
        FileMaps(meta, layers, cuda=cuda)
    assert cuda.registered == {}


@needs_library
def test_short_and_shrinking_files(models, tmp_path):
    """A file that shrank under an open reader fails the read of what it lost."""
    ed, meta, li = copied_experts(models, tmp_path)
    lay = meta.layers[li]
    meta, pools, reader = reader_over(ed, 4, threads=2)
    os.truncate(meta.file(li), 3 * lay.stride)  # shrinks underneath the open reader
    with pytest.raises(RecordReadError, match=r"shrank.*expert 9 .*split the model again"):
        reader._read_waves(li, [9], [0])
    reader._read_waves(li, [1], [0])  # records still in the file read on
    reader.close()
    with pytest.raises(OSError, match="holds"):  # the meta was read before the cut
        NativeReader(meta, pools)


@needs_library
@pytest.mark.parametrize("short", ["stride", "byte", "padding"])
def test_a_file_short_of_its_last_stride_is_refused(models, tmp_path, short):
    """Reads cover whole strides, so a layer's file must hold ``num_experts * stride``
    bytes (as the writer writes): one stride, one byte or the last record's padding
    short is refused when the reader opens, naming the file and both sizes; whole, the
    last record reads."""
    ed, meta, li = copied_experts(models, tmp_path)
    lay = meta.layers[li]
    need = lay.num_experts * lay.stride
    assert meta.file(li).stat().st_size == need and lay.record_bytes < lay.stride
    meta, pools, reader = reader_over(ed, 4, threads=2)
    reader._read_waves(li, [lay.num_experts - 1], [0])
    assert_slot_holds(meta, pools, li, 0, lay.num_experts - 1)
    reader.close()
    size = {"stride": need - lay.stride, "byte": need - 1,
            "padding": need - lay.stride + lay.record_bytes}[short]  # fmt: skip
    os.truncate(meta.file(li), size)
    where = re.escape(str(meta.file(li)))
    with pytest.raises(OSError, match=rf"{where}: .*holds {size} bytes.* needs? {need}"):
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
        assert store.runtime.reader == reader
        got[reader] = {li: (r["hits"], r["misses"]) for li, r in store.layer_report().items()}
        store.close()
    assert got["native"] == got["python"]
    assert sum(m for _, m in got["native"].values()) > 0


I64 = st.integers(-(2**63), 2**63 - 1)
SMALL = st.integers(-2, 70000)


@needs_library
@settings(max_examples=150, deadline=None)
@given(
    n_layers=st.integers(-1, 3),
    threads=st.integers(-1, 3),
    wave=st.integers(-1, 300),
    max_stride=st.one_of(SMALL, I64),
    piece=st.one_of(SMALL, I64),
    pos=st.integers(-1, 3),
    stride=st.one_of(SMALL, I64),
    record=st.one_of(SMALL, I64),
    experts=st.integers(-1, 70),
    capacity=st.integers(-1, 9),
    parts=st.lists(st.tuples(st.one_of(SMALL, I64), st.one_of(SMALL, I64), SMALL), max_size=3),
    now=st.integers(0, 1),
)
def test_fuzzed_layouts_never_crash(models, n_layers, threads, wave, max_stride, piece, pos,
                                    stride, record, experts, capacity, parts, now):  # fmt: skip
    """The engine's set-up entry points refuse any bad size, count or layout (raw
    arguments, no Python checks in between) and accept only layouts inside the file."""
    lib, err = library(), error_buffer()
    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    li = sorted(meta.layers)[0]
    staging = np.zeros(1 << 16, np.uint8)
    ok_new = 1 <= n_layers and 0 <= threads and 1 <= wave <= 256 and 1 <= max_stride
    ok_new = ok_new and 4096 <= piece <= 2**40 and wave * max_stride <= staging.size
    if not ok_new:  # sizes the staging area could not hold are the caller's to avoid
        if not (1 <= wave <= 256 and 1 <= max_stride and wave * max_stride > staging.size):
            assert not lib.mlxs_new(n_layers, threads, wave, max_stride, piece, None,
                                    None, None, None, None, err, len(err))  # fmt: skip
            assert err.value  # saying why
        return
    e = lib.mlxs_new(n_layers, threads, wave, max_stride, piece, staging.ctypes.data,
                     None, None, None, None, err, len(err))  # fmt: skip
    assert e
    rows = [np.zeros((max(capacity, 1), max(r, 1)), np.uint8) for _, _, r in parts]
    arr = [np.array([p[i] for p in parts] or [0], np.int64) for i in range(3)]
    dst = (ctypes.c_void_p * max(1, len(parts)))(*[r.ctypes.data for r in rows])
    fd = os.open(meta.file(li), os.O_RDONLY)
    try:
        rc = lib.mlxs_layer(e, pos, fd, stride, record, experts, capacity, len(parts),
                            arr[0].ctypes.data, arr[1].ctypes.data,
                            ctypes.cast(dst, ctypes.c_void_p), arr[2].ctypes.data, None, None,
                            err, len(err))  # fmt: skip
        size, st_ = os.fstat(fd).st_size, np.zeros(1, np.int32)
        if rc == 0:  # accepted: every part inside its record, every record inside the file
            assert 0 <= pos < n_layers and 1 <= record <= stride <= max_stride
            assert 1 <= experts and experts * stride <= size and capacity >= 1
            for off, nb, row in parts:
                assert 0 <= off and 0 <= nb and off + nb <= record and row >= nb
            last = np.array([experts - 1, capacity - 1], np.int32)  # its whole stride reads
            ids = last[:1].ctypes.data, last[1:].ctypes.data
            assert lib.mlxs_start(e, pos, 1, *ids, now, err, len(err)) == 0 and not err.value
            assert lib.mlxs_finish(e, st_.ctypes.data, None, err, len(err)) == 0 and st_[0] == 0
        else:
            assert rc == -1 and err.value
        if lib.mlxs_start(e, pos, 0, None, None, now, err, len(err)) == 0:  # reads nothing
            assert rc == 0 and lib.mlxs_finish(e, st_.ctypes.data, None, err, len(err)) == 0
        else:
            assert rc != 0 and b"bad request" in err.value
            assert lib.mlxs_finish(e, st_.ctypes.data, None, err, len(err)) == 4
    finally:
        lib.mlxs_free(e)
        os.close(fd)


def test_sanitizer_build_is_the_one_under_test():
    """Under .ci/sanitize the engine is the ASan/UBSan build, not the installed one."""
    want = os.environ.get("MLX_STREAMING_TEST_ENGINE")
    if want:
        assert library()._name == want
    else:
        assert Path(library()._name) == library_path()


@needs_library
def test_map_files_is_for_cuda_only(models):
    """``map_files`` lets the GPU copy records from page-locked mappings; on the CPU (and
    Metal) it is refused with the reason, as is its pairing with direct_io (the CUDA
    path itself: ``tests/test_cuda.py``)."""
    from test_exactness import patched

    ck, ed = models.experts("tiny-qwen3_moe")
    for bad, match in [({}, "map_files lets the GPU copy records"),
                       ({"direct_io": True}, "exclude each other")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            patched(ck, ed, map_files=True, **bad)


@needs_library
def test_abandoned_started_read_is_finished_before_new_reservations(models):
    """A call that raised between starting its reads and waiting for them (a client gone,
    an error while building its graph) leaves a started read; the next load finishes it
    first, so the slot table stays consistent and output stays exact."""
    from mlx_lm import load
    from test_exactness import patched

    from mlx_streaming.analysis.verify import compare_traces, greedy_trace

    ck, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    model, store = patched(ck, ed, capacity=meta.top_k)
    li = sorted(meta.layers)[0]
    abandoned = store.loads.begin(li, np.arange(meta.top_k))  # started, never waited
    assert not abandoned.done and store.caches[li].pending
    t = store.loads.begin(li, np.arange(meta.top_k, 2 * meta.top_k))
    assert abandoned.done  # finished before the new reservation
    t.wait()
    cache = store.caches[li]
    held = cache.slot_of[cache.slot_of >= 0]
    assert len(set(held.tolist())) == len(held) and not cache.pending
    ref, tok = load(str(ck))
    ids = tok.encode("After an abandoned read the store still computes exactly.")
    assert compare_traces(greedy_trace(ref, ids, 8), greedy_trace(model, ids, 8)).exact
    store.close()


@needs_library
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts Linux's threads")
def test_a_store_dropped_without_close_releases_threads_and_files(models):
    """The native reader's threads and file descriptors go with a store that is dropped
    unclosed (before: 10 dropped stores left 40 threads and 30 descriptors)."""
    import gc

    from mlx_streaming import FileExpertStore

    _, ed = models.experts("tiny-qwen3_moe")

    def counts():
        return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))

    gc.collect()
    before = counts()
    for _ in range(5):
        store = FileExpertStore(ed, capacity=8, threads=4, reader="native")
        del store
    gc.collect()
    assert counts() == before


@needs_library
def test_a_failed_device_copy_names_the_cuda_error_not_the_file(models):
    """The engine's copies to the device (CUDA's cudaMemcpyAsync) run here through a
    stand-in that fails with error 700: the read fails naming that code, and does not
    tell the user to split the model again (the file read well)."""
    import ctypes

    from mlx_streaming.core.io.reader import RecordReadError, aligned_buffer

    copy_t = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
        ctypes.c_void_p,
    )  # fmt: skip
    sync_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    failing_copy, sync = copy_t(lambda *a: 700), sync_t(lambda s: 0)

    class Device:  # what NativeReader asks of the cuda module
        page_locked = staticmethod(aligned_buffer)
        new_stream = staticmethod(lambda: 0)
        destroy_stream = staticmethod(lambda s: None)
        functions = {"cudaMemcpyAsync": failing_copy, "cudaStreamSynchronize": sync}

        @classmethod
        def function(cls, name):
            return ctypes.cast(cls.functions[name], ctypes.c_void_p).value

    _, ed = models.experts("tiny-qwen3_moe")
    meta, pools, reader = reader_over(ed, 4, threads=2, checksums=False, cuda=Device)
    li = sorted(meta.layers)[0]
    with pytest.raises(RecordReadError, match="CUDA error 700") as e:
        reader.start(li, [0, 1], [0, 1]).result()
    assert "split the model again" not in str(e.value)
    reader.close()


@needs_library
def test_the_engines_thread_limit_is_the_runtimes(models, tmp_path):
    """``resolve`` refuses what the engine would: past ``MAX_THREADS`` threads, naming
    --threads; the engine itself runs exactly that many."""
    from mlx_streaming.core.io.engine_lib import MAX_THREADS
    from mlx_streaming.core.options import StreamConfig
    from mlx_streaming.core.runtime import RuntimeChoiceError, resolve

    _, ed = models.experts("tiny-qwen3_moe")
    meta, pools, reader = reader_over(ed, 2, threads=MAX_THREADS, checksums=False)
    reader.close()
    with pytest.raises(OSError, match=f"0 to {MAX_THREADS}"):
        reader_over(ed, 2, threads=MAX_THREADS + 1, checksums=False)
    cfg = StreamConfig(threads=MAX_THREADS + 1)
    with pytest.raises(RuntimeChoiceError, match="give --threads a smaller number"):
        resolve(cfg, meta, backend="cpu", engine_available=True)


@needs_library
def test_a_filesystem_without_o_direct_names_the_file_and_the_fix(models, monkeypatch):
    import errno

    from mlx_streaming.core.io import native

    _, ed = models.experts("tiny-qwen3_moe")
    real = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a)

    monkeypatch.setattr(native.os, "open", no_direct)
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT here")
    with pytest.raises(OSError, match=r"refuses O_DIRECT; run with --no-direct-io"):
        reader_over(ed, 2, threads=1, direct=True, checksums=False)
    # the default's own check, before any reader is made: the file and why
    from mlx_streaming.core.io import engine_lib

    meta = load_meta(ed)
    files = [meta.file(li) for li in meta.layers]
    assert engine_lib.direct_refused(files) == f"{files[0]}: Invalid argument"
    monkeypatch.undo()
    if engine_lib.direct_refused(files[:1]):
        pytest.skip(f"this filesystem refuses O_DIRECT: {engine_lib.direct_refused(files[:1])}")
    assert engine_lib.direct_refused(files) == ""  # each file, on a filesystem that takes it
    missing = Path(ed) / "missing.bin"
    assert engine_lib.direct_refused([*files, missing]) == f"{missing}: No such file or directory"
