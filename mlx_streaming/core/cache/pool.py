"""The resident expert pool on the device: fixed-size slot arrays per MoE layer.

Each record part (``gate_proj.weight``, ``gate_proj.scales``...) is one array of shape
``[slots, *part_shape]``, allocated once, and a lookup table ``lut[expert] = slot`` lets
routed expert ids become slot ids with one device gather. Fixed shapes also mean kernels
compile once. Slots are filled in place, in one of two modes:

* ``host`` (unified memory: CPU, Apple GPUs): the part arrays live in host memory, and
  the reader writes records into their slot rows.
* ``cuda`` (MLX's CUDA build): the part arrays are plain device memory (outputs of a
  GPU op, never read back on the host, whose addresses a one-thread kernel reports),
  written by the native reader's copies or the device reader's kernel.

MLX never sees these writes, so a slot is written only once every computation that read
it has run (``loads.Outputs``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..format import DTYPES, ExpertDirError, LayerLayout
from ..ids import DECODE_IDS, SLOT_IDS, SLOT_IDS_NP
from ..io import cuda

MODES = ("host", "cuda")


def _host_view(arr: mx.array) -> np.ndarray:
    """A writable byte view [rows, row_bytes] of an evaluated, contiguous MLX array."""
    v = np.array(arr, copy=False)
    assert v.flags.c_contiguous and v.flags.writeable
    return v.reshape(v.shape[0], -1).view(np.uint8)


class LayerPool:
    """Device arrays holding ``slots`` experts of one layer, plus with ``zero_slot`` one
    always-zero slot (``dummy``) that masked calls point their skipped rows at."""

    def __init__(self, layout: LayerLayout, slots: int, mode: str, zero_slot: bool = True):
        self.layout = layout
        self.slots = slots
        self.dummy = slots if zero_slot else None
        self.mode = mode
        if self.mode not in MODES:
            raise ValueError(f"pool mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "cuda" and not cuda.available():
            raise ValueError(
                "pool mode 'cuda' needs the CUDA runtime (libcudart), which was not found: "
                "install MLX's CUDA build (pip install 'mlx[cuda]')"
            )
        self.arrays: dict[str, mx.array] = {}
        self._rows: dict[str, np.ndarray] = {}  # host mode: byte view [slots, row_bytes]
        self._dev: dict[str, tuple[int, int]] = {}  # cuda mode: (device address, row bytes)
        n = slots + bool(zero_slot)
        if self.mode == "cuda":
            mx.clear_cache()  # fresh device buffers, not recycled managed ones
        for p in layout.parts:
            np_dt, mx_dt = DTYPES[p.dtype]
            if self.mode == "cuda":
                arr = mx.zeros((n, *p.shape), dtype=mx_dt)
                mx.eval(arr)
                self._dev[p.name] = (device_address(arr), p.nbytes)
            else:
                base = mx.array(np.zeros((n, *p.shape), dtype=np_dt))
                arr = base.view(mx_dt) if base.dtype != mx_dt else base
                mx.eval(arr)
                self._rows[p.name] = _host_view(base)
            self.arrays[p.name] = arr
        self._pointers = [  # fixed for the pool's life: computed once
            self._dev[p.name]
            if self.mode == "cuda"
            else (self._rows[p.name].ctypes.data, self._rows[p.name].shape[1])
            for p in layout.parts
        ]
        self._lut_dev, self._lut_stale = 0, False
        if self.mode == "cuda":  # a page-locked host copy, copied over after each change
            self.lut = mx.zeros((layout.num_experts,), dtype=SLOT_IDS)
            mx.eval(self.lut)
            self._lut_dev = device_address(self.lut)
            self._lut_host = cuda.page_locked(4 * layout.num_experts).view(SLOT_IDS_NP)
            self._lut_host[:] = 0
        else:
            self.lut = mx.array(np.zeros(layout.num_experts, dtype=SLOT_IDS_NP))
            mx.eval(self.lut)
            self._lut_host = np.array(self.lut, copy=False)
        pos, gap = 0, 0
        for p in layout.parts:
            gap += max(0, p.offset - pos)
            pos = p.offset + p.nbytes
        self._gaps = np.zeros((slots, gap), dtype=np.uint8)  # record padding lands here
        self._arange = np.arange(layout.num_experts, dtype=np.int32)
        self.identity = False  # lut[e] == e for every expert (set_lut keeps it)
        self._bufs = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def row_pointers(self) -> list[tuple[int, int]]:
        """``(address, bytes per slot)`` of each part's slot rows, in layout order: the
        arrays' own memory, written behind MLX's back (device addresses in cuda mode)."""
        return self._pointers

    def device_lut(self) -> mx.array:
        """The lookup table as a device array, for remapping routed ids on the device (in
        cuda mode the host table is copied over first if it changed since)."""
        if self._lut_stale:
            cuda.copy_to_device(self._lut_dev, self._lut_host.ctypes.data, self._lut_host.nbytes)
            cuda.synchronize()
            self._lut_stale = False
        return self.lut

    # ---------------------------------------------------------------- host mode
    def record_bufs(self, slot: int) -> list[memoryview]:
        """Buffers one record's bytes fill in order: each part's slot row, with the
        record's alignment gaps going to a scratch row of the slot."""
        if self._bufs is None:
            self._bufs = [self._slot_bufs(s) for s in range(self.slots)]
        return self._bufs[slot]

    def _slot_bufs(self, slot: int) -> list[memoryview]:
        out, pos, g = [], 0, 0
        gaps = self._gaps[slot]
        for p in self.layout.parts:
            if p.offset > pos:
                n = p.offset - pos
                out.append(memoryview(gaps[g : g + n]))
                g += n
            out.append(memoryview(self._rows[p.name][slot]).cast("B"))
            pos = p.offset + p.nbytes
        return out

    # ---------------------------------------------------------------- all modes
    def slots_of(self, experts: np.ndarray, reserved: dict | None = None) -> np.ndarray:
        """The slot of each expert id in ``experts`` (host copy of the lookup table;
        valid for resident experts, and for those in ``reserved``: expert -> its slot
        while it loads). A decode step's few ids go one at a time: numpy's fancy
        indexing costs more, cold, than the work (``core/cache/slots.py``)."""
        reserved = reserved or {}
        if experts.size > DECODE_IDS:  # Python lists beat numpy on a few ids
            out = self._lut_host[experts]
            for e, s in reserved.items():
                out[experts == e] = s
            return out
        lut, ids = self._lut_host, experts.ravel().tolist()
        out = [reserved[e] if e in reserved else lut[e] for e in ids]
        return np.array(out, SLOT_IDS_NP).reshape(experts.shape)

    def set_lut(self, experts, slots) -> None:
        """Point ``lut[experts]`` at ``slots``."""
        lut = self._lut_host
        for e, s in zip(experts, slots):
            lut[e] = s
        # slot e holds expert e everywhere: only possible with a slot per expert
        self.identity = self.slots >= len(self._arange) and bool(
            np.array_equal(self._lut_host, self._arange)
        )
        if self.mode == "cuda":  # copied over when the device next needs it
            self._lut_stale = True


_ADDRESS = []  # the address kernel, built on first use
ADDRESS_SOURCE = "if (threadIdx.x == 0) p[0] = (unsigned long long)(a);"


def device_address(a: mx.array) -> int:
    """The device address of ``a``'s buffer (CUDA), reported by a one-thread kernel: a
    host read would move the buffer to managed memory.

    Raises:
        ValueError: the buffer is not plain device memory.
    """
    if not _ADDRESS:
        _ADDRESS.append(
            mx.fast.cuda_kernel(
                name="mlxs_address",
                input_names=["a"],
                output_names=["p"],
                source=ADDRESS_SOURCE,
            )
        )
    p = _ADDRESS[0](
        inputs=[a],
        grid=(1, 1, 1),
        threadgroup=(1, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.uint64],
    )[0]
    addr = int(p.item())
    kind = cuda.memory_type(addr)
    if kind != cuda.ATTR_DEVICE:
        raise ValueError(
            f"MLX {mx.__version__} gave a pool buffer in CUDA memory of type {kind}, not "
            "device memory, which the slots' copies need: use the MLX version the project "
            "is tested with (mlx[cuda]>=0.32.4, pyproject.toml)"
        )
    return addr


def default_slots(meta) -> int:
    """The one default number of slots per layer: half the experts, at least top-k."""
    return max(meta.top_k, meta.num_experts // 2)


def capacities(meta, capacity: int, layer_caps: dict | None) -> dict[int, int]:
    """Slots per MoE layer: ``capacity``, or ``layer_caps``'s, clipped to each layer's
    experts.

    Raises:
        ExpertDirError: a count that is not a positive integer, below top-k, or for a
            layer that is not a MoE layer.
    """
    _check_count("capacity", capacity)
    caps = {}
    layer_caps = {int(k): v for k, v in (layer_caps or {}).items()}
    unknown = sorted(set(layer_caps) - set(meta.layers))
    if unknown:
        raise ExpertDirError(
            f"layer_caps names layers {unknown} that are not MoE layers of "
            f"{meta.root} (MoE layers: {list(meta.moe_layers)})"
        )
    for li, lay in meta.layers.items():
        c = layer_caps.get(li, capacity)
        _check_count(f"slots for layer {li}", c)
        if c < meta.top_k:
            src = "layer_caps" if li in layer_caps else "capacity"
            raise ExpertDirError(
                f"{src} of {c} slots for layer {li} is below top_k={meta.top_k}: each token "
                f"needs {meta.top_k} experts resident at once; use at least {meta.top_k}"
            )
        caps[li] = min(int(c), lay.num_experts)
    return caps


def make_pools(meta, caps: dict, mode: str, zero_slot: bool) -> dict[int, LayerPool]:
    """The layers' pools in ``mode`` (a layer with every expert's slot gets no zero slot)."""
    return {
        li: LayerPool(meta.layers[li], c, mode, zero_slot and c < meta.layers[li].num_experts)
        for li, c in caps.items()
    }


def _check_count(what: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ExpertDirError(f"{what} must be a positive integer, got {v!r}")
