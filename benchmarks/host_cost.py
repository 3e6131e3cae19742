"""Host cost of a streamed layer call per phase, by reader and policy (CPU-sized).

A tiny DeepSeek-V2 model of the DeepSeek-V2-Lite trace's routing shape (64 experts,
top-6), the trace replayed, 32 of 64 slots, 128 decode tokens, no overlap split: µs per
MoE layer call waiting for the routing, planning, reading plus the policy's
bookkeeping, and building the expert graph. Then ``planning``: the store's side of a
layer call alone (request, steps, the wait for its reads; no model, no device work),
the trace's routing handed in already evaluated, median and mean µs per call over
``--plan-tokens`` tokens (the first 50 left out), where the phases above also measure
MLX's compute they overlap on a small CPU.

    python benchmarks/host_cost.py
"""

from __future__ import annotations

import time

import numpy as np
from harness import finish, parser

from mlx_streaming.commands._args import positive_int


def planning(store, trace, tokens: int, start: int = 5000) -> dict:
    """µs per layer call of the store's own work for the trace's routing (request,
    steps, the wait for its reads), the ids already on the device."""
    import mlx.core as mx

    layers = sorted(store.caches)
    ids = [
        [mx.array(trace.experts[start + t, min(j, trace.layers - 1)].astype(np.int32)[None, None])
         for j in range(len(layers))]
        for t in range(tokens)
    ]  # fmt: skip
    mx.eval(ids)
    times = []
    for t in range(tokens):
        for j, li in enumerate(layers):
            t0 = time.perf_counter()
            call = store.request(li, ids[t][j], False)
            if call.routing is not None:  # planned late, at finish (which launches)
                store.finish(call, call.slots)
            for i in range(len(call.steps)):
                store.step(call, i)
            if call.wait_at_launch:
                store.host.wait(call)
            times.append(time.perf_counter() - t0)
    us = 1e6 * np.array(times[50 * len(layers) :])
    return {"median_us": round(float(np.median(us)), 1), "mean_us": round(float(us.mean()), 1)}


def main():
    p = parser(__doc__, preset=None, trace="required", workdir="scratch/host_cost")
    p.add_argument("--tokens", type=positive_int, default=128)
    p.add_argument("--plan-tokens", type=positive_int, default=400,
                   help="routed tokens timed (after 50 left out), from the trace's token 5000")  # fmt: skip
    a = p.parse_args()
    if a.plan_tokens <= 50:
        p.error(f"--plan-tokens {a.plan_tokens}: the first 50 are left out; give more")
    from mlx_streaming.planning.trace import RoutingTrace, apply_trace_routing

    trace = RoutingTrace.load(a.trace)  # long enough for both replays, before the build
    need = 5000 + max(a.plan_tokens, a.tokens + 8 + 64)
    if trace.tokens < need:
        p.error(f"--trace {a.trace}: {trace.tokens} tokens; these runs replay from token "
                f"5000 and need {need}: lower --plan-tokens or --tokens, or record more")  # fmt: skip
    from mlx_lm import stream_generate

    import mlx_streaming
    from mlx_streaming.prep.split_experts import ensure_split
    from mlx_streaming.synthetic import make_checkpoint

    ck = make_checkpoint(f"{a.workdir}/trace-deepseek_v2", "trace-deepseek_v2")
    ed = f"{a.workdir}/trace-deepseek_v2-experts"
    ensure_split(ck, ed)
    rows = []
    for reader in ("native", "python"):
        for policy in ("predictive", "lru"):
            model, tok, store = mlx_streaming.load(
                ck, ed, slots=32, reader=reader, policy=policy, progress=False,
                config=mlx_streaming.StreamConfig(overlap=False),
            )  # fmt: skip
            apply_trace_routing(model, trace, 5000)
            for _ in stream_generate(model, tok, "hello there", max_tokens=8):
                pass
            store.reset_stats()
            for _ in stream_generate(model, tok, "hello there", max_tokens=a.tokens):
                pass
            t = store.totals()
            calls = t["host_calls"] + t["device_calls"]
            us = {
                k: round(1e6 * t[k] / calls, 1)
                for k in ("ahead_s", "sync_s", "host_s", "read_s", "graph_s")
            }
            rows.append(
                {"reader": reader, "policy": policy, "hit_rate": round(t["hit_rate"], 4), **us}
            )
            store.close()
    plan_rows = []
    for policy in ("predictive", "lru"):
        _, _, store = mlx_streaming.load(
            ck, ed, slots=32, reader="native", policy=policy, progress=False,
            config=mlx_streaming.StreamConfig(overlap=False),
        )  # fmt: skip
        plan_rows.append({"reader": "native", "policy": policy,
                          **planning(store, trace, a.plan_tokens)})  # fmt: skip
        store.close()
    finish(
        a,
        "host_cost",
        {"slots": 32, "tokens": a.tokens, "rows": rows, "planning": plan_rows},
    )


if __name__ == "__main__":
    main()
