"""Where a streamed model stops being bit-exact on a GPU: stock against itself (is stock
deterministic?), then streamed under each pool mode, row mode and slot count, greedy
decode after a chunked prefill, each compared with stock.

    python benchmarks/probes/cuda_exact.py tiny-qwen3_next [--tokens 6] [--chunk 8]
"""

from __future__ import annotations

import argparse
import json
import time

from mlx_lm import load

import mlx_streaming
from mlx_streaming.analysis.verify import compare_traces, greedy_trace
from mlx_streaming.core.dispatch import backend
from mlx_streaming.core.meta import load_meta
from mlx_streaming.prep.split_experts import split_model
from mlx_streaming.synthetic import make_checkpoint

TEXT = "A mixture of experts routes each token to a few experts out of many. " * 3


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("preset")
    p.add_argument("--tokens", type=int, default=6)
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--workdir", default="/tmp/cuda_exact")
    a = p.parse_args()
    ck = make_checkpoint(f"{a.workdir}/{a.preset}", a.preset, dtype="bfloat16")
    ed = f"{a.workdir}/{a.preset}-experts"
    split_model(ck, ed)
    meta = load_meta(ed)
    ref, tok = load(str(ck))
    ids = tok.encode(TEXT)
    t0 = time.perf_counter()
    want = greedy_trace(ref, ids, a.tokens, a.chunk)
    again = greedy_trace(ref, ids, a.tokens, a.chunk)
    report(f"stock vs stock ({time.perf_counter() - t0:.0f}s)", want, again)
    for slots in sorted({meta.top_k, meta.num_experts}):
        combos = [("cuda", "masked"), ("mlx", "masked"), ("cuda", "subset")]
        if backend() == "cpu":  # a smoke test: CPU pools have no zero slot for masked rows
            combos = [("host", "subset"), ("mlx", "subset")]
        for mode, rows in combos:
            model, _, store = mlx_streaming.load(
                ck, ed, slots=slots, pool_mode=mode, progress=False,
                config=mlx_streaming.StreamConfig(rows=rows, kernel_check=False),
            )  # fmt: skip
            got = greedy_trace(model, ids, a.tokens, a.chunk)
            report(f"slots={slots} pool={mode} rows={rows}", want, got)
            store.close()


def report(what, want, got):
    cmp = compare_traces(want, got)
    print(what, json.dumps(cmp.to_json()), flush=True)


if __name__ == "__main__":
    main()
