"""Where the host's time goes in one decode, by function: stock mlx-lm against streamed
at the given residencies, under cProfile.

MLX's own calls (``mx.eval``, ``mx.async_eval``, array conversion) are wrapped in named
Python functions so that the profile shows them apart from the Python that calls them:
``mlx:async_eval`` is MLX encoding and launching a graph, ``mlx:eval`` that plus waiting
for it. Profiled from the first decoded token on (the prompt's calls take the host
path). Each row: total µs per decoded token, and per MoE layer call.

    python benchmarks/probes/host_profile.py --preset dsv2-lite --residency 0.5,0.25

``--swap-tier-gb G`` (with ``--direct-io``) profiles a bounded swap tier: on CUDA the
host path with the tier, the files read by the native reader.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
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

from mlx_streaming.commands._args import budget_value  # noqa: E402


def _wrap_mlx() -> None:
    """Make MLX's evaluation calls visible to cProfile under their own names."""
    real_eval, real_async = mx.eval, mx.async_eval

    def eval_(*a, **k):
        return real_eval(*a, **k)

    def async_eval_(*a, **k):
        return real_async(*a, **k)

    # cProfile names a function by its code object's name
    eval_.__code__ = eval_.__code__.replace(co_name="mlx:eval")
    async_eval_.__code__ = async_eval_.__code__.replace(co_name="mlx:async_eval")
    mx.eval, mx.async_eval = eval_, async_eval_


def _profile(model, tok, ids, tokens: int, layers: int, top: int) -> dict:
    from mlx_lm import stream_generate

    for _ in stream_generate(model, tok, ids, max_tokens=4):  # warm
        pass
    pr = cProfile.Profile()
    gen = stream_generate(model, tok, ids, max_tokens=tokens)
    next(gen)  # the prompt and the first token: host-path calls, not decode's
    pr.enable()
    last = None
    for last in gen:  # noqa: B007 - the last response carries the counts
        pass
    pr.disable()
    n = last.generation_tokens - 1  # the tokens decoded while profiled
    st = pstats.Stats(pr, stream=io.StringIO())
    rows = []
    for (file, line, name), (_, calls, tt, ct, _) in st.stats.items():
        where = name if name.startswith("mlx:") else f"{Path(file).name}:{line}:{name}"
        rows.append(
            {
                "function": where,
                "calls_per_token": round(calls / n, 1),
                "self_us_per_token": round(1e6 * tt / n, 1),
                "self_us_per_layer": round(1e6 * tt / n / layers, 1),
                "cum_us_per_token": round(1e6 * ct / n, 1),
            }
        )
    rows.sort(key=lambda r: -r["self_us_per_token"])
    return {"tok_per_s": round(last.generation_tps, 2), "tokens": n, "top": rows[:top]}


def main():
    p = parser(__doc__, preset="dsv2-lite", workdir="/tmp/mlxs")
    p.add_argument("--residency", type=RESIDENCIES, default=[0.5, 0.25])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--top", type=int, default=30)
    p.add_argument(
        "--swap-tier-gb", type=budget_value, help="a swap tier of at most this many GB, or auto"
    )
    p.add_argument("--direct-io", action=argparse.BooleanOptionalAction, default=None,
                   help="read the files with O_DIRECT (default: the package's)")  # fmt: skip
    a = p.parse_args()
    load_kw = {"direct_io": a.direct_io}
    if a.swap_tier_gb:
        load_kw.update(swap_tier=True, swap_tier_gb=a.swap_tier_gb)
    ck, ed, meta = build(a)
    trace, start = routing_trace(a)
    layers = len(meta.layers)
    ids = PROMPT
    _wrap_mlx()
    out = {}
    model, tok, routing = stock(ck, trace, start)
    rewind(start, routing)
    out["stock"] = _profile(model, tok, ids, a.tokens, layers, a.top)
    log("stock", out["stock"]["tok_per_s"], out["stock"]["top"][:8])
    del model
    for r in a.residency:
        slots = slots_at(meta, r)
        model, tok, store, routing = streamed(ck, ed, trace, start, slots=slots, **load_kw)
        rewind(start, routing)
        res = _profile(model, tok, ids, a.tokens, layers, a.top)
        res["slots"], res["hit_rate"] = slots, round(store.totals()["hit_rate"], 4)
        res["options"] = load_kw
        out[f"streamed_{r}"] = res
        log(f"streamed {r}", res["tok_per_s"], res["top"][:8])
        store.close()
        del model
    finish(a, "host_profile", {"moe_layers": layers, "runs": out})


if __name__ == "__main__":
    main()
