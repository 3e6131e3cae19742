"""``python -m mlx_streaming synth --preset NAME --out DIR``: write a synthetic checkpoint."""

from __future__ import annotations

import argparse

from ..synthetic import PRESETS, checkpoint_bytes, make_checkpoint
from ._args import positive_int


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_streaming synth",
        description=(
            "Write a synthetic MoE checkpoint (random weights, a real mlx-lm architecture)."
        ),
    )
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--bits", type=int, default=-1, help="4, 8, or 0 for unquantized")
    p.add_argument("--group-size", type=positive_int)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--num-layers", type=positive_int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true")
    return p


def main(argv=None) -> None:
    a = setup_arg_parser().parse_args(argv)
    bits = None if a.bits == 0 else a.bits
    out = make_checkpoint(
        a.out,
        a.preset,
        bits=bits,
        group_size=a.group_size,
        dtype=a.dtype,
        num_layers=a.num_layers,
        seed=a.seed,
        force=a.force,
    )
    print(f"{out}: {checkpoint_bytes(out) / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
