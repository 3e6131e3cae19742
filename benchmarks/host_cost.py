"""Host cost of a streamed layer call per phase, by reader and policy (CPU-sized).

A tiny DeepSeek-V2 model of the DeepSeek-V2-Lite trace's routing shape (64 experts,
top-6), the trace replayed, 32 of 64 slots, 128 decode tokens, no overlap split: µs per
MoE layer call waiting for the routing, planning, reading plus the policy's
bookkeeping, and building the expert graph.

    python benchmarks/host_cost.py
"""

from __future__ import annotations

from harness import TRACE, finish, parser


def main():
    p = parser(__doc__, preset=None, workdir="scratch/host_cost")
    p.add_argument("--tokens", type=int, default=128)
    a = p.parse_args()
    from mlx_lm import stream_generate

    import mlx_streaming
    from mlx_streaming.planning.trace import RoutingTrace, apply_trace_routing
    from mlx_streaming.prep.split_experts import ensure_split
    from mlx_streaming.synthetic import make_checkpoint

    ck = make_checkpoint(f"{a.workdir}/trace-deepseek_v2", "trace-deepseek_v2")
    ed = f"{a.workdir}/trace-deepseek_v2-experts"
    ensure_split(ck, ed)
    trace = RoutingTrace.load(a.trace if a.trace != "none" else TRACE)
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
    finish(a, "host_cost", {"slots": 32, "tokens": a.tokens, "rows": rows})


if __name__ == "__main__":
    main()
