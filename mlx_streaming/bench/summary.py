"""The fields a benchmark run reports: the seed script's, plus I/O, memory by source,
host time per layer call and per-layer counters."""

from __future__ import annotations

import mlx.core as mx

from ..core.cache.stats import per_call_us

PHASES = {  # the store's stats of a layer call's host phases, by their names here
    "ahead_s": "beside_device",
    "sync_s": "routing_wait",
    "host_s": "plan",
    "read_s": "read_wait",
    "graph_s": "graph",
}
MEMORY_SOURCES = {
    "rss_*": "the process's resident set size (OS); on macOS it leaves out Metal buffers",
    "mlx_*": "MLX's allocator: active = bytes in live arrays, peak = most since the "
    "timed runs began; on Metal and CUDA this is the GPU's memory",
}


def summarize(cfg, store, timed, ids, load_s, cal_s, after_patch, after_gen, sampler) -> dict:
    """The result fields of one benchmark run (the seed's, then ours)."""
    meta = store.meta
    totals, first = store.totals(), timed["first"] or store.totals()
    gen = max(1, timed["generated_tokens"])
    decode_lookups = (totals["hits"] + totals["misses"]) - (first["hits"] + first["misses"])
    decode_hits = totals["hits"] - first["hits"]
    fast, fall = store.fastpath_calls, store.fallback_calls
    decode = {
        k: totals[k] - first.get(k, 0)
        for k in (
            "gap_s",
            "device_s",
            "device_kernel_s",
            "device_path_calls",
            "device_calls",
            "host_calls",
            *PHASES,
        )
    }
    decode_calls = decode["device_calls"] + decode["host_calls"]
    caps = [store.capacity(li) for li in store.layers]
    out = {
        "mode": "streaming_filebacked",
        "model": cfg.model,
        "expert_dir": str(meta.root),
        "expert_bits": meta.dims.get("bits"),
        "expert_group": meta.dims.get("group_size"),
        "proj_bits": meta.dims.get("proj_bits"),
        "layered": "per_layer_proj_bits" in meta.dims,
        "per_layer_slots": caps[0] if cfg.stream.budget_gb is None else None,
        "slots_per_layer": {str(li): c for li, c in zip(store.layers, caps)},
        "budget_gb": cfg.stream.budget_gb,
        "policy": store.runtime.policy,
        "runtime": store.runtime.to_json(),  # every choice made by backend, and why
        "pool_mode": store.runtime.pool_mode,
        "reader": store.runtime.reader,
        "decode_path": store.runtime.decode_path,
        "mapped_gb": round(store.totals()["mapped_bytes"] / 1e9, 2),  # page-locked on CUDA
        "overlap": store.runtime.overlap,
        "prefetch": store.runtime.prefetch,
        "pool_profile": len(set(caps)) > 1 or cfg.stream.pool_profile not in ("auto", "none", None),
        "wired_gb": cfg.wired_gb,
        "cache_limit_gb": cfg.stream.cache_limit_gb,
        "clear_on_evict": cfg.stream.clear_on_evict,
        "pin_hot": cfg.pin_hot,
        "cal_s": cal_s,
        "warmup_tok": cfg.max_tokens if cfg.warmup_tokens is None else cfg.warmup_tokens,
        "repeat": cfg.repeat,
        "cold": cfg.cold,
        "direct_io": store.runtime.direct_io,
        "threads": store.runtime.threads,
        "prefill_chunk": cfg.prefill_chunk,
        "patched_moe_layers": len(store.layers),
        "num_experts": meta.num_experts,
        "top_k": meta.top_k,
        "resident_experts": store.resident_count(),
        "pinned_experts": store.pinned_count(),
        "pool_gb": round(store.pool_bytes() / 1e9, 4),
        "expert_mb": round(meta.expert_bytes() / 1e6, 3),
        "load_patch_s": round(load_s, 2),
        **{
            k: timed[k]
            for k in (
                "tok_per_s",
                "tok_per_s_runs",
                "tok_per_s_minmax",
                "decode_tok_per_s",
                "decode_tok_per_s_runs",
                "prefill_tok_per_s",
                "generated_tokens",
            )
        },
        "prompt_tokens": len(ids),
        # the prompt's time to the first token, median of the timed runs (cold with --cold)
        "ttft_s": round(len(ids) / timed["prefill_tok_per_s"], 4)
        if timed["prefill_tok_per_s"]
        else None,
        "memory_limit_gb": cfg.memory_limit_gb,
        "memory_sources": MEMORY_SOURCES,
        "rss_gb_after_patch": round(after_patch.rss_bytes / 1e9, 3),
        "rss_gb_after_gen": round(after_gen.rss_bytes / 1e9, 3),
        "peak_rss_gb": round(after_gen.peak_rss_bytes / 1e9, 3),
        "mlx_active_gb_after_gen": round(after_gen.mlx_active_bytes / 1e9, 3),
        "mlx_peak_gb": round(after_gen.mlx_peak_bytes / 1e9, 3),
        "timed_peak_rss_gb": round(sampler.peak_rss / 1e9, 3),
        "timed_peak_mlx_active_gb": round(sampler.peak_mlx / 1e9, 3),
        "expert_hit_rate": round(store.hit_rate(), 4),
        "expert_hits": store.hits,
        "expert_misses": store.misses,
        "decode_hit_rate": round(decode_hits / decode_lookups, 4) if decode_lookups else None,
        "evictions": totals["evictions"],
        "bytes_read": totals["bytes_read"],
        "bytes_read_per_token": round(
            (totals["bytes_read"] - first["bytes_read"]) / max(1, gen - 1)
        ),
        # of those, read from the files (the rest traded with a swap tier: host memory)
        "file_bytes_read_per_token": round(
            (totals["file_bytes_read"] - first.get("file_bytes_read", 0)) / max(1, gen - 1)
        ),
        "swap_tier_gb": round(totals["swap_tier_bytes"] / 1e9, 3),
        "prefill_bytes_read": first.get("bytes_read", 0),
        "prefill_bytes_per_token": round(first.get("bytes_read", 0) / max(1, len(ids))),
        "read_wait_s": round(totals["read_s"], 4),
        "read_gbps": round(totals["read_gbps"], 3),
        "host_us_per_layer_call": round(totals["host_us_per_call"], 1),
        # decode only (the last run after its first token): the store's host time per
        # MoE layer call, and the share of decode time in which the device had no routed
        # expert work queued (routing read to expert launch, host path; 0 on the device
        # path and for full pools)
        "decode_host_us_per_layer_call": round(1e6 * decode["host_s"] / max(1, decode_calls), 1),
        # ... split into the phases of a layer call (µs per call): work beside the
        # device's (launching the routing, the deferred policy update, read-ahead),
        # waiting for the routing, planning, waiting for reads, building the expert graph
        "decode_phases_us_per_layer_call": {
            name: round(1e6 * decode[k] / max(1, decode_calls), 1) for k, name in PHASES.items()
        },
        "decode_device_gap_share": round(decode["gap_s"] / timed["decode_s"], 4),
        # decode's calls by path: served on the device (every expert resident, or the
        # device path), of them the device path's and their host µs each (the expert
        # graph's build not included); those that read the routing
        "decode_device_calls": decode["device_calls"],
        "decode_device_path_calls": decode["device_path_calls"],
        "decode_host_calls": decode["host_calls"],
        "decode_device_call_us": per_call_us(decode["device_s"], decode["device_path_calls"]),
        # ... of it, MLX building the plan kernel's op (the rest: the store's Python)
        "decode_device_kernel_us": per_call_us(
            decode["device_kernel_s"], decode["device_path_calls"]
        ),
        "prefetched": totals["prefetched"],
        "prefetch_used": totals["prefetch_used"],
        "prefetch_on_time": totals["prefetch_on_time"],
        "prefetch_precision": _r(totals["prefetch_precision"]),
        "prediction_precision": _r(totals["prediction_precision"]),
        "prediction_recall": _r(totals["prediction_recall"]),
        "host_syncs": totals["host_calls"],
        "gpu_fastpath": fast,
        "gpu_fallback": fall,
        "gpu_fastpath_frac": round(fast / max(1, fast + fall), 4),
        "device": str(mx.default_device()),
        "sample": timed["text"][:240],
        "layers": {
            str(li): {k: r[k] for k in ("hits", "misses", "bytes_read", "slots")}
            | {"hit_rate": round(r["hits"] / max(1, r["hits"] + r["misses"]), 4)}
            for li, r in store.layer_report().items()
        },
    }
    if cfg.memory_series:
        out["memory_series"] = sampler.series[:: max(1, len(sampler.series) // 300)]
    return out


def _r(v):
    return None if v is None else round(v, 4)
