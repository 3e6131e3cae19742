"""``python -m mlx_streaming demo``: the whole job on a model that needs no download.

Takes the small trained model committed with the repository (or, without it, builds a
synthetic checkpoint in the Qwen3-Next architecture), splits its experts,
runs it streamed with a pool of about half its experts, runs stock mlx-lm on the same
prompt, checks that tokens and logits are identical, and prints a short summary (the
full benchmark JSON with ``--json FILE``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..bench.run import BenchConfig, run_bench
from ..core.format import write_json_atomic
from ..core.options import StreamConfig
from ..synthetic import PRESETS, make_checkpoint
from ..synthetic.train import trained_checkpoint
from ._args import positive_int

DEMO_PROMPT = (
    "Explain in three sentences what a mixture of experts model is, and why "
    "streaming its experts from disk saves memory."
)


CODE_PROMPT = 'import os\n\n\ndef read_config(path):\n    """'


def demo(
    workdir: str = "mlx_streaming_demo",
    preset: str = "auto",
    slots: int | None = None,
    max_tokens: int = 64,
    repeat: int = 3,
) -> dict:
    """Stream a model with about half its experts resident, compare with stock mlx-lm and
    return the benchmark result. ``preset="auto"``: the trained model committed with the
    repository when present (it writes readable text), else the synthetic ``demo``."""
    root = Path(workdir)
    trained = trained_checkpoint() if preset in ("auto", "trained") else None
    if preset == "trained" and trained is None:
        raise FileNotFoundError(
            "the trained model (checkpoints/tiny-stdlib-moe) is not here: it ships with the "
            "repository, not the wheel; use --preset demo, or train one with train-tiny"
        )
    if trained is not None:
        model, cfg, prompt = trained, json.loads((trained / "config.json").read_text()), CODE_PROMPT
        preset, about = "trained", f"a qwen3_moe trained on Python sources ({trained.name})"
    else:
        preset = "demo" if preset == "auto" else preset
        model, cfg = make_checkpoint(root / f"model-{preset}", preset), PRESETS[preset].config
        prompt, about = DEMO_PROMPT, PRESETS[preset].description
    experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg["num_local_experts"]
    slots = slots or max(cfg["num_experts_per_tok"], experts // 2)
    expert_dir = root / f"experts-{preset}"
    result = run_bench(
        BenchConfig(
            model=str(model),
            expert_dir=str(expert_dir),
            stream=StreamConfig(slots=slots),
            prompt=prompt,
            max_tokens=max_tokens,
            repeat=repeat,
            compare_stock=True,
        )
    )
    text = sampled_text(model, expert_dir, slots, prompt, max_tokens) if trained else None
    return {
        "demo": f"{preset}: {about}; {slots} of {experts} experts per layer resident",
        **result,
        "prompt": prompt,
        "sampled_text": text,
    }


def sampled_text(model, expert_dir, slots: int, prompt: str, max_tokens: int) -> str:
    """The streamed model's continuation of ``prompt``, sampled as ``TRAINED_SAMPLING``
    says (seed 0): greedy decoding, which the exactness check uses, repeats itself on a
    small model."""
    import mlx.core as mx
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    from ..model_builder import load
    from ..synthetic.train import TRAINED_SAMPLING as S

    mx.random.seed(0)
    m, tok, store = load(model, expert_dir, slots=slots, progress=False)
    try:
        out = generate(
            m, tok, prompt, max_tokens=max_tokens, sampler=make_sampler(S["temp"], S["top_p"]),
            logits_processors=make_logits_processors(repetition_penalty=S["repetition_penalty"]),
        )  # fmt: skip
    finally:
        store.close()
    return prompt + out


def sampling() -> str:
    """``TRAINED_SAMPLING`` as the summary prints it."""
    from ..synthetic.train import TRAINED_SAMPLING as S

    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in S.items())


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
            f"mlx-lm: {r['ratio_vs_stock']:.2f}x (decode {r['decode_ratio_vs_stock']:.2f}x), "
            f"the median of {len(r['ratio_pairs'])} alternating pairs",
            f"  experts    hit rate {r['expert_hit_rate']:.3f}, "
            f"{r['bytes_read_per_token'] / 1e6:.2f} MB read per decoded token",
            f"  memory     peak RSS {r['peak_rss_gb']} GB, MLX peak {r['mlx_peak_gb']} GB",
            f"  exact      {r['exact_vs_stock']} (tokens equal: {e['tokens_equal']}, logits "
            f"equal: {e['logits_equal']}, max |diff| {e['max_abs_logit_diff']})",
            f"  greedy     {r['sample'][:100]!r}",
        ]
        + ([f"  sampled    ({sampling()})\n{r['sampled_text']}"] if r.get("sampled_text") else [])
    )


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx_streaming demo", description=__doc__)
    p.add_argument(
        "--workdir",
        default="mlx_streaming_demo",
        help="where the synthetic model and its experts go",
    )
    p.add_argument(
        "--preset",
        default="auto",
        choices=["auto", "trained", *sorted(PRESETS)],
        help="auto: the repository's trained model when present, else the synthetic demo",
    )
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
        write_json_atomic(Path(json_out), result)
        print(f"  full JSON  {json_out}")


if __name__ == "__main__":
    main()
