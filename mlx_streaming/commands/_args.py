"""Argument types that reject bad values with a message naming the flag's fix."""

from __future__ import annotations

import argparse
import math

from ..core.cache.policy import DEFAULT_POLICY, POLICIES


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{v} must be a positive integer")
    return v


def nonneg_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} must be >= 0")
    return v


def positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{s} must be a positive finite number")
    return v


def add_store_args(p: argparse.ArgumentParser, several: bool = False) -> None:
    """Flags shared by every command that opens a streamed model (``several``: --slots
    and --budget-gb take a list, one run each)."""
    g = p.add_argument_group("streaming")
    g.add_argument("--expert-dir", help="expert directory (split there on first use)")
    size = g.add_mutually_exclusive_group()
    n = "+" if several else None
    size.add_argument("--slots", type=positive_int, nargs=n,
                      help="expert slots per MoE layer (seed: EXPERT_SLOTS)")
    size.add_argument("--budget-gb", type=positive_float, nargs=n,
                      help="total GB for all expert pools, instead of --slots")
    g.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                   help=f"eviction policy (default: {DEFAULT_POLICY})")
    g.add_argument("--threads", type=positive_int, default=4, help="pread threads")
    g.add_argument("--direct-io", action="store_true",
                   help="bypass the page cache (O_DIRECT / F_NOCACHE)")
    g.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip record checksums (benchmarks of the raw read path)")
