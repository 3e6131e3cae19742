"""``python -m mlx_streaming requantize``: fewer bits per expert, per projection or layer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..prep.requantize import requantize
from ._args import positive_float, positive_int


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_streaming requantize",
        description=(
            "Dequantize each expert and quantize it again with mx.quantize into a new expert "
            "directory (a projection already in the target format is copied as is)."
        ),
    )
    p.add_argument("--src", required=True, help="expert directory, or a model to split first")
    p.add_argument("--out", required=True, help="new expert directory")
    p.add_argument("--bits", type=positive_int, default=4)
    p.add_argument("--group-size", type=positive_int)
    p.add_argument("--proj-bits", help="per projection, e.g. gate=2,up=2,down=3")
    p.add_argument("--layer-bits", help="JSON file {layer: bits or {projection: bits}}")
    p.add_argument("--model-out", help="also write a standard MLX model with these experts")
    p.add_argument(
        "--model",
        help="source model (for --model-out and --target-gb; default: "
        "the one the experts were split from)",
    )
    p.add_argument(
        "--target-gb",
        type=positive_float,
        help="choose bits per layer and projection to "
        "minimise the measured error within this many GB of experts",
    )
    return p


def main(argv=None) -> None:
    a = setup_arg_parser().parse_args(argv)
    from ..core.format import META_NAME
    from ..model_builder import default_expert_dir

    if a.target_gb is not None and a.layer_bits:
        raise ValueError("--target-gb chooses the bits per layer itself: drop --layer-bits")
    src = a.src
    split_dir = None if (Path(src) / META_NAME).exists() else default_expert_dir(src)
    report = None
    if a.target_gb is not None:
        from ..analysis.quality import choose_bits

        if split_dir is not None:  # a model: split it first, so its experts can be measured
            from ..prep.hub import resolve_model_path
            from ..prep.split_experts import split_model

            split_model(resolve_model_path(src), split_dir)
            src, split_dir, a.model = str(split_dir), None, a.model or src  # split once
        layer_bits, report = choose_bits(src, a.target_gb, a.model, a.group_size)
        a.layer_bits = layer_bits
    meta = requantize(
        src,
        a.out,
        a.bits,
        group_size=a.group_size,
        proj_bits=a.proj_bits,
        layer_bits=a.layer_bits,
        model_out=a.model_out,
        model=a.model,
        split_dir=split_dir,
    )
    if report:
        print(json.dumps({"allocation": report}, indent=1))
    lay = next(iter(meta["layers"].values()))
    print(
        json.dumps(
            {
                "expert_dir": a.out,
                "dims": meta["dims"],
                "expert_bytes": lay["record_bytes"],
                "model_out": a.model_out,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
