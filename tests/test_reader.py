"""The Python record reader: merged runs, records cut into pieces over threads."""

import sys

import numpy as np
import pytest

from mlx_streaming.core.io.reader import RecordJob, RecordReader, aligned_buffer

STRIDE = 4096 * 700  # 2.8 MB records: cut into pieces at the sizes below


@pytest.mark.parametrize("piece_bytes", [4096, 1 << 20, 1 << 24])
def test_pieces_land_every_byte_once(tmp_path, piece_bytes):
    path = tmp_path / "layer.bin"
    data = np.random.default_rng(0).integers(0, 256, STRIDE * 6, dtype=np.uint8)
    data.tofile(path)
    r = RecordReader(threads=4, piece_bytes=piece_bytes)
    r.open(0, path, STRIDE)
    rec = STRIDE - 1000  # reads may stop short of the stride (the padding is skipped)
    outs = {i: aligned_buffer(STRIDE) for i in (0, 1, 2, 4)}
    done = []
    jobs = [
        RecordJob(
            i, [outs[i][: rec // 3], outs[i][rec // 3 : rec]], after=lambda i=i: done.append(i)
        )
        for i in outs
    ]
    assert r.submit(0, jobs).result() == rec * len(outs)
    for i, out in outs.items():
        assert np.array_equal(out[:rec], data[i * STRIDE : i * STRIDE + rec])
    assert sorted(done) == sorted(outs)  # each job's after runs once, after all its pieces
    if piece_bytes < STRIDE:
        assert r.stats.reads > 3  # records were cut
    r.close()


def test_failing_piece_fails_the_batch(tmp_path):
    path = tmp_path / "layer.bin"
    np.zeros(STRIDE * 2, dtype=np.uint8).tofile(path)
    r = RecordReader(threads=2, piece_bytes=1 << 20)
    r.open(0, path, STRIDE)

    def boom():
        raise OSError(5, "injected")

    out = aligned_buffer(STRIDE)
    fut = r.submit(0, [RecordJob(1, [out], after=boom)])
    with pytest.raises(OSError, match="injected"):
        fut.result()
    r.close()


@pytest.mark.skipif(sys.platform == "darwin", reason="F_NOCACHE is the Python reader's there")
def test_direct_io_is_the_native_readers_off_macos():
    with pytest.raises(ValueError, match="O_DIRECT needs aligned whole-record reads"):
        RecordReader(direct=True)


def test_an_interrupted_wait_lets_every_read_stop_first(tmp_path, monkeypatch):
    """Ctrl-C while a batch lands: the caller frees the batch's slots on the way out, so
    no read may still be writing when the interrupt reaches it."""
    import threading
    import time

    from mlx_streaming.core.io import futures as mod

    path = tmp_path / "layer.bin"
    np.zeros(STRIDE * 4, dtype=np.uint8).tofile(path)
    r = RecordReader(threads=2, piece_bytes=1 << 20)
    r.open(0, path, STRIDE)
    release = threading.Event()

    def slow():
        release.wait(5)
        time.sleep(0.2)

    real_wait, calls = mod.wait, []

    def interrupted(parts, timeout=None):
        calls.append(1)
        if len(calls) == 1:
            release.set()  # the reads are still writing when the interrupt arrives
            raise KeyboardInterrupt
        return real_wait(parts, timeout)

    monkeypatch.setattr(mod, "wait", interrupted)
    outs = [aligned_buffer(STRIDE) for _ in range(3)]
    fut = r.submit(0, [RecordJob(i, [outs[i]], after=slow) for i in range(3)])
    with pytest.raises(KeyboardInterrupt):
        fut.result()
    assert all(p.done() for p in fut._parts)  # nothing writes after the interrupt
    r.close()


def test_a_timed_out_wait_leaves_the_batch_pending(tmp_path):
    """``result(timeout)`` while reads still write raises TimeoutError and leaves the
    batch to finish: a later ``result()`` returns its bytes (before, the batch failed
    for good with the reads still running)."""
    import threading

    path = tmp_path / "layer.bin"
    data = np.random.default_rng(1).integers(0, 256, STRIDE * 2, dtype=np.uint8)
    data.tofile(path)
    r = RecordReader(threads=2, piece_bytes=1 << 20)
    r.open(0, path, STRIDE)
    release = threading.Event()
    out = aligned_buffer(STRIDE)
    fut = r.submit(0, [RecordJob(1, [out], after=lambda: release.wait(5))])
    with pytest.raises(TimeoutError, match="still running"):
        fut.result(timeout=0.05)
    release.set()
    assert fut.result() == STRIDE
    assert np.array_equal(out, data[STRIDE:])
    r.close()
