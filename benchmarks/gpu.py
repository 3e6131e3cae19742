"""Where a streamed GPU decode step goes, and the primitives it rests on (one script for
the probe and the profile).

Probe (``--probe``): whether MLX memory is host-visible (records read straight into a
pool?), host-to-device bandwidth of array creation and of pinned ``cudaMemcpyAsync``, the
cost of reading the routing on the host once per layer, raw random-record read bandwidth
(page cache and O_DIRECT, several thread counts).

Profile (default): per configuration (every expert resident; resident with the routing
read on the host; 50% and 25% resident), decode tok/s, the store's host time per layer
call, the time it waited for reads, misses per token.

    python benchmarks/gpu.py --preset dsv2-lite --json out.json [--probe]
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
from harness import (
    PROMPT,
    build,
    decode_run,
    finish,
    log,
    parser,
    routing_trace,
    slots_at,
    streamed,
)


def _median(f, n=7) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def probe(record_mb: float, file_gb: float, path: str) -> dict:
    out = {}
    a = mx.zeros((8, 1 << 20), dtype=mx.uint8)
    mx.eval(a)
    try:
        v = np.array(a, copy=False)
        v[3, :] = 7
        out["host_write_seen_by_device"] = int(a[3].astype(mx.uint32).sum().item()) == 7 << 20
    except Exception as e:  # noqa: BLE001
        out["host_view_error"] = repr(e)
    n = int(record_mb * 1e6) // 4 * 4
    host = np.random.randint(0, 255, n, dtype=np.uint8)
    out["h2d_array_gbps"] = round(n / _median(lambda: mx.eval(mx.array(host))) / 1e9, 2)
    from mlx_streaming.core.io import cuda

    if cuda.available():
        src = cuda.page_locked(n)
        src[:] = host
        from mlx_streaming.core.cache.pool import device_address

        dst = mx.zeros((n,), mx.uint8)
        mx.eval(dst)
        ptr = device_address(dst)

        def copy():
            cuda.copy_to_device(ptr, src.ctypes.data, n)
            cuda.synchronize()

        out["h2d_pinned_copy_gbps"] = round(n / _median(copy) / 1e9, 2)
    x, w = mx.random.normal((1, 2048)), mx.random.normal((2048, 512))
    mx.eval(x, w)

    def chain(sync: bool):
        y = x
        for _ in range(48):
            y = mx.tanh(y @ w @ w.T * 1e-3)
            if sync:
                np.array(mx.argmax(y, axis=-1))
        mx.eval(y)

    chain(True)
    out["48_layers_no_sync_ms"] = round(_median(lambda: chain(False)) * 1e3, 3)
    out["48_layers_sync_each_ms"] = round(_median(lambda: chain(True)) * 1e3, 3)
    out["read"] = read_bandwidth(file_gb, record_mb, path)
    return out


def read_bandwidth(file_gb: float, record_mb: float, path: str) -> dict:
    rec = (int(record_mb * 1e6) + 4095) // 4096 * 4096
    n = int(file_gb * 1e9) // rec
    if not os.path.exists(path) or os.path.getsize(path) < n * rec:
        with open(path, "wb") as f:
            chunk = np.random.randint(0, 255, 64 << 20, dtype=np.uint8).tobytes()
            for _ in range(0, n * rec, len(chunk)):
                f.write(chunk)
    rng = np.random.default_rng(0)
    out = {"record_bytes": rec, "file_gb": round(n * rec / 1e9, 2)}
    for direct in (False, True):
        if direct and not hasattr(os, "O_DIRECT"):
            out["odirect"] = "not on this OS"
            continue
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        for threads in (1, 4, 8, 16):
            ids = rng.choice(n, size=min(n, 64), replace=False)
            bufs = [np.frombuffer(mmap.mmap(-1, rec), np.uint8) for _ in range(threads)]

            def one(j, ids=ids, bufs=bufs, threads=threads, fd=fd):
                return os.preadv(fd, [memoryview(bufs[j % threads])], int(ids[j]) * rec)

            if not direct:  # warm the page cache for these records first
                for j in range(len(ids)):
                    one(j)
            t = time.perf_counter()
            with ThreadPoolExecutor(threads) as ex:
                total = sum(ex.map(one, range(len(ids))))
            key = f"{'odirect' if direct else 'warm'}_gbps_t{threads}"
            out[key] = round(total / (time.perf_counter() - t) / 1e9, 2)
        os.close(fd)
    return out


def profile(a, ck, ed, meta, trace, start) -> list[dict]:
    configs = [
        ("resident", 1.0, {}),
        ("resident+host sync", 1.0, {"record": True}),
        ("50%", 0.5, {}),
        ("25%", 0.25, {}),
    ]
    out = []
    for name, r, kw in configs:
        slots = slots_at(meta, r)
        model, tok, store, _ = streamed(ck, ed, trace, start, slots=slots, threads=a.threads, **kw)
        ids = tok.encode(PROMPT)
        decode_run(model, tok, ids, a.tokens)
        runs = []
        for _ in range(3):
            store.reset_stats()
            runs.append(decode_run(model, tok, ids, a.tokens))
        t = store.totals()
        n = runs[-1][2] + len(ids)
        rec = {
            "config": name,
            "slots": slots,
            "pool_mode": store.pool_mode,
            "tok_per_s": round(statistics.median(r[0] for r in runs), 2),
            "hit_rate": round(t["hit_rate"], 4),
            "host_us_per_layer_call": round(t["host_us_per_call"], 1),
            "read_wait_ms_per_token": round(1e3 * t["read_s"] / n, 3),
            "host_syncs_per_token": round(t["host_calls"] / n, 2),
            "misses_per_token": round(t["misses"] / n, 2),
        }
        log(rec)
        out.append(rec)
        store.close()
        del model
        mx.clear_cache()
    return out


def main():
    p = parser(__doc__, preset="dsv2-lite", workdir="scratch/gpu")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--probe", action="store_true", help="the primitives too")
    p.add_argument("--record-mb", type=float, default=4.87)
    p.add_argument("--file-gb", type=float, default=2.0)
    p.add_argument("--probe-file", default="/tmp/mlxs_probe.bin")
    a = p.parse_args()
    t0 = time.perf_counter()
    res = {}
    if a.probe:
        res["probe"] = probe(a.record_mb, a.file_gb, a.probe_file)
        log(res["probe"])
    ck, ed, meta = build(a)
    trace, start = routing_trace(a)
    res["profile"] = profile(a, ck, ed, meta, trace, start)
    finish(a, "gpu", {"preset": a.preset, **res}, t0)


if __name__ == "__main__":
    main()
