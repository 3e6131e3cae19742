"""A streamed generation under ``--budget-gb`` in a process of its own, for
``test_memory.py``: prints one JSON line with the peak memory (RSS sampled every 5 ms and
the kernel's high-water mark; MLX's peak) against the budget's accounting."""

from __future__ import annotations

import argparse
import json
import threading
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--expert-dir", required=True)
    p.add_argument("--budget-gb", type=float, required=True)
    p.add_argument("--tokens", type=int, default=2000)
    a = p.parse_args()

    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    import mlx_streaming
    from mlx_streaming.core.mem import peak_rss_bytes, rss_bytes

    base = rss_bytes()  # everything imported, nothing loaded
    peak, stop = [base], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    model, tok, store = mlx_streaming.load(
        a.model, a.expert_dir, budget_gb=a.budget_gb, progress=False
    )
    cache = make_prompt_cache(model)
    n = 0
    for r in stream_generate(model, tok, "Once upon a time", max_tokens=a.tokens,
                             prompt_cache=cache):  # fmt: skip
        n = r.generation_tokens
    stop.set()
    t.join()
    plan = mlx_streaming.memory_plan(model, store)
    kv = sum(x.nbytes for c in cache for x in c.state if isinstance(x, mx.array))
    print(json.dumps({
        "generated": n,
        "baseline": base,
        "peak_rss": max(peak[0], peak_rss_bytes()) - base,
        "mlx_peak": mx.get_peak_memory(),
        "trunk": plan.trunk_bytes,
        "pools": plan.pool_bytes,
        "cache_cap": plan.cache_limit_bytes,
        "kv": kv,
        "budget": int(a.budget_gb * 1e9),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
