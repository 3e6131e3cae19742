"""Where a streamed token's time goes: host time per MoE call split into the routing
sync, issuing reads and waiting for them, for a few configurations side by side, plus
the raw costs of one record's read and host-to-device copy.

    python benchmarks/gpu_profile.py --preset dsv2-lite --trace TRACE --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import decode_run, open_streamed  # noqa: E402


class Timers:
    """Wraps methods to sum their wall time."""

    def __init__(self):
        self.t = defaultdict(float)
        self.n = defaultdict(int)
        self._undo = []

    def wrap(self, cls, name, key=None):
        key = key or name
        orig = getattr(cls, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.t[key] += time.perf_counter() - t0
                self.n[key] += 1

        setattr(cls, name, timed)
        self._undo.append((cls, name, orig))

    def reset(self):
        self.t.clear()
        self.n.clear()

    def undo(self):
        for cls, name, orig in reversed(self._undo):
            setattr(cls, name, orig)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="dsv2-lite-cpu")
    p.add_argument("--workdir", default="scratch/speed")
    p.add_argument("--trace", required=True)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--json", dest="json_out")
    p.add_argument("--raw", action="store_true", help="only the read/copy variants")
    p.add_argument("--configs", help="comma-separated subset of the configuration names")
    a = p.parse_args()

    from mlx_lm import load

    from mlx_streaming.core.cache.expert_store import FileExpertStore, Ticket
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.core.prefetch.patch import StreamedExperts, StreamOptions
    from mlx_streaming.prep.split_experts import split_model
    from mlx_streaming.synthetic import make_checkpoint
    from mlx_streaming.planning.trace import RoutingTrace

    root = Path(a.workdir)
    ck = make_checkpoint(root / a.preset, a.preset)
    ed = root / f"{a.preset}-experts"
    split_model(ck, ed)
    meta = load_meta(ed)
    trace = RoutingTrace.load(a.trace)
    start = trace.split(0.5)[0].tokens
    _, tok = load(str(ck), lazy=True)
    ids = tok.encode("Explain how a mixture of experts model routes tokens, briefly.")

    if a.raw:
        out = read_variants(ed, meta)
        if a.json_out:
            Path(a.json_out).write_text(json.dumps(out, indent=1))
        return
    timers = Timers()
    timers.wrap(StreamedExperts, "__call__", "call")
    timers.wrap(FileExpertStore, "begin")
    timers.wrap(Ticket, "wait")
    timers.wrap(FileExpertStore, "plan")
    configs = [
        ("resident", 1.0, {}, StreamOptions()),
        ("resident+sync", 1.0, {"record": True}, StreamOptions()),
        ("25%", 0.25, {}, StreamOptions()),
        ("25% no-overlap", 0.25, {}, StreamOptions(overlap=False)),
        ("25% no-verify", 0.25, {"verify": False}, StreamOptions()),
        ("50%", 0.5, {}, StreamOptions()),
    ]
    if a.configs:
        configs = [c for c in configs if c[0] in a.configs.split(",")]
    out = []
    for name, r, kw, opts in configs:
        slots = max(meta.top_k, round(r * meta.num_experts))
        model, store, _ = open_streamed(ck, ed, slots, trace, start, opts,
                                        {"threads": a.threads, **kw})
        decode_run(model, tok, ids, a.tokens, 2048)
        runs = []
        for _ in range(2):
            timers.reset()
            store.reset_stats()
            t0 = time.perf_counter()
            tps, _, n = decode_run(model, tok, ids, a.tokens, 2048)
            wall = time.perf_counter() - t0
            runs.append(tps)
        tot = store.totals()
        toks = n  # per decoded token (the prompt's one call per layer included)
        rec = {"config": name, "slots": slots, "tok_per_s": round(statistics.median(runs), 2),
               "hit_rate": round(store.hit_rate(), 4), "wall_s": round(wall, 3),
               "misses_per_token": round(tot["misses"] / toks, 2),
               "pool_mode": store.pool_mode}
        for k in timers.t:
            rec[f"{k}_ms_per_token"] = round(timers.t[k] / toks * 1e3, 3)
            rec[f"{k}_calls_per_token"] = round(timers.n[k] / toks, 2)
        print(json.dumps(rec), flush=True)
        out.append(rec)
        if name == "25%":  # raw costs of one record on this machine
            out.append(raw_costs(store, meta))
            print(json.dumps(out[-1]), flush=True)
        store.close()
        del model
        mx.clear_cache()
    timers.undo()
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=1))


def raw_costs(store, meta) -> dict:
    """Median time of one record: pread into a staging row, copy into a slot."""
    from mlx_streaming.core.io.reader import RecordJob

    li = store.layers[0]
    pool, lay = store.pool(li), meta.layers[li]
    rows = store._stage(li).take(1)
    res = {"record_mb": round(lay.record_bytes / 1e6, 3)}
    t_read, t_copy, t_one = [], [], []
    for e in range(min(16, lay.num_experts)):
        t0 = time.perf_counter()
        store.reader.submit(li, [RecordJob(e, [rows[0][: lay.record_bytes]])]).result()
        t_read.append(time.perf_counter() - t0)
        if pool.mode == "cuda":
            t0 = time.perf_counter()
            pool.copy_range(0, rows[0], 0, lay.record_bytes)
            t_copy.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pool.copy_range(0, rows[0], 0, 1 << 20)
            t_one.append(time.perf_counter() - t0)
    store._stage(li).give(rows)
    res["read_ms"] = round(statistics.median(t_read) * 1e3, 3)
    if t_copy:
        res["copy_ms"] = round(statistics.median(t_copy) * 1e3, 3)
        res["copy_1mb_ms"] = round(statistics.median(t_one) * 1e3, 3)
        res["copy_gbps"] = round(lay.record_bytes / statistics.median(t_copy) / 1e9, 2)
    return res


def read_variants(ed, meta) -> list[dict]:
    """One call's worth of misses (4 records) read and copied into slots, as pieces of
    several sizes over several thread counts: median ms per batch."""
    from mlx_streaming.core.cache.expert_store import FileExpertStore
    from mlx_streaming.core.io.reader import RecordJob, RecordReader

    out = []
    store = FileExpertStore(ed, capacity=8)
    li = store.layers[0]
    pool, lay = store.pool(li), meta.layers[li]
    rows = store._stage(li).take(4)
    for threads in (4, 8, 16):
        for piece in (256 << 10, 1 << 20, 64 << 20):
            r = RecordReader(threads=threads, piece_bytes=piece)
            for l2 in store.layers:
                r.open(l2, meta.file(l2), meta.layers[l2].stride)
            for copy in (False, True):
                ts = []
                for it in range(12):
                    ids = [(it * 4 + 9 * j) % lay.num_experts for j in range(4)]
                    jobs = [RecordJob(e, [rows[j][: lay.record_bytes]],
                                      piece=(lambda a, b, j=j: pool.copy_range(j, rows[j], a, b))
                                      if copy and pool.mode == "cuda" else None)
                            for j, e in enumerate(ids)]
                    t0 = time.perf_counter()
                    r.submit(store.layers[it % len(store.layers)], jobs).result()
                    ts.append(time.perf_counter() - t0)
                ms = statistics.median(ts[2:]) * 1e3
                rec = {"threads": threads, "piece_kb": piece >> 10, "copy": copy,
                       "batch_ms": round(ms, 3),
                       "gbps": round(4 * lay.record_bytes / ms / 1e6, 2)}
                print(json.dumps(rec), flush=True)
                out.append(rec)
            r.close()
    store._stage(li).give(rows)
    store.close()
    return out


if __name__ == "__main__":
    main()
