"""A pipeline's ranks kept in touch: ``PeerWatch`` ends a rank whose peer stopped
answering (MLX would wait on it forever), and ``Pace`` keeps ranks doing local work of
unequal length (a load) in touch under it, so that a slow rank is told apart from a
silent one.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable

import mlx.core as mx

from .parallel import DEFAULT_CONNECT_TIMEOUT_S, collective

EXIT_PEER_SILENT = 6


def _is_local_wait(filename: str) -> bool:
    """A frame of the standard library's blocking waits (locks, events, queues)."""
    return os.path.basename(filename) in ("threading.py", "queue.py")


class PeerWatch:
    """Ends this rank when work that needs its peers makes no progress for ``timeout_s``.

    MLX waits on a silent peer (stopped, hung, its host unreachable) without a limit.
    While armed (``with watch:``), each ``beat()`` (every expert layer call makes one,
    through ``FileExpertStore.watch``) pushes the deadline back; past it, a thread
    (MLX releases the GIL while it waits) runs ``on_silence(message)`` (the server answers
    its request in flight), prints the message naming the rank this one waits on, and
    exits the process with code ``EXIT_PEER_SILENT``. A rank whose own thread is the one
    stuck (blocked on a lock or event of this process, not on MLX's transport) says so
    and names itself instead: a rank that hangs between two layer calls beat last before
    its peers did, so its watch is often the first to fire.
    """

    def __init__(self, group, timeout_s: float, on_silence: Callable[[str], None] | None = None):
        self.rank, self.size, self.timeout_s = group.rank(), group.size(), float(timeout_s)
        self.on_silence = on_silence
        self._armed, self._deadline, self._depth = False, 0.0, 0
        self._worker: int | None = None  # the thread that beat last (runs the model)
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="mlxs-peer-watch", daemon=True).start()

    def waits_on(self) -> int:
        """The rank this one waits on first in a step: mlx-lm's pipeline passes the
        hidden states from rank r + 1 to rank r, and the last rank waits for rank 0's
        share of the output."""
        return self.rank + 1 if self.rank + 1 < self.size else 0

    def message(self) -> str:
        """What this rank says when it gives up: the rank it waits on, or itself when its
        own thread is blocked in this process (see ``stuck_at``)."""
        stuck = self.stuck_at()
        if stuck is not None:
            return (
                f"mlx_streaming: error: rank {self.rank}: no progress within "
                f"{self.timeout_s:.0f} s: this rank is stuck in its own work ({stuck}), "
                "not waiting on a peer; the other ranks wait on it"
            )
        return (
            f"mlx_streaming: error: rank {self.rank}: no answer within {self.timeout_s:.0f} s: "
            f"rank {self.waits_on()} (or a rank it waits on) stopped answering; a stopped or "
            "hung process or an unreachable host; its own output may say why (raise "
            "--pipeline-timeout if one step can take longer)"
        )

    def stuck_at(self) -> str | None:
        """Where the thread that beat last is blocked, as ``function (file:line)``
        of the first frame outside ``threading``/``queue``, when it waits on a lock or
        event of this process; None when it is inside a call that may wait on a peer."""
        worker = self._worker
        frame = sys._current_frames().get(worker) if worker is not None else None
        if frame is None or not _is_local_wait(frame.f_code.co_filename):
            return None
        while frame is not None and _is_local_wait(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is None:
            return "a lock or event"
        where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        return f"{frame.f_code.co_name} ({where}), on a lock or event"

    def beat(self) -> None:
        """Progress: push the deadline back."""
        self._deadline = time.monotonic() + self.timeout_s
        self._worker = threading.get_ident()

    def __enter__(self) -> PeerWatch:
        with self._lock:
            self._depth += 1
            self.beat()
            self._armed = True
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._depth -= 1
            self._armed = self._depth > 0

    def _watch(self) -> None:
        # wake at the deadline itself, not on a coarse tick: the rank that stopped beat
        # last (its peers wait on it), so the first to fire is one that waits and names it
        while True:
            if not self._armed:
                time.sleep(min(0.25, self.timeout_s / 4))
                continue
            left = self._deadline - time.monotonic()
            if left <= 0:
                self._fire()
            time.sleep(max(left, 0.001))

    def _fire(self) -> None:
        msg = self.message()
        if self.on_silence is not None:
            try:
                self.on_silence(msg)
            except Exception:  # noqa: BLE001 - the exit below must happen regardless
                pass
        print(msg, file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_SILENT)


class Pace:
    """Ranks doing local work of unequal length (a load: the split, the trunk) wait for
    each other in rounds, so that a slow rank is told apart from a silent one.

    ``tick()``, after each piece of work, joins a round once ``every`` s passed since the
    last; ``done()`` joins rounds until every rank is done. Only the rounds run under
    ``watch`` (armed there alone): a rank that stops, or stops working, ends its peers
    within the watch's time; one that works on, in pieces shorter than that less
    ``every``, does not. A round pairs with any round of the peers, so ranks need not
    tick alike.
    """

    def __init__(self, group, watch: PeerWatch | None = None):
        self.group, self.watch = group, watch
        self.every = (watch.timeout_s if watch else DEFAULT_CONNECT_TIMEOUT_S) / 4
        self._last = time.monotonic()

    def tick(self) -> None:
        """After a piece of this rank's work: a round with the peers, if one is due."""
        if time.monotonic() - self._last >= self.every:
            self._round(0)

    def done(self) -> None:
        """This rank's work is done: rounds until every rank's is (a barrier)."""
        while self._round(1) < self.group.size():
            pass

    def _round(self, done: int) -> int:
        with self.watch or contextlib.nullcontext():
            n = collective(
                lambda: mx.distributed.all_sum(mx.array(done), group=self.group, stream=mx.cpu)
            )
        self._last = time.monotonic()
        return n.item()
