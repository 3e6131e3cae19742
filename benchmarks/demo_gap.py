"""Where the demo's gap to stock goes (issue 31, item 7): the trained model at half its
experts, stock and streamed variants in alternating runs, then one streamed decode's
host timeline split into its segments.

1. Pairs: stock mlx-lm and each streamed variant (the default; planned early: every call
   planned before its expert graph is built, ``HostPath.late`` off; ``lru``; rows
   masked) run in turn, ``--repeat`` rounds of ``--tokens`` decode tokens; each
   variant's decode tok/s over the stock run of its round, median.
2. Timeline: the default's layer calls marked (``store.timeline``) over one run; the
   median µs of each segment between consecutive marks (``request``: the MoE call
   begins; ``ahead``: its routing launched; ``routed``: read; ``planned``; ``read``: the
   misses landed; ``built``: the expert graph launched), and the share of the run.

    python benchmarks/demo_gap.py --json benchmarks/results/demo-gap-cpu.json
"""

from __future__ import annotations

import collections
import statistics
import time

from harness import ROOT, finish, log, parser

CHECKPOINT = ROOT / "checkpoints" / "tiny-stdlib-moe"
PROMPT = 'import os\n\n\ndef read_config(path):\n    """'


def main() -> None:
    p = parser(__doc__, preset=None, trace=False, workdir="scratch/demo-gap")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=7)
    a = p.parse_args()
    from mlx_lm import load as mlx_load
    from mlx_lm import stream_generate

    from mlx_streaming.core.options import StreamConfig
    from mlx_streaming.model_builder import load
    from mlx_streaming.prep.split_experts import ensure_split

    t0 = time.perf_counter()
    ed = f"{a.workdir}/experts"
    ensure_split(CHECKPOINT, ed)
    stock, tok = mlx_load(str(CHECKPOINT))

    def run(model, n=a.tokens):
        *_, last = stream_generate(model, tok, PROMPT, max_tokens=n)
        return last.generation_tps

    variants = {
        "default": StreamConfig(slots=32),
        "planned early": StreamConfig(slots=32),
        "lru": StreamConfig(slots=32, policy="lru"),
        "rows masked": StreamConfig(slots=32, rows="masked"),
    }
    models = {"stock": stock}
    stores = {}
    for name, cfg in variants.items():
        models[name], _, stores[name] = load(CHECKPOINT, ed, cfg, progress=False)
    stores["planned early"].host.late = False  # the plan before the graph, as in 786a343^
    for m in models.values():
        run(m, 16)  # warm up: compile, fill the pools
    tps = {k: [] for k in models}
    for _ in range(a.repeat):
        for k, m in models.items():
            tps[k].append(run(m))
    pairs = {
        k: {
            "decode_tok_per_s": round(statistics.median(v), 1),
            "pair_ratio_median": round(
                statistics.median(x / s for x, s in zip(v, tps["stock"])), 3
            ),
            "runs": [round(x, 1) for x in v],
        }
        for k, v in tps.items()
    }
    log(pairs)

    store = stores["default"]
    store.timeline.start()
    t1 = time.perf_counter()
    timed = run(models["default"])
    wall = time.perf_counter() - t1
    events = [e for e in store.timeline.stop() if e["path"] == "host"]  # as before 2026-12-04
    seg = collections.defaultdict(list)
    for e0, e1 in zip(events, events[1:]):
        seg[f"{e0['phase']} -> {e1['phase']}"].append(e1["t_us"] - e0["t_us"])
    segments = {
        k: {
            "calls": len(v),
            "median_us": round(statistics.median(v)),
            "share_of_run": round(sum(v) / 1e6 / wall, 3),
        }  # fmt: skip
        for k, v in sorted(seg.items(), key=lambda kv: -sum(kv[1]))
        if len(v) > 8  # decode calls (the prompt's few calls left out)
    }
    log(segments)
    for s in stores.values():
        s.close()
    finish(
        a,
        "demo-gap",
        {
            "checkpoint": str(CHECKPOINT.relative_to(ROOT)),
            "slots": 32,
            "tokens": a.tokens,
            "repeat": a.repeat,
            "pairs": pairs,
            "timeline_tok_per_s": round(timed, 1),
            "timeline_segments": segments,
        },  # fmt: skip
        t0,
    )


if __name__ == "__main__":
    main()
