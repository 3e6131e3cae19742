"""The native I/O engine on the CPU: a Python thread plays the GPU (writes requests into
the mailbox, waits for the answer), copies are memcpy into host "pools"; slots, reads,
checksums, victims, the log and errors are checked against the expert files."""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import pytest

from mlx_streaming.core.io.native import Engine, EngineLayer, engine_library
from mlx_streaming.core.meta import load_meta

pytestmark = pytest.mark.skipif(engine_library() is None, reason="no C compiler")
MAX_ROWS = 64


class HostPool:
    """Per-part host arrays [slots, part bytes], as a pool's rows."""

    def __init__(self, layout, slots):
        self.parts = {p.name: np.zeros((slots, p.nbytes), np.uint8) for p in layout.parts}


def make(meta, capacity, checksums=True, threads=3, **kw):
    layers, pools, fds = [], [], []
    for li in sorted(meta.layers):
        lay = meta.layers[li]
        pool = HostPool(lay, capacity)
        fd = os.open(meta.file(li), os.O_RDONLY)
        sums = np.array([int(c, 16) for c in lay.checksums], np.uint64) if checksums else None
        layers.append(
            EngineLayer(
                fd,
                lay,
                capacity,
                np.full(lay.num_experts, -1, np.int32),
                np.full(capacity, -1, np.int32),
                [pool.parts[p.name].ctypes.data for p in lay.parts],
                [pool.parts[p.name].shape[1] for p in lay.parts],
                checksums=sums,
            )
        )
        pools.append(pool)
        fds.append(fd)
    return Engine(layers, threads=threads, max_rows=MAX_ROWS, **kw), pools, fds


def record(meta, li, e):
    lay = meta.layers[li]
    with open(meta.file(li), "rb") as f:
        f.seek(e * lay.stride)
        return np.frombuffer(f.read(lay.record_bytes), np.uint8)


def check_slots(meta, eng, pools, pos):
    li = sorted(meta.layers)[pos]
    lay, L = meta.layers[li], eng.layers[pos]
    for e in np.flatnonzero(L.slot_of >= 0):
        s = L.slot_of[e]
        assert L.expert_in[s] == e
        rec = record(meta, li, e)
        for p in lay.parts:
            assert np.array_equal(pools[pos].parts[p.name][s], rec[p.offset : p.offset + p.nbytes])


def test_serve_reads_evicts_and_logs(models):
    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    k, cap = meta.top_k, meta.top_k + 2
    eng, pools, fds = make(meta, cap)
    eng.start()
    rng = np.random.default_rng(0)
    used_total = 0
    for step in range(60):
        pos = step % len(meta.layers)
        ids = rng.choice(meta.num_experts, (2, k), replace=True)  # two tokens
        if len(np.unique(ids)) > cap:
            ids = ids[:1]
        st, slots = eng.serve(pos, ids)
        assert st == 0, eng.error()
        L = eng.layers[pos]
        assert np.array_equal(slots, L.slot_of[ids.reshape(-1)])
        check_slots(meta, eng, pools, pos)
        used_total += len(np.unique(ids))
    calls, _ = eng.drain()
    assert len(calls) == 60
    assert sum(len(u) for _, u, _, _ in calls) == used_total
    c = sum(lay.counters for lay in eng.layers)
    assert c[0] == 60 and c[1] + c[2] == used_total and c[2] > 0 and c[3] > 0
    assert c[4] == c[5] * meta.layers[sorted(meta.layers)[0]].record_bytes
    eng.close()
    for fd in fds:
        os.close(fd)


def test_victim_queue_and_pins(models):
    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    k = meta.top_k
    eng, pools, fds = make(meta, k + 1, threads=0)
    eng.start()
    L = eng.layers[0]
    eng.serve(0, np.arange(k + 1)[None])  # fill: experts 0..k
    L.pinned[0] = 1
    L.queue_victims([0, 3, 2])  # 0 is pinned: skipped
    st, _ = eng.serve(0, [[k + 1]])
    assert st == 0 and L.slot_of[3] < 0 and L.slot_of[0] >= 0
    st, _ = eng.serve(0, [[k + 2, 2]])  # 2 is used by this call: skipped; queue ends: LRU
    assert st == 0 and L.slot_of[2] >= 0 and L.slot_of[k + 2] >= 0
    assert L.slot_of[1] < 0  # the least recently used unpinned expert
    _, placed = [c for c in eng.drain()[0]][-1][1:3]
    assert placed.tolist() == [[k + 2, placed[0][1], 1]]
    check_slots(meta, eng, pools, 0)
    eng.close()
    for fd in fds:
        os.close(fd)


def test_mailbox_loop_answers_a_kernel_like_caller(models):
    """The GPU's side, played by a thread: write ids, layer, rows, then the request seq;
    spin until the answer seq matches; read the slots."""
    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    eng, pools, fds = make(meta, meta.top_k + 4)
    box = np.zeros(16 + 2 * MAX_ROWS, np.int32)
    eng.start(box.ctypes.data)
    rng = np.random.default_rng(1)
    answers = []

    def gpu():
        for seq in range(1, 41):
            pos = seq % len(meta.layers)
            ids = rng.choice(meta.num_experts, meta.top_k, replace=False)
            box[16 : 16 + len(ids)] = ids
            box[1], box[2] = pos, len(ids)
            box[0] = seq
            while box[3] != seq:
                pass
            answers.append(
                (pos, ids, box[16 + MAX_ROWS : 16 + MAX_ROWS + len(ids)].copy(), int(box[4]))
            )

    t = threading.Thread(target=gpu)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive() and len(answers) == 40
    for pos, ids, slots, status in answers[-len(meta.layers) :]:
        assert status == 0
        assert np.array_equal(slots, eng.layers[pos].slot_of[ids])
    for pos in range(len(meta.layers)):
        check_slots(meta, eng, pools, pos)
    eng.close()
    for fd in fds:
        os.close(fd)


def test_corrupt_record_is_never_resident(models, tmp_path):
    _, ed0 = models.experts("tiny-qwen3_moe")
    ed = tmp_path / "e"
    shutil.copytree(ed0, ed)
    meta = load_meta(ed)
    li = sorted(meta.layers)[0]
    data = np.fromfile(meta.file(li), np.uint8)
    data[5 * meta.layers[li].stride + 100] ^= 0xFF
    data.tofile(meta.file(li))
    eng, pools, fds = make(meta, meta.top_k + 1)  # the pools must outlive the engine
    eng.start()
    st, _ = eng.serve(0, [[5, 6]])
    assert st == 2 and "checksum mismatch" in eng.error() and "expert 5 of" in eng.error()
    L = eng.layers[0]
    assert L.slot_of[5] < 0 and L.slot_of[6] >= 0 and 5 not in L.expert_in
    # the host path's reads: statuses per record, tables untouched
    st = eng.read(0, [5, 7], [0, 1])
    assert st.tolist() == [2, 0] and L.slot_of[7] < 0
    eng.close()
    for fd in fds:
        os.close(fd)
