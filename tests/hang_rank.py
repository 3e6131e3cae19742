"""``python -m mlx_streaming ARGV`` as one rank under ``mlx.launch``, where rank 1 hangs
for good (blocked on an event no one sets) after ``--hang-after`` layer calls, writing the
time it hung to ``--hang-file``: a rank that stops answering without dying (a deadlock, a
stuck read). Run by ``test_pipeline.py``."""

from __future__ import annotations

import os
import sys
import threading
import time


def main() -> None:
    args = sys.argv[1:]
    i = args.index("--hang-after")
    after, args = int(args[i + 1]), args[:i] + args[i + 2 :]
    j = args.index("--hang-file")
    hang_file, args = args[j + 1], args[:j] + args[j + 2 :]
    if os.environ.get("MLX_RANK") == "1":
        from mlx_streaming.core.cache.expert_store import FileExpertStore

        real, calls = FileExpertStore.request, [0]

        def request(self, *a, **kw):
            calls[0] += 1
            if calls[0] > after:
                with open(hang_file, "w") as f:
                    f.write(str(time.time()))
                threading.Event().wait()  # forever
            return real(self, *a, **kw)

        FileExpertStore.request = request
    from mlx_streaming.cli import main as cli

    cli(args)


if __name__ == "__main__":
    main()
