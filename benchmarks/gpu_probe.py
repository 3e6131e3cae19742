"""Probe the primitives streaming depends on, on the current MLX device.

Prints one JSON object: whether MLX memory is host-visible (can records be read straight
into the pool?), host-to-device array creation speed, the cost of a slot write into pools
of several sizes (is it in place?), the per-layer routing sync, raw read bandwidth of
expert-sized records (page cache and O_DIRECT, several thread counts), and the
exactness of remapped and row-subset gather_qmm on this device.

    python benchmarks/gpu_probe.py [--file-gb 2] [--record-mb 4.87]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np


def _median(f, n=7):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def host_visibility() -> dict:
    a = mx.zeros((8, 1 << 20), dtype=mx.uint8)
    mx.eval(a)
    out = {}
    try:
        v = np.array(a, copy=False)
        out["np_view_writeable"] = bool(v.flags.writeable)
        v[3, :] = 7
        out["host_write_seen_by_device"] = int(a[3].astype(mx.uint32).sum().item()) == 7 << 20
        mx.eval(a + 1)  # the device touches it again
        v[3, :] = 9
        out["host_write_after_device_use_seen"] = int(a[3].astype(mx.uint32).sum().item()) == 9 << 20
        buf = np.full(1 << 20, 5, np.uint8)
        out["host_write_1mb_us"] = round(_median(lambda: v.__setitem__(4, buf)) * 1e6, 1)

        def roundtrip():
            v[5] = buf
            mx.eval(a[5].sum())
        out["host_write_then_device_read_1mb_us"] = round(_median(roundtrip) * 1e6, 1)
    except Exception as e:  # noqa: BLE001
        out["np_view_error"] = repr(e)
    return out


def h2d_and_slot_writes(record_mb: float) -> dict:
    n = int(record_mb * 1e6) // 4 * 4
    host = np.random.randint(0, 255, n, dtype=np.uint8)
    out = {"record_bytes": n}
    t = _median(lambda: mx.eval(mx.array(host)))
    out["h2d_array_gbps"] = round(n / t / 1e9, 2)
    src = mx.array(host).view(mx.uint32)
    mx.eval(src)
    for slots in (8, 64, 256):
        for scatter in (False, True):
            key = f"{'scatter' if scatter else 'slice'}_write_ms_pool{slots}"
            out[key] = round(_slot_write_s(slots, src, scatter) * 1e3, 3)
    return out


def _slot_write_s(slots: int, src: mx.array, scatter: bool) -> float:
    """Median time to write one slot of a ``slots``-slot pool (flat if in place)."""
    pool = mx.zeros((slots, src.size), dtype=src.dtype)
    mx.eval(pool)
    step = [0]

    def write():
        s = step[0] % slots
        step[0] += 1
        if scatter:
            pool[mx.array([s])] = src[None]
        else:
            pool[s:s + 1] = src[None]
        mx.eval(pool)
    return _median(write)


def sync_cost() -> dict:
    x = mx.random.normal((1, 2048))
    w = mx.random.normal((2048, 512))
    mx.eval(x, w)

    def chain(sync: bool):
        y = x
        for _ in range(48):
            y = mx.tanh(y @ w @ w.T * 1e-3)
            if sync:
                np.array(mx.argmax(y, axis=-1))
        mx.eval(y)
    for s in (False, True):
        chain(s)
    return {"48_layers_no_sync_ms": round(_median(lambda: chain(False)) * 1e3, 3),
            "48_layers_sync_each_ms": round(_median(lambda: chain(True)) * 1e3, 3)}


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
    import mmap

    for direct in (False, True):
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(path, flags)
        except OSError as e:
            out["odirect_error"] = repr(e)
            continue
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
            dt = time.perf_counter() - t
            out[f"{'odirect' if direct else 'warm'}_gbps_t{threads}"] = round(total / dt / 1e9, 2)
        os.close(fd)
    return out


def gather_exactness() -> dict:
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    mx.random.seed(0)
    E, D, H, k = 32, 512, 256, 6
    out = {}
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        glu = SwitchGLU(D, H, E)
        glu.set_dtype(dtype)
        nn.quantize(glu, group_size=64, bits=4)
        pool = SwitchGLU(D, H, 12)
        pool.set_dtype(dtype)
        nn.quantize(pool, group_size=64, bits=4)
        for N in (1, 3, 40, 200):
            x = mx.random.normal((1, N, D)).astype(dtype)
            inds = mx.argpartition(mx.random.normal((1, N, E)), kth=-k, axis=-1)[..., -k:]
            ref = glu(x, inds)
            used = sorted(set(np.array(inds).reshape(-1).tolist()))[:12]
            if len(used) < len(set(np.array(inds).reshape(-1).tolist())):
                inds = mx.array(np.array(used)[np.random.randint(0, len(used), (1, N, k))])
                ref = glu(x, inds)
            lut = np.zeros(E, np.int32)
            for s, e in enumerate(reversed(used)):
                lut[e] = s
            for name in ("gate_proj", "up_proj", "down_proj"):
                for a in ("weight", "scales", "biases"):
                    src = getattr(getattr(glu, name), a)
                    dst = mx.zeros_like(getattr(getattr(pool, name), a))
                    dst[mx.array(lut[used])] = src[mx.array(used)]
                    setattr(getattr(pool, name), a, dst)
            slots = mx.array(lut)[inds]
            got = pool(x, slots)
            rows = pool(mx.repeat(x.reshape(-1, D), k, axis=0), slots.reshape(-1, 1))
            out[f"{dtype}_N{N}_remap_exact"] = bool(mx.array_equal(got, ref).item())
            out[f"{dtype}_N{N}_rows_exact"] = bool(
                mx.array_equal(rows.reshape(ref.shape), ref).item())
    return out


def model_exactness(root: str) -> dict:
    """Streamed vs stock on small synthetic models, every pool mode, on this device."""
    from mlx_lm import load

    from mlx_streaming import FileExpertStore, patch_model_filebacked, split_model
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.synthetic import make_checkpoint
    from mlx_streaming.analysis.verify import compare_traces, greedy_trace

    out = {}
    text = "A mixture of experts model routes each token to a few experts out of many. " * 3
    for preset, dtype in (("tiny-qwen3_next", "bfloat16"), ("tiny-gpt_oss", "bfloat16"),
                          ("tiny-deepseek_v3", "float16"), ("tiny-mixtral", "float32")):
        ck = make_checkpoint(f"{root}/{preset}-{dtype}", preset, dtype=dtype)
        ed = f"{root}/{preset}-{dtype}-experts"
        split_model(ck, ed)
        meta = load_meta(ed)
        ref, tok = load(str(ck))
        ids = tok.encode(text)
        want = greedy_trace(ref, ids, 24, 16)
        for mode in ("host", "device"):
            for cap in (meta.top_k, meta.num_experts):
                model, _ = load(str(ck), lazy=True)
                try:
                    store = FileExpertStore(ed, capacity=cap, pool_mode=mode)
                except Exception as e:  # noqa: BLE001
                    out[f"{preset}_{mode}"] = repr(e)
                    break
                d = meta.dims
                patch_model_filebacked(model, store, d["hidden"], d["moe_inter"],
                                       d["group_size"], d["bits"])

                cmp = compare_traces(want, greedy_trace(model, ids, 24, 16))
                out[f"{preset}_{dtype}_{mode}_slots{cap}"] = cmp.exact or cmp.to_json()
                store.close()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--file-gb", type=float, default=2.0)
    p.add_argument("--record-mb", type=float, default=4.87)
    p.add_argument("--path", default="/tmp/mlxs_probe.bin")
    a = p.parse_args()
    res = {"device": str(mx.default_device()), "mlx": mx.__version__}
    for name, fn in [("host", host_visibility),
                     ("h2d", lambda: h2d_and_slot_writes(a.record_mb)),
                     ("sync", sync_cost), ("exact", gather_exactness),
                     ("models", lambda: model_exactness("/tmp/mlxs_probe_models")),
                     ("read", lambda: read_bandwidth(a.file_gb, a.record_mb, a.path))]:
        t = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": repr(e)}
        res[name]["_s"] = round(time.perf_counter() - t, 1)
        print(json.dumps({name: res[name]}), flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
