"""Pipelining a streamed model over ``mx.distributed``: mlx-lm's own engine, no transport
of ours.

mlx-lm's ``pipeline(group, split)`` gives each rank a contiguous share of the decoder
layers (rank 0 the last ones); hidden states pass rank to rank by send/recv and the
output is all-gathered, so every rank ends each step with the same logits. This module
holds what a streamed model adds around it: the group with a bounded start, which layers
are this rank's, the cross-rank check that every rank loaded the same model and experts,
and the translation of a lost peer into a clear error. Keeping the ranks in touch under a
time limit (``PeerWatch``, ``Pace``) is the concern of ``peers``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np

from .config import settings

DEFAULT_CONNECT_TIMEOUT_S = 60.0  # --connect-timeout, and --pipeline-timeout (a peer to answer)


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
        "check the hosts and ports, or raise --connect-timeout"
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


def ranks_on_this_host(group) -> int:
    """How many of ``group``'s ranks run on this host (this one included): they split
    its memory (``mem.HostShare``)."""
    from .core.mem import host_key

    key = host_key()
    return sum(line == key for line in gather_lines(group, key))


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
