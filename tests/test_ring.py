"""The native engine's request ring (``engine_ring.c``, ``io.ring``): records asked for
through shared entries land whole in each entry's staging record, beside the engine's
ordinary reads; bad requests, corrupt and shrunken files are answered with a status that
names the file and the expert (never a crash or a hang); the ring refuses what it cannot
serve and stops with its engine."""

from __future__ import annotations

import os
import shutil
import threading
import time

import numpy as np
import pytest
from test_engine import HostRows

from mlx_streaming.core.format import ExpertChecksumError
from mlx_streaming.core.io.engine_lib import error_buffer, library
from mlx_streaming.core.io.native import NativeReader
from mlx_streaming.core.io.reader import RecordReadError
from mlx_streaming.core.io.ring import DONE, SEQ, RequestRing
from mlx_streaming.core.meta import load_meta

pytestmark = pytest.mark.skipif(
    library() is None, reason="the compiled reader is not installed (pip install the package)"
)


def reader_over(ed, slots=4, **kw):
    meta = load_meta(ed)
    pools = {li: HostRows(meta.layers[li], slots) for li in meta.layers}
    return meta, pools, NativeReader(meta, pools, **kw)


def record(meta, li, e):
    lay = meta.layers[li]
    with open(meta.file(li), "rb") as f:
        f.seek(e * lay.stride)
        return np.frombuffer(f.read(lay.record_bytes), np.uint8)


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("pieces", [1, 3])  # 3: each 16 KB record in two reads of 8 KB
def test_requests_are_answered_with_their_records_beside_ordinary_reads(models, pieces):
    _, ed = models.experts("tiny-qwen3_moe")
    meta, pools, reader = reader_over(ed, threads=2, wave=4)
    began, ring = time.monotonic_ns(), RequestRing(reader, entries=6, readers=3, pieces=pieces)
    layers, rng = sorted(meta.layers), np.random.default_rng(0)
    stop, errors = threading.Event(), []

    def ordinary():  # the engine's own reads, on its own threads, meanwhile
        mine = np.random.default_rng(1)
        try:
            while not stop.is_set():
                li = layers[int(mine.integers(len(layers)))]
                e = mine.choice(meta.num_experts, 4, replace=False).astype(np.int32)
                reader.start(li, e, np.arange(4, dtype=np.int32)).result()
                for s, x in enumerate(e.tolist()):  # the first part of each slot
                    p = meta.layers[li].parts[0]
                    got = pools[li].parts[0][s]
                    assert np.array_equal(got, record(meta, li, x)[p.offset : p.offset + p.nbytes])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=ordinary)
    t.start()
    asked = 0
    try:
        for _ in range(30):
            reqs = [
                (k, layers[int(rng.integers(len(layers)))], int(rng.integers(meta.num_experts)))
                for k in range(ring.entries)
            ]
            seqs = [ring.post(k, li, e) for k, li, e in reqs]
            for (k, li, e), seq in zip(reqs, seqs):
                got = ring.wait(k, seq)
                assert np.array_equal(got[: meta.layers[li].record_bytes], record(meta, li, e))
            asked += len(reqs)
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    c = ring.counters()
    assert c["requests"] == asked and c["failed"] == 0
    assert c["reads"] == asked * (2 if pieces > 1 else 1)  # a record in 1 read, or 2
    assert 0 < c["read_ns"] and c["max_ns"] * asked >= c["answer_ns"] >= c["read_ns"]
    # the wall time a reader was reading: within the ring's life, and at least one of its
    # 3 readers' share of their times summed
    assert time.monotonic_ns() - began >= c["busy_ns"] >= c["read_ns"] / 3 > 0
    ring.close()
    reader.close()


def test_bytes_counted_are_the_records_read(models):
    _, ed = models.experts("tiny-qwen3_moe")
    meta, _, reader = reader_over(ed, threads=0, wave=1)  # as CUDA's files' reader: no workers
    li = sorted(meta.layers)[0]
    with RingOf(reader) as ring:
        for e in range(3):
            ring.wait(0, ring.post(0, li, e))
        assert ring.counters()["bytes"] == 3 * meta.layers[li].record_bytes
        # a caller that counts other counters than the engine's is refused, not overrun
        room = np.zeros(len(ring.counters()) + 8, np.int64)
        got = [reader.lib.mlxs_ring_counters(ring.handle, room.ctypes.data, n) for n in (7, 9)]
        assert got == [-2, -2] and not room.any()
    reader.close()


def test_the_storage_probe_reads_through_the_ring_what_it_reports(models):
    from mlx_streaming.bench.measure import ring_read_gbps

    _, ed = models.experts("tiny-qwen3_moe")
    meta, _, reader = reader_over(ed, threads=0, wave=1)
    (size,) = {lay.record_bytes for lay in meta.layers.values()}  # one record size
    with RingOf(reader, entries=4, readers=2, pieces=2) as ring:
        for depth, records in ((None, 10), (1, 3)):  # the queue full, then a lone record
            before, t0 = ring.counters(), time.perf_counter()
            gbps, ms = ring_read_gbps(ring, meta, records, depth)
            wall, c = time.perf_counter() - t0, ring.counters()
            assert c["requests"] - before["requests"] == records and c["failed"] == 0
            assert c["bytes"] - before["bytes"] == records * size
            assert c["reads"] - before["reads"] == 2 * records  # in the ring's pieces
            assert records * size / wall / 1e9 <= gbps and 0 < ms <= 1e3 * wall
    reader.close()


class RingOf:
    """A ring stopped on leaving the block."""

    def __init__(self, reader, **kw):
        self.ring = RequestRing(reader, **kw)

    def __enter__(self):
        return self.ring

    def __exit__(self, *exc):
        self.ring.close()


def test_bad_requests_are_answered_and_leave_the_ring_usable(models):
    _, ed = models.experts("tiny-qwen3_moe")
    meta, _, reader = reader_over(ed)
    li = sorted(meta.layers)[0]
    with RingOf(reader, entries=2, readers=1) as ring:
        with pytest.raises(ValueError, match="refused"):
            ring.wait(0, ring.post(0, 10_000, 0))  # no such layer
        with pytest.raises(ValueError, match=f"expert {meta.num_experts}"):
            ring.wait(1, ring.post(1, li, meta.num_experts))
        with pytest.raises(ValueError, match="expert -1"):
            ring.wait(1, ring.post(1, li, -1))
        got = ring.wait(0, ring.post(0, li, 3))
        assert np.array_equal(got[: meta.layers[li].record_bytes], record(meta, li, 3))
        assert ring.counters()["failed"] == 3
    reader.close()


@pytest.mark.parametrize("pieces", [1, 4])  # 4: a read a page, one failing of the record's
def test_corrupt_and_shrunken_files_name_the_file_and_the_expert(models, tmp_path, pieces):
    _, src = models.experts("tiny-qwen3_moe")
    ed = tmp_path / "e"
    shutil.copytree(src, ed)
    meta = load_meta(ed)
    li = sorted(meta.layers)[0]
    lay = meta.layers[li]
    with open(meta.file(li), "r+b") as f:  # flip a byte of expert 2's record
        f.seek(2 * lay.stride + 5)
        b = f.read(1)
        f.seek(2 * lay.stride + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    _, _, reader = reader_over(ed)
    with RingOf(reader, pieces=pieces) as ring:
        with pytest.raises(ExpertChecksumError, match=f"expert 2 of layer {li}.*{meta.file(li)}"):
            ring.wait(0, ring.post(0, li, 2))
        os.truncate(meta.file(li), (meta.num_experts - 1) * lay.stride)  # the last one goes
        with pytest.raises(RecordReadError, match=str(meta.file(li))):
            ring.wait(1, ring.post(1, li, meta.num_experts - 1))
        got = ring.wait(0, ring.post(0, li, 1))  # the rest still read
        assert np.array_equal(got[: lay.record_bytes], record(meta, li, 1))
        c = ring.counters()
        assert (c["requests"], c["failed"], c["bytes"]) == (3, 2, lay.record_bytes), c
    reader.close()


def test_a_failed_read_no_waiter_saw_is_named_for_the_commands(models, tmp_path, monkeypatch,
                                                              capsys):  # fmt: skip
    """A read a kernel asked for that failed: the kernel traps on it, and MLX's error
    names nothing. ``unexplained_failure`` names the file, the layer and the expert, while
    the ring runs and once it is closed, and the commands say it beside MLX's error; a
    failure a host ``wait`` raised is not left unexplained."""
    import mlx_streaming.commands.generate as command
    from mlx_streaming import cli
    from mlx_streaming.core.io import ring as ring_mod

    monkeypatch.setattr(ring_mod, "_closed_failures", [])  # other tests' rings
    _, src = models.experts("tiny-qwen3_moe")
    ed = tmp_path / "e"
    shutil.copytree(src, ed)
    meta = load_meta(ed)
    li = sorted(meta.layers)[0]
    with open(meta.file(li), "r+b") as f:  # expert 2's record fails its checksum
        f.seek(2 * meta.layers[li].stride + 5)
        b = f.read(1)
        f.seek(2 * meta.layers[li].stride + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    _, _, reader = reader_over(ed)
    ring = RequestRing(reader)
    with pytest.raises(ExpertChecksumError):
        ring.wait(0, ring.post(0, li, 2))  # told: nothing left unexplained
    ring.wait(1, ring.post(1, li, 1))
    assert ring.failed() is None and ring_mod.unexplained_failure() is None
    seq, until = ring.post(1, li, 2), time.monotonic() + 10  # as a kernel posts: no wait
    while ring.done(1) != seq:
        assert time.monotonic() < until, "the ring did not answer"
        time.sleep(1e-3)
    named = f"expert 2 of layer {li} in {meta.file(li)} fails its checksum"
    assert named in str(ring_mod.unexplained_failure())

    def trapped(argv):  # what MLX raises after the kernel's trap
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(command, "main", trapped)
    with pytest.raises(SystemExit) as out:
        cli.main(["generate"])
    err = capsys.readouterr().err
    assert out.value.code == 1 and named in err and "unspecified launch failure" in err, err
    ring.close()
    assert named in str(ring_mod.unexplained_failure())  # kept past the ring
    ring.words[1, SEQ] += 1  # as a kernel posts, to a ring that no longer answers (its
    ring.words[1, ring_mod.EXPERT] = 3  # wait runs out): the record is named too
    assert "expert 3 of layer" in str(ring.failed()) and "not read in time" in str(ring.failed())
    reader.close()
    again = RequestRing(reader_over(ed)[2])  # a new ring: an earlier one's failure is not its
    assert ring_mod.unexplained_failure() is None
    again.close()
    again.reader.close()
    with pytest.raises(RuntimeError, match="unspecified launch failure"):
        cli.main(["generate"])  # nothing failed: MLX's error as it was


@pytest.mark.parametrize(
    "kw, why",
    [
        ({"entries": 0}, "1 to 64 entries"),
        ({"entries": 65}, "1 to 64 entries"),
        ({"readers": 0}, "1 to 16 readers"),
        ({"readers": 17}, "1 to 16 readers"),
        ({"pieces": 0}, "0 pieces a record: 1 to the ring's 4 readers"),
        ({"readers": 2, "pieces": 3}, "3 pieces a record: 1 to the ring's 2 readers"),
    ],
)
def test_a_ring_that_cannot_be_made_says_why(models, kw, why):
    _, ed = models.experts("tiny-qwen3_moe")
    _, _, reader = reader_over(ed)
    with pytest.raises(ValueError, match=why):
        RequestRing(reader, **kw)
    reader.close()


def test_one_ring_an_engine_and_no_layer_registered_while_it_runs(models):
    _, ed = models.experts("tiny-qwen3_moe")
    meta, _, reader = reader_over(ed)
    with RingOf(reader):
        with pytest.raises(OSError, match="running already"):
            RequestRing(reader)
        err = error_buffer()
        rc = reader.lib.mlxs_layer(
            reader.handle, 0, -1, 1, 1, 1, 1, 1, None, None, None, None, None, None, err, 512
        )
        assert rc == -1 and b"register every layer before starting it" in err.value
    RequestRing(reader).close()  # one ring stopped, another may start
    reader.close()


def test_the_ring_stops_with_its_engine_and_when_dropped(models):
    _, ed = models.experts("tiny-qwen3_moe")
    meta, _, reader = reader_over(ed, threads=1)
    li = sorted(meta.layers)[0]
    before = native_threads()
    ring = RequestRing(reader, entries=2, readers=3)
    assert native_threads() == before + 4  # the poller and three readers
    del ring  # dropped: its threads stop before its memory goes
    assert native_threads() == before
    ring = RequestRing(reader, entries=2, readers=2)
    ring.wait(0, ring.post(0, li, 1))
    reader.close()  # the engine stops the ring first
    assert native_threads() == before - 1  # and its own worker
    ring.close()  # nothing left to stop


def test_a_ring_left_open_stops_as_the_process_exits(models):
    """A ring no one closed stops at exit before the memory made ahead of it is freed: on
    CUDA its entries are page-locked buffers that ``weakref.finalize`` frees at exit, and
    its poller reads them (a benchmark's child crashed with SIGSEGV as it ended, 2026-12-07c).
    Here a finalizer made before the ring looks, as it runs at exit, for the ring's
    threads; and a handler registered before the ring's module finds the ring stopped."""
    import subprocess
    import sys

    _, ed = models.experts("tiny-qwen3_moe")
    code = f"""
import atexit, os, weakref
tasks = lambda: len(os.listdir("/proc/self/task"))
seen = []
atexit.register(lambda: print("handler:", "stopped" if seen[1]() == seen[0] else "running"))
from test_ring import reader_over
from mlx_streaming.core.io.ring import RequestRing
meta, _, reader = reader_over({str(ed)!r})
class Entries: pass
entries = Entries()  # as the ring's page-locked entries: a finalizer made before it
weakref.finalize(entries, lambda: print("memory:", "stopped" if tasks() == seen[0] else "running", flush=True))
seen += [tasks(), tasks]
ring = RequestRing(reader, entries=2, readers=2)
ring.wait(0, ring.post(0, sorted(meta.layers)[0], 1))
"""
    here = os.path.dirname(__file__)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=here)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-2:] == ["memory: stopped", "handler: stopped"], r.stdout


def test_an_idle_ring_still_answers(models):
    """The poller slows to one look every 0.5 ms once idle for a second; a request then
    is still answered."""
    _, ed = models.experts("tiny-qwen3_moe")
    meta, _, reader = reader_over(ed)
    li = sorted(meta.layers)[0]
    with RingOf(reader) as ring:
        time.sleep(1.3)
        seq = ring.post(3, li, 4)
        got = ring.wait(3, seq, timeout=5)
        assert np.array_equal(got[: meta.layers[li].record_bytes], record(meta, li, 4))
        assert ring.words[3, DONE] == ring.words[3, SEQ] == seq
    reader.close()


def test_the_host_poster_refuses_what_would_hang(models):
    """``post`` on an entry whose last request is unanswered, and ``post`` or ``wait``
    on a stopped ring, raise at once, naming why (before: a wait ran to its timeout);
    ``wait`` returns a copy, which the entry's next request leaves alone."""
    _, ed = models.experts("tiny-qwen3_moe")
    meta, _, reader = reader_over(ed)
    li = sorted(meta.layers)[0]
    ring = RequestRing(reader, entries=2, readers=1)
    got = ring.wait(0, ring.post(0, li, 2))
    ring.wait(0, ring.post(0, li, 3))
    assert np.array_equal(got[: meta.layers[li].record_bytes], record(meta, li, 2))
    ring.words[1, DONE] = -5  # as an entry whose last request is not answered yet
    with pytest.raises(RuntimeError, match="entry 1 still has a request unanswered"):
        ring.post(1, li, 1)
    seq = ring.post(0, li, 1)
    ring.close()
    with pytest.raises(RuntimeError, match="the request ring is stopped"):
        ring.post(0, li, 1)
    with pytest.raises(RuntimeError, match="the request ring is stopped"):
        ring.wait(0, seq + 1)
    reader.close()
    meta, _, reader = reader_over(ed)
    ring = RequestRing(reader, entries=2, readers=1)
    assert ring.running and ring.counters()["requests"] == 0
    reader.close()  # its engine freed, the ring stopped with it: nothing reads the engine
    assert not ring.running
    with pytest.raises(RuntimeError, match="stopped \\(closed, or its reader closed"):
        ring.counters()
    ring.close()


def test_the_host_paths_ring_reads_go_in_rounds_fail_alone_and_give_way(models):
    """``device_reader.RingReads`` (the host path's reads beyond a bounded tier on CUDA),
    over a ring in host memory with a copy that keeps each staged record: more records
    than entries go in rounds, each slot getting its own record; a bad record fails its
    read alone (the ring serves the next); a read given up for a newer one raises, never
    posting again over the newer one's entries."""
    import mlx.core as mx

    from mlx_streaming.core.io.device_reader import RingReads

    _, ed = models.experts("tiny-qwen3_moe")
    meta, _, reader = reader_over(ed)
    li = sorted(meta.layers)[0]
    n = meta.layers[li].record_bytes
    ring = RequestRing(reader, entries=2, readers=2)
    got: dict[int, np.ndarray] = {}

    def copy(layer, slots):  # as the fill kernel: entry j's staging into slots[j]
        assert layer == li
        for j, s in enumerate(slots):
            got[s] = ring.staging[j, :n].copy()
        return mx.array(0)

    reads = RingReads(ring, copy, meta)
    experts, slots = [5, 0, 7, 3, 1], [10, 11, 12, 13, 14]
    read = reads.start(li, experts, slots)
    assert read.result() == 5 * n
    for e, s in zip(experts, slots):
        assert np.array_equal(got[s], record(meta, li, e)), (e, s)
    bad = reads.start(li, [2, meta.layers[li].num_experts + 3], [0, 1])
    with pytest.raises(ValueError, match="refused a request"):
        bad.result()
    got.clear()
    assert reads.start(li, [4], [9]).result() == n and np.array_equal(got[9], record(meta, li, 4))
    old = reads.start(li, [6, 2, 3], [0, 1, 2])
    new = reads.start(li, [1], [5])  # the old one given up (its caller interrupted)
    with pytest.raises(RuntimeError, match="given up"):
        old.result()
    assert new.result() == n and np.array_equal(got[5], record(meta, li, 1))
    ring.close()
    reader.close()


def test_a_partial_tier_s_device_reader_needs_the_ring_s_cut():
    """The runtime resolves the ring's cut (``Runtime.ring_cut``); a device reader over a
    partial tier given none refuses at once, before it opens anything, rather than
    choose a cut of its own."""
    from mlx_streaming.core.io.device_reader import DeviceReader

    for cut in (None, (0, 0)):
        with pytest.raises(ValueError, match=r"needs the ring's cut \(Runtime.ring_cut\)"):
            DeviceReader(None, {}, tier=object(), files=object(), ring=cut)
