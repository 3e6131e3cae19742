"""Where one decode step's time goes: the host building its graph, the host launching
it, and the wait for the device, stock against streamed (issue 31, item 8).

A loop shaped as mlx-lm's ``generate_step`` (build token t+1's graph, launch it with
``mx.async_eval``, then wait for token t), timed per token: ``build`` (the model call and
the argmax, Python and MLX's graph), ``launch`` (MLX encoding and launching it) and
``wait`` (the token before, on the device). Then the same loop synchronised per token:
``synced`` = build + launch + the device's tail after the last launch. A wait near 0
means the host bounds the step; a wait > 0, the device.

Models, each on the same trace position: stock; streamed at ``--residency``; the same
with the fill kernel copying nothing (inexact: the device cost of the copies is the
difference); every expert resident (no plan, no fill). Medians in ms per token.

    python benchmarks/probes/decode_split.py --preset dsv2-lite --residency 0.5 \
        --workdir /tmp/mlxs --json out.json
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from harness import PROMPT, build, finish, log, parser, rewind, routing_trace, stock, streamed  # noqa: E402


def _ms(xs: list[float]) -> float:
    return round(1e3 * statistics.median(xs), 3)


def split(model, tok, tokens: int, synced: bool) -> dict:
    """Per-token medians of build, launch and wait (ms) over ``tokens`` decode steps."""
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    ids = mx.array(tok.encode(PROMPT))
    with mx.stream(generation_stream):
        y = mx.argmax(model(ids[None], cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)
    build_s, launch_s, wait_s, step_s = [], [], [], []
    t_prev = time.perf_counter()
    for _ in range(tokens):
        t0 = time.perf_counter()
        with mx.stream(generation_stream):
            nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        (nxt if synced else y).item()
        t3 = time.perf_counter()
        build_s.append(t1 - t0)
        launch_s.append(t2 - t1)
        wait_s.append(t3 - t2)
        step_s.append(t3 - t_prev)
        t_prev, y = t3, nxt
    mx.eval(y)
    skip = 4  # warm-up steps
    return {
        "build_ms": _ms(build_s[skip:]),
        "launch_ms": _ms(launch_s[skip:]),
        "wait_ms": _ms(wait_s[skip:]),
        "step_ms": _ms(step_s[skip:]),
    }


def measure(name: str, model, tok, routing, start: int, tokens: int, store=None) -> dict:
    out = {}
    for mode in ("pipelined", "synced", "pipelined_again"):
        rewind(start, routing)
        if store is not None:
            store.reset_stats()
        out[mode] = split(model, tok, tokens, synced=mode == "synced")
    if store is not None:
        out["hit_rate"] = round(store.totals()["hit_rate"], 4)
    log(name, out)
    return out


def main():
    p = parser(__doc__, preset="dsv2-lite", workdir="/tmp/mlxs")
    p.add_argument("--residency", type=float, default=0.5)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args()
    ck, ed, meta = build(a)
    trace, start = routing_trace(a)
    runs = {}
    ref, tok, routing = stock(ck, trace, start)
    runs["stock"] = measure("stock", ref, tok, routing, start, a.tokens)
    del ref
    slots = max(meta.top_k, round(a.residency * meta.num_experts))
    for name, n, copies in (
        (f"streamed_{a.residency}", slots, True),
        (f"streamed_{a.residency}_no_copies", slots, False),
        ("streamed_resident", meta.num_experts, True),
    ):
        model, tok, store, routing = streamed(ck, ed, trace, start, slots=n)
        if not copies:  # the plan kernel still runs; its fills are dropped (inexact)
            store.reader.fill = lambda layer, fills, slots: slots
        runs[name] = measure(name, model, tok, routing, start, a.tokens, store)
        runs[name]["decode_path"] = store.runtime.decode_path
        store.close()
        del model
    # stock again: the machine's drift over the run
    ref, tok, routing = stock(ck, trace, start)
    runs["stock_again"] = measure("stock_again", ref, tok, routing, start, a.tokens)
    finish(a, "decode_split", {"slots": slots, "tokens": a.tokens, "runs": runs})


if __name__ == "__main__":
    main()
