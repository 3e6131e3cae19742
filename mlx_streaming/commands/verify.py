"""``python -m mlx_streaming verify``: is streaming bit-exact on this machine?"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..core.format import write_json_atomic
from ._args import add_store_args, load_kwargs, positive_int


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_streaming verify",
        description=(
            "Compare, layer by layer, the streamed experts' output with stock mlx-lm's on the "
            "same real inputs (one token, and prefill chunks around MLX's kernel thresholds). "
            "One layer's experts are loaded at a time. Prints 'exact' or the first layer "
            "that differs; exits with 1 if one does."
        ),
    )
    p.add_argument("--model", required=True, help="MLX model directory or repo id")
    add_store_args(p)
    p.add_argument(
        "--layers",
        type=int,
        nargs="+",
        help="model layer indices to check (default: every MoE layer)",
    )
    p.add_argument("--prompt", default=None, help="text whose hidden states are the inputs")
    p.add_argument(
        "--max-tokens-per-call",
        type=positive_int,
        default=2048,
        help="the largest prefill chunk checked (mlx-lm's default: 2048)",
    )
    p.add_argument("--json", dest="json_out", help="also write the report as JSON here")
    return p


def main(argv=None) -> None:
    from ..analysis.layers import DEFAULT_PROMPT, verify_layers
    from ..model_builder import load
    from ..prep.hub import load_lazy, resolve_model_path

    a = setup_arg_parser().parse_args(argv)
    model, tokenizer, store = load(a.model, **load_kwargs(a))
    stock, _ = load_lazy(resolve_model_path(a.model))
    ids = tokenizer.encode(a.prompt or DEFAULT_PROMPT)

    def say(r):
        what = (
            "exact"
            if r.exact
            else (f"DIFFERS at {r.differ_at} tokens per call (max |diff| {r.max_abs_diff:g})")
        )
        print(
            f"layer {r.layer}: {what} ({len(r.tokens)} call sizes, "
            f"{r.tokens[0]}-{r.tokens[-1]} tokens)",
            flush=True,
        )

    report = verify_layers(model, stock, ids, a.layers, a.max_tokens_per_call, progress=say)
    store.close()
    first = report.first_difference
    print("exact" if report.exact else f"not exact: first differing layer {first.layer}")
    if a.json_out:
        write_json_atomic(Path(a.json_out), report.to_json())
    if not report.exact:
        sys.exit(1)


if __name__ == "__main__":
    main()
