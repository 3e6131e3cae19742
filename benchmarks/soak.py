"""Soak: one long generation (5,000 tokens) with a streamed model; RSS and MLX active
memory must stay flat. The KV cache grows with the context by design, so drift is also
given with it subtracted.

    python benchmarks/soak.py --json benchmarks/results/soak-cpu.json
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
from harness import build, finish, parser


def kv_bytes(cache) -> int:
    total = 0
    for c in cache:
        st = c.state if isinstance(c.state, (list, tuple)) else [c.state]
        total += sum(getattr(a, "nbytes", 0) for a in st if a is not None)
    return total


def main():
    p = parser(__doc__, preset="demo", trace=False, workdir="scratch/soak")
    p.add_argument("--tokens", type=int, default=5000)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument(
        "--stock",
        action="store_true",
        help="the same generation with stock mlx-lm (all experts resident), "
        "to tell the library's drift from MLX's and the allocator's",
    )
    a = p.parse_args()
    if a.tokens < 900:  # drift is read from token 500 on, a quarter at each end
        p.error(f"--tokens {a.tokens}: give 900 or more (drift is read from token 500 on)")
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    import mlx_streaming
    from mlx_streaming.core.mem import rss_bytes

    ck, ed, _ = build(a)
    model, tok, store = mlx_streaming.load(ck, ed, slots=a.slots)
    limit = mlx_streaming.memory_plan(model, store).cache_limit_bytes
    if a.stock:
        from mlx_lm import load

        store.close()
        del model
        model, tok = load(str(ck))
        mx.set_cache_limit(limit)  # the same buffer-cache cap as the streamed run
    cache = make_prompt_cache(model)
    # random weights: keep sampling from ending the story early on an EOS token
    eos = mx.array(sorted(tok.eos_token_ids), dtype=mx.int32)

    def no_eos(tokens, logits):
        return logits.at[..., eos].add(-1e9)

    samples = []
    t0 = time.perf_counter()
    for r in stream_generate(
        model,
        tok,
        "Tell a very long story.",
        max_tokens=a.tokens,
        prompt_cache=cache,
        sampler=make_sampler(0.8, 0.95),
        logits_processors=[no_eos],
    ):
        if r.generation_tokens % 100 == 0:
            samples.append(
                (
                    r.generation_tokens,
                    rss_bytes(),
                    mx.get_active_memory(),
                    kv_bytes(cache),
                    mx.get_cache_memory(),
                )
            )
        n = r.generation_tokens
    wall = time.perf_counter() - t0
    warm = [s for s in samples if s[0] >= 500]  # after the pools have filled
    q = len(warm) // 4 or 1
    first, last = warm[:q], warm[-q:]

    def drift(i, minus_kv=False, minus_cache=False):
        def v(s):
            return s[i] - (s[3] if minus_kv else 0) - (s[4] if minus_cache else 0)

        f = statistics.mean(v(s) for s in first)
        lst = statistics.mean(v(s) for s in last)
        return round(lst / f - 1, 4)

    finish(
        a,
        "soak",
        {
            "model": a.preset,
            "slots": a.slots,
            "generated": n,
            "wall_s": round(wall, 1),
            "tok_per_s": round(n / wall, 2),
            "hit_rate": None if a.stock else round(store.hit_rate(), 4),
            "stock": a.stock,
            "rss_mb_first": round(statistics.mean(s[1] for s in first) / 1e6, 1),
            "rss_mb_last": round(statistics.mean(s[1] for s in last) / 1e6, 1),
            "kv_mb_last": round(last[-1][3] / 1e6, 2),
            "rss_drift": drift(1),
            "mlx_active_drift": drift(2),
            "rss_drift_minus_kv": drift(1, True),
            "mlx_active_drift_minus_kv": drift(2, True),
            # MLX keeps freed buffers (the KV cache's old, shorter copies) up to its cache
            # limit, set by load(); RSS holds them too
            "mlx_cache_limit_mb": round(limit / 1e6, 1),
            "mlx_cache_mb_last": round(last[-1][4] / 1e6, 2),
            "rss_drift_minus_kv_and_mlx_cache": drift(1, True, True),
            "flat_within_2pct": abs(drift(1, True, True)) < 0.02 and abs(drift(2, True)) < 0.02,
            "samples": samples[:: max(1, len(samples) // 100)],
        },
        quiet=("samples",),
    )


if __name__ == "__main__":
    main()
