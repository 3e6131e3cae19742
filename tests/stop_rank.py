"""``python -m mlx_streaming ARGV`` as one rank, where rank 1's load is held up as it
enters ``mlx_streaming.model_builder.NAME`` (``--in NAME``): with ``--stop-file F`` it
writes the time to F and stops itself there (SIGSTOP: a rank stopped while the ranks
load); with ``--slow S`` it works on for S s first, in pieces of 0.25 s, each ending
with the call's ``tick`` (a rank much slower to load, still working: ``load_trunk``
only). Run by ``test_pipeline.py``."""

from __future__ import annotations

import os
import signal
import sys
import time


def _take(args: list[str], flag: str) -> tuple[str | None, list[str]]:
    if flag not in args:
        return None, args
    i = args.index(flag)
    return args[i + 1], args[:i] + args[i + 2 :]


def main() -> None:
    name, args = _take(sys.argv[1:], "--in")
    stop_file, args = _take(args, "--stop-file")
    slow, args = _take(args, "--slow")
    if os.environ.get("MLX_RANK") == "1":
        from mlx_streaming import model_builder

        real = getattr(model_builder, name)

        def held(*a, **kw):
            if stop_file is not None:
                with open(stop_file, "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
            for _ in range(int(float(slow or 0) / 0.25)):
                time.sleep(0.25)
                a[2]()  # load_trunk(model, progress, tick)
            return real(*a, **kw)

        setattr(model_builder, name, held)
    from mlx_streaming.cli import main as cli

    cli(args)


if __name__ == "__main__":
    main()
