"""How many operations a decoded token launches, stock mlx-lm against streamed: MLX's
evaluation calls (``mx.eval``, ``mx.async_eval``) are wrapped so that each call's pending
graph is exported (``mx.export_to_dot``) and its primitives counted before it runs.

On CUDA a launched op costs the host ~4-9 µs (``benchmarks/RESULTS.md``, "MLX's host cost
per evaluation call"), so ops per token, beside evaluation calls per token, say how much
of the streamed host path's launch time is more work launched and how much is the
splitting. Counted on any backend (the graph is the model's; the CUDA path's own copy
and transfer kernels are not in a CPU count).

    python benchmarks/probes/graph_ops.py --preset dsv2-lite-cpu --residency 0.25
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from harness import (  # noqa: E402
    PROMPT,
    RESIDENCIES,
    build,
    finish,
    log,
    parser,
    rewind,
    routing_trace,
    slots_at,
    stock,
    streamed,
)
from mlx.utils import tree_flatten  # noqa: E402

from mlx_streaming.commands._args import budget_value  # noqa: E402

_NODE = re.compile(r'\{ (\d+) \[label ="([^"]+)", shape=rectangle\]; \}')
# primitives that launch no kernel of their own (views and shape changes)
VIEWS = {"Broadcast", "Reshape", "ExpandDims", "Squeeze", "Slice", "Transpose",
         "StopGradient", "Flatten", "Unflatten", "AsStrided"}  # fmt: skip


class OpCounter:
    """Counts the primitives each evaluation call runs (while ``on``): ``calls`` that ran
    some, ``waits`` that found nothing pending (the host path's wait for a routing it
    launched before)."""

    def __init__(self):
        self.on, self.calls, self.waits, self.ops = False, 0, 0, collections.Counter()
        self._tmp = tempfile.TemporaryDirectory()
        self._dot = os.path.join(self._tmp.name, "g.dot")
        self._eval, self._async = mx.eval, mx.async_eval
        mx.eval, mx.async_eval = self._wrap(self._eval), self._wrap(self._async)

    def _wrap(self, real):
        def call(*args, **kw):
            if self.on:
                arrays = [x for _, x in tree_flatten(list(args)) if isinstance(x, mx.array)]
                if arrays:
                    mx.export_to_dot(self._dot, *arrays)
                    with open(self._dot) as f:
                        found = [label for _, label in _NODE.findall(f.read())]
                    self.ops.update(found)
                    self.calls += 1 if found else 0  # a call with nothing pending only waits
                    self.waits += 0 if found else 1
            return real(*args, **kw)

        return call

    def restore(self) -> None:
        mx.eval, mx.async_eval = self._eval, self._async
        self._tmp.cleanup()


def _count(counter: OpCounter, model, tok, tokens: int) -> dict:
    from mlx_lm import stream_generate

    for _ in stream_generate(model, tok, PROMPT, max_tokens=3):  # warm
        pass
    counter.calls, counter.waits, counter.ops = 0, 0, collections.Counter()
    gen = stream_generate(model, tok, PROMPT, max_tokens=tokens + 1)
    next(gen)  # the prompt and the first token
    counter.on = True
    n = 0
    for _ in gen:
        n += 1
    counter.on = False
    total = sum(counter.ops.values())
    kernels = sum(v for k, v in counter.ops.items() if k not in VIEWS)
    top = {k: round(v / n, 1) for k, v in counter.ops.most_common(40)}
    return {"tokens": n, "evaluations_per_token": round(counter.calls / n, 1),
            "waits_per_token": round(counter.waits / n, 1),
            "ops_per_token": round(total / n, 1), "ops_not_views_per_token": round(kernels / n, 1),
            "ops_by_kind_per_token": top}  # fmt: skip


def main():
    """Count stock's ops, then each residency's (the host path), and print them."""
    p = parser(__doc__, preset="dsv2-lite-cpu", workdir="scratch/bench")
    p.add_argument("--residency", type=RESIDENCIES, default=[0.25])
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument(
        "--swap-tier-gb", type=budget_value, help="a swap tier of at most this many GB, or auto"
    )
    p.add_argument("--direct-io", action=argparse.BooleanOptionalAction, default=None)
    a = p.parse_args()
    load_kw = {"direct_io": a.direct_io, "device_reads": False}  # the host path, on CUDA too
    if a.swap_tier_gb:
        load_kw.update(swap_tier=True, swap_tier_gb=a.swap_tier_gb)
    ck, ed, meta = build(a)
    trace, start = routing_trace(a)
    counter = OpCounter()
    out = {}
    try:
        model, tok, routing = stock(ck, trace, start)
        rewind(start, routing)
        out["stock"] = _count(counter, model, tok, a.tokens)
        log("stock", {k: v for k, v in out["stock"].items() if k != "ops_by_kind_per_token"})
        del model
        for r in a.residency:
            model, tok, store, routing = streamed(
                ck, ed, trace, start, slots=slots_at(meta, r), **load_kw
            )
            rewind(start, routing)
            out[f"streamed_{r}"] = res = _count(counter, model, tok, a.tokens)
            res["decode_path"] = store.runtime.decode_path
            log(f"streamed {r}", {k: v for k, v in res.items() if k != "ops_by_kind_per_token"})
            store.close()
            del model
    finally:
        counter.restore()
    finish(a, "graph_ops", {"moe_layers": len(meta.layers), "runs": out})


if __name__ == "__main__":
    main()
