"""The resident expert pool on the device: fixed-size slot arrays per MoE layer.

Each record part (``gate_proj.weight``, ``gate_proj.scales``...) is one array of shape
``[slots, *part_shape]``, allocated once. Loading experts writes their slots in place
(``arr[s:s+1] = ...``: MLX donates the buffer, no whole-pool copy) and updates a device
lookup table ``lut[expert] = slot``, so remapping routed expert ids to slots is one
device gather. Fixed shapes also mean kernels compile once.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..format import DTYPES, LayerLayout


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first slot, first row, count) of consecutive slot runs, rows in input order."""
    out, i = [], 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1:
            j += 1
        out.append((slots[i], i, j - i))
        i = j
    return out


class LayerPool:
    """Device arrays holding ``slots`` experts of one layer."""

    def __init__(self, layout: LayerLayout, slots: int):
        self.layout = layout
        self.slots = slots
        self.arrays = {
            p.name: mx.zeros((slots, *p.shape), dtype=DTYPES[p.dtype][1]) for p in layout.parts
        }
        self.lut = mx.zeros((layout.num_experts,), dtype=mx.int32)
        self.writes = 0  # slot writes issued (one per expert loaded)
        self.write_ops = 0  # array update ops issued

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def write(self, experts: list[int], slots: list[int], records: np.ndarray) -> None:
        """Place ``records[i]`` (raw record bytes) of ``experts[i]`` into ``slots[i]``.

        One host-to-device copy for the whole batch, then per part one slice update per
        run of consecutive slots. Lazy: nothing is evaluated here.
        """
        n = len(experts)
        rec = mx.array(records[:n, : self.layout.record_bytes])  # [n, record_bytes] uint8
        runs = _runs(list(slots))
        for p in self.layout.parts:
            src = rec[:, p.offset: p.offset + p.nbytes].view(DTYPES[p.dtype][1])
            src = src.reshape(n, *p.shape)
            arr = self.arrays[p.name]
            for s, r, c in runs:
                arr[s: s + c] = src[r: r + c]
                self.write_ops += 1
        self.lut[mx.array(list(experts), dtype=mx.int32)] = mx.array(list(slots), dtype=mx.int32)
        self.writes += n

    def state(self) -> list[mx.array]:
        """Arrays to evaluate to settle pending writes."""
        return [*self.arrays.values(), self.lut]
