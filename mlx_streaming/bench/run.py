"""End-to-end benchmark of a streamed model, optionally side by side with stock mlx-lm.

``run_bench`` does what the seed script does (split if needed, lazy load, patch, pin,
warm up, timed generations) through ``load``, with every knob an explicit field of
``BenchConfig``, and returns the seed's JSON fields plus I/O, the prefill/decode split,
host time per layer call, the bounds of ``measure`` and, with ``compare_stock``, stock
mlx-lm's speed on the same prompt and the exactness check.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

from .. import config
from ..core import mem
from ..core.options import StreamConfig
from ..model_builder import load
from .measure import (
    bounds,
    drop_page_cache,
    enter_memory_limit,
    memory_limits,
    store_read_gbps,
)
from .summary import summarize

DEFAULT_PROMPT = "用三句话解释什么是混合专家模型。"


@dataclass(frozen=True)
class BenchConfig:
    """Everything a benchmark run depends on (the seed's environment, as fields)."""

    model: str
    expert_dir: str | None = None
    stream: StreamConfig = field(default_factory=StreamConfig)  # slots, policy, reader...
    prompt: str = DEFAULT_PROMPT
    max_tokens: int = 128
    warmup_tokens: int | None = None  # default: max_tokens
    repeat: int = 3
    wired_gb: float | None = None
    pin_hot: int = 0
    cal_tokens: int = 32
    expert_bits: int | None = None  # checked against the meta (seed's EXPERT_BITS)
    expert_group: int | None = None
    prefill_chunk: int = config.PREFILL_CHUNK  # prefill_step_size (0: mlx-lm's default)
    predictor: str = "router"  # or "transition" (learned from the routing trace)
    routing_trace: str | None = None
    trace_start: int | None = None  # default: the trace's held-out half
    record_trace: str | None = None
    cold: bool = False  # evict the expert files from the page cache before each timed run
    memory_limit_gb: float | None = None  # run within a memory cgroup this size
    compare_stock: bool = False
    t_compute_ms: float | None = None  # resident time per token, for the bound
    read_gbps: float | None = None  # storage bandwidth for the bound (default: measured)
    memory_series: bool = False  # keep RSS / MLX memory over time (for --report plots)
    pipeline_split: tuple[int, ...] | None = None  # with a pipeline group: layers per rank
    progress: bool = False  # a line on stderr after each timed run


def encode(tokenizer, prompt: str) -> list[int]:
    """Prompt ids as mlx-lm's generate makes them (no second BOS)."""
    bos = tokenizer.bos_token
    return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))


def generate_once(model, tokenizer, ids, max_tokens, cfg: BenchConfig, on_first=None):
    """One generation with mlx-lm's ``stream_generate``: (wall s, last response, text)."""
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


def _timed_runs(
    model, tokenizer, ids, cfg: BenchConfig, store=None, files=(), recorder=None
) -> dict:
    warm = cfg.max_tokens if cfg.warmup_tokens is None else cfg.warmup_tokens
    if warm > 0:
        generate_once(model, tokenizer, ids, warm, cfg)
    mem.reset_peak()
    runs, text, last, first = [], "", None, {}
    for r in range(cfg.repeat):
        if cfg.cold and files:
            drop_page_cache(files)
        on_first = None
        if store is not None and r == cfg.repeat - 1:
            store.reset_stats()

            def on_first():
                first.update(store.totals())

        if recorder is not None:
            recorder.new_sequence()
        wall, last, text = generate_once(model, tokenizer, ids, cfg.max_tokens, cfg, on_first)
        runs.append(
            {
                "wall_s": wall,
                "tokens": last.generation_tokens,
                "prompt_tps": last.prompt_tps,
                "generation_tps": last.generation_tps,
            }
        )
        if cfg.progress:
            print(f"bench: run {r + 1}/{cfg.repeat}: {last.generation_tokens} tokens, "
                  f"{last.generation_tps:.1f} tok/s decode", file=sys.stderr, flush=True)  # fmt: skip
    tps = [round(r["tokens"] / r["wall_s"], 2) for r in runs]
    return {
        "tok_per_s": statistics.median(tps),
        "tok_per_s_runs": tps,
        "tok_per_s_minmax": [min(tps), max(tps)],
        "decode_tok_per_s": round(statistics.median(r["generation_tps"] for r in runs), 2),
        "decode_tok_per_s_runs": [round(r["generation_tps"], 2) for r in runs],
        "prefill_tok_per_s": round(statistics.median(r["prompt_tps"] for r in runs), 2),
        "generated_tokens": runs[-1]["tokens"],
        # the last run's decode time (its stats window after the first token)
        "decode_s": runs[-1]["tokens"] / max(runs[-1]["generation_tps"], 1e-9),
        "text": text,
        "first": first,
    }


def _trace(cfg: BenchConfig):
    """(trace, replay start, its first half) for trace routing."""
    from ..planning.trace import RoutingTrace

    trace = RoutingTrace.load(cfg.routing_trace)
    train, _ = trace.split(0.5)
    start = cfg.trace_start if cfg.trace_start is not None else train.tokens
    return trace, start, train


def open_model(cfg: BenchConfig, group=None, watch=None):
    """``load`` with the config's options (``group``: pipeline over it, under ``watch``):
    ``(model, tokenizer, store)``."""
    stream = cfg.stream.replace(record=cfg.stream.record or cfg.pin_hot > 0)
    if stream.prefetch and cfg.predictor == "transition":
        from ..core.prefetch.predictor import TransitionPredictor

        if not cfg.routing_trace:
            raise ValueError("the transition predictor learns from --routing-trace")
        trace, _, train = _trace(cfg)
        stream = stream.replace(predictor=TransitionPredictor.from_trace(train, trace.top_k))
    model, tokenizer, store = load(
        cfg.model,
        cfg.expert_dir,
        stream,
        pipeline_group=group,
        pipeline_split=list(cfg.pipeline_split) if cfg.pipeline_split else None,
        pipeline_watch=watch,
    )
    _check_bits(cfg, store.meta)
    return model, tokenizer, store


def _check_bits(cfg: BenchConfig, meta) -> None:
    for flag, have, want in (
        ("--expert-bits", meta.dims.get("bits"), cfg.expert_bits),
        ("--expert-group", meta.dims.get("group_size"), cfg.expert_group),
    ):
        if want is not None and want != have:
            raise ValueError(
                f"{flag} {want} disagrees with {meta.root}'s meta ({have}), which "
                "is the authority on how its experts are stored: drop the flag"
            )


def run_bench(cfg: BenchConfig, group=None, watch=None) -> dict:
    """Run the benchmark; returns the JSON-ready result dict.

    With a pipeline ``group`` every rank runs it in step; each rank's result describes
    its own layers, and ``pipeline.per_rank`` holds every rank's main figures. ``watch``
    (the group's ``peers.PeerWatch``) ends this rank if a peer stops answering: the
    load arms it around its exchanges, and it is armed from the load's end on.
    """
    if cfg.cold and not hasattr(os, "posix_fadvise"):
        drop_page_cache([])  # raises the clear error before anything is loaded
    if cfg.memory_limit_gb and cfg.compare_stock:
        raise ValueError(
            "--compare-stock loads every expert, which a memory limit smaller than the model "
            "cannot hold: give the bound --t-compute-ms (stock's time per token, measured "
            "without the limit), or run benchmarks/speed.py --beyond-ram"
        )
    if cfg.memory_limit_gb:
        enter_memory_limit(int(cfg.memory_limit_gb * 1e9))
    if group is not None and cfg.compare_stock:
        raise ValueError(
            "--compare-stock loads the whole model in one process, which a pipeline "
            "exists to avoid: compare on one host (or check exactness with the tests)"
        )
    with memory_limits(cfg.wired_gb, cfg.stream.cache_limit_gb), contextlib.ExitStack() as on:
        out = _run(cfg, group, watch, on)
        if group is not None:
            out["pipeline"] = _per_rank(cfg, group, out)
    return out


PER_RANK = (
    "patched_moe_layers",
    "pool_gb",
    "peak_rss_gb",
    "timed_peak_rss_gb",
    "mlx_peak_gb",
    "expert_hit_rate",
    "bytes_read_per_token",
    "decode_tok_per_s",
    "tok_per_s",
)


def _per_rank(cfg: BenchConfig, group, out: dict) -> dict:
    import json

    from ..parallel import finish_step, gather_lines

    finish_step(group)  # the last generation's step ahead is still in flight
    mine = {k: out[k] for k in PER_RANK} | {
        "rank": group.rank(),
        "moe_layers": [int(k) for k in out["slots_per_layer"]],
    }
    ranks = [json.loads(t) for t in gather_lines(group, json.dumps(mine))]
    return {
        "ranks": group.size(),
        "split": list(cfg.pipeline_split) if cfg.pipeline_split else "even",
        "bytes_read_per_token_all_ranks": sum(r["bytes_read_per_token"] for r in ranks),
        "per_rank": ranks,
    }


def _run(cfg: BenchConfig, group=None, watch=None, armed=None) -> dict:
    """One run; ``watch`` is armed in ``armed`` (an ``ExitStack``) once loaded."""
    mem.reset_peak()
    t0 = time.perf_counter()
    model, tokenizer, store = open_model(cfg, group, watch)
    load_s = time.perf_counter() - t0
    if watch is not None:
        armed.enter_context(watch)  # for the rest of the run
    after_patch = mem.snapshot()
    ids = encode(tokenizer, cfg.prompt)
    meta = store.meta
    files = [meta.file(li) for li in meta.layers]
    if cfg.memory_limit_gb and files:  # pages cached before the limit (the split's, an
        drop_page_cache(files)  # earlier run's) are charged elsewhere and would serve reads
    routing, out = None, {}
    if cfg.routing_trace:
        from ..planning.trace import apply_trace_routing

        trace, start, _ = _trace(cfg)
        routing = apply_trace_routing(model, trace, start, meta.model_layers)
        out.update(routing_trace=cfg.routing_trace, trace_model=trace.model, trace_start=start)
    recorder = None
    if cfg.record_trace:
        from ..planning.trace import TraceRecorder

        recorder = TraceRecorder(store.layers, meta.num_experts, str(cfg.model))
        store.observers.append(recorder)

    cal_s = 0.0
    if cfg.pin_hot > 0:
        tc = time.perf_counter()
        generate_once(model, tokenizer, ids, cfg.cal_tokens, cfg)
        for li in store.recorded_layers():
            store.pin(li, store.hot(li, cfg.pin_hot))
        store.record = False
        store.reset_stats()
        cal_s = round(time.perf_counter() - tc, 2)

    with mem.MemorySampler() as sampler:
        timed = _timed_runs(model, tokenizer, ids, cfg, store, files, recorder)
    mem.clear_cache()
    after_gen = mem.snapshot()
    out.update(summarize(cfg, store, timed, ids, load_s, cal_s, after_patch, after_gen, sampler))
    if recorder is not None:
        from ..parallel import rank_path

        out["recorded_trace"] = rank_path(cfg.record_trace, group)
        recorder.save(out["recorded_trace"])
    if cfg.compare_stock:
        out.update(_compare_stock(cfg, model, tokenizer, ids, routing, files))
    rt = store.runtime  # the store's own reader, threads and direct reads
    cold = cfg.cold or bool(cfg.memory_limit_gb)  # larger than RAM: the disk's own rate
    ring = getattr(store.reader, "ring", None)  # a bounded tier's: the reads beyond it
    gbps = cfg.read_gbps or store_read_gbps(meta, rt, cold=cold, ring=ring)
    out["storage_gbps"] = round(gbps, 3)
    t_compute = (
        cfg.t_compute_ms / 1e3
        if cfg.t_compute_ms
        else 1 / out["stock_decode_tok_per_s"]
        if out.get("stock_decode_tok_per_s")
        else None
    )
    # the storage bound counts the files' bytes (a swap tier's trades are host memory)
    out.update(bounds(t_compute, out["file_bytes_read_per_token"], gbps, out["decode_tok_per_s"]))
    store.close()
    return out


def _compare_stock(cfg: BenchConfig, streamed, tokenizer, ids, routing, files=()) -> dict:
    """Stock mlx-lm, fully resident, same prompt, settings and routing, in this run:
    ``repeat`` alternating pairs (stock, then streamed, each replaying the same stretch
    of a routing trace), so that both see the machine's load alike; the ratios are the
    pairs' medians. Then the exactness check."""
    from mlx_lm import load as mlx_load

    from ..analysis.verify import compare
    from ..prep.hub import resolve_model_path

    stock, _ = mlx_load(str(resolve_model_path(cfg.model)))
    stock_routing, start = None, None
    if cfg.routing_trace:
        from ..planning.trace import apply_trace_routing

        trace, start, _ = _trace(cfg)
        stock_routing = apply_trace_routing(stock, trace, start)
    warm = cfg.max_tokens if cfg.warmup_tokens is None else cfg.warmup_tokens
    if warm > 0:
        generate_once(stock, tokenizer, ids, warm, cfg)
    pairs = []
    for _ in range(cfg.repeat):
        pair = []
        for model in (stock, streamed):
            if routing is not None:  # both replay the trace from the same token
                routing.cursor = stock_routing.cursor = start
            if cfg.cold and files and model is streamed:
                drop_page_cache(files)
            wall, last, _ = generate_once(model, tokenizer, ids, cfg.max_tokens, cfg)
            pair.append((last.generation_tokens / wall, last.generation_tps, last.prompt_tps))
        pairs.append(pair)
    if routing is not None:
        routing.cursor = stock_routing.cursor = start
    step = cfg.prefill_chunk if cfg.prefill_chunk > 0 else config.PREFILL_CHUNK
    cmp = compare(stock, streamed, ids, min(cfg.max_tokens, 64), step)
    del stock
    gc.collect()
    mem.clear_cache()

    def median(i):  # stock's runs
        return round(statistics.median(p[0][i] for p in pairs), 2)

    def ratio(i):
        return round(statistics.median(p[1][i] / p[0][i] for p in pairs), 4)

    return {
        "stock_tok_per_s": median(0),
        "stock_tok_per_s_runs": [round(p[0][0], 2) for p in pairs],
        "stock_decode_tok_per_s": median(1),
        "stock_prefill_tok_per_s": median(2),
        "paired_tok_per_s_runs": [round(p[1][0], 2) for p in pairs],
        "paired_decode_tok_per_s_runs": [round(p[1][1], 2) for p in pairs],
        "ratio_vs_stock": ratio(0),  # per alternating pair, median
        "decode_ratio_vs_stock": ratio(1),
        "ratio_pairs": [round(p[1][0] / p[0][0], 4) for p in pairs],
        "exact_vs_stock": cmp.exact,
        "exactness": cmp.to_json(),
    }
