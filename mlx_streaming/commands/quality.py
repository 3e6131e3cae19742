"""``python -m mlx_streaming quality``: what requantized experts cost."""

from __future__ import annotations

import argparse
import json

from ._args import positive_int


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx_streaming quality", description=(
        "Compare requantized experts with their source: per layer and projection, the "
        "relative output error on captured activations; end to end, KL divergence and "
        "top-1 agreement of next-token distributions. On random-weight models these are "
        "a relative guide only."))
    p.add_argument("--model", required=True, help="the source model")
    p.add_argument("--expert-dir", required=True, help="requantized expert directory")
    p.add_argument("--source-expert-dir", help="the source's (default: recorded in the meta)")
    p.add_argument("--tokens", type=positive_int, default=256)
    p.add_argument("--text", help="a text file to score on (default: built-in text)")
    return p


def quality(model: str, expert_dir: str, source_expert_dir: str | None = None,
            tokens: int = 256, text: str | None = None) -> dict:
    """Per-projection errors and end-to-end KL/top-1 of ``expert_dir`` against the source."""
    from mlx_lm import load as mlx_load

    from ..core.format import load_meta
    from ..model_builder import load
    from ..analysis.quality import QUALITY_TEXT, capture_inputs, compare_distributions, projection_errors

    new = load_meta(expert_dir)
    src = load_meta(source_expert_dir or new.extra.get("requantized_from") or expert_dir)
    stock, tok = mlx_load(model)
    ids = tok.encode(text or QUALITY_TEXT)[:tokens]
    errors = projection_errors(src, new, capture_inputs(stock, ids))
    streamed, _, store = load(model, expert_dir, slots=new.num_experts)
    e2e = compare_distributions(stock, streamed, ids)
    store.close()
    return {"expert_dir": expert_dir, "dims": new.dims,
            "expert_bytes": new.expert_bytes(), "source_expert_bytes": src.expert_bytes(),
            "projection_error": {str(k): v for k, v in errors.items()},
            "mean_projection_error": {p: round(sum(v[p] for v in errors.values() if p in v)
                                               / len(errors), 6)
                                      for p in next(iter(errors.values()))},
            **e2e, "note": "random-weight models: a relative guide only"}


def main(argv=None) -> None:
    a = setup_arg_parser().parse_args(argv)
    text = open(a.text).read() if a.text else None
    print(json.dumps(quality(a.model, a.expert_dir, a.source_expert_dir, a.tokens, text),
                     indent=1))


if __name__ == "__main__":
    main()
