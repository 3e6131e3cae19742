"""Decode speed against the physical limit, side by side with stock mlx-lm.

One process: builds (or reuses) a synthetic checkpoint, loads stock mlx-lm fully resident
and a streamed model per configuration, replays a real routing trace in both, and
alternates timed generations (stock, streamed, stock, ..., stock) so that the shared
machine's noise hits both alike. Reports medians, per-pair ratios (each streamed run over
the stock run before it) and bracket ratios (over the mean of the stock runs on either
side: a drift within the bracket cancels), and, per configuration:

* resident parity: streamed decode over stock decode with every expert resident;
* under a budget (fraction of experts resident), warm and cold page cache: tok/s, hit
  rate, bytes read per token, the reader's bandwidth, ``t_compute`` (stock's time per
  token), the overlap bound ``max(t_compute, miss_bytes / B)``, the serial bound, and
  efficiency = overlap-bound time / measured time (B: random-record read bandwidth of
  the expert files, measured here warm or cold), host time per layer call;
* prefill of a long prompt at one budget: bytes read against the ideal (each distinct
  expert of each chunk read once) and prefill tok/s against stock;
* exactness: greedy tokens and logits identical to stock for every configuration.

    python benchmarks/speed.py --preset dsv2-lite-cpu --json benchmarks/results/speed-cpu.json
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from harness import (
    PROMPT,
    RESIDENCIES,
    add_trace_start,
    ahead_label,
    build,
    decode_run,
    finish,
    follow,
    log,
    oracle_accuracies,
    parser,
    read_ahead,
    rewind,
    routing_trace,
    save,
    slots_at,
    stamped,
    stock,
    streamed,
)

from mlx_streaming.commands._args import add_store_args, positive_int, stream_config
from mlx_streaming.core.cache.stats import per_call_us

# the host's phases of a layer call, as the store's stats name them
PHASES = ("ahead_s", "sync_s", "host_s", "read_s", "graph_s")


def main():
    p = parser(__doc__, workdir="scratch/speed")
    p.add_argument("--residency", type=RESIDENCIES, default=[1, 0.5, 0.25, 0.125])
    p.add_argument("--tokens", type=int, default=32, help="decode tokens per run")
    p.add_argument("--prompt-tokens", type=int, help="cut or repeat the prompt to this length")
    p.add_argument("--repeat", type=positive_int, default=3)
    add_trace_start(p)
    # (None: not given; --beyond-ram has its own protocol and refuses them)
    p.add_argument("--cold", choices=["warm", "cold", "both"], help="default both")
    p.add_argument("--prefill-tokens", type=int, help="default 512")
    p.add_argument("--prefill-residency", type=float, help="default 0.25")
    p.add_argument("--prefill-chunk", type=int, help="default 512")
    p.add_argument(
        "--limited-residency",
        type=float,
        help="also run streamed alone at this residency with MLX's memory "
        "limited to trunk + pool + 1 GB",
    )
    p.add_argument(
        "--beyond-ram",
        choices=["direct", "memlimit", "both"],
        help="larger than RAM (benchmarks/beyond_ram.py): stock first, then cold streamed "
        "runs with the experts kept out of RAM by O_DIRECT, a memory cgroup, or both",
    )
    p.add_argument(
        "--memory-limit-gb",
        type=float,
        default=0.0,
        help="with --beyond-ram memlimit: the cgroup's limit (trunk, pools and the page "
        "cache it leaves)",
    )
    add_store_args(p, sizes=False)  # the package's own streaming flags
    p.add_argument("--timeline", help="write one decode step's host timeline (JSON) here")
    p.add_argument("--profile", help="write a cProfile of one streamed decode run here")
    p.add_argument(
        "--ring-pieces",
        type=int,
        help="with --beyond-ram on CUDA: the reads the request ring cuts each record beyond a "
        "bounded tier in (StreamConfig.ring_pieces; a measurement's knob, not a user's)",
    )
    p.add_argument(
        "--ring-readers",
        type=int,
        help="with --beyond-ram on CUDA: the request ring's reader threads "
        "(StreamConfig.ring_readers; a measurement's knob, not a user's)",
    )
    p.add_argument(
        "--oracle",
        help="what-if read-ahead curve (a simulation): also run each residency under 1 with "
        "a predictor that knows the trace's next-layer picks, right with these "
        "probabilities (e.g. 0,0.5,0.7,0.9,1), and with the trace's transition predictor; "
        "with --beyond-ram, each residency also runs read-ahead by each such predictor",
    )
    a = p.parse_args()
    defaults = {"cold": "both", "prefill_tokens": 512, "prefill_residency": 0.25,
                "prefill_chunk": 512, "limited_residency": 0.0, "profile": None}  # fmt: skip
    given = [k for k in defaults if getattr(a, k) not in (None, 0)]  # (0: none, as off)
    if a.beyond_ram and given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        p.error(f"--beyond-ram runs its own protocol (a cold load, a first token, then "
                f"--repeat timed runs): drop {flags}")  # fmt: skip
    for k, v in defaults.items():
        setattr(a, k, v if getattr(a, k) is None else getattr(a, k))
    if (a.ring_pieces is not None or a.ring_readers is not None) and not a.beyond_ram:
        p.error("--ring-readers and --ring-pieces apply with --beyond-ram")
    oracles = oracle_accuracies(a.oracle)
    if oracles and a.trace in (None, "none"):
        p.error("--oracle reads the replayed trace ahead: give --trace")

    from mlx_streaming.analysis.verify import compare_traces, greedy_trace
    from mlx_streaming.bench.measure import (
        bounds,
        drop_page_cache,
        measure_h2d_gbps,
        store_read_gbps,
    )
    from mlx_streaming.core.runtime import resolve

    if a.beyond_ram and a.beyond_ram != "direct" and not a.memory_limit_gb:
        p.error("--beyond-ram memlimit needs --memory-limit-gb")  # before the build
    try:  # the ring's cut (None without --beyond-ram), a measurement's knob: checked here
        cfg = stream_config(a).replace(ring_readers=a.ring_readers, ring_pieces=a.ring_pieces)
    except ValueError as e:
        p.error(str(e))
    trace, start = routing_trace(a)  # (--trace-start checked before the build)
    t0 = time.perf_counter()
    ck, ed, meta = build(a)
    files = [meta.file(li) for li in meta.layers]
    log(f"built/split in {time.perf_counter() - t0:.0f}s")

    def prompt_ids(tokenizer):
        ids = tokenizer.encode(PROMPT)
        if a.prompt_tokens:
            ids = (ids * (a.prompt_tokens // len(ids) + 1))[: a.prompt_tokens]
        return ids

    if a.beyond_ram:
        import beyond_ram

        extra = {"preset": None if a.checkpoint else a.preset, "checkpoint": str(ck),
                 "expert_mb": round(meta.expert_bytes() / 1e6, 3), "trace": a.trace,
                 "trace_start": start, "tokens": a.tokens, "repeat": a.repeat,
                 "prompt_tokens": a.prompt_tokens}  # fmt: skip

        def progress(res):  # each row on disk as it comes: a run cut short keeps its rows
            save(a, stamped(a, "speed-beyond-ram", {**extra, **res}, t0))

        res = beyond_ram.run(a, ck, ed, meta, trace, start, cfg, prompt_ids, progress)
        finish(a, "speed-beyond-ram", {**extra, **res}, t0)
        return
    ref, tok, ref_routing = stock(ck, trace, start)
    ids = prompt_ids(tok)
    if a.prefetch and trace is not None:
        cfg = read_ahead(cfg, "transition", trace, meta)
    runtime = resolve(cfg, meta)
    load_kw = {"config": cfg}

    decode_run(ref, tok, ids, a.tokens)  # warm up stock (compiles kernels)
    h2d = measure_h2d_gbps()  # on a GPU the copy bounds the read path too
    read = {t: store_read_gbps(meta, runtime, cold=t == "cold") for t in ("warm", "cold")}
    gbps = {t: min(v, h2d or v) for t, v in read.items()}
    configs = []
    for r in a.residency:
        temps = (
            ["warm"]
            if r >= 1
            else {"warm": ["warm"], "cold": ["cold"], "both": ["warm", "cold"]}[a.cold]
        )
        configs += [(r, t, None) for t in temps]
        if oracles and r < 1 and trace is not None:
            configs += [(r, "warm", p) for p in ["transition", *oracles]]

    out_cfgs, timelines = [], {}
    for r, temp, pred in configs:
        slots = slots_at(meta, r)
        kw = load_kw
        if pred is not None:  # read-ahead by the trace's transitions or a simulated oracle
            kw = {"config": read_ahead(cfg, pred, trace, meta)}
        model, _, store, routing = streamed(ck, ed, trace, start, slots=slots, **kw)
        follow(kw["config"], routing)
        decode_run(model, tok, ids, a.tokens)  # warm up: fill the pool, compile
        s_runs, k_runs, per_run = [], [], []
        for _ in range(a.repeat):
            k_runs.append(decode_run(ref, tok, ids, a.tokens)[0])
            if temp == "cold":
                drop_page_cache(files)
            store.reset_stats()
            t1 = time.perf_counter()
            tps, _, n = decode_run(model, tok, ids, a.tokens)
            wall = time.perf_counter() - t1
            s_runs.append(tps)
            per_run.append({**store.totals(), "tokens": n + len(ids), "wall_s": wall})
        k_after = decode_run(ref, tok, ids, a.tokens)[0]  # closes the last bracket
        timeline = decode_timeline(model, tok, ids, store) if a.timeline and r < 1 else None
        if a.profile and r < 1 and pred is None and not Path(a.profile).exists():
            profile(a.profile, decode_run, model, tok, ids, a.tokens)
        rewind(start, ref_routing, routing)  # exactness: the same trace position for both
        want = greedy_trace(ref, ids, 16)
        rewind(start, ref_routing, routing)
        exact = compare_traces(want, greedy_trace(model, ids, 16)).exact
        tot = {
            k: sum(x[k] for x in per_run)
            for k in (
                "bytes_read",
                "hits",
                "misses",
                "tokens",
                "prefetched",
                "prefetch_used",
                "prefetch_on_time",
                "host_s",
                "device_s",
                "device_kernel_s",
                "device_path_calls",
                "ahead_s",
                "sync_s",
                "read_s",
                "graph_s",
                "gap_s",
                "wall_s",
                "host_calls",
                "device_calls",
            )
        }
        mapped = store.totals()["mapped_bytes"]
        calls = max(1, tot["host_calls"] + tot["device_calls"])
        stock_tps, tps = statistics.median(k_runs), statistics.median(s_runs)
        pairs = [x / y for x, y in zip(s_runs, k_runs)]
        # each streamed run over the mean of the stock runs on either side of it: a
        # drift of the machine's speed within a bracket cancels
        brackets = [x / ((y + z) / 2) for x, y, z in zip(s_runs, k_runs, k_runs[1:] + [k_after])]
        bpt = tot["bytes_read"] / tot["tokens"]
        rec = {
            "residency": r,
            "slots": slots,
            # a pool profile's per-layer slots, where they are not uniform
            "layer_slots": None
            if len({store.capacity(li) for li in store.layers}) == 1
            else {li: store.capacity(li) for li in store.layers},
            "page_cache": temp,
            "tok_per_s": round(tps, 3),
            "decode_runs": [round(x, 3) for x in s_runs],
            "stock_tok_per_s": round(stock_tps, 3),
            "stock_runs": [round(x, 3) for x in k_runs],
            "ratio_vs_stock": round(tps / stock_tps, 4),
            # each streamed run over the stock run just before it (the machine's speed
            # drifts less within a pair than across the run): median and range
            "pair_ratio_median": round(statistics.median(pairs), 4),
            "pair_ratio_range": [round(min(pairs), 4), round(max(pairs), 4)],
            "bracket_ratio_median": round(statistics.median(brackets), 4),
            "bracket_ratio_range": [round(min(brackets), 4), round(max(brackets), 4)],
            "hit_rate": round(tot["hits"] / max(1, tot["hits"] + tot["misses"]), 4),
            "bytes_read_per_token": round(bpt),
            "read_gbps": round(per_run[-1]["read_gbps"], 3),
            "storage_gbps": round(gbps[temp], 3),
            # per MoE layer call, the host's time in each phase (µs): launching the
            # routing and working while the device computes it (read-ahead, deferred
            # bookkeeping), waiting for it, planning the misses, reading them, building
            # the expert graph
            "host_us_per_layer_call": round(1e6 * sum(tot[k] for k in PHASES) / calls, 1),
            "ahead_us": round(1e6 * tot["ahead_s"] / calls, 1),
            "routing_wait_us": round(1e6 * tot["sync_s"] / calls, 1),
            "plan_us": round(1e6 * tot["host_s"] / calls, 1),
            "read_us": round(1e6 * tot["read_s"] / calls, 1),
            "graph_us": round(1e6 * tot["graph_s"] / calls, 1),
            # the device path's own calls apart (the averages above mix in the prompt's
            # host-path calls): host µs each, its expert graph's build not included
            "device_call_us": per_call_us(tot["device_s"], tot["device_path_calls"]),
            # ... of it, MLX building the plan kernel's op (the rest: the store's Python)
            "device_kernel_us": per_call_us(tot["device_kernel_s"], tot["device_path_calls"]),
            "device_calls": tot["device_calls"],
            "device_path_calls": tot["device_path_calls"],
            "host_calls": tot["host_calls"],
            # share of the runs' time from a routing read to the call's expert launch,
            # when the device had no routed-expert work queued (host path only)
            "device_gap_share": round(tot["gap_s"] / tot["wall_s"], 4),
            # share of decode time outside the store's layer calls: the host building and
            # launching the rest of the model (and, with no sync, the device computing)
            "outside_calls_share": round(
                1 - sum(tot[k] for k in PHASES) / tot["wall_s"],
                4,
            ),
            "runtime": store.runtime.to_json(),
            "reader": store.runtime.reader,
            "mapped_gb": round(mapped / 1e9, 2),
            "decode_path": store.runtime.decode_path,
            # page-locked mappings: the pages stay in memory and only the copy bounds
            **bounds(1 / stock_tps, bpt, h2d if mapped and h2d else gbps[temp], tps),
            "exact_vs_stock": exact,
            "pool_mode": store.runtime.pool_mode,
        }
        if pred is not None:
            rec["predictor"] = ahead_label(pred)
        if a.prefetch or pred is not None:
            rec["prediction_recall"] = round(
                sum(x.get("prediction_recall") or 0 for x in per_run) / len(per_run), 4
            )
            rec["prefetch_precision"] = round(tot["prefetch_used"] / max(1, tot["prefetched"]), 4)
            rec["prefetch_on_time_share"] = round(
                tot["prefetch_on_time"] / max(1, tot["prefetch_used"]), 4
            )
        log(rec)
        out_cfgs.append(rec)
        if timeline:
            timelines[str(r)] = timeline
        store.close()
        del model

    if a.timeline:
        Path(a.timeline).write_text(json.dumps(timelines, indent=0) + "\n")
    limited = prefill = None
    if a.limited_residency:
        limited = memory_limited(a, ck, ed, meta, trace, start, tok, ids, ref, load_kw)
        ref, _, ref_routing = stock(ck, trace, start)
    if a.prefill_tokens:
        prefill = prefill_run(a, ck, ed, meta, trace, start, tok, ids, ref, ref_routing, load_kw)
    finish(
        a,
        "speed",
        {
            "preset": None if a.checkpoint else a.preset,
            "num_layers": a.num_layers,
            "checkpoint": str(ck),
            "expert_mb": round(meta.expert_bytes() / 1e6, 3),
            "moe_layers": len(meta.moe_layers),
            "num_experts": meta.num_experts,
            "top_k": meta.top_k,
            "trace": a.trace,
            "trace_start": start,
            "tokens": a.tokens,
            "prompt_tokens": len(ids),
            "repeat": a.repeat,
            "runtime": runtime.to_json(),
            "read_gbps_warm": round(read["warm"], 3),
            "read_gbps_cold": round(read["cold"], 3),
            "h2d_gbps": h2d and round(h2d, 2),
            "bound_gbps_warm": round(gbps["warm"], 3),
            "bound_gbps_cold": round(gbps["cold"], 3),
            "configs": out_cfgs,
            "prefill": prefill,
            "memory_limited": limited,
        },
        t0,
    )


def profile(path: str, fn, *args) -> None:
    """cProfile ``fn(*args)``; write the top functions by own and by cumulative time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn, *args)
    buf = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(45)
    Path(path).write_text(buf.getvalue())


def decode_timeline(model, tok, ids, store) -> list[dict]:
    """Host timestamps of every layer call's phases in one decode step (the third
    generated token), from ``store.timeline``."""
    from mlx_lm import stream_generate

    out = []
    for i, _ in enumerate(stream_generate(model, tok, ids, max_tokens=4)):
        if i == 1:
            store.timeline.start()
        elif i == 2:
            out = store.timeline.stop()
    return out


def step_phases(events: list[dict]) -> dict:
    """Milliseconds of one decode step's timeline (``decode_timeline``) between each
    pair of consecutive phases of a layer call, summed over the step's calls
    (``"routed>grouped"``...), and ``"step"``, from the first mark to the last."""
    calls: dict[int, list[dict]] = {}
    for e in events:
        calls.setdefault(e["layer"], []).append(e)
    out: dict[str, float] = {}
    for marks in calls.values():
        for a, b in zip(marks, marks[1:]):
            key = f"{a['phase']}>{b['phase']}"
            out[key] = out.get(key, 0.0) + (b["t_us"] - a["t_us"]) / 1e3
    out = {k: round(v, 3) for k, v in out.items()}
    out["step"] = round((events[-1]["t_us"] - events[0]["t_us"]) / 1e3, 3) if events else 0.0
    return out


def memory_limited(a, ck, ed, meta, trace, start, tok, ids, ref, load_kw) -> dict:
    """Streamed alone, with MLX's memory capped below the whole model: the pool fits, the
    model would not."""
    from mlx.utils import tree_flatten

    slots = slots_at(meta, a.limited_residency)
    whole = sum(v.nbytes for _, v in tree_flatten(ref.parameters()))
    del ref
    gc.collect()
    mx.clear_cache()
    model, _, store, _ = streamed(ck, ed, trace, start, slots=slots, **load_kw)
    trunk = sum(v.nbytes for _, v in tree_flatten(model.parameters())) - store.pool_bytes()
    limit = int(trunk + store.pool_bytes() + 1e9)
    old_limit = mx.set_memory_limit(limit)
    mx.reset_peak_memory()
    decode_run(model, tok, ids, a.tokens)
    runs = [decode_run(model, tok, ids, a.tokens)[0] for _ in range(a.repeat)]
    out = {
        "residency": a.limited_residency,
        "slots": slots,
        "memory_limit_gb": round(limit / 1e9, 3),
        "whole_model_gb": round(whole / 1e9, 3),
        "pool_gb": round(store.pool_bytes() / 1e9, 3),
        "tok_per_s": round(statistics.median(runs), 3),
        "mlx_peak_gb": round(mx.get_peak_memory() / 1e9, 3),
    }
    mx.set_memory_limit(old_limit)
    log(out)
    store.close()
    return out


def prefill_run(a, ck, ed, meta, trace, start, tok, ids, ref, ref_routing, load_kw) -> dict:
    """A long prompt at one budget: prefill tok/s against stock and bytes read against
    the ideal (every distinct expert of every chunk read once)."""
    slots = slots_at(meta, a.prefill_residency)
    model, _, store, routing = streamed(ck, ed, trace, start, slots=slots, **load_kw)
    long_ids = (ids * (a.prefill_tokens // len(ids) + 1))[: a.prefill_tokens]
    decode_run(model, tok, long_ids[:64], 2, a.prefill_chunk)  # compile
    k_runs, s_runs, bytes_runs, ideal_runs = [], [], [], []
    for _ in range(a.repeat):
        rewind(start, ref_routing)
        k_runs.append(decode_run(ref, tok, long_ids, 1, a.prefill_chunk)[1])
        store.reset_stats()
        rewind(start, routing)
        s_runs.append(decode_run(model, tok, long_ids, 1, a.prefill_chunk)[1])
        bytes_runs.append(store.totals()["bytes_read"])
        if trace is not None:
            rows = trace.experts[(start + np.arange(len(long_ids))) % trace.tokens]
            ideal = 0
            for c in range(0, len(long_ids), a.prefill_chunk):
                for pos, li in enumerate(meta.moe_layers):
                    ideal += (
                        len(np.unique(rows[c : c + a.prefill_chunk, pos]))
                        * meta.layers[li].record_bytes
                    )
            ideal_runs.append(ideal)
    sb, kb = statistics.median(s_runs), statistics.median(k_runs)
    out = {
        "prompt_tokens": len(long_ids),
        "residency": a.prefill_residency,
        "slots": slots,
        "chunk": a.prefill_chunk,
        "prefill_tok_per_s": round(sb, 2),
        "stock_prefill_tok_per_s": round(kb, 2),
        "ratio_vs_stock": round(sb / kb, 4),
        "bytes_read": int(statistics.median(bytes_runs)),
        "ideal_bytes": int(statistics.median(ideal_runs)) if ideal_runs else None,
        "bytes_over_ideal": round(statistics.median(bytes_runs) / statistics.median(ideal_runs), 4)
        if ideal_runs
        else None,
    }
    log(out)
    store.close()
    return out


if __name__ == "__main__":
    main()
