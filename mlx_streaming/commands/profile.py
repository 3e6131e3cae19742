"""``python -m mlx_streaming profile``: per-layer slots from recorded routing."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..core.cache.policy import DEFAULT_POLICY, POLICIES
from ..core.meta import load_meta
from ..planning.profiles import PROFILE_NAME, build_profile, write_pool_profile
from ..planning.trace import RoutingTrace
from ._args import positive_float, positive_int


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_streaming profile",
        description=(
            "Write pool_profile.json: slots per MoE layer, from a routing trace recorded with "
            "`bench --record-trace` or `generate --record-trace` (first half: calibration; "
            "second half: judged against uniform slots at equal bytes)."
        ),
    )
    p.add_argument("--expert-dir", required=True)
    p.add_argument("--trace", required=True)
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--budget-gb", type=positive_float)
    size.add_argument("--slots", type=positive_int, help="the bytes of this many uniform slots")
    size.add_argument(
        "--lossless", action="store_true", help="cap each layer at the distinct experts it used"
    )
    p.add_argument(
        "--whole-layers",
        type=int,
        default=0,
        metavar="N",
        help="the N layers that miss most hold every expert (no streamed call there), the "
        "others share the rest: fewer hits for less host work per token, which pays where "
        "host work bounds decode (the CUDA device path, experts in RAM); with --budget-gb "
        "or --slots",
    )
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES))
    p.add_argument("--tokens", type=positive_int, default=10000)
    p.add_argument("--out", help=f"default: EXPERT_DIR/{PROFILE_NAME}")
    return p


def main(argv=None) -> None:
    a = setup_arg_parser().parse_args(argv)
    meta = load_meta(a.expert_dir)
    prof = build_profile(
        RoutingTrace.load(a.trace),
        meta,
        budget_gb=a.budget_gb,
        slots=a.slots,
        mode="lossless" if a.lossless else "budget",
        policy=a.policy,
        tokens=a.tokens,
        whole_layers=a.whole_layers,
    )
    out = Path(a.out or Path(a.expert_dir) / PROFILE_NAME)
    worse = prof.heldout_hit_rate < prof.uniform_heldout_hit_rate
    if worse and not a.whole_layers:  # load would use it unasked; whole layers trade hits
        raise ValueError(
            f"{a.trace}: the profile fitted on the trace's first half hits "
            f"{prof.heldout_hit_rate:.3f} of its second half, uniform slots "
            f"{prof.uniform_heldout_hit_rate:.3f}: {out} not written. Record more routing "
            "(more prompts or tokens), or keep uniform slots (no profile)"
        )
    write_pool_profile(out, prof.slots, **prof.info())
    if worse:  # asked for: say what it costs, and who will use it
        print(
            f"{out}: {len(prof.whole_layers)} whole layers hit "
            f"{prof.heldout_hit_rate:.3f} of the trace's second half against "
            f"{prof.uniform_heldout_hit_rate:.3f} for uniform slots: fewer hits for fewer "
            "streamed calls, which pays only where host work bounds decode (the CUDA device "
            "path with the experts in RAM). `load` uses a profile in the expert directory "
            "on every backend; EXPERT_POOL_PROFILE=none or pool_profile='none' leaves it out",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "profile": str(out),
                **prof.info(),
                "slots": {str(k): v for k, v in prof.slots.items()},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
