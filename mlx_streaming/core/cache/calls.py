"""The work of one MoE layer call, as the store hands it to the patched module."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import mlx.core as mx
import numpy as np


class LayerCall:
    """The expert work of one MoE layer call, as the store planned it.

    ``slots``: device-side slot ids for every row, when no host work is needed.
    Otherwise ``host_ids`` is the routing read on the host and ``steps()`` yields
    ``(rows, slots)`` once each step's experts are resident: ``rows`` a boolean mask
    shaped like the routing (None: every row), ``slots`` the slot of every row. With
    ``settle``, each step's output must be evaluated before the next step (it reuses
    slots).
    """

    def __init__(
        self,
        layer: int,
        complete: Callable,
        slots: mx.array | None = None,
        host_ids: np.ndarray | None = None,
        settle: bool = False,
    ):
        self.layer, self.slots, self.host_ids = layer, slots, host_ids
        self.settle = settle
        self.misses = 0  # experts this call loaded
        self.plan: Iterator | None = None  # the steps, set by the store
        self.also: np.ndarray | None = None  # request(also=...) read on the host
        self.before_launch: Callable[[], None] | None = None  # waits for the misses' reads
        self.waited_s = 0.0  # of the steps' and completion's time, spent waiting for reads
        self.routed_at: float | None = None  # when the routing reached the host
        self.launched_at: float | None = None  # when the first expert work was launched
        self._complete = complete

    def launched(self) -> None:
        """Note that expert work of this call was just handed to the device."""
        if self.launched_at is None:
            self.launched_at = time.perf_counter()

    def steps(self) -> Iterator[tuple[np.ndarray | None, np.ndarray]]:
        return self.plan if self.plan is not None else iter(())

    def done(self, y: mx.array) -> mx.array:
        """Complete the call with its output; returns it."""
        return self._complete(self, y)
