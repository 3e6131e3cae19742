"""Larger than RAM: decode with the experts kept out of RAM for the whole run, measured
against the storage bound of the same run. ``speed.py --beyond-ram`` runs it.

Two ways to keep the experts out of RAM, both reported:

* ``direct``: the store reads with O_DIRECT (F_NOCACHE on macOS): every miss comes from
  the disk, the page cache never holds an expert.
* ``memlimit``: the process moves into a memory cgroup smaller than the model (trunk +
  pools + what ``--memory-limit-gb`` leaves over), so the page cache can hold only part
  of the expert files: misses come from the page cache or the disk, as on a machine
  with that much memory.

Stock mlx-lm is measured first, with every expert resident (it cannot run within the
limit): its time per token is ``t_compute``, its greedy tokens and logits the exactness
reference. Then, per method and residency, a cold streamed run: the expert files dropped
from the page cache, the store loaded (load time, cold), the first token (TTFT, cold),
then the timed decode runs. In the same run, before the store loads, the storage
bandwidth ``B``: random record-sized reads at the native reader's queue depth (its
threads), cold, the same way the store reads (O_DIRECT or not). Each row reports tok/s,
bytes read per token, ``B``, the overlap bound ``max(t_compute, bytes / B)`` and the serial
bound ``t_compute + bytes / B`` with the run's share of each, and whether the output was
exact.
"""

from __future__ import annotations

import gc
import statistics
import time

import mlx.core as mx
from harness import decode_run, log, rewind, stock, streamed

from mlx_streaming.analysis.verify import compare_traces, greedy_trace
from mlx_streaming.bench.measure import (
    bounds,
    drop_page_cache,
    enter_memory_limit,
    measure_read_gbps,
)
from mlx_streaming.core.mem import cgroup_memory
from mlx_streaming.planning.tiers import simulate_tiers


def disk_read_bytes() -> int:
    """Bytes this process has had read from storage (not the page cache)."""
    with open("/proc/self/io") as f:
        return int(next(x for x in f if x.startswith("read_bytes:")).split()[1])


def page_cache_room() -> int:
    """What the memory cgroup leaves the page cache: its limit less what else it holds."""
    m = cgroup_memory()
    if m is None:
        return 0
    limit, used, cache = m
    return max(0, limit - (used - cache))


def run(a, ck, ed, meta, trace, start, cfg, prompt_ids) -> dict:
    """The larger-than-RAM rows (see the module's text): ``a`` speed.py's arguments,
    ``cfg`` the streaming options, ``prompt_ids(tokenizer)`` the prompt."""
    from mlx_streaming.core.runtime import resolve

    ref, tok, ref_routing = stock(ck, trace, start)
    ids = prompt_ids(tok)
    decode_run(ref, tok, ids, a.tokens)  # warm up stock (compiles kernels)
    k_runs = [decode_run(ref, tok, ids, a.tokens)[0] for _ in range(a.repeat)]
    stock_tps = statistics.median(k_runs)
    rewind(start, ref_routing)
    want = greedy_trace(ref, ids, 16)
    del ref
    gc.collect()
    mx.clear_cache()
    files = [meta.file(li) for li in meta.layers]
    expert_bytes = sum(f.stat().st_size for f in files)
    methods = ["direct", "memlimit"] if a.beyond_ram == "both" else [a.beyond_ram]
    rows, limit = [], None
    for method in methods:  # direct first: the memory limit is for the rest of the process
        if method == "memlimit":
            limit = int(a.memory_limit_gb * 1e9)
            group = enter_memory_limit(limit)
            log(
                f"memory limit {limit / 1e9:.2f} GB ({group}); expert files {expert_bytes / 1e9:.2f} GB"
            )
        mcfg = cfg.replace(direct_io=method == "direct")
        rt = resolve(mcfg, meta)
        for r in [float(x) for x in a.residency.split(",")]:
            slots = max(meta.top_k, round(r * meta.num_experts))
            drop_page_cache(files)
            gbps = measure_read_gbps(
                meta, rt.threads, rt.direct_io, cold=True, engine=rt.reader == "native"
            )
            drop_page_cache([*files, *ck.glob("*.safetensors")])
            t0 = time.perf_counter()
            model, _, store, routing = streamed(ck, ed, trace, start, slots=slots, config=mcfg)
            load_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            first = decode_run(model, tok, ids, 1)  # cold: the prompt and its first token
            ttft = time.perf_counter() - t1
            runs, per_run = [], []
            cursor = routing.cursor if routing is not None else start
            disk0 = disk_read_bytes()
            for _ in range(a.repeat):
                store.reset_stats()
                tps, _, n = decode_run(model, tok, ids, a.tokens)
                runs.append(tps)
                per_run.append((store.totals(), n + len(ids)))
            tokens_run = sum(n for _, n in per_run)
            disk_tok = (disk_read_bytes() - disk0) / tokens_run
            bytes_tok = sum(t["bytes_read"] for t, _ in per_run) / tokens_run
            page_cache = page_cache_room() if method == "memlimit" else 0
            predicted = simulate_tiers(
                trace, rt.policy, slots, page_cache, meta.layers[meta.moe_layers[0]].stride,
                model_layers=len(meta.moe_layers), start=cursor, tokens=tokens_run,
            ) if trace is not None else None  # fmt: skip
            hits = sum(t["hits"] for t, _ in per_run)
            lookups = hits + sum(t["misses"] for t, _ in per_run)
            rewind(start, routing)
            exact = compare_traces(want, greedy_trace(model, ids, 16)).exact
            tps = statistics.median(runs)
            row = {
                "method": method,
                "residency": r,
                "slots": slots,
                "tok_per_s": round(tps, 3),
                "decode_runs": [round(x, 3) for x in runs],
                "ratio_vs_stock": round(tps / stock_tps, 4),
                "hit_rate": round(hits / max(1, lookups), 4),
                "bytes_read_per_token": round(bytes_tok),
                # from the disk itself (/proc/self/io), against the two-tier simulator's
                # prediction for this span of the trace (planning.tiers)
                "disk_bytes_per_token": round(disk_tok),
                "page_cache_room_gb": round(page_cache / 1e9, 3),
                "predicted_disk_bytes_per_token": predicted
                and round(predicted.disk_bytes_per_token),
                "predicted_pool_hit_rate": predicted and round(predicted.shares()["pool"], 4),
                "storage_gbps": round(gbps, 3),
                **bounds(1 / stock_tps, bytes_tok, gbps, tps),
                "ttft_cold_s": round(ttft, 3),
                "prompt_tps_cold": round(first[1], 2),
                "load_cold_s": round(load_s, 2),
                "exact_vs_stock": exact,
                "runtime": store.runtime.to_json(),
            }
            log(row)
            rows.append(row)
            store.close()
            del model
            gc.collect()
    return {
        "stock_tok_per_s": round(stock_tps, 3),
        "stock_runs": [round(x, 3) for x in k_runs],
        "expert_files_gb": round(expert_bytes / 1e9, 3),
        "memory_limit_gb": limit and round(limit / 1e9, 3),
        "rows": rows,
    }
