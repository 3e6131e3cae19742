"""The resident expert pool on the device: fixed-size slot arrays per MoE layer.

Each record part (``gate_proj.weight``, ``gate_proj.scales``...) is one array of shape
``[slots, *part_shape]``, allocated once, and a lookup table ``lut[expert] = slot`` lets
routed expert ids become slot ids with one device gather. Fixed shapes also mean kernels
compile once. Slots are filled without copying a pool array, in one of three ways:

* ``host`` (unified memory: CPU, Apple GPUs): records are ``preadv``'d straight into the
  slot rows of the part arrays. Zero copies.
* ``cuda`` (MLX's CUDA build): the part arrays are plain device memory (outputs of a
  GPU op, never read back on the host, whose addresses a one-thread kernel reports);
  records land in page-locked host rows and are copied into their slots with
  ``cudaMemcpyAsync``. Device memory, unlike the managed memory MLX gives arrays made
  from host data, can be written by a copy engine while a kernel runs.
* ``mlx`` (anywhere): records land in a staging buffer, become one MLX array (one
  host-to-device copy), and slice updates write the slots. In place only when MLX can
  donate the pool buffer, which it cannot while earlier work still holds it.

In the first two modes MLX never sees the writes, so the caller must only write a slot
once every computation that read it has been evaluated (``StreamedExperts`` does).
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np

from ..format import DTYPES, ExpertDirError, LayerLayout
from ..io import cuda

MODES = ("host", "cuda", "mlx")


def default_mode() -> str:
    """``host`` where MLX memory is host memory (CPU, Metal), ``cuda`` on MLX's CUDA
    build when the CUDA runtime is reachable, else ``mlx``."""
    device = str(mx.default_device())
    if device not in _DEFAULT:  # probed once per device
        if mx.default_device() == mx.cpu or mx.metal.is_available():
            mode = "host"
        elif cuda.available():
            mode = "cuda"
        else:
            mode = "mlx"
        _DEFAULT[device] = mode
    return _DEFAULT[device]


_DEFAULT: dict[str, str] = {}


def default_zero_slot() -> bool:
    """Whether pools get a zero slot by default: where calls run masked rows (GPUs)."""
    return mx.default_device() != mx.cpu


def _host_view(arr: mx.array) -> np.ndarray:
    """A writable byte view [rows, row_bytes] of an evaluated, contiguous MLX array."""
    v = np.array(arr, copy=False)
    assert v.flags.c_contiguous and v.flags.writeable
    return v.reshape(v.shape[0], -1).view(np.uint8)


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
    """Device arrays holding ``slots`` experts of one layer, plus with ``zero_slot`` one
    always-zero slot (``dummy``) that masked calls point their skipped rows at."""

    def __init__(
        self, layout: LayerLayout, slots: int, mode: str | None = None, zero_slot: bool = True
    ):
        self.layout = layout
        self.slots = slots
        self.dummy = slots if zero_slot else None
        self.mode = mode or default_mode()
        if self.mode not in MODES:
            raise ValueError(f"pool mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "cuda" and not cuda.available():
            raise ValueError("pool mode 'cuda' needs the CUDA runtime (libcudart)")
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
                if self.mode == "host":
                    self._rows[p.name] = _host_view(base)
            self.arrays[p.name] = arr
        self._lut_dev, self._lut_stale = 0, False
        if self.mode == "cuda":  # a pinned host copy, copied over after each change
            self.lut = mx.zeros((layout.num_experts,), dtype=mx.int32)
            mx.eval(self.lut)
            self._lut_dev = device_address(self.lut)
            self._lut_host = cuda.pinned(4 * layout.num_experts).view(np.int32)
            self._lut_host[:] = 0
        else:
            self.lut = mx.array(np.zeros(layout.num_experts, dtype=np.int32))
            mx.eval(self.lut)
            self._lut_host = (
                np.array(self.lut, copy=False)
                if self.mode == "host"
                else np.zeros(layout.num_experts, dtype=np.int32)
            )
        pos, gap = 0, 0
        for p in layout.parts:
            gap += max(0, p.offset - pos)
            pos = p.offset + p.nbytes
        self._gaps = np.zeros((slots, gap), dtype=np.uint8)  # record padding lands here
        self._arange = np.arange(layout.num_experts, dtype=np.int32)
        self.identity = False  # lut[e] == e for every expert (set_lut keeps it)
        self._bufs = None
        self.writes = 0  # experts written into slots
        self.write_ops = 0  # MLX update ops issued (mlx mode)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def row_pointers(self) -> list[tuple[int, int]]:
        """``(address, bytes per slot)`` of each part's slot rows, in layout order: the
        arrays' own memory, written behind MLX's back (device addresses in cuda mode)."""
        if self.mode == "cuda":
            return [self._dev[p.name] for p in self.layout.parts]
        return [
            (self._rows[p.name].ctypes.data, self._rows[p.name].shape[1]) for p in self.layout.parts
        ]

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

    # ---------------------------------------------------------------- cuda mode
    def copy_range(self, slot: int, record: np.ndarray, start: int, end: int) -> None:
        """Copy bytes [start, end) of a record in a pinned host row into ``slot``'s
        parts, and wait for the copies (called on a reader thread as pieces land)."""
        src = record.ctypes.data
        for p in self.layout.parts:
            lo, hi = max(start, p.offset), min(end, p.offset + p.nbytes)
            if lo < hi:
                base, row = self._dev[p.name]
                cuda.copy_to_device(base + slot * row + (lo - p.offset), src + lo, hi - lo)
        cuda.synchronize()

    # ---------------------------------------------------------------- mlx mode
    def write(self, experts: list[int], slots: list[int], records: np.ndarray) -> None:
        """Place ``records[i]`` (raw record bytes) of ``experts[i]`` into ``slots[i]``:
        one host-to-device copy for the batch, then per part one slice update per run of
        consecutive slots (lazy, evaluated with the next computation)."""
        n = len(experts)
        rec = mx.array(records[:n, : self.layout.record_bytes])  # [n, record_bytes] uint8
        runs = _runs(list(slots))
        idx = mx.array(np.asarray(slots, dtype=np.int32)) if len(runs) > 1 else None
        for p in self.layout.parts:
            src = rec[:, p.offset : p.offset + p.nbytes].view(DTYPES[p.dtype][1])
            src = src.reshape(n, *p.shape)
            arr = self.arrays[p.name]
            if idx is None:  # one run of consecutive slots: a slice update
                s0 = runs[0][0]
                arr[s0 : s0 + n] = src
            else:  # scattered slots: one scatter per part
                arr[idx] = src
            self.write_ops += 1

    def place(self, slot: int, record: np.ndarray) -> None:
        """Copy one staged record's parts into ``slot`` (host mode, O_DIRECT staging)."""
        for p in self.layout.parts:
            self._rows[p.name][slot] = record[p.offset : p.offset + p.nbytes]

    # ---------------------------------------------------------------- all modes
    def slots_of(self, experts: np.ndarray) -> np.ndarray:
        """The slot of each expert id in ``experts`` (host copy of the lookup table;
        valid for resident experts)."""
        return self._lut_host[experts]

    def set_lut(self, experts, slots) -> None:
        """Point ``lut[experts]`` at ``slots``."""
        e = np.asarray(experts, dtype=np.int64)
        s = np.asarray(slots, dtype=np.int32)
        self._lut_host[e] = s
        # slot e holds expert e everywhere: only possible with a slot per expert
        self.identity = self.slots >= len(self._arange) and bool(
            np.array_equal(self._lut_host, self._arange)
        )
        if self.mode == "cuda":  # copied over when the device path next needs it
            self._lut_stale = True
        elif self.mode == "mlx":
            self.lut[mx.array(e.astype(np.int32))] = mx.array(s)
        self.writes += len(e)

    def state(self) -> list[mx.array]:
        """Arrays to evaluate to settle pending MLX writes."""
        return [*self.arrays.values(), self.lut]


_ADDRESS = []  # the address kernel, built on first use


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
                source="if (threadIdx.x == 0) p[0] = (unsigned long long)(a);",
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
        raise ValueError(f"MLX gave a pool buffer in CUDA memory of type {kind}, not device memory")
    return addr


def cuda_self_test(pool: LayerPool) -> None:
    """Copy a pattern into slot 0 with the CUDA path and read it back through MLX."""
    lay = pool.layout
    row = cuda.pinned(lay.stride)
    row[:] = np.arange(lay.stride, dtype=np.uint64).astype(np.uint8)
    half = lay.record_bytes // 2 + 1  # two pieces, the cut inside a part
    pool.copy_range(0, row, 0, half)
    pool.copy_range(0, row, half, lay.record_bytes)
    for p in lay.parts:  # read back a computed copy, never the pool's own buffer
        got = np.array(pool.arrays[p.name][0].view(mx.uint8) * 1).reshape(-1)
        if not np.array_equal(got, row[p.offset : p.offset + p.nbytes]):
            raise RuntimeError(f"read back wrong bytes for {p.name}")
    pool.copy_range(0, np.zeros(lay.stride, np.uint8), 0, lay.record_bytes)


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


def make_pools(meta, caps: dict, mode: str | None, zero_slot: bool) -> dict[int, LayerPool]:
    """The layers' pools (a layer with every expert's slot gets no zero slot); an
    automatic ``cuda`` choice that fails its self-test (a record copied in and read back
    through MLX) falls back to ``mlx``."""
    auto = mode is None
    mode = mode or default_mode()

    def make(m):
        return {
            li: LayerPool(meta.layers[li], c, m, zero_slot and c < meta.layers[li].num_experts)
            for li, c in caps.items()
        }

    try:
        pools = make(mode)
        if mode == "cuda":
            cuda_self_test(next(iter(pools.values())))
        return pools
    except Exception as e:  # noqa: BLE001
        if not (auto and mode == "cuda"):
            raise
        warnings.warn(f"CUDA slot copies unavailable ({e}); using MLX updates", stacklevel=3)
        return make("mlx")


def _check_count(what: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ExpertDirError(f"{what} must be a positive integer, got {v!r}")
