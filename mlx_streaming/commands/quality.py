"""``python -m mlx_streaming quality``: what requantized experts cost."""

from __future__ import annotations

import argparse
import json

from ._args import positive_int


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_streaming quality",
        description=(
            "Compare requantized experts with their source: per layer and projection, the "
            "relative output error on captured activations; end to end, KL divergence and "
            "top-1 agreement of next-token distributions. On random-weight models these are "
            "a relative guide only."
        ),
    )
    p.add_argument("--model", required=True, help="the source model")
    p.add_argument("--expert-dir", required=True, help="requantized expert directory")
    p.add_argument("--source-expert-dir", help="the source's (default: recorded in the meta)")
    p.add_argument("--tokens", type=positive_int, default=256)
    p.add_argument("--text", help="a text file to score on (default: built-in text)")
    return p


def main(argv=None) -> None:
    from ..analysis.quality import quality_report

    a = setup_arg_parser().parse_args(argv)
    text = open(a.text).read() if a.text else None
    print(
        json.dumps(
            quality_report(a.model, a.expert_dir, a.source_expert_dir, a.tokens, text), indent=1
        )
    )


if __name__ == "__main__":
    main()
