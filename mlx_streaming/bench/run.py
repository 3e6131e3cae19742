"""End-to-end benchmark of a streamed model, optionally side by side with stock mlx-lm.

``run_bench`` does what the seed script does (split if needed, lazy load, patch, pin,
warm up, timed generations) with every knob an explicit field of ``BenchConfig``, and
returns the seed's JSON fields plus I/O, the prefill/decode split and, with
``compare_stock``, stock mlx-lm's speed on the same prompt and the exactness check.

The physical limit of decode: per token, ``miss_bytes`` must come from storage at
bandwidth ``B`` while the model computes for ``t_compute`` (the resident speed). Fully
overlapped, ``t >= max(t_compute, miss_bytes / B)``; serialised, the sum. ``efficiency``
is the overlap bound's time over the measured time per token.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..core import mem
from ..core.cache.expert_store import FileExpertStore
from ..core.cache.policy import DEFAULT_POLICY
from ..core.format import META_NAME, load_meta
from ..core.io.reader import RecordReader, aligned_buffer
from ..core.prefetch.patch import StreamOptions, patch_model_filebacked
from ..model_builder import _int_keys, load_pool_profile, read_pool_profile, store_kwargs_from
from ..prep.split_experts import resolve_model_path, split_model

DEFAULT_PROMPT = "用三句话解释什么是混合专家模型。"
MEMORY_SOURCES = {
    "rss_*": "the process's resident set size (OS); on macOS it leaves out Metal buffers",
    "mlx_*": "MLX's allocator: active = bytes in live arrays, peak = most since the "
             "timed runs began; on Metal and CUDA this is the GPU's memory",
}


@dataclass(frozen=True)
class BenchConfig:
    """Everything a benchmark run depends on (the seed's environment, as fields)."""

    model: str
    expert_dir: str
    slots: int | None = 8
    budget_gb: float | None = None
    prompt: str = DEFAULT_PROMPT
    max_tokens: int = 128
    warmup_tokens: int | None = None  # default: max_tokens
    repeat: int = 3
    wired_gb: float | None = None
    cache_gb: float | None = None
    clear_on_evict: bool = False
    pin_hot: int = 0
    cal_tokens: int = 32
    expert_bits: int | None = None  # override the meta (seed's EXPERT_BITS)
    expert_group: int | None = None
    pool_profile: str | None = "auto"  # "auto": EXPERT_DIR/pool_profile.json; "none"; a path
    prefill_chunk: int = 2048  # prefill_step_size (0: mlx-lm's default)
    policy: str = DEFAULT_POLICY
    threads: int = 4
    direct_io: bool = False
    verify: bool = True
    pool_mode: str | None = None
    overlap: bool | None = None
    prefetch: bool = False
    predictor: str = "router"  # or "transition" (learned from the routing trace)
    routing_trace: str | None = None
    trace_start: int | None = None  # default: the trace's held-out half
    record_trace: str | None = None
    cold: bool = False  # evict the expert files from the page cache before each timed run
    compare_stock: bool = False
    t_compute_ms: float | None = None  # resident time per token, for the bound
    read_gbps: float | None = None  # storage bandwidth for the bound (default: measured)
    extra: dict = field(default_factory=dict)


@contextlib.contextmanager
def memory_limits(wired_gb: float | None, cache_gb: float | None):
    """Set MLX's wired and cache limits for the duration, restoring them after."""
    old = {}
    try:
        if wired_gb is not None and hasattr(mx, "set_wired_limit"):
            old["wired"] = mx.set_wired_limit(int(wired_gb * 1e9))
        if cache_gb is not None:
            old["cache"] = mx.set_cache_limit(int(cache_gb * 1e9))
        yield
    finally:
        if "wired" in old:
            mx.set_wired_limit(old["wired"])
        if "cache" in old:
            mx.set_cache_limit(old["cache"])


def drop_page_cache(paths) -> None:
    """Evict files from the OS page cache (POSIX_FADV_DONTNEED; no root needed).

    Raises:
        ValueError: the OS has no ``posix_fadvise`` (macOS).
    """
    if not hasattr(os, "posix_fadvise"):
        raise ValueError(
            f"cold runs need posix_fadvise, which {sys.platform} lacks; on macOS flush the "
            "page cache with `sudo purge` before a warm-cache run instead, and use "
            "--direct-io (F_NOCACHE) to keep expert reads out of the cache")
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure_read_gbps(meta, threads: int, direct: bool, records: int = 64,
                      cold: bool = False) -> float:
    """Bandwidth of random whole-record reads from the expert files through the store's
    reader (GB/s)."""
    rng = np.random.default_rng(1)
    layers = list(meta.layers)
    if cold:
        drop_page_cache([meta.file(li) for li in layers])
    reader = RecordReader(threads=threads, direct=direct)
    try:
        picks: dict[int, list[int]] = {}
        for i in range(records):
            li = layers[i % len(layers)]
            picks.setdefault(li, []).append(int(rng.integers(meta.layers[li].num_experts)))
        total, t0 = 0, time.perf_counter()
        for li, ids in picks.items():
            reader.open(li, meta.file(li), meta.layers[li].stride)
            out = aligned_buffer(len(ids) * meta.layers[li].stride)
            total += reader.read(li, ids, out.reshape(len(ids), -1))
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        reader.close()


def _encode(tokenizer, prompt: str) -> list[int]:
    bos = tokenizer.bos_token
    return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))


def _generate(model, tokenizer, ids, max_tokens, cfg: BenchConfig, on_first=None):
    """One generation: (wall seconds, last response, text)."""
    from mlx_lm import stream_generate

    kw = {"prefill_step_size": cfg.prefill_chunk} if cfg.prefill_chunk > 0 else {}
    if cfg.wired_gb is not None:
        kw["prompt_progress_callback"] = mem.keep_wired_limit(int(cfg.wired_gb * 1e9))
    t0 = time.perf_counter()
    text, last = "", None
    for last in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, **kw):
        if on_first is not None and last.generation_tokens == 1:
            on_first()
        text += last.text
    return time.perf_counter() - t0, last, text


def _timed_runs(model, tokenizer, ids, cfg: BenchConfig, store=None, files=()) -> dict:
    warm = cfg.max_tokens if cfg.warmup_tokens is None else cfg.warmup_tokens
    if warm > 0:
        _generate(model, tokenizer, ids, warm, cfg)
    mem.reset_peak()
    runs, text, last, first = [], "", None, {}
    for r in range(cfg.repeat):
        if cfg.cold and files:
            drop_page_cache(files)
        if store is not None and r == cfg.repeat - 1:
            store.reset_stats()

            def on_first():
                first.update(store.totals())
        else:
            on_first = None
        wall, last, text = _generate(model, tokenizer, ids, cfg.max_tokens, cfg, on_first)
        runs.append({"wall_s": wall, "tokens": last.generation_tokens,
                     "prompt_tps": last.prompt_tps, "generation_tps": last.generation_tps})
    tps = [round(r["tokens"] / r["wall_s"], 2) for r in runs]
    return {
        "tok_per_s": statistics.median(tps),
        "tok_per_s_runs": tps,
        "tok_per_s_minmax": [min(tps), max(tps)],
        "decode_tok_per_s": round(statistics.median(r["generation_tps"] for r in runs), 2),
        "decode_tok_per_s_runs": [round(r["generation_tps"], 2) for r in runs],
        "prefill_tok_per_s": round(statistics.median(r["prompt_tps"] for r in runs), 2),
        "generated_tokens": runs[-1]["tokens"],
        "text": text,
        "first": first,
    }


def _trace_setup(cfg: BenchConfig):
    """(trace, start, predictor or None) for trace routing."""
    from ..planning.trace import RoutingTrace

    trace = RoutingTrace.load(cfg.routing_trace)
    train, _ = trace.split(0.5)
    start = cfg.trace_start if cfg.trace_start is not None else train.tokens
    return trace, start, train


def open_streamed(cfg: BenchConfig):
    """Split if needed, load lazily, open the store and patch: ``(model, tok, store, n)``."""
    from mlx_lm import load

    model_dir = resolve_model_path(cfg.model)
    if not (Path(cfg.expert_dir) / META_NAME).exists():
        split_model(model_dir, cfg.expert_dir)
    meta = load_meta(cfg.expert_dir)
    if cfg.pool_profile in (None, "none"):
        caps = None
    elif cfg.pool_profile == "auto":
        caps = load_pool_profile(cfg.expert_dir)
    else:
        caps = read_pool_profile(cfg.pool_profile)
    kw = store_kwargs_from(meta, slots=cfg.slots if cfg.budget_gb is None else None,
                           budget_gb=cfg.budget_gb, layer_caps=caps)
    model, tokenizer = load(str(model_dir), lazy=True)
    store = FileExpertStore(cfg.expert_dir, clear_on_evict=cfg.clear_on_evict,
                            record=cfg.pin_hot > 0, policy=cfg.policy, threads=cfg.threads,
                            direct_io=cfg.direct_io, verify=cfg.verify, pool_mode=cfg.pool_mode,
                            **kw)
    predictor = cfg.predictor
    if cfg.prefetch and predictor == "transition":
        from ..core.prefetch.predictor import TransitionPredictor

        if not cfg.routing_trace:
            raise ValueError("the transition predictor learns from --routing-trace")
        predictor = TransitionPredictor.from_trace(_trace_setup(cfg)[2], meta.top_k)
    d = meta.dims
    n = patch_model_filebacked(
        model, store, d["hidden"], d["moe_inter"],
        cfg.expert_group or d.get("group_size"), cfg.expert_bits or d.get("bits"),
        proj_bits=d.get("proj_bits"), layer_proj_bits=_int_keys(d.get("per_layer_proj_bits")),
        options=StreamOptions(overlap=cfg.overlap, prefetch=cfg.prefetch, predictor=predictor))
    return model, tokenizer, store, n


def run_bench(cfg: BenchConfig) -> dict:
    """Run the benchmark; returns the JSON-ready result dict."""
    if cfg.cold and not hasattr(os, "posix_fadvise"):
        drop_page_cache([])  # raises the clear error before anything is loaded
    with memory_limits(cfg.wired_gb, cfg.cache_gb):
        return _run(cfg)


def _bounds(t_compute: float | None, bytes_per_token: float, gbps: float | None,
            decode_tps: float) -> dict:
    if not t_compute or not gbps:
        return {}
    io = bytes_per_token / (gbps * 1e9)
    overlap, serial = max(t_compute, io), t_compute + io
    actual = 1.0 / decode_tps if decode_tps else float("inf")
    return {
        "t_compute_ms": round(t_compute * 1e3, 3),
        "t_io_ms": round(io * 1e3, 3),
        "bound_tok_per_s": round(1 / overlap, 2),
        "serial_bound_tok_per_s": round(1 / serial, 2),
        "efficiency": round(overlap / actual, 4),
        "efficiency_vs_serial": round(serial / actual, 4),
    }


def _run(cfg: BenchConfig) -> dict:
    mem.reset_peak()
    t0 = time.perf_counter()
    model, tokenizer, store, n_patched = open_streamed(cfg)
    t1 = time.perf_counter()
    after_patch = mem.snapshot()
    ids = _encode(tokenizer, cfg.prompt)
    meta = store.meta
    files = [meta.file(li) for li in meta.layers]

    trace_info = {}
    if cfg.routing_trace:
        from ..planning.trace import apply_trace_routing

        trace, start, _ = _trace_setup(cfg)
        apply_trace_routing(model, trace, start)
        trace_info = {"routing_trace": cfg.routing_trace, "trace_model": trace.model,
                      "trace_start": start}
    recorder = None
    if cfg.record_trace:
        from ..planning.trace import TraceRecorder

        recorder = TraceRecorder(store.layers, meta.num_experts, str(cfg.model))
        store.observers.append(recorder)

    cal_s = 0.0
    if cfg.pin_hot > 0:
        tc = time.perf_counter()
        _generate(model, tokenizer, ids, cfg.cal_tokens, cfg)
        for li in store.recorded_layers():
            store.pin(li, store.hot(li, cfg.pin_hot))
        store.record = False
        store.reset_stats()
        cal_s = round(time.perf_counter() - tc, 2)

    with mem.MemorySampler() as sampler:
        timed = _timed_runs(model, tokenizer, ids, cfg, store, files)
    mem.clear_cache()
    after_gen = mem.snapshot()
    totals, first = store.totals(), timed["first"] or store.totals()
    gen = max(1, timed["generated_tokens"])
    decode_bytes = (totals["bytes_read"] - first["bytes_read"]) / max(1, gen - 1)
    decode_lookups = (totals["hits"] + totals["misses"]) - (first["hits"] + first["misses"])
    decode_hits = totals["hits"] - first["hits"]
    out = {
        "mode": "streaming_filebacked",
        "model": cfg.model,
        "expert_dir": str(cfg.expert_dir),
        "expert_bits": cfg.expert_bits or meta.dims.get("bits"),
        "expert_group": cfg.expert_group or meta.dims.get("group_size"),
        "proj_bits": meta.dims.get("proj_bits"),
        "layered": "per_layer_proj_bits" in meta.dims,
        "per_layer_slots": store.capacity(store.layers[0]) if cfg.budget_gb is None else None,
        "slots_per_layer": {str(li): store.capacity(li) for li in store.layers},
        "budget_gb": cfg.budget_gb,
        "policy": cfg.policy,
        "pool_mode": store.pool_mode,
        "overlap": cfg.overlap,
        "prefetch": cfg.prefetch,
        "pool_profile": any(store.capacity(li) != store.capacity(store.layers[0])
                            for li in store.layers) or cfg.pool_profile not in ("auto", "none", None),
        "wired_gb": cfg.wired_gb,
        "cache_gb": cfg.cache_gb,
        "clear_on_evict": cfg.clear_on_evict,
        "pin_hot": cfg.pin_hot,
        "cal_s": cal_s,
        "warmup_tok": cfg.max_tokens if cfg.warmup_tokens is None else cfg.warmup_tokens,
        "repeat": cfg.repeat,
        "cold": cfg.cold,
        "direct_io": cfg.direct_io,
        "threads": cfg.threads,
        "prefill_chunk": cfg.prefill_chunk,
        "patched_moe_layers": n_patched,
        "num_experts": meta.num_experts,
        "top_k": meta.top_k,
        "resident_experts": store.resident_count(),
        "pinned_experts": store.pinned_count(),
        "pool_gb": round(store.pool_bytes() / 1e9, 4),
        "expert_mb": round(meta.expert_bytes() / 1e6, 3),
        "load_patch_s": round(t1 - t0, 2),
        **{k: timed[k] for k in ("tok_per_s", "tok_per_s_runs", "tok_per_s_minmax",
                                 "decode_tok_per_s", "decode_tok_per_s_runs",
                                 "prefill_tok_per_s", "generated_tokens")},
        "prompt_tokens": len(ids),
        **trace_info,
        "memory_sources": MEMORY_SOURCES,
        "rss_gb_after_patch": round(after_patch.rss_bytes / 1e9, 3),
        "rss_gb_after_gen": round(after_gen.rss_bytes / 1e9, 3),
        "peak_rss_gb": round(after_gen.peak_rss_bytes / 1e9, 3),
        "mlx_active_gb_after_gen": round(after_gen.mlx_active_bytes / 1e9, 3),
        "mlx_peak_gb": round(after_gen.mlx_peak_bytes / 1e9, 3),
        "expert_hit_rate": round(store.hit_rate(), 4),
        "expert_hits": store.hits,
        "expert_misses": store.misses,
        "decode_hit_rate": round(decode_hits / decode_lookups, 4) if decode_lookups else None,
        "evictions": totals["evictions"],
        "bytes_read": totals["bytes_read"],
        "bytes_read_per_token": round(decode_bytes),
        "prefill_bytes_read": first.get("bytes_read", 0),
        "prefill_bytes_per_token": round(first.get("bytes_read", 0) / max(1, len(ids))),
        "read_wait_s": round(totals["read_s"], 4),
        "read_gbps": round(store.reader.stats.gbps(), 3),
        "prefetched": totals["prefetched"],
        "prefetch_used": totals["prefetch_used"],
        "prefetch_on_time": totals["prefetch_on_time"],
        "prefetch_precision": round(totals["prefetch_used"] / totals["prefetched"], 4)
        if totals["prefetched"] else None,
        "prefetch_recall": round(totals["prefetch_used"] / (totals["prefetch_used"]
                                                            + totals["misses"]), 4)
        if totals["prefetched"] else None,
        "host_syncs": totals["host_calls"],
        "gpu_fastpath": store._resident.gpu_fastpath,
        "gpu_fallback": store._resident.gpu_fallback,
        "gpu_fastpath_frac": round(store._resident.gpu_fastpath / max(
            1, store._resident.gpu_fastpath + store._resident.gpu_fallback), 4),
        "device": str(mx.default_device()),
        "sample": timed["text"][:240],
        "layers": {str(li): {k: r[k] for k in ("hits", "misses", "bytes_read", "slots")}
                   | {"hit_rate": round(r["hits"] / max(1, r["hits"] + r["misses"]), 4)}
                   for li, r in store.layer_report().items()},
        "memory_series": sampler.series[:: max(1, len(sampler.series) // 300)],
        "timed_peak_rss_gb": round(sampler.peak_rss / 1e9, 3),
        "timed_peak_mlx_active_gb": round(sampler.peak_mlx / 1e9, 3),
    }
    if store.prefetcher is not None:
        out.update(store.prefetcher.report())
    if recorder is not None:
        recorder.save(cfg.record_trace)
        out["recorded_trace"] = cfg.record_trace
    if cfg.compare_stock:
        out.update(_compare_stock(cfg, model, tokenizer, ids, out["tok_per_s"]))
        out["decode_ratio_vs_stock"] = round(
            out["decode_tok_per_s"] / out["stock_decode_tok_per_s"], 4)
    gbps = cfg.read_gbps or measure_read_gbps(meta, cfg.threads, cfg.direct_io, cold=cfg.cold)
    out["storage_gbps"] = round(gbps, 3)
    t_compute = (cfg.t_compute_ms / 1e3 if cfg.t_compute_ms else
                 1 / out["stock_decode_tok_per_s"] if out.get("stock_decode_tok_per_s") else None)
    out.update(_bounds(t_compute, out["bytes_read_per_token"], gbps, out["decode_tok_per_s"]))
    store.close()
    return out


def _compare_stock(cfg: BenchConfig, streamed, tokenizer, ids, streamed_tps) -> dict:
    """Stock mlx-lm, fully resident, same prompt, settings and routing, in this run."""
    from mlx_lm import load

    from ..analysis.verify import compare

    stock, _ = load(str(resolve_model_path(cfg.model)))
    if cfg.routing_trace:
        from ..planning.trace import apply_trace_routing

        trace, start, _ = _trace_setup(cfg)
        apply_trace_routing(stock, trace, start)
    timed = _timed_runs(stock, tokenizer, ids, cfg)
    step = cfg.prefill_chunk if cfg.prefill_chunk > 0 else 2048
    if cfg.routing_trace:  # both replay the trace from the same token
        from ..planning.trace import TraceRouted

        for m in (stock, streamed):
            for _, mod in m.named_modules():
                if isinstance(mod, TraceRouted):
                    mod._routing.cursor = start
    cmp = compare(stock, streamed, ids, min(cfg.max_tokens, 64), step)
    del stock
    gc.collect()
    mem.clear_cache()
    return {
        "stock_tok_per_s": timed["tok_per_s"],
        "stock_tok_per_s_runs": timed["tok_per_s_runs"],
        "stock_decode_tok_per_s": timed["decode_tok_per_s"],
        "stock_prefill_tok_per_s": timed["prefill_tok_per_s"],
        "ratio_vs_stock": round(streamed_tps / timed["tok_per_s"], 4),
        "exact_vs_stock": cmp.exact,
        "exactness": cmp.to_json(),
    }
