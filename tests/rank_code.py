"""``python -m mlx_streaming ARGV`` as one rank, in a child process whose exit code this
wrapper writes to ``--codes F`` (a line ``rank R rc C``): ``mlx.launch`` itself dies on
a terminal's Ctrl-C, so a test sees the ranks' own codes only through it. The wrapper
waits through Ctrl-C for the child. Run by ``test_pipeline.py``."""

from __future__ import annotations

import os
import subprocess
import sys


def main() -> None:
    args = sys.argv[1:]
    i = args.index("--codes")
    codes, args = args[i + 1], args[:i] + args[i + 2 :]
    child = subprocess.Popen([sys.executable, "-m", "mlx_streaming", *args])
    while True:
        try:
            rc = child.wait()
            break
        except KeyboardInterrupt:  # the child got it too: its own handling is tested
            pass
    with open(codes, "a") as f:
        f.write(f"rank {os.environ.get('MLX_RANK')} rc {rc}\n")


if __name__ == "__main__":
    main()
