"""Memory benchmark: experts are never materialized.

Builds a synthetic checkpoint whose experts are many times the pool, then measures, each
phase in a fresh process:

* ``split``: peak RSS of splitting it (should be about one block of one layer's experts);
* ``stream``: peak RSS of lazy load + patch + generating 64 tokens with the pool, against
  trunk bytes + pool bytes + KV cache;
* ``stock``: the same generation with stock mlx-lm, everything resident (for scale).

Both runs cap MLX's buffer cache at 0 (``mx.set_cache_limit(0)``), so freed activation
buffers go back to the system instead of counting against the budget.

RSS deltas are taken over the process's RSS after imports (Python, MLX, transformers).

    python benchmarks/memory.py --json benchmarks/results/memory-cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from harness import finish, parser

from mlx_streaming.core.mem import MemorySampler

HERE = Path(__file__).resolve()


def _imports():
    import mlx.core as mx  # noqa: F401
    import mlx_lm  # noqa: F401
    from mlx_lm import generate  # noqa: F401

    import mlx_streaming  # noqa: F401


def phase_split(model: str, experts: str) -> dict:
    _imports()
    from mlx_streaming.core.mem import peak_rss_bytes, rss_bytes
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.prep.split_experts import split_model

    base = rss_bytes()
    with MemorySampler(0.005) as s:
        t0 = time.perf_counter()
        split_model(model, experts, progress=False)
        secs = time.perf_counter() - t0
    peak = max(s.peak_rss, peak_rss_bytes())
    meta = load_meta(experts)
    lay = next(iter(meta.layers.values()))
    return {
        "split_s": round(secs, 2),
        "split_peak_rss_delta": peak - base,
        "layer_expert_bytes": lay.num_experts * lay.record_bytes,
    }


def _kv_bytes(cache) -> int:
    total = 0
    for c in cache:
        for a in c.state if isinstance(c.state, (list, tuple)) else [c.state]:
            total += getattr(a, "nbytes", 0) if a is not None else 0
    return total


def phase_run(model: str, experts: str, slots: int, tokens: int, stock: bool) -> dict:
    _imports()
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load, stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_streaming.core.mem import rss_bytes

    prompt = "Memory benchmark: streaming experts from disk keeps resident memory small. " * 4
    mx.set_cache_limit(0)  # MLX returns freed buffers at once (both runs): structural memory
    base = rss_bytes()
    mx.reset_peak_memory()
    with MemorySampler(0.005) as s:
        if stock:
            m, tok = load(model)
            store = None
        else:
            import mlx_streaming

            m, tok, store = mlx_streaming.load(
                model, experts, slots=slots, cache_limit_gb=0, progress=False
            )
        cache = make_prompt_cache(m)
        n = 0
        for r in stream_generate(m, tok, prompt, max_tokens=tokens, prompt_cache=cache):
            n = r.generation_tokens
    from mlx_streaming.core.mem import peak_rss_bytes

    peak = max(s.peak_rss, peak_rss_bytes())  # the sampler's peak, or the kernel's if higher
    params = sum(v.nbytes for _, v in tree_flatten(m.parameters()))
    pool = store.pool_bytes() if store else 0
    out = {
        "generated": n,
        "peak_rss_delta": peak - base,
        "mlx_peak": mx.get_peak_memory(),
        "param_bytes": params,
        "pool_bytes": pool,
        "trunk_bytes": params - pool,
        "kv_bytes": _kv_bytes(cache),
        "rss_series": [(t, r) for t, r, _ in s.series[:: max(1, len(s.series) // 200)]],
    }
    if store:
        out["hit_rate"] = round(store.hit_rate(), 4)
        out["bytes_read"] = store.totals()["bytes_read"]
    return out


def phase_budget(model: str, experts: str, budget_gb: float, tokens: int) -> dict:
    """``mlx_streaming.load(budget_gb=...)`` and a long generation: peak memory against
    trunk + budget + KV cache."""
    _imports()
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    import mlx_streaming
    from mlx_streaming.core.mem import peak_rss_bytes, rss_bytes

    base = rss_bytes()
    mx.reset_peak_memory()
    with MemorySampler(0.005) as s:
        m, tok, store = mlx_streaming.load(model, experts, budget_gb=budget_gb)
        cache = make_prompt_cache(m)
        n = 0
        for r in stream_generate(
            m,
            tok,
            "Write a long story about experts on a disk.",
            max_tokens=tokens,
            prompt_cache=cache,
        ):
            n = r.generation_tokens
    plan = mlx_streaming.memory_plan(m, store)
    kv = _kv_bytes(cache)
    peak = max(s.peak_rss, peak_rss_bytes())
    expected = plan.trunk_bytes + int(budget_gb * 1e9) + kv
    return {
        "budget_gb": budget_gb,
        "generated": n,
        "plan": plan.to_json(),
        "pool_bytes": plan.pool_bytes,
        "trunk_bytes": plan.trunk_bytes,
        "kv_bytes": kv,
        "peak_rss_delta": peak - base,
        "mlx_peak": mx.get_peak_memory(),
        "expected": expected,
        "rss_over_expected": round((peak - base) / expected, 3),
        "mlx_over_expected": round(mx.get_peak_memory() / expected, 3),
        "hit_rate": round(store.hit_rate(), 4),
    }


def _sub(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, str(HERE), *args], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = parser(__doc__, preset=None, trace=False, workdir="scratch/memory-bench")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--no-stock", action="store_true")
    p.add_argument(
        "--budget-gb",
        type=float,
        default=0.0,
        help="also run load(budget_gb=...) and generate --budget-tokens tokens",
    )
    p.add_argument("--budget-tokens", type=int, default=512)
    p.add_argument(
        "--phase", choices=["split", "stream", "stock", "budget"], help=argparse.SUPPRESS
    )
    a = p.parse_args()
    root = Path(a.workdir)
    model, experts = root / "model", root / "experts"
    if a.phase == "split":
        print(json.dumps(phase_split(str(model), str(experts))))
        return
    if a.phase == "budget":
        print(json.dumps(phase_budget(str(model), str(experts), a.budget_gb, a.budget_tokens)))
        return
    if a.phase in ("stream", "stock"):
        print(
            json.dumps(phase_run(str(model), str(experts), a.slots, a.tokens, a.phase == "stock"))
        )
        return

    from mlx_streaming.synthetic import Preset, checkpoint_bytes, make_checkpoint

    preset = Preset(
        "memory-bench",
        {
            "model_type": "qwen3_moe",
            "hidden_size": a.hidden,
            "num_hidden_layers": a.layers,
            "intermediate_size": 2 * a.hidden,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": a.hidden // 8,
            "num_experts": a.experts,
            "num_experts_per_tok": a.top_k,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": a.hidden,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "max_position_embeddings": 4096,
            "norm_topk_prob": True,
        },
    )
    t0 = time.perf_counter()
    make_checkpoint(model, preset)
    build_s = time.perf_counter() - t0
    if experts.exists():
        import shutil

        shutil.rmtree(experts)
    split = _sub(["--workdir", str(root), "--phase", "split"])
    common = ["--workdir", str(root), "--slots", str(a.slots), "--tokens", str(a.tokens)]
    stream = _sub([*common, "--phase", "stream"])
    stock = None if a.no_stock else _sub([*common, "--phase", "stock"])
    budget = (
        _sub(
            [
                "--workdir",
                str(root),
                "--phase",
                "budget",
                "--budget-gb",
                str(a.budget_gb),
                "--budget-tokens",
                str(a.budget_tokens),
            ]
        )
        if a.budget_gb
        else None
    )
    expert_bytes = stock["param_bytes"] - stream["trunk_bytes"] if stock else None
    expected = stream["trunk_bytes"] + stream["pool_bytes"] + stream["kv_bytes"]
    finish(
        a,
        "memory",
        {
            "checkpoint_gb": round(checkpoint_bytes(model) / 1e9, 3),
            "build_s": round(build_s, 1),
            "layers": a.layers,
            "experts": a.experts,
            "top_k": a.top_k,
            "slots": a.slots,
            "experts_over_pool": round(expert_bytes / stream["pool_bytes"], 2) if stock else None,
            **{f"split_{k}" if not k.startswith("split") else k: v for k, v in split.items()},
            "trunk_mb": round(stream["trunk_bytes"] / 1e6, 1),
            "pool_mb": round(stream["pool_bytes"] / 1e6, 1),
            "kv_mb": round(stream["kv_bytes"] / 1e6, 2),
            "expected_mb": round(expected / 1e6, 1),
            "stream_peak_rss_delta_mb": round(stream["peak_rss_delta"] / 1e6, 1),
            "stream_mlx_peak_mb": round(stream["mlx_peak"] / 1e6, 1),
            "stream_over_expected": round(stream["peak_rss_delta"] / expected, 3),
            "within_25pct": stream["peak_rss_delta"] <= 1.25 * expected,
            "stream_hit_rate": stream.get("hit_rate"),
            "stream_generated": stream["generated"],
            "stock_peak_rss_delta_mb": round(stock["peak_rss_delta"] / 1e6, 1) if stock else None,
            "stock_mlx_peak_mb": round(stock["mlx_peak"] / 1e6, 1) if stock else None,
            "stream_rss_series": stream["rss_series"],
            "budget_run": budget
            and {
                **{
                    k: budget[k]
                    for k in (
                        "budget_gb",
                        "generated",
                        "plan",
                        "hit_rate",
                        "rss_over_expected",
                        "mlx_over_expected",
                    )
                },
                "expected_mb": round(budget["expected"] / 1e6, 1),
                "kv_mb": round(budget["kv_bytes"] / 1e6, 1),
                "peak_rss_delta_mb": round(budget["peak_rss_delta"] / 1e6, 1),
                "mlx_peak_mb": round(budget["mlx_peak"] / 1e6, 1),
                "within_10pct": budget["peak_rss_delta"] <= 1.10 * budget["expected"]
                and budget["mlx_peak"] <= 1.10 * budget["expected"],
            },
        },
        quiet=("stream_rss_series",),
    )


if __name__ == "__main__":
    main()
