"""Flags shared by the commands, and argument types that reject bad values with a
message naming the flag's fix.

Every command that opens a streamed model (``generate``, ``chat``, ``serve``, ``bench``,
``verify``) takes the same streaming flags, one per option of ``load``, and turns them
into ``load``'s keyword arguments with ``load_kwargs``.
"""

from __future__ import annotations

import argparse
import math

from ..core.cache.policy import DEFAULT_POLICY, POLICIES
from ..core.prefetch.patch import StreamOptions
from ..parallel import DEFAULT_CONNECT_TIMEOUT_S


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
    """The streaming flags: one per option of ``mlx_streaming.load`` (``several``: --slots
    and --budget-gb take a list, one run each)."""
    g = p.add_argument_group("streaming (the options of mlx_streaming.load)")
    g.add_argument("--expert-dir", help="expert directory (split there on first use)")
    size = g.add_mutually_exclusive_group()
    n = "+" if several else None
    size.add_argument(
        "--slots",
        type=positive_int,
        nargs=n,
        help="expert slots per MoE layer (seed: EXPERT_SLOTS)",
    )
    size.add_argument(
        "--budget-gb",
        type=positive_float,
        nargs=n,
        help="total GB for all expert pools, instead of --slots",
    )
    g.add_argument(
        "--pool-profile",
        default="auto",
        help="auto (EXPERT_DIR/pool_profile.json or EXPERT_POOL_PROFILE), none, or a path",
    )
    g.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        choices=sorted(POLICIES),
        help=f"eviction policy (default: {DEFAULT_POLICY})",
    )
    g.add_argument(
        "--threads",
        type=positive_int,
        help="read threads (default: 4 for the Python reader; for the native reader on CUDA, "
        "one per core up to 15)",
    )
    g.add_argument(
        "--direct-io", action="store_true", help="bypass the page cache (O_DIRECT / F_NOCACHE)"
    )
    g.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip record checksums (benchmarks of the raw read path)",
    )
    g.add_argument(
        "--pool-mode",
        choices=["host", "cuda", "mlx"],
        help="how slots are written (default: by backend)",
    )
    g.add_argument(
        "--clear-on-evict",
        action="store_true",
        help="release MLX's buffer cache after evictions (CLEAR_ON_EVICT=1)",
    )
    g.add_argument(
        "--cache-limit-gb",
        type=float,
        help="cap on MLX's cache of freed buffers (default: 5%% of the pools)",
    )
    g.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compute resident experts while misses load (default: by pool mode)",
    )
    g.add_argument(
        "--prefetch", action="store_true", help="read the next layer's predicted experts ahead"
    )
    g.add_argument(
        "--rows",
        choices=["subset", "masked"],
        help="how partial calls run (default: subset on the CPU, masked on GPUs)",
    )
    g.add_argument(
        "--no-kernel-check",
        dest="kernel_check",
        action="store_const",
        const=False,
        default=None,
        help="skip the start-up kernel self-test on GPUs (bit-exactness then "
        "rests on the kernel rule alone)",
    )
    g.add_argument(
        "--reader",
        choices=["native", "python"],
        help="who reads records into slots: native (compiled, no GIL) or python threads "
        "(default: native for CUDA pools, python for host pools)",
    )


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """``--pipeline``: run as one rank of a pipeline started by ``mlx.launch``."""
    g = p.add_argument_group("pipeline over several hosts (run under mlx.launch)")
    g.add_argument(
        "--pipeline",
        action="store_true",
        help="split the layers over the ranks mlx.launch started; each streams its own",
    )
    g.add_argument(
        "--pipeline-split",
        help="decoder layers per rank, in rank order (rank 0 runs the last), e.g. 20,28; "
        "default: even (python -m mlx_streaming plan --hosts-gb suggests one)",
    )
    g.add_argument(
        "--rank-budget-gb",
        help="expert pool GB per rank, rank order (plan --hosts-gb suggests them); "
        "instead of --budget-gb, which every rank would take alike",
    )
    g.add_argument(
        "--pipeline-timeout",
        type=positive_float,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        help=f"seconds to wait for the other ranks to connect (default {DEFAULT_CONNECT_TIMEOUT_S:.0f})",
    )


def pipeline_kwargs(a: argparse.Namespace) -> dict:
    """``load``'s pipeline arguments: joins the group (bounded by --pipeline-timeout);
    with --rank-budget-gb, this rank's ``budget_gb``."""
    from ..parallel import init_pipeline, parse_split

    if not a.pipeline:
        if a.pipeline_split or a.rank_budget_gb:
            raise ValueError("--pipeline-split and --rank-budget-gb need --pipeline")
        return {}
    split = parse_split(a.pipeline_split)
    budgets = None
    if a.rank_budget_gb:
        if a.budget_gb or a.slots:
            raise ValueError("give --rank-budget-gb or --budget-gb/--slots, not both")
        try:
            budgets = [positive_float(x) for x in a.rank_budget_gb.split(",")]
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--rank-budget-gb {a.rank_budget_gb!r}: {e}") from None
    group = init_pipeline(a.pipeline_timeout)
    out = {"pipeline_group": group, "pipeline_split": split}
    if budgets is not None:
        if len(budgets) != group.size():
            raise ValueError(f"--rank-budget-gb has {len(budgets)} values for {group.size()} ranks")
        out["budget_gb"] = budgets[group.rank()]
    return out


def stream_options(a: argparse.Namespace) -> StreamOptions:
    return StreamOptions(
        overlap=a.overlap, prefetch=a.prefetch, rows=a.rows, kernel_check=a.kernel_check
    )


def load_kwargs(a: argparse.Namespace) -> dict:
    """``mlx_streaming.load``'s keyword arguments from the streaming flags."""
    profile = {"auto": True, "none": False}.get(a.pool_profile, a.pool_profile)
    return dict(
        expert_dir=a.expert_dir,
        slots=a.slots,
        budget_gb=a.budget_gb,
        pool_profile=profile,
        policy=a.policy,
        threads=a.threads,
        direct_io=a.direct_io,
        verify=a.verify,
        pool_mode=a.pool_mode,
        clear_on_evict=a.clear_on_evict,
        cache_limit_gb=a.cache_limit_gb,
        reader=a.reader,
        options=stream_options(a),
    )
