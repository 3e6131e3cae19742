"""The resident expert pool on the device: fixed-size slot arrays per MoE layer.

Each record part (``gate_proj.weight``, ``gate_proj.scales``...) is one array of shape
``[slots, *part_shape]``, allocated once, and a lookup table ``lut[expert] = slot`` lets
the routed expert ids be remapped to slots with one device gather. Fixed shapes also
mean kernels compile once.

Two ways to fill slots, neither of which copies a whole pool array:

* ``host`` (unified memory: CPU and Apple GPUs): the reader ``preadv``s each record
  straight into the slot rows of the part arrays (zero copies). MLX arrays on these
  backends live in host-visible memory; the store writes a slot only at a point where
  every computation that read it has finished (after the layer's routing was read).
* ``device`` (discrete GPUs): records land in a host staging buffer, become one MLX
  array (one host-to-device copy) and are written into their slots with slice updates.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..format import DTYPES, LayerLayout


def default_mode() -> str:
    """``host`` where MLX memory is host-visible (CPU, Metal), else ``device``."""
    if mx.default_device() == mx.cpu:
        return "host"
    return "host" if mx.metal.is_available() else "device"


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

    def __init__(self, layout: LayerLayout, slots: int, mode: str | None = None):
        self.layout = layout
        self.slots = slots
        self.mode = mode or default_mode()
        if self.mode not in ("host", "device"):
            raise ValueError(f"pool mode must be 'host' or 'device', got {self.mode!r}")
        self.arrays: dict[str, mx.array] = {}
        self._host: dict[str, np.ndarray] = {}  # writable byte views of the arrays (host mode)
        for p in layout.parts:
            np_dt, mx_dt = DTYPES[p.dtype]
            base = mx.array(np.zeros((slots, *p.shape), dtype=np_dt))  # contiguous, owned
            arr = base.view(mx_dt) if base.dtype != mx_dt else base
            mx.eval(arr)
            self.arrays[p.name] = arr
            if self.mode == "host":
                view = np.array(base, copy=False)
                assert view.flags.c_contiguous and view.flags.writeable
                self._host[p.name] = view.reshape(slots, -1).view(np.uint8)
        self.lut = mx.array(np.zeros(layout.num_experts, dtype=np.int32))
        mx.eval(self.lut)
        self._lut_host = np.array(self.lut, copy=False) if self.mode == "host" else None
        self.writes = 0  # experts written into slots
        self.write_ops = 0  # MLX update ops issued (device mode)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    # ---------------------------------------------------------------- host mode
    def record_iovecs(self, slot: int, gaps: np.ndarray) -> list[memoryview]:
        """Buffers that one record's bytes fill in order: the slot rows of each part,
        with the record's alignment gaps going to ``gaps`` (a scratch row)."""
        out, pos, g = [], 0, 0
        for p in self.layout.parts:
            if p.offset > pos:
                n = p.offset - pos
                out.append(memoryview(gaps[g:g + n]))
                g += n
            out.append(memoryview(self._host[p.name][slot]))
            pos = p.offset + p.nbytes
        return out

    def gap_bytes(self) -> int:
        pos, total = 0, 0
        for p in self.layout.parts:
            total += max(0, p.offset - pos)
            pos = p.offset + p.nbytes
        return total

    def set_lut(self, experts, slots) -> None:
        """Point ``lut[experts]`` at ``slots``."""
        if self._lut_host is not None:
            self._lut_host[np.asarray(experts)] = np.asarray(slots, dtype=np.int32)
        else:
            self.lut[mx.array(np.asarray(experts, dtype=np.int32))] = mx.array(
                np.asarray(slots, dtype=np.int32))

    # ---------------------------------------------------------------- device mode
    def write(self, experts: list[int], slots: list[int], records: np.ndarray) -> None:
        """Place ``records[i]`` (raw record bytes) of ``experts[i]`` into ``slots[i]``.

        One host-to-device copy for the batch, then per part one slice update per run of
        consecutive slots. Lazy: nothing is evaluated here.
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
        self.set_lut(experts, slots)
        self.writes += n

    def state(self) -> list[mx.array]:
        """Arrays to evaluate to settle pending writes (device mode)."""
        return [*self.arrays.values(), self.lut]
