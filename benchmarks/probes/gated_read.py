"""What a bounded swap tier's reads gain by starting beside its trades (a gated read).

A miss outside the tier is read from the files into a slot whose victim the GPU is still
trading out to the tier. Before, the host waited for the trades, then started the read:
``trade + read``. A gated read (``NativeReader.start(..., after=wait)``) reads at once and
copies into the slots once the wait has returned: ``max(trade, read)`` plus the copy.
This probe times both for 1, 2 and 4 records of one layer, with a trade of each length:
on CUDA a real queued matmul chain of about that length (``after`` evaluates it), else a
sleep standing in for the device. Median µs per call, and the gated call's share of the
serial one against the ideal ``max / sum``.

    python benchmarks/probes/gated_read.py --preset dsv2-lite --workdir /tmp/mlxs [--direct]
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
from harness import build, finish, log, numbers, parser  # noqa: E402


def trade_of(ms: float, on_cuda: bool):
    """A queued stand-in for the trades lasting about ``ms``: it returns their wait."""
    if not on_cuda:
        end = time.perf_counter() + ms / 1e3
        return lambda: time.sleep(max(0.0, end - time.perf_counter()))
    x = mx.random.normal((2048, 2048))
    mx.eval(x)
    t0 = time.perf_counter()
    mx.eval(x @ x)
    one = max(1e-5, time.perf_counter() - t0)
    y = x
    for _ in range(max(1, round(ms / 1e3 / one))):
        y = (y @ x) * 1e-3
    mx.async_eval(y)
    return lambda: mx.eval(y)


def main():
    p = parser(__doc__, preset="dsv2-lite-cpu", trace=False, workdir="/tmp/mlxs")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--direct", action="store_true", help="read with O_DIRECT (the disk)")
    p.add_argument("--trade-ms", type=numbers(float, 0), default=[0.5, 1.0, 2.0])
    a = p.parse_args()
    from mlx_streaming.core.cache.expert_store import FileExpertStore
    from mlx_streaming.core.io import cuda
    from mlx_streaming.core.io.native import NativeReader

    ck, ed, meta = build(a)
    store = FileExpertStore(ed, meta.num_experts // 2)
    layer = store.layers[len(store.layers) // 2]
    on_cuda = store.pool_mode == "cuda"
    threads = max(1, min(15, (os.cpu_count() or 2) - 1))
    r = NativeReader(meta, store.pools, threads=threads, checksums=False, direct=a.direct,
                     cuda=cuda if on_cuda else None)  # fmt: skip
    rng = np.random.default_rng(0)
    rows = []
    for ms in a.trade_ms:
        for n in (1, 2, 4):
            times = {"serial": [], "gated": []}
            for i in range(a.repeat):
                for mode in ("serial", "gated") if i % 2 else ("gated", "serial"):
                    experts = rng.choice(meta.num_experts, n, replace=False)
                    wait = trade_of(ms, on_cuda)
                    t0 = time.perf_counter()
                    if mode == "serial":
                        wait()
                        r.start(layer, experts, np.arange(n)).result()
                    else:
                        r.start(layer, experts, np.arange(n), after=wait).result()
                    times[mode].append(1e6 * (time.perf_counter() - t0))
            alone = []
            for _ in range(a.repeat):
                experts = rng.choice(meta.num_experts, n, replace=False)
                t0 = time.perf_counter()
                r.start(layer, experts, np.arange(n)).result()
                alone.append(1e6 * (time.perf_counter() - t0))
            med = {k: statistics.median(v) for k, v in times.items()}
            read, trade = statistics.median(alone), med["serial"] - statistics.median(alone)
            row = {
                "trade_ms": ms, "records": n, "read_us": round(read),
                "serial_us": round(med["serial"]), "gated_us": round(med["gated"]),
                "gated_of_serial": round(med["gated"] / med["serial"], 3),
                "ideal": round(max(trade, read) / (trade + read), 3),
            }  # fmt: skip
            rows.append(row)
            log(row)
    r.close()
    store.close()
    finish(a, "gated_read", {"direct": a.direct, "threads": threads, "rows": rows})


if __name__ == "__main__":
    main()
