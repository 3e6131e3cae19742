"""``python -m mlx_streaming ARGV`` as one rank, where rank 1's load is held up as it
enters the function ``--in NAME``: a function of ``mlx_streaming.model_builder``, or
``module:qualname`` elsewhere (e.g. ``mlx_streaming.core.cache.readers:forget_pages``,
the end of each layer of a swap tier's fill).
With ``--stop-file F`` it writes the time to F and stops itself there (SIGSTOP: a rank
stopped while the ranks load); with ``--slow S`` it works on for S s first, in pieces
of 0.25 s, each ending with the call's ``tick`` (a rank much slower to load, still
working: ``load_trunk`` only); with ``--each S`` every call sleeps S s first, saying so
on stderr (one piece of work longer by S s: only the code's own tick after it keeps
the rank in touch). ``--kernel-check`` turns the kernel check on, on every rank (the
CPU skips it by default). Run by ``test_pipeline.py``."""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time


def _take(args: list[str], flag: str) -> tuple[str | None, list[str]]:
    if flag not in args:
        return None, args
    i = args.index(flag)
    return args[i + 1], args[:i] + args[i + 2 :]


def _owner(name: str) -> tuple[object, str]:
    """The object holding the function ``name`` names, and its attribute there."""
    module, _, path = name.rpartition(":")
    owner = importlib.import_module(module or "mlx_streaming.model_builder")
    *outer, attr = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, attr


def main() -> None:
    name, args = _take(sys.argv[1:], "--in")
    stop_file, args = _take(args, "--stop-file")
    slow, args = _take(args, "--slow")
    each, args = _take(args, "--each")
    if "--kernel-check" in args:
        args.remove("--kernel-check")
        from mlx_streaming.commands import _args

        config = _args.stream_config
        _args.stream_config = lambda a, **kw: config(a, **{"kernel_check": True, **kw})
    if os.environ.get("MLX_RANK") == "1":
        owner, attr = _owner(name)
        real = getattr(owner, attr)

        def held(*a, **kw):
            if stop_file is not None:
                with open(stop_file, "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
            for _ in range(int(float(slow or 0) / 0.25)):
                time.sleep(0.25)
                a[2]()  # load_trunk(model, progress, tick)
            if each is not None:
                print(f"stop_rank: {name} held {each} s", file=sys.stderr, flush=True)
                time.sleep(float(each))
            return real(*a, **kw)

        setattr(owner, attr, held)
    from mlx_streaming.cli import main as cli

    cli(args)


if __name__ == "__main__":
    main()
