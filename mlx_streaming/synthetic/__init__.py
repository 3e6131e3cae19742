"""Synthetic MoE checkpoints in real mlx-lm architectures, for tests, the demo and the
benchmarks: no download needed."""

from .build import build_tokenizer, checkpoint_bytes, make_checkpoint
from .presets import PRESETS, TINY_ARCHS, Preset

__all__ = [
    "PRESETS",
    "TINY_ARCHS",
    "Preset",
    "build_tokenizer",
    "checkpoint_bytes",
    "make_checkpoint",
]
