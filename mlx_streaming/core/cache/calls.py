"""The work of one MoE layer call, as the store plans it: plain data, which the patched
module reads and hands back (``FileExpertStore.step``, ``FileExpertStore.finish``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np


@dataclass
class Step:
    """Rows of a call computed together: ``rows`` a boolean mask shaped like the
    routing (None: every row); ``group``: the experts an expert-major step loads first;
    ``after_reads``: computed once the call's reads have landed."""

    rows: np.ndarray | None = None
    group: np.ndarray | None = None
    after_reads: bool = False


@dataclass
class LayerCall:
    """One MoE layer call. ``path``: ``resident`` (every expert resident: ids remapped on
    the device), ``device`` (the device path plans and fills on the GPU) or ``host`` (the
    routing read on the host, ``host_ids``). ``slots``: the device-side slot of every row,
    where the graph is built on the pool's table (resident and device calls, and a late
    host call, whose ``routing`` the host reads at ``finish``, before the launch);
    otherwise ``steps`` in order. ``evaluate_each``: each step's output must be evaluated
    before the next (they reuse slots)."""

    layer: int
    path: str
    slots: mx.array | None = None
    host_ids: np.ndarray | None = None
    steps: list[Step] = field(default_factory=list)
    evaluate_each: bool = False
    wait_at_launch: bool = False  # the graph was built on reserved slots: wait, then launch
    routing: mx.array | None = None  # a late call's routing, not yet read
    also: np.ndarray | None = None  # request(also=...) read on the host
    misses: int = 0  # experts this call loaded
    waited_s: float = 0.0  # of the steps' and completion's time, spent waiting for reads
    routed_at: float | None = None  # when the routing reached the host
    reads_at: float | None = None  # when the misses' reads were issued
    launched_at: float | None = None  # when the first expert work was launched
