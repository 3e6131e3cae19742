"""Decode speed against the physical limit, side by side with stock mlx-lm.

One process: builds (or reuses) a synthetic checkpoint, loads stock mlx-lm fully resident
and a streamed model per configuration, replays a real routing trace in both, and
alternates timed generations (stock, streamed, stock, ...) so that the shared machine's
noise hits both alike. Reports medians and, per configuration:

* resident parity: streamed decode over stock decode with every expert resident;
* under a budget (fraction of experts resident), warm and cold page cache: tok/s, hit
  rate, bytes read per token, the reader's bandwidth, ``t_compute`` (stock's time per
  token), the overlap bound ``max(t_compute, miss_bytes / B)``, the serial bound, and
  efficiency = overlap-bound time / measured time (B: raw random-record read bandwidth
  of the expert files, measured here warm or cold);
* prefill of a long prompt at one budget: bytes read against the ideal (each distinct
  expert of each chunk read once) and prefill tok/s against stock;
* exactness: greedy tokens and logits identical to stock for every configuration.

    python benchmarks/speed.py --preset dsv2-lite-cpu \\
        --trace ../shared/traces/deepseek-v2-lite.npz --json benchmarks/results/speed-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np


def _log(*a):
    print(*a, file=sys.stderr, flush=True)


def decode_run(model, tok, ids, tokens, prefill):
    """(decode tok/s, prefill tok/s, generated) of one stream_generate run."""
    from mlx_lm import stream_generate

    last = None
    for r in stream_generate(model, tok, ids, max_tokens=tokens, prefill_step_size=prefill):
        last = r
    return last.generation_tps, last.prompt_tps, last.generation_tokens


def open_streamed(ck, ed, slots, trace, start, opts, store_kw):
    from mlx_lm import load

    from mlx_streaming import FileExpertStore, patch_model_filebacked
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.planning.trace import apply_trace_routing

    model, _ = load(str(ck), lazy=True)
    store = FileExpertStore(ed, capacity=slots, **store_kw)
    d = load_meta(ed).dims
    patch_model_filebacked(model, store, d["hidden"], d["moe_inter"], d["group_size"],
                           d["bits"], options=opts)
    routing = apply_trace_routing(model, trace, start) if trace else _NoRouting()
    return model, store, routing


class _NoRouting:
    """Stands in for a TraceRouting when the model's own router decides."""

    cursor = 0


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="dsv2-lite-cpu")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--workdir", default="scratch/speed")
    p.add_argument("--trace", default=str(Path(__file__).resolve().parents[2] / "shared"
                                          / "traces" / "deepseek-v2-lite.npz"))
    p.add_argument("--residency", default="1,0.5,0.25,0.125")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cold", default="both", choices=["warm", "cold", "both"])
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--prefill-residency", type=float, default=0.25)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--prefetch", action="store_true")
    p.add_argument("--limited-residency", type=float, default=0.0,
                   help="also run streamed alone at this residency with MLX's memory "
                        "limited to trunk + pool + 1 GB")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--pool-mode")
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()

    from mlx_lm import load

    from mlx_streaming.bench.run import drop_page_cache, measure_read_gbps
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.core.prefetch.patch import StreamOptions
    from mlx_streaming.core.prefetch.predictor import TransitionPredictor
    from mlx_streaming.prep.split_experts import split_model
    from mlx_streaming.synthetic import make_checkpoint
    from mlx_streaming.planning.trace import RoutingTrace, apply_trace_routing
    from mlx_streaming.analysis.verify import compare_traces, greedy_trace

    t_start = time.perf_counter()
    root = Path(a.workdir)
    tag = a.preset + (f"-{a.num_layers}l" if a.num_layers else "")
    ck = make_checkpoint(root / tag, a.preset, num_layers=a.num_layers)
    ed = root / f"{tag}-experts"
    split_model(ck, ed)
    meta = load_meta(ed)
    files = [meta.file(li) for li in meta.layers]
    trace = train = None
    start = 0
    if a.trace != "none":
        trace = RoutingTrace.load(a.trace)
        train, _ = trace.split(0.5)
        start = train.tokens  # replay held-out routing
    _log(f"built/split in {time.perf_counter() - t_start:.0f}s")

    stock, tok = load(str(ck))
    stock_routing = apply_trace_routing(stock, trace, start) if trace else _NoRouting()
    ids = tok.encode("Explain how a mixture of experts model routes tokens, briefly.")
    store_kw = {"threads": a.threads, "verify": not a.no_verify}
    if a.pool_mode:
        store_kw["pool_mode"] = a.pool_mode
    opts = StreamOptions(
        overlap=a.overlap, prefetch=a.prefetch,
        predictor=TransitionPredictor.from_trace(train, meta.top_k)
        if a.prefetch and trace else "router")

    # warm up stock (compiles kernels)
    decode_run(stock, tok, ids, a.tokens, 2048)
    warm_gbps = measure_read_gbps(meta, a.threads, False, cold=False)
    cold_gbps = measure_read_gbps(meta, a.threads, False, cold=True)
    results = {"stock_decode_runs": []}
    configs = []
    for r in [float(x) for x in a.residency.split(",")]:
        temps = ["warm"] if r >= 1 else {"warm": ["warm"], "cold": ["cold"],
                                         "both": ["warm", "cold"]}[a.cold]
        configs += [(r, t) for t in temps]

    out_cfgs = []
    for r, temp in configs:
        slots = max(meta.top_k, round(r * meta.num_experts))
        model, store, routing = open_streamed(ck, ed, slots, trace, start, opts, store_kw)
        decode_run(model, tok, ids, a.tokens, 2048)  # warm up: fill the pool, compile
        first = store.layers[0]
        ptrs = store.pool(first).data_pointers()
        s_runs, k_runs, per_run = [], [], []
        for _ in range(a.repeat):
            k_runs.append(decode_run(stock, tok, ids, a.tokens, 2048)[0])
            if temp == "cold":
                drop_page_cache(files)
            store.reset_stats()
            tps, _, n = decode_run(model, tok, ids, a.tokens, 2048)
            s_runs.append(tps)
            t = store.totals()
            per_run.append({"bytes": t["bytes_read"], "hits": t["hits"], "misses": t["misses"],
                            "tokens": n + len(ids), "prefetched": t["prefetched"],
                            "prefetch_used": t["prefetch_used"],
                            "prefetch_on_time": t["prefetch_on_time"]})
        results["stock_decode_runs"] += k_runs
        # exactness on this configuration: same trace position for both
        stock_routing.cursor = routing.cursor = start
        want = greedy_trace(stock, ids, 16)
        stock_routing.cursor = routing.cursor = start
        exact = compare_traces(want, greedy_trace(model, ids, 16)).exact
        tot = {k: sum(x[k] for x in per_run) for k in per_run[0]}
        stock_tps, tps = statistics.median(k_runs), statistics.median(s_runs)
        t_compute = 1 / stock_tps
        bpt = tot["bytes"] / tot["tokens"]
        gbps = warm_gbps if temp == "warm" else cold_gbps
        io = bpt / (gbps * 1e9)
        bound, serial, actual = max(t_compute, io), t_compute + io, 1 / tps
        rec = {
            "residency": r, "slots": slots, "page_cache": temp,
            "decode_tok_per_s": round(tps, 3), "decode_runs": [round(x, 3) for x in s_runs],
            "stock_decode_tok_per_s": round(stock_tps, 3),
            "stock_runs": [round(x, 3) for x in k_runs],
            "ratio_vs_stock": round(tps / stock_tps, 4),
            "hit_rate": round(tot["hits"] / max(1, tot["hits"] + tot["misses"]), 4),
            "bytes_read_per_token": round(bpt),
            "read_gbps": round(store.reader.stats.gbps(), 3),
            "storage_gbps": round(gbps, 3),
            "t_compute_ms": round(t_compute * 1e3, 2), "t_io_ms": round(io * 1e3, 2),
            "bound_tok_per_s": round(1 / bound, 3), "serial_bound_tok_per_s": round(1 / serial, 3),
            "efficiency": round(bound / actual, 4), "efficiency_vs_serial": round(serial / actual, 4),
            "exact_vs_stock": exact,
            "pool_mode": store.pool_mode,
            "pool_moved": store.pool(first).data_pointers() != ptrs,
            "mlx_write_ops": sum(store.pool(li).write_ops for li in store.layers),
        }
        if a.prefetch:
            rec["prefetch_precision"] = round(tot["prefetch_used"] / max(1, tot["prefetched"]), 4)
            rec["prefetch_recall"] = round(
                tot["prefetch_used"] / max(1, tot["prefetch_used"] + tot["misses"]), 4)
            rec["prefetch_on_time_share"] = round(
                tot["prefetch_on_time"] / max(1, tot["prefetch_used"]), 4)
            rec.update(store.prefetcher.report())
        _log(json.dumps(rec))
        out_cfgs.append(rec)
        store.close()
        del model

    limited = None
    if a.limited_residency:
        # Streamed alone, with MLX's memory capped below the whole model: the pool fits,
        # the model would not.
        import gc

        from mlx.utils import tree_flatten

        slots = max(meta.top_k, round(a.limited_residency * meta.num_experts))
        whole = sum(v.nbytes for _, v in tree_flatten(stock.parameters()))
        del stock
        gc.collect()
        mx.clear_cache()
        model, store, routing = open_streamed(ck, ed, slots, trace, start, opts, store_kw)
        trunk = sum(v.nbytes for _, v in tree_flatten(model.parameters())) - store.pool_bytes()
        limit = int(trunk + store.pool_bytes() + 1e9)
        old_limit = mx.set_memory_limit(limit)
        mx.reset_peak_memory()
        decode_run(model, tok, ids, a.tokens, 2048)
        runs = [decode_run(model, tok, ids, a.tokens, 2048)[0] for _ in range(a.repeat)]
        limited = {"residency": a.limited_residency, "slots": slots,
                   "memory_limit_gb": round(limit / 1e9, 3),
                   "whole_model_gb": round(whole / 1e9, 3),
                   "pool_gb": round(store.pool_bytes() / 1e9, 3),
                   "decode_tok_per_s": round(statistics.median(runs), 3),
                   "mlx_peak_gb": round(mx.get_peak_memory() / 1e9, 3)}
        mx.set_memory_limit(old_limit)
        _log(json.dumps(limited))
        store.close()
        del model
        stock, _ = load(str(ck))
        stock_routing = apply_trace_routing(stock, trace, start) if trace else _NoRouting()

    prefill = None
    if a.prefill_tokens:
        slots = max(meta.top_k, round(a.prefill_residency * meta.num_experts))
        model, store, routing = open_streamed(ck, ed, slots, trace, start, opts, store_kw)
        long_ids = (ids * (a.prefill_tokens // len(ids) + 1))[: a.prefill_tokens]
        decode_run(model, tok, long_ids[:64], 2, a.prefill_chunk)  # compile
        k_runs, s_runs, bytes_runs, ideal_runs = [], [], [], []
        for _ in range(a.repeat):
            stock_routing.cursor = start
            k_runs.append(decode_run(stock, tok, long_ids, 1, a.prefill_chunk)[1])
            store.reset_stats()
            routing.cursor = start
            before = routing.cursor
            s_runs.append(decode_run(model, tok, long_ids, 1, a.prefill_chunk)[1])
            bytes_runs.append(store.totals()["bytes_read"])
            # ideal: every distinct expert of every chunk read once
            if trace is not None:
                rows = trace.experts[(before + np.arange(len(long_ids))) % trace.tokens]
                ideal = 0
                for c in range(0, len(long_ids), a.prefill_chunk):
                    for li_pos, li in enumerate(meta.moe_layers):
                        ideal += len(np.unique(rows[c:c + a.prefill_chunk, li_pos])) \
                            * meta.layers[li].record_bytes
                ideal_runs.append(ideal)
        prefill = {
            "prompt_tokens": len(long_ids), "residency": a.prefill_residency, "slots": slots,
            "chunk": a.prefill_chunk,
            "prefill_tok_per_s": round(statistics.median(s_runs), 2),
            "stock_prefill_tok_per_s": round(statistics.median(k_runs), 2),
            "ratio_vs_stock": round(statistics.median(s_runs) / statistics.median(k_runs), 4),
            "bytes_read": int(statistics.median(bytes_runs)),
            "ideal_bytes": int(statistics.median(ideal_runs)) if ideal_runs else None,
            "bytes_over_ideal": round(statistics.median(bytes_runs)
                                      / statistics.median(ideal_runs), 4) if ideal_runs else None,
            "bytes_read_per_prompt_token": round(statistics.median(bytes_runs) / len(long_ids)),
        }
        _log(json.dumps(prefill))
        store.close()

    result = {
        "benchmark": "speed",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.uname().sysname} {os.uname().machine}, {os.cpu_count()} cores, "
                   f"MLX {mx.__version__} on {mx.default_device()}",
        "command": "python benchmarks/speed.py " + " ".join(sys.argv[1:]),
        "preset": a.preset, "num_layers": a.num_layers,
        "checkpoint": str(ck), "expert_mb": round(meta.expert_bytes() / 1e6, 3),
        "moe_layers": len(meta.moe_layers), "num_experts": meta.num_experts,
        "top_k": meta.top_k, "trace": a.trace, "trace_start": start,
        "tokens": a.tokens, "repeat": a.repeat, "threads": a.threads,
        "prefetch": a.prefetch, "overlap": a.overlap,
        "storage_gbps_warm": round(warm_gbps, 3), "storage_gbps_cold": round(cold_gbps, 3),
        "configs": out_cfgs, "prefill": prefill, "memory_limited": limited,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(result, indent=1))
    if a.json_out:
        Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json_out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
