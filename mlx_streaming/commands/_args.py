"""Flags shared by the commands, and argument types that reject bad values with a
message naming the flag's fix.

Every command that opens a streamed model (``generate``, ``chat``, ``serve``, ``bench``,
``verify``) takes the same streaming flags, one per option of ``load``, and turns them
into ``load``'s keyword arguments with ``load_kwargs``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import fields

from ..core.options import StreamConfig
from ..parallel import DEFAULT_CONNECT_TIMEOUT_S


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{v} must be a positive integer")
    return v


def port_number(s: str) -> int:
    v = positive_int(s)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"{v} is not a TCP port: give 1-65535")
    return v


def nonneg_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} must be >= 0")
    return v


def budget_value(s: str) -> float | str:
    """A positive number of GB, or ``auto``."""
    return "auto" if s == "auto" else positive_float(s)


def nonneg_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{s} must be a finite number >= 0")
    return v


def positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{s} must be a positive finite number")
    return v


def add_store_args(p: argparse.ArgumentParser, several: bool = False, sizes: bool = True) -> None:
    """The streaming flags, one per ``StreamConfig`` field that has a flag, built from
    the field (type, default, help); ``several``: --slots and --budget-gb take a list,
    one run each; ``sizes=False``: no --expert-dir, --slots nor --budget-gb (a caller
    that sizes the pools itself)."""
    g = p.add_argument_group("streaming (StreamConfig, the options of mlx_streaming.load)")
    if sizes:
        g.add_argument("--expert-dir", help="expert directory (split there on first use)")
    size = g.add_mutually_exclusive_group() if sizes else g
    for f in fields(StreamConfig):
        flag = f.metadata["flag"]
        if flag is None or (not sizes and f.name in ("slots", "budget_gb", "context")):
            continue
        flag = flag or "--" + f.name.replace("_", "-")
        kw = {"help": f.metadata["help"], **f.metadata["cli"]}
        if f.default is False:
            kw["action"] = "store_true"
        elif flag.startswith("--no-"):  # the option is on unless the flag is given
            kw.update(action="store_const", const=False, default=f.default)
        elif f.type == "bool | None":
            kw.update(action=argparse.BooleanOptionalAction, default=None)
        elif "choices" not in kw:
            kw["type"] = {"int": positive_int, "float": nonneg_float}.get(f.type.split(" ")[0], str)
            if f.name in ("budget_gb", "swap_tier_gb"):
                kw["type"] = budget_value
            if f.name == "threads":  # 0: read inline
                kw["type"] = nonneg_int
            kw["default"] = f.default
            if several and f.name in ("slots", "budget_gb"):
                kw["nargs"] = "+"
        else:
            kw["default"] = f.default
        (size if f.name in ("slots", "budget_gb") else g).add_argument(flag, dest=f.name, **kw)


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
        "default: even (python -m mlx_streaming plan --machines-gb suggests one)",
    )
    g.add_argument(
        "--rank-budget-gb",
        help="expert pool GB per rank, rank order (plan --machines-gb suggests them); "
        "instead of --budget-gb, which every rank would take alike",
    )
    g.add_argument(
        "--pipeline-timeout",
        type=positive_float,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        help="seconds to wait for a peer to answer while loading (a slower one is waited "
        "for while it works) and within a step "
        f"(default {DEFAULT_CONNECT_TIMEOUT_S:.0f}); a silent peer ends the rank",
    )
    g.add_argument(
        "--connect-timeout",
        type=positive_float,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        help="seconds to wait for the other ranks to connect at start "
        f"(default {DEFAULT_CONNECT_TIMEOUT_S:.0f}): ranks start at different times, so "
        "this is apart from --pipeline-timeout",
    )


def pipeline_kwargs(a: argparse.Namespace, on_silence=None) -> dict:
    """``load``'s pipeline arguments: joins the group (bounded by --connect-timeout)
    and makes the one ``PeerWatch`` (``pipeline_watch``) that bounds every exchange with
    the other ranks from then on, the load's and each step's (``on_silence``: see
    ``PeerWatch``); with --rank-budget-gb, this rank's ``budget_gb``."""
    from ..parallel import init_pipeline, parse_split
    from ..peers import PeerWatch

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
    group = init_pipeline(a.connect_timeout)
    watch = PeerWatch(group, a.pipeline_timeout, on_silence)
    out = {"pipeline_group": group, "pipeline_split": split, "pipeline_watch": watch}
    if budgets is not None:
        if len(budgets) != group.size():
            raise ValueError(f"--rank-budget-gb has {len(budgets)} values for {group.size()} ranks")
        out["budget_gb"] = budgets[group.rank()]
    return out


def stream_config(a: argparse.Namespace, **changes) -> StreamConfig:
    """The ``StreamConfig`` the streaming flags describe (with ``changes``)."""
    values = {f.name: getattr(a, f.name) for f in fields(StreamConfig) if hasattr(a, f.name)}
    return StreamConfig(**{**values, **changes})


def load_kwargs(a: argparse.Namespace) -> dict:
    """``mlx_streaming.load``'s keyword arguments from the streaming flags."""
    return {"expert_dir": a.expert_dir, "config": stream_config(a)}
