"""On MLX's CUDA backend (skipped elsewhere): the plan kernel's bounded-tier variant
(``plan_kernel`` with ``rows``; ``device_tier``) on a real expert file, its misses outside
the tier asked of the engine's request ring (``io.ring``) from inside the kernel. Call by
call it must give the reference's slots and ops (``device_tier.bounded_reference``), and
leave the pool, the tier's rows and every table as ``copy_reference`` and the reference
leave them, to the bit."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_cuda import _device_copy, _device_state, _host_copy
from test_engine import HostRows  # the native reader's pools (the ring reads into staging)

from mlx_streaming.core.dispatch import backend
from mlx_streaming.core.meta import load_meta

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(backend() != "cuda", reason="needs MLX's CUDA backend"),
    pytest.mark.timeout(240, method="thread", func_only=True),
]


@pytest.mark.parametrize("policy", ["lru", "predictive"])
def test_the_bounded_tier_kernel_reads_trades_and_copies_as_the_reference(models, policy):
    from mlx_streaming.core.cache.device_plan import (
        COUNTERS,
        constants,
        layer_arrays,
        scratch_arrays,
        table_to_arrays,
    )
    from mlx_streaming.core.cache.device_tier import bounded_reference, copy_reference
    from mlx_streaming.core.cache.plan_kernel import BLOCKS, THREADS, plan_constants, plan_kernel
    from mlx_streaming.core.cache.policy import make_policy
    from mlx_streaming.core.cache.scored import WEIGHTS
    from mlx_streaming.core.cache.slots import SlotCache
    from mlx_streaming.core.io import cuda
    from mlx_streaming.core.io.native import NativeReader
    from mlx_streaming.core.io.ring import RequestRing

    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    li = sorted(meta.layers)[0]
    lay = meta.layers[li]
    E, stride, K = lay.num_experts, lay.stride, 4
    S, R = max(K + 1, E // 4), E // 4  # the rest, E - S - R records, in the file only
    raw = np.fromfile(meta.file(li), np.uint8)
    files = np.stack([raw[e * stride : e * stride + stride] for e in range(E)])
    nbytes = lay.record_bytes // 16 * 16  # the part the kernel copies, in 16-byte words
    reader = NativeReader(meta, {i: HostRows(meta.layers[i], 2) for i in meta.layers})
    ring = RequestRing(reader, entries=8, readers=4, cuda=cuda)

    sim = SlotCache(E, S, make_policy(policy, E))  # as a load leaves the tables
    sim.commit(sim.reserve(range(S), protect=np.zeros(0, np.int64)))
    ref = layer_arrays(E, S, R)
    table_to_arrays(ref, sim)
    ref["home"][S : S + R], ref["owner"][:] = np.arange(R), np.arange(S, S + R)
    pool_np, rows_np = files[:S].copy(), files[S : S + R].copy()
    pool, pool_at = _device_copy(pool_np)
    flat, rows_at = cuda.shared_host(rows_np.nbytes)  # as the tier's: mapped host memory
    rows = flat.reshape(rows_np.shape)
    rows[...] = rows_np
    state = {**ref, **constants(WEIGHTS[policy]), **scratch_arrays()}
    buf, base, off, ptrs = _device_state(state)
    desc = [rows_at, stride, 1, 0, nbytes, pool_at, stride]
    desc += [ring.device_words, ring.device_staging, ring.stride, reader.pos[li], ring.entries]
    kernel = plan_kernel(16)(plan_constants(E, S, K, WEIGHTS[policy], True, R))
    out, rng = mx.zeros((1,), mx.uint32), np.random.default_rng(9)
    hot, w = rng.permutation(E), 1.0 / (1 + np.arange(E)) ** 1.1
    reads = 0
    for step in range(150):
        order = np.roll(hot, step // 25)
        ids = rng.choice(order, size=K, replace=False, p=w / w.sum()).astype(np.uint32)
        want, ops = bounded_reference(li, ref, WEIGHTS[policy], ids[None])
        copy_reference(ops, rows_np, pool_np, files)
        reads += int(ops[2])
        (out,) = kernel(
            inputs=[mx.array(ids[None]), ptrs, mx.array(np.array(desc, np.int64)), out],
            grid=(BLOCKS * THREADS, 1, 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[(1, K)],
            output_dtypes=[mx.uint32],
        )
        mx.eval(out)
        assert np.array_equal(np.array(out), want), step
        fills = _host_copy(base + off["fills"], state["fills"])
        assert fills[: len(ops)].tolist() == ops.tolist(), step
        got = _host_copy(pool_at, pool_np)
        assert np.array_equal(got[:, :nbytes], pool_np[:, :nbytes]), step
        held = ref["owner"] >= 0
        assert np.array_equal(rows[held, :nbytes], rows_np[held, :nbytes]), step
        for name in ("slot_of", "expert_in", "home", "owner", "stamp", "heat", "heat_w", "clock"):
            assert np.array_equal(_host_copy(base + off[name], ref[name]), ref[name]), (step, name)
    ctr = _host_copy(base + off["counters"], ref["counters"])
    assert ctr[COUNTERS.index("READS")] == reads > 30, (reads, ctr)
    assert ctr[COUNTERS.index("FAILED")] == 0 and ctr[COUNTERS.index("LATE")] == 0
    assert ring.counters()["requests"] == reads
    ring.close()
    reader.close()
    del buf, pool, rows, flat  # the buffers outlive every kernel that wrote them
