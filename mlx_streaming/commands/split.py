"""``python -m mlx_streaming split MODEL --expert-dir DIR``"""

from __future__ import annotations

import argparse
import json

from ..prep.split_experts import split_model


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_streaming split",
        description=(
            "Split every MoE layer's experts of an MLX checkpoint into one 4 KiB-aligned "
            "record per expert. Resumes an interrupted split; a complete directory is a no-op."
        ),
    )
    p.add_argument("model", help="MLX model directory or Hugging Face repo id")
    p.add_argument("--expert-dir", required=True, dest="out_dir", help="output directory")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: only on a terminal)",
    )
    return p


def main(argv=None) -> None:
    args = setup_arg_parser().parse_args(argv)
    meta = split_model(args.model, args.out_dir, progress=args.progress)
    print(
        json.dumps(
            {
                "expert_dir": args.out_dir,
                "moe_layers": meta["moe_layers"],
                "num_experts": meta["num_experts"],
                "top_k": meta["top_k"],
                "dims": meta["dims"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
