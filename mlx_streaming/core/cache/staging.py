"""Page-aligned host rows that records pass through on their way to a pool.

Records are staged where they cannot be read straight into slot rows: in ``cuda`` and
``mlx`` pool modes (the pool is device memory) and under O_DIRECT (whole aligned
records). In ``cuda`` mode the rows are page-locked, so copies to the device run at full
speed without the GIL.
"""

from __future__ import annotations

import threading

import numpy as np

from ..io.reader import aligned_buffer


class Staging:
    """A free list of ``stride``-byte rows, grown in blocks as loads need them."""

    def __init__(self, stride: int, pinned: bool):
        self.stride, self.pinned = stride, pinned
        self._free: list[np.ndarray] = []
        self._blocks: list[np.ndarray] = []  # keeps the allocations alive
        self._lock = threading.Lock()

    def take(self, n: int) -> list[np.ndarray]:
        """``n`` rows for one load; give them back with ``give`` once it is done."""
        with self._lock:
            if len(self._free) < n:
                k = max(n - len(self._free), 8)
                if self.pinned:
                    from ..io import cuda

                    block = cuda.pinned(k * self.stride)  # page-aligned too
                else:
                    block = aligned_buffer(k * self.stride)
                self._blocks.append(block)
                self._free += list(block.reshape(k, self.stride))
            rows, self._free = self._free[:n], self._free[n:]
            return rows

    def give(self, rows: list[np.ndarray]) -> None:
        with self._lock:
            self._free += rows

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._blocks)
