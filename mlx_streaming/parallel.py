"""Pipelining a streamed model over ``mx.distributed``: mlx-lm's own engine, no transport
of ours.

mlx-lm's ``pipeline(group, split)`` gives each rank a contiguous share of the decoder
layers (rank 0 the last ones); hidden states pass rank to rank by send/recv and the
output is all-gathered, so every rank ends each step with the same logits. This module
holds what a streamed model adds around it: the group with a bounded start, which layers
are this rank's, the cross-rank check that every rank loaded the same model and experts,
the translation of a lost peer into a clear error, ``PeerWatch``, which ends a rank
whose peer stopped answering (MLX would wait on it forever), and ``Pace``, which keeps
ranks doing local work of unequal length (a load) in touch under it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from .config import settings

DEFAULT_CONNECT_TIMEOUT_S = 60.0  # to connect, and for a peer to answer during a step
EXIT_PEER_SILENT = 6


class PipelineError(RuntimeError):
    """A pipeline rank cannot go on: a peer is lost, or the ranks disagree."""


def init_pipeline(timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S):
    """The ``mx.distributed`` group this process was launched in (by ``mlx.launch``).

    MLX's ring backend waits for a peer that never connects without a limit; here the
    process exits with a clear message after ``timeout_s`` instead (a watchdog thread,
    since the wait is inside MLX).

    Raises:
        PipelineError: the process was not launched as part of a group of two or more.
    """
    env = settings()
    message = (
        f"mlx_streaming: error: rank {env.launch_rank} could not connect "
        f"to its pipeline peers within {timeout_s:.0f} s (hostfile "
        f"{env.launch_hostfile}): start every rank with mlx.launch, "
        "check the hosts and ports, or raise --pipeline-timeout"
    )
    with _Watchdog(timeout_s, message):
        try:
            group = mx.distributed.init(strict=True)
        except RuntimeError as e:
            raise PipelineError(
                f"could not join the pipeline group ({e}); launch every rank with "
                "mlx.launch (python -m mlx_streaming ... --pipeline under mlx.launch)"
            ) from e
    if group.size() < 2:
        raise PipelineError(
            "--pipeline needs two or more ranks: launch with mlx.launch -n 2 (or a hostfile)"
        )
    return group


_WATCHDOG = """
import os, select, signal, sys
pid, timeout, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
ready, _, _ = select.select([sys.stdin], [], [], timeout)
if not ready:
    print(message, file=sys.stderr, flush=True)
    os.kill(pid, signal.SIGTERM)
"""


class _Watchdog:
    """Ends this process with ``message`` unless the block finishes within
    ``timeout_s``. A separate process, since MLX holds the interpreter while it waits."""

    def __init__(self, timeout_s: float, message: str):
        self.args = [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(timeout_s), message]

    def __enter__(self) -> None:
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE)

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()  # the watchdog sees end of input and exits
        self.proc.wait()


def parse_split(text: str | None) -> list[int] | None:
    """``"20,28"`` -> ``[20, 28]``: decoder layers per rank, in rank order (rank 0 runs
    the last layers, as in mlx-lm)."""
    if text is None:
        return None
    try:
        split = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--pipeline-split {text!r}: give the layers of each rank as integers, e.g. 20,28"
        ) from None
    return split


def pipeline_model(model, group, split: list[int] | None = None) -> range:
    """Split ``model``'s layers over ``group`` with mlx-lm's ``pipeline``; returns the
    decoder layers this rank runs (indices in the whole model).

    Raises:
        ValueError: the architecture has no pipeline support in mlx-lm, or ``split``
            does not fit the group and the layer count.
    """
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "pipeline"):
        kind = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
        raise ValueError(
            f"model type '{kind}' cannot be pipelined: mlx-lm has no pipeline support "
            "for it (its model has no `pipeline` method); run it on one host"
        )
    n = len(inner.layers)
    if split is not None and (len(split) != group.size() or sum(split) != n or min(split) <= 0):
        raise ValueError(
            f"--pipeline-split {','.join(map(str, split))}: need {group.size()} positive "
            f"layer counts (one per rank, rank 0 runs the last layers) summing to {n}"
        )
    inner.pipeline(group, split)
    return range(inner.start_idx, inner.end_idx)


def digest(obj) -> str:
    """A short hash of a JSON-able object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def check_same_everywhere(group, values: dict[str, str], what: dict[str, str]) -> None:
    """Raise on every rank if some rank's ``values`` differ from rank 0's.

    ``what[key]`` says what a difference in ``key`` means and how to fix it. Every rank
    reaches this call before any raises, so none is left waiting on the others.

    Raises:
        PipelineError: naming the ranks that differ and the fix.
    """
    rows = [json.loads(line) for line in gather_lines(group, json.dumps(values))]
    bad = []
    for key in what:
        odd = [r for r, row in enumerate(rows) if row[key] != rows[0][key]]
        if odd:
            bad.append(f"ranks {odd} differ from rank 0 in {key}: {what[key]}")
    if bad:
        raise PipelineError("; ".join(bad))


def collective(fn):
    """Run and evaluate a collective; a lost peer becomes a ``PipelineError``.

    Work still queued on other streams is finished first: mlx-lm's generate leaves the
    next step's forward pass (with its own send, recv and all_gather) in flight, and two
    streams sharing the ring's sockets interleave their bytes (this was the flaky
    pipeline test: the exchange after a generation read the model's activations).
    """
    mx.synchronize()
    try:
        out = fn()
        mx.eval(out)
        return out
    except RuntimeError as e:
        raise lost_peer(e) from e


def barrier(group) -> None:
    """Wait until every rank gets here."""
    collective(lambda: mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


def finish_step(group) -> None:
    """After a generation: finish the forward pass mlx-lm started ahead (its send, recv
    and all_gather still in flight), then wait for every rank. Without it a rank that
    exits, or exchanges anything, tears into its peers' last step (``collective``
    synchronises first)."""
    barrier(group)


def rank_path(path: str, group) -> str:
    """``path`` for this rank's own file: ``name.rank{r}.ext`` in a pipeline of several
    ranks (each records only its own layers; ranks on one host would overwrite one file)."""
    if group is None or group.size() == 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{group.rank()}{p.suffix}"))


def lost_peer(e: Exception) -> Exception:
    """A clear error for MLX's report of a lost connection; other errors unchanged."""
    if "[ring]" in str(e) or "peer" in str(e):
        return PipelineError(
            f"a pipeline peer is gone ({e}): another rank exited or its host is "
            "unreachable; its own output says why"
        )
    return e


def gather_lines(group, line: str) -> list[str]:
    """Every rank's ``line``, in rank order (on every rank).

    Raises:
        PipelineError: the bytes that arrived are not what a rank sent (each line travels
            behind its CRC-32: MLX's ring can log a socket error and still return).
    """
    raw = line.encode()
    data = np.frombuffer(zlib.crc32(raw).to_bytes(4, "little") + raw, dtype=np.uint8)
    sizes = collective(
        lambda: mx.distributed.all_gather(mx.array([data.size]), group=group, stream=mx.cpu)
    ).tolist()
    if min(sizes) < 4 or max(sizes) > 1 << 24:
        raise PipelineError(f"a pipeline exchange arrived corrupt (line sizes {sizes})")
    buf = np.zeros(max(sizes), dtype=np.uint8)
    buf[: data.size] = data
    rows = collective(lambda: mx.distributed.all_gather(mx.array(buf), group=group, stream=mx.cpu))
    rows = np.array(rows).reshape(len(sizes), -1)
    out = [bytes(row[4:n]) for row, n in zip(rows, sizes)]
    bad = [
        r
        for r, (row, b) in enumerate(zip(rows, out))
        if zlib.crc32(b) != int.from_bytes(bytes(row[:4]), "little")
    ]
    if bad:
        raise PipelineError(
            f"a pipeline exchange arrived corrupt from ranks {bad} (the transport lost "
            "bytes; see MLX's [ring] messages above): restart every rank"
        )
    return [b.decode() for b in out]


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
