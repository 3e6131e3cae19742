"""``python -m mlx_streaming train-tiny --out DIR``: train a small MoE on offline text."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace
from pathlib import Path

from ..core.format import write_json_atomic
from ..synthetic.train import TrainConfig, report_lines, train_tiny
from ._args import nonneg_float, nonneg_int, positive_int


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_streaming train-tiny",
        description=(
            "Train a small qwen3_moe model (mlx-lm's architecture, load-balanced routing) on "
            "the Python standard library's sources, hold some out, and save a checkpoint "
            "mlx_lm.load reads, with its loss curve and routing statistics (training.json). "
            "The defaults are a CPU-sized run; the same seed gives the same weights."
        ),
    )
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    for f in fields(TrainConfig):  # one flag per TrainConfig field, its default from there
        kind = {"int": positive_int, "int | None": positive_int, "float": nonneg_float}.get(
            f.type, str
        )
        if f.name == "seed":
            kind = nonneg_int
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    p.add_argument("--float-out", help="also keep the unquantized model here")
    p.add_argument("--json", dest="json_out", help="also write the report here")
    return p


def main(argv=None) -> None:
    a = setup_arg_parser().parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(a, f.name) for f in fields(TrainConfig)})
    if cfg.bits == 0:
        cfg = replace(cfg, bits=None)
    command = "python -m mlx_streaming train-tiny " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    report = train_tiny(a.out, cfg, float_dir=a.float_out, command=command)
    print(report_lines(report))
    if a.json_out:
        write_json_atomic(Path(a.json_out), report)
