"""``python -m mlx_streaming demo``: the whole job on a model that needs no download.

Builds a synthetic checkpoint (Qwen3-Next architecture by default), splits its experts,
runs it streamed with a pool of about half its experts, runs stock mlx-lm on the same
prompt, checks that tokens and logits are identical, and prints a short summary (the
full benchmark JSON with ``--json FILE``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..bench.run import BenchConfig, run_bench
from ..core.options import StreamConfig
from ..synthetic import PRESETS, make_checkpoint
from ._args import positive_int

DEMO_PROMPT = (
    "Explain in three sentences what a mixture of experts model is, and why "
    "streaming its experts from disk saves memory."
)


def demo(
    workdir: str = "mlx_streaming_demo",
    preset: str = "demo",
    slots: int | None = None,
    max_tokens: int = 64,
    repeat: int = 3,
) -> dict:
    """Build, split, stream and compare; returns the benchmark result."""
    root = Path(workdir)
    model = make_checkpoint(root / f"model-{preset}", preset)
    cfg = PRESETS[preset].config
    experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg["num_local_experts"]
    top_k = cfg["num_experts_per_tok"]
    slots = slots or max(top_k, experts // 2)
    result = run_bench(
        BenchConfig(
            model=str(model),
            expert_dir=str(root / f"experts-{preset}"),
            stream=StreamConfig(slots=slots),
            prompt=DEMO_PROMPT,
            max_tokens=max_tokens,
            repeat=repeat,
            compare_stock=True,
        )
    )
    return {
        "demo": f"{preset}: {PRESETS[preset].description}; {slots} of {experts} experts "
        "per layer resident",
        **result,
    }


def summary(r: dict) -> str:
    """A few lines a person reads."""
    e = r["exactness"]
    return "\n".join(
        [
            f"mlx_streaming demo: {r['demo']}",
            f"  model      {r['model']} ({r['patched_moe_layers']} MoE layers, device "
            f"{r['device']})",
            f"  experts    {r['expert_dir']} ({r['expert_mb']} MB each; pools {r['pool_gb']} GB)",
            f"  speed      {r['tok_per_s']} tok/s streamed, {r['stock_tok_per_s']} tok/s stock "
            f"mlx-lm ({r['ratio_vs_stock']:.2f}x)",
            f"  experts    hit rate {r['expert_hit_rate']:.3f}, "
            f"{r['bytes_read_per_token'] / 1e6:.2f} MB read per decoded token",
            f"  memory     peak RSS {r['peak_rss_gb']} GB, MLX peak {r['mlx_peak_gb']} GB",
            f"  exact      {r['exact_vs_stock']} (tokens equal: {e['tokens_equal']}, logits "
            f"equal: {e['logits_equal']}, max |diff| {e['max_abs_logit_diff']})",
            f"  sample     {r['sample'][:100]!r}",
        ]
    )


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx_streaming demo", description=__doc__)
    p.add_argument(
        "--workdir",
        default="mlx_streaming_demo",
        help="where the synthetic model and its experts go",
    )
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    p.add_argument("--slots", type=positive_int, help="slots per layer (default: half)")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--repeat", type=positive_int, default=3)
    p.add_argument("--json", dest="json_out", help="also write the full benchmark JSON here")
    return p


def main(argv=None) -> None:
    args = vars(setup_arg_parser().parse_args(argv))
    json_out = args.pop("json_out")
    result = demo(**args)
    print(summary(result))
    if json_out:
        Path(json_out).write_text(json.dumps(result, ensure_ascii=False, indent=1) + "\n")
        print(f"  full JSON  {json_out}")


if __name__ == "__main__":
    main()
