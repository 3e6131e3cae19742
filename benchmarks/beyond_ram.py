"""Larger than RAM: decode with the experts kept out of RAM for the whole run, measured
against the storage bound of the same run. ``speed.py --beyond-ram`` runs it.

Two ways to keep the experts out of RAM, both reported:

* ``direct``: the store reads with O_DIRECT (F_NOCACHE on macOS): every miss comes from
  the disk, the page cache never holds an expert.
* ``memlimit``: the run's process lives in a memory cgroup smaller than the model
  (``--memory-limit-gb``: trunk, pools, the process and what page cache that leaves), so
  the page cache holds only part of the expert files: misses come from the page cache or
  the disk, as on a machine with that much memory.

Stock mlx-lm is measured first, with every expert resident (it cannot run within the
limit): its time per token is ``t_compute``, its greedy tokens and logits the exactness
reference. Then each (method, residency) runs in a fresh process (inside the cgroup for
``memlimit``, so that everything it allocates is charged there): the storage bandwidth
``B`` (random record-sized reads at the native reader's queue depth, cold, the way the
store reads), the expert files dropped from the page cache, the store loaded (load time,
cold), the first token (TTFT, cold), then the timed decode runs. Each row reports tok/s,
bytes per decode step (from each run's first token on, the prompt left out) from the
store and from the disk itself (``/proc/self/io``) beside the
two-tier simulator's prediction (``planning.tiers``), ``B``, the overlap bound
``max(t_compute, disk bytes / B)`` and the serial bound ``t_compute + disk bytes / B``
with the run's share of each, the share of the runs' time with demand reads in flight
(``demand_reads_share``: where it is well under 1 at the storage bound, the disk idles
between layers, as demand reads start only once a layer's routing is known), and whether
the output was exact. Routing differs from text to text, so a row's simulated disk bytes
are set beside the held-out routing's (``typical_run``): ``stretch_vs_typical`` and
``stretch_percentile`` say how light or heavy the runs' stretch was (``--trace-start``
moves it). With a trace, stock runs again reading each MoE layer's routing on
the host as the host path does (``harness.routing_on_host``): the host path's floor, and
a host-path row's serial bound on it, ``1 / (1 / floor + disk bytes / B)``, with its
share (``efficiency_vs_host_serial``): how close the store's own work comes to reading
the routing on the host and then the disk, nothing else. Rows that overlap reads with
compute (read-ahead, the overlap split) may pass it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

TYPICAL = 4000  # tokens of held-out routing a row's stretch is set against (``typical_run``)
WARM = 64  # uncounted tokens before them
# the store's per-phase host seconds (``LayerStats``), as speed.py's PHASES, and two spans:
# gap_s (the device's idle bound) and demand_s (reads in flight), which overlap the rest
PHASES = ("ahead_s", "sync_s", "host_s", "read_s", "graph_s", "gap_s", "demand_s")


def run(a, ck, ed, meta, trace, start, cfg, prompt_ids, progress=None) -> dict:
    """The larger-than-RAM rows (see the module's text): ``a`` speed.py's arguments,
    ``cfg`` the streaming options, ``prompt_ids(tokenizer)`` the prompt; ``progress``
    is given the result so far after each row (a run cut short keeps its rows)."""
    import dataclasses

    if not Path("/proc/self/io").exists() or not hasattr(os, "posix_fadvise"):
        raise SystemExit(  # the disk's own bytes and the cold starts need both
            f"--beyond-ram runs on Linux (it reads /proc/self/io and drops files from the "
            f"page cache with posix_fadvise; {sys.platform} has neither): on macOS use "
            "`python -m mlx_streaming bench --direct-io` (F_NOCACHE)"
        )
    from harness import decode_run, log, oracle_accuracies, rewind, routing_on_host, stock

    from mlx_streaming.analysis.verify import greedy_trace

    ref, tok, ref_routing = stock(ck, trace, start)
    ids = prompt_ids(tok)
    decode_run(ref, tok, ids, a.tokens)  # warm up stock (compiles kernels)
    k_runs = [decode_run(ref, tok, ids, a.tokens)[0] for _ in range(a.repeat)]
    stock_tps = statistics.median(k_runs)
    floor_runs = []  # stock reading each layer's routing on the host: the host path's floor
    if trace is not None:
        with routing_on_host():
            decode_run(ref, tok, ids, a.tokens)  # warm up (the ids' transfer kernel compiles)
            floor_runs = [decode_run(ref, tok, ids, a.tokens)[0] for _ in range(a.repeat)]
    floor_tps = statistics.median(floor_runs) if floor_runs else None
    rewind(start, ref_routing)
    want = greedy_trace(ref, ids, 16)
    del ref
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()  # the children measure what is left: stock's buffers given back
    files = [meta.file(li) for li in meta.layers]
    expert_bytes = sum(f.stat().st_size for f in files)
    methods = ["direct", "memlimit"] if a.beyond_ram == "both" else [a.beyond_ram]
    stream = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    stream = {k: (v.value if hasattr(v, "value") else v) for k, v in stream.items()}
    stream = {k: v for k, v in stream.items() if isinstance(v, (int, float, str, bool, type(None)))}
    trace_file = (
        None if a.trace in (None, "none") else str(Path(a.trace).resolve())
    )  # runs elsewhere
    rows = []
    # read-ahead as asked, then (--oracle, below every expert) by a simulated predictor
    # of each accuracy
    oracles = oracle_accuracies(getattr(a, "oracle", None))

    def result(rows, complete):
        return {
            "stock_tok_per_s": round(stock_tps, 3),
            "stock_runs": [round(x, 3) for x in k_runs],
            # stock reading each MoE layer's routing on the host as the host path does
            "host_floor_tok_per_s": floor_tps and round(floor_tps, 3),
            "host_floor_runs": [round(x, 3) for x in floor_runs],
            "expert_files_gb": round(expert_bytes / 1e9, 3),
            "memory_limit_gb": a.memory_limit_gb if "memlimit" in methods else None,
            "prompt_tokens": len(ids),
            "moe_layers": len(meta.moe_layers),
            "record_bytes": meta.layers[meta.moe_layers[0]].stride,  # what a miss reads
            "rows": rows,
            "complete": complete,
        }

    with tempfile.TemporaryDirectory() as tmp:
        ref_file = Path(tmp) / "want.npz"
        np.savez(ref_file, tokens=np.array(want.tokens), logits=want.logits)
        for method in methods:
            residencies = list(a.residency)
            for r, oracle in [
                (r, o) for r in residencies for o in [None, *oracles] if r < 1 or not o
            ]:
                job = {
                    "method": method, "residency": r, "checkpoint": str(Path(ck).resolve()),
                    "expert_dir": str(Path(ed).resolve()), "trace": trace_file, "start": start, "ids": ids,
                    "tokens": a.tokens, "repeat": a.repeat, "stock_tps": stock_tps, "floor_tps": floor_tps,
                    "stream": stream, "want": str(ref_file),
                    "limit": int(a.memory_limit_gb * 1e9) if method == "memlimit" else 0,
                    "oracle": oracle, "timeline": a.timeline and str(Path(a.timeline).resolve()),
                }  # fmt: skip
                out = subprocess.run(
                    [sys.executable, __file__, json.dumps(job)],
                    capture_output=True, text=True, timeout=1800,
                    cwd=str(Path(__file__).parent),
                )  # fmt: skip
                if out.returncode != 0:
                    why = f"rc {out.returncode}{killed_note()}"
                    raise RuntimeError(
                        f"{method} at {r} (oracle {oracle}), {why}: {out.stderr[-3000:]}"
                    )
                row = json.loads(out.stdout.strip().splitlines()[-1])
                log(row)
                rows.append(row)
                if progress is not None:
                    progress(result(rows, complete=False))
    return result(rows, complete=True)


def host_bound(floor_tps, decode_path: str, disk_tok: float, gbps: float, tps: float) -> dict:
    """A host-path row's serial bound on the host path's floor: stock reading each
    layer's routing on the host (``floor_tps``), then its disk bytes in series; the row's
    share of it. Empty for the device path, or without a floor (no trace to replay)."""
    if not floor_tps or decode_path != "host" or not gbps:
        return {}
    step = 1 / floor_tps + disk_tok / (gbps * 1e9)
    return {"host_serial_bound_tok_per_s": round(1 / step, 2),
            "efficiency_vs_host_serial": round(tps * step, 4)}  # fmt: skip


def typical_run(trace, args: tuple, sim: dict):
    """``simulate_tiers(*args, **sim)`` over the held-out routing a row's stretch is set
    against: ``TYPICAL`` tokens from the held-out half's first (wherever the runs start),
    one a call, after ``WARM`` uncounted ones (as the runs' prompts warm their pools)."""
    from mlx_streaming.planning.tiers import simulate_tiers

    start = trace.split(0.5)[0].tokens
    counted = [False] * WARM + [True] * TYPICAL
    return simulate_tiers(*args, start=start, calls=[1] * len(counted), counted=counted, **sim)


def stretch(run, typical) -> dict:
    """The simulator's disk bytes per token for the run's own stretch of routing
    (``run``) against ``typical`` (a long one): their ratio, and the share of
    ``typical``'s stretches as long as the run's decode that read less (None where
    ``typical`` holds fewer than 5 such stretches)."""
    if not typical.disk_bytes_per_token:
        return {}
    _, disk = typical.windows(max(1, run.tokens))
    share = float((disk < run.disk_bytes_per_token).mean()) if len(disk) >= 5 else None
    return {
        "typical_disk_bytes_per_token": round(typical.disk_bytes_per_token),
        "stretch_vs_typical": round(run.disk_bytes_per_token / typical.disk_bytes_per_token, 4),
        "stretch_percentile": share if share is None else round(share, 3),
    }


def run_calls(prompt: int, tokens: int, repeat: int) -> tuple[list[int], list[bool]]:
    """The forwards mlx-lm makes, in tokens per call, since the cold start, and which of
    them ``decode_window`` counts: the first token's run (the prompt less its last token,
    the last, and the next token's forward, built before the first token is returned),
    then each timed run's (the same, then one per later token, the last of them built
    ahead and dropped); counted, each run's forwards after the first token's return."""
    first = [prompt - 1, 1, 1] if prompt > 1 else [1, 1]
    calls, counted = list(first), [False] * len(first)
    for _ in range(repeat):
        calls += [*first, *[1] * (tokens - 1)]
        counted += [False] * len(first) + [True] * (tokens - 1)
    return calls, counted


def decode_window(model, tok, ids, tokens: int, store) -> dict:
    """One timed run: mlx-lm's decode tok/s, and from the first token's return to the
    end (the prompt left out) the store's counters, the disk's bytes, the wall time and
    the forwards made (``run_calls``' counted ones)."""
    from mlx_lm import stream_generate

    mark = None
    for r in stream_generate(model, tok, ids, max_tokens=tokens):
        if mark is None:
            store.reset_stats()
            mark = (disk_read_bytes(), time.perf_counter())
        last = r
    wall = time.perf_counter() - mark[1]
    return {
        "tps": last.generation_tps,
        "totals": store.totals(),
        "disk_bytes": disk_read_bytes() - mark[0],
        "wall_s": wall,
        "steps": max(1, last.generation_tokens - 1),
    }


def run_detail(run: dict) -> dict:
    """One timed run's own figures per decode step: pool hit rate, MB from the disk and
    from the store, and the ms of each phase of the host's time (as ``host_ms_per_token``)."""
    t, n = run["totals"], run["steps"]
    looked = t["hits"] + t["misses"]
    return {
        "tps": round(run["tps"], 3),
        "hit_rate": round(t["hits"] / looked, 4) if looked else None,
        "disk_mb": round(run["disk_bytes"] / n / 1e6, 2),
        "read_mb": round(t["bytes_read"] / n / 1e6, 2),
        **{k.replace("_s", "_ms"): round(1e3 * t[k] / n, 3) for k in PHASES},
        "wall_ms": round(1e3 * run["wall_s"] / n, 3),
    }


def disk_read_bytes() -> int:
    """Bytes this process has had read from storage (not the page cache)."""
    with open("/proc/self/io") as f:
        return int(next(x for x in f if x.startswith("read_bytes:")).split()[1])


def killed_note() -> str:
    """What a dead child's memory cgroup says (its group outlives a process killed
    outright): the OOM kills and the peak, or "" where there is none."""
    notes = []
    for g in Path("/sys/fs/cgroup").glob("mlxs-beyond-ram-*"):  # (cgroup v2)
        try:
            events = (g / "memory.events").read_text().splitlines()
            kills = next((x.split()[1] for x in events if x.startswith("oom_kill ")), "?")
            peak = int((g / "memory.peak").read_text())
        except (OSError, ValueError):
            continue  # the child's own error stands
        notes.append(f"{g.name}: oom_kill {kills}, peak {peak / 1e9:.2f} GB")
    return "; " + "; ".join(notes) if notes else ""


def in_use(job: dict, when: str) -> None:
    """Under a memory limit, what the process holds beside the page cache, on stderr (a
    process the limit kills says how far it got)."""
    if job["limit"]:
        held = (job["limit"] - page_cache_room()) / 1e9
        print(f"{when}: {held:.2f} GB in use beside the page cache", file=sys.stderr, flush=True)


def page_cache_room() -> int:
    """What the memory cgroup leaves the page cache: its limit less what else it holds."""
    from mlx_streaming.core.mem import cgroup_memory

    m = cgroup_memory()
    if m is None:
        return 0
    limit, used, cache = m
    return max(0, limit - (used - cache))


def child(job: dict) -> dict:
    """One (method, residency) row, in this fresh process (see the module's text)."""
    from mlx_streaming.bench.measure import enter_memory_limit

    if job["limit"]:  # before the model allocates anything: all of it is charged there
        enter_memory_limit(job["limit"], "mlxs-beyond-ram")
    from harness import ahead_label, decode_run, follow, read_ahead, rewind, slots_at, streamed

    from mlx_streaming.analysis.verify import Trace, compare_traces, greedy_trace
    from mlx_streaming.bench.measure import (
        bounds,
        drop_page_cache,
        ring_read_gbps,
        store_read_gbps,
    )
    from mlx_streaming.core.mem import Sampler
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.core.options import StreamConfig
    from mlx_streaming.core.runtime import resolve
    from mlx_streaming.planning.tiers import simulate_tiers
    from mlx_streaming.planning.trace import RoutingTrace

    ck, ed, ids, start = Path(job["checkpoint"]), job["expert_dir"], job["ids"], job["start"]
    meta = load_meta(ed)
    trace = None if job["trace"] in (None, "none") else RoutingTrace.load(job["trace"])
    cfg = StreamConfig(**job["stream"])  # memlimit with --direct-io: both at once
    cfg = cfg.replace(direct_io=job["method"] == "direct" or cfg.direct_io)
    if job["method"] == "direct" and cfg.swap_tier is None:  # every miss from the disk,
        cfg = cfg.replace(swap_tier=False)  # not CUDA's default tier where memory is short
    # read-ahead by a simulated oracle (a what-if), or as asked: by the trace's transitions
    how = job["oracle"] or ("transition" if cfg.prefetch and trace is not None else None)
    if how is not None:
        cfg = read_ahead(cfg, how, trace, meta)
    slots = slots_at(meta, job["residency"])
    rt = resolve(cfg, meta, slots={li: slots for li in meta.layers})  # CUDA's default tier too
    files = [meta.file(li) for li in meta.layers]
    drop_page_cache(files)
    measured_direct = rt.direct_io
    gbps = store_read_gbps(meta, rt, cold=True)
    drop_page_cache([*files, *ck.glob("*.safetensors")])
    in_use(job, "before load")
    t0 = time.perf_counter()
    model, tok, store, routing = streamed(ck, ed, trace, start, slots=slots, config=cfg)
    follow(cfg, routing)
    load_s = time.perf_counter() - t0
    in_use(job, "loaded")
    rt = store.runtime  # as the store weighed it (with its pools: CUDA's default tier)
    ring = getattr(store.reader, "ring", None)  # both paths' reads beyond a bounded tier
    probe, lone = "engine", None
    if ring is not None:  # the disk as the ring reads it: its queue full, then a lone miss
        if not rt.direct_io:  # the tier's fill read through the page cache: from the disk
            drop_page_cache(files)
        lone = ring_read_gbps(ring, meta, records=16, depth=1, seed=2)
        gbps = store_read_gbps(meta, rt, cold=True, ring=ring)  # (which leaves it cold)
        probe = "ring"
    elif rt.direct_io and not measured_direct:  # the store weighed the trunk's load too:
        # read as it reads (O_DIRECT: no page cache to drop), fewer records beside the tier
        gbps = store_read_gbps(meta, rt, records=16, cold=True)
    tier_bytes = store.reader.mapped_bytes if rt.reader == "tier" else 0  # a swap tier
    bounded = bool(tier_bytes) and store.reader.tier.partial  # --swap-tier-gb: the rest read
    whole = bool(tier_bytes) and not bounded  # every record in RAM from load: none read
    cursor = routing.cursor if routing is not None else start
    t1 = time.perf_counter()
    first = decode_run(model, tok, ids, 1, first_only=True)  # cold: prompt, first token
    ttft = time.perf_counter() - t1
    in_use(job, "first token")
    runs, per_run, wall, disk, detail = [], [], 0.0, 0, []
    room = Sampler(lambda: (page_cache_room(),), 0.05) if job["limit"] else nullcontext()
    ring_at = ring.counters() if ring is not None else None  # the runs' own reads
    with room:
        for _ in range(job["repeat"]):
            run = decode_window(model, tok, ids, job["tokens"], store)
            runs.append(run["tps"])
            per_run.append((run["totals"], run["steps"]))
            detail.append(run_detail(run))
            wall, disk = wall + run["wall_s"], disk + run["disk_bytes"]
            in_use(job, "a run")
    ran = None  # what the ring read in the runs, over the wall time a reader was reading
    if ring is not None:
        c = ring.counters()
        busy = c["busy_ns"] - ring_at["busy_ns"]
        ran = (c["bytes"] - ring_at["bytes"]) / busy if busy else None
    bound_gbps = max(gbps, ran or 0)
    tokens_run = sum(n for _, n in per_run)  # decode steps, the prompts left out
    disk_tok = disk / tokens_run
    bytes_tok = sum(t["bytes_read"] for t, _ in per_run) / tokens_run
    hits = sum(t["hits"] for t, _ in per_run)
    demand = sum(t["demand_s"] for t, _ in per_run)
    ahead, ahead_used = (sum(t[k] for t, _ in per_run) for k in ("prefetched", "prefetch_used"))
    lookups = hits + sum(t["misses"] for t, _ in per_run)
    # where a token's host time goes: ms per token by phase (``PHASES``)
    split = {k: round(1e3 * sum(t[k] for t, _ in per_run) / tokens_run, 3) for k in PHASES}
    split["wall_s"] = round(1e3 * wall / tokens_run, 3)
    phases = None
    if job.get("timeline"):  # one decode step's phases, beside the rows
        from speed import decode_timeline, step_phases

        steps = decode_timeline(model, tok, ids, store)
        phases = step_phases(steps)
        row = f"{job['method']}-{job['residency']}-{job['oracle'] or 'as-run'}"
        name = f"{Path(job['timeline']).with_suffix('')}-{row}.json"
        Path(name).write_text(json.dumps(steps, indent=0) + "\n")
    page_cache_end = page_cache_room() if job["limit"] else 0
    rooms = [r for _, r in room.series] if job["limit"] else [0]
    page_cache = int(statistics.median(rooms))  # what the runs had, not the end
    predicted, typical = None, {}
    if trace is not None and how is None:  # (the simulator has no read-ahead)
        calls, counted = run_calls(len(ids), job["tokens"], job["repeat"])
        moe = len(meta.moe_layers)
        cache = 0 if rt.direct_io else page_cache  # O_DIRECT reads around the page cache
        beneath = tier_bytes if bounded else cache  # the tier, exclusive (the page cache
        # beneath it left out), or the page cache
        sim = dict(layers=range(min(moe, trace.layers)), model_layers=moe, exclusive=bounded)
        args = (trace, rt.policy, slots, beneath, meta.layers[meta.moe_layers[0]].stride)
        predicted = simulate_tiers(*args, start=cursor, calls=calls, counted=counted, **sim)
        if not whole:  # (nothing read: no stretch)
            typical = stretch(predicted, typical_run(trace, args, sim))
    step_bytes = None  # each decode step's disk bytes, as the simulator replays them
    if predicted is not None and not whole:
        by_call = predicted.disk_bytes_by_call()
        step_bytes = [by_call[i] for i, (n, on) in enumerate(zip(calls, counted)) if on and n == 1]
    rewind(start, routing)
    ref = np.load(job["want"])
    want = Trace(ref["tokens"].tolist(), ref["logits"])
    exact = compare_traces(want, greedy_trace(model, ids, 16)).exact
    asked = (
        {**ring.counters(), "readers": ring.readers, "pieces": ring.pieces}
        if ring is not None
        else None
    )
    tps = statistics.median(runs)
    stock_tps = job["stock_tps"]
    row = {
        "method": job["method"],
        "residency": job["residency"],
        "slots": slots,
        "predictor": ahead_label(how),
        "tok_per_s": round(tps, 3),
        "decode_runs": [round(x, 3) for x in runs],
        "decode_runs_detail": detail,  # what each run read and waited for
        "ratio_vs_stock": round(tps / stock_tps, 4),
        "hit_rate": round(hits / max(1, lookups), 4),
        # read-ahead (--prefetch): experts read on a guess, and those a call then used
        "prefetched_per_token": round(ahead / tokens_run, 3),
        "prefetch_used_share": round(ahead_used / ahead, 4) if ahead else None,
        # per decode step, from each run's first token on: the prompts left out (before
        # 2026-12-04q every forward counted, prompts included, as "tokens")
        "window": "decode",
        "bytes_read_per_token": round(bytes_tok),
        # from the disk itself, against the two-tier simulator's prediction for the
        # same calls of the trace and the page cache the limit leaves
        "disk_bytes_per_token": round(disk_tok),
        "page_cache_room_gb": round(page_cache / 1e9, 3),  # the median during the runs
        "page_cache_room_gb_range": [round(min(rooms) / 1e9, 3), round(max(rooms) / 1e9, 3)],
        "page_cache_room_gb_at_end": round(page_cache_end / 1e9, 3),
        "swap_tier_gb": round(tier_bytes / 1e9, 3),
        # a swap tier holds every record the pools do not, from load: no disk read
        "predicted_disk_bytes_per_token": predicted
        and (0 if whole else round(predicted.disk_bytes_per_token)),
        "predicted_pool_hit_rate": predicted and round(predicted.shares()["pool"], 4),
        # the run's stretch of routing against the held-out routing's (4,000 tokens
        # from the held-out half's first, one a step, wherever --trace-start puts the
        # runs): decode runs this short read what their stretch of text asks, which
        # ranges widely (2026-12-08)
        **typical,
        # the disk's rate in this run: the probe (``storage_probe``: the ring's queue full,
        # else the engine's reads), and a lone record through the ring (what a decode
        # call with one miss waits); the bounds take the probe, or the rate the ring
        # reached in the runs where that is higher (``bound_gbps``)
        "storage_gbps": round(gbps, 3),
        "storage_probe": probe,
        "lone_record_ms": lone and round(lone[1], 3),
        "lone_record_gbps": lone and round(lone[0], 3),
        "ring_runs_gbps": ran and round(ran, 3),
        "bound_gbps": round(bound_gbps, 3),
        # the runs' decode time (from each first token on) with demand reads in flight:
        # the rest, the storage idles unless read-ahead fills it
        "demand_reads_share": round(demand / wall, 4) if wall else None,
        "host_ms_per_token": split,
        "step_phases_ms": phases,  # one decode step's timeline, by phase (--timeline)
        # the disk's bounds: its bytes; per step, the simulator's (it matches the disk)
        **bounds(1 / stock_tps, disk_tok, bound_gbps, tps, step_bytes),
        **host_bound(job["floor_tps"], store.runtime.decode_path, disk_tok, bound_gbps, tps),
        "ttft_cold_s": round(ttft, 3),
        "prompt_tps_cold": round(first[1], 2),
        "load_cold_s": round(load_s, 2),
        "exact_vs_stock": exact,
        # the request ring since load (the probes', the prompts' and the check's reads
        # too): whether a record's wait is its read or the queue before it
        "ring": asked
        and {
            **asked,
            "read_ms_per_request": round(asked["read_ns"] / 1e6 / max(1, asked["requests"]), 3),
            "answer_ms_per_request": round(asked["answer_ns"] / 1e6 / max(1, asked["requests"]), 3),
        },
        "runtime": store.runtime.to_json(),
    }
    store.close()  # its threads stopped before the process's teardown
    return row


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].startswith("{"):
        raise SystemExit("beyond_ram.py is speed.py's child, given one row as JSON: run "
                         "python benchmarks/speed.py --beyond-ram direct|memlimit|both ...")  # fmt: skip
    faulthandler.enable()  # a crash in C code prints the Python stack in the row's error
    print(json.dumps(child(json.loads(sys.argv[1]))), flush=True)
