"""How long the native reader takes to bring n records into pool slots, by thread count
and piece size, alone and while the device computes (the decode case).

A decode layer call at 50% residency reads about 1.2 records of 4.87 MB; the host
profile put that at ~640 µs (9 GB/s) where batches of 64 records read at 26-29 GB/s.
This probe times ``NativeReader.read`` on the preset's expert files (warm page cache)
for 1, 2 and 4 records, and reports the engine's own counters per call: its wall time,
and the time its threads spent in ``pread``, in copy calls and in stream
synchronization (summed over the threads). With ``--direct`` every read comes from the
disk (O_DIRECT), 1-8 records with up to 63 threads: how fast one record comes from the
disk, which a layer call that misses the page cache waits for (5-10 ms on the H200's
disk in the 6 GB cgroup, 2026-12-04p), against the disk's bandwidth with many records
in flight.

    python benchmarks/probes/native_read.py --preset dsv2-lite --workdir /tmp/mlxs [--direct]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from harness import build, finish, log, parser  # noqa: E402


def main():
    p = parser(__doc__, preset="dsv2-lite", trace=False, workdir="/tmp/mlxs")
    p.add_argument("--repeat", type=int, default=21)
    p.add_argument("--direct", action="store_true", help="read with O_DIRECT (the disk)")
    a = p.parse_args()
    from mlx_streaming.core.cache.expert_store import FileExpertStore
    from mlx_streaming.core.io import cuda
    from mlx_streaming.core.io.engine_lib import COUNTERS
    from mlx_streaming.core.io.native import NativeReader

    ck, ed, meta = build(a)
    slots = meta.num_experts // 2
    store = FileExpertStore(ed, slots)
    pools = store.pools
    layer = store.layers[len(store.layers) // 2]
    on_cuda = store.pool_mode == "cuda"
    rng = np.random.default_rng(0)
    x = mx.random.normal((4096, 4096) if on_cuda else (256, 256))  # CPU: a smoke run
    mx.eval(x)
    rows = []
    cores = os.cpu_count() or 2
    top = min(15, cores - 1)
    counts = sorted({3, top, *([31, 63] if a.direct else [])})  # disk reads: more in flight
    for threads, piece_kb in [(t, kb) for t in counts for kb in (128, 4096)]:
        r = NativeReader(
            meta, pools, threads=threads, checksums=False, direct=a.direct,
            cuda=cuda if on_cuda else None, piece_bytes=piece_kb << 10,
        )  # fmt: skip
        pos = r.pos[layer]
        for n in (1, 2, 4, 8) if a.direct else (1, 2, 4):  # the disk: its queue deepened
            for busy in (False,) if a.direct else (False, True):
                ts = []
                r.counters[:] = 0
                for _ in range(a.repeat):
                    experts = rng.choice(meta.num_experts, n, replace=False)
                    if busy:  # the device computes meanwhile, as in decode
                        y = x
                        for _ in range(8):
                            y = y @ x * 1e-3
                        mx.async_eval(y)
                    t = time.perf_counter()
                    r.start(layer, experts, np.arange(n)).result()
                    ts.append(time.perf_counter() - t)
                    if busy:
                        mx.eval(y)
                us = 1e6 * statistics.median(ts[1:])
                nbytes = n * meta.layers[layer].record_bytes
                c = dict(zip(COUNTERS, r.counters[pos].tolist()))
                per = {  # µs per call, summed over the threads (wall for busy)
                    f"{k[:-3]}_us": round(c[k] / 1e3 / c["calls"], 1)
                    for k in ("busy_ns", "pread_ns", "copy_ns", "sync_ns")
                }
                rows.append(
                    {"threads": threads, "piece_kb": piece_kb, "records": n, "device_busy": busy, "us": round(us, 1),
                     "gbps": round(nbytes / us / 1e3, 2), **per,
                     "copies": round(c["copies"] / c["calls"], 1)}
                )  # fmt: skip
                log(rows[-1])
        r.close()
    store.close()
    finish(a, "native_read", {"layer": layer, "pool_mode": store.pool_mode,
                              "direct": a.direct, "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
