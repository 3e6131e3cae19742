"""A swap tier: the experts a layer's pool does not hold, in host memory (page-locked and
mapped into the device's address space on CUDA), read from the expert files once, at load.

Each record lives in one place: a pool slot, or a tier slot (its ``home``). The pool is
full from load (slot ``s`` holds expert ``s``), so every miss has a victim, and a miss is
a trade: the miss's record comes into the victim's slot and the victim's goes out to the
tier slot the miss leaves, its new home. Pools and tier hold the model once; no miss reads
the disk after load. The tier knows where records are, not why they move (the slot tables
and the policy decide). On CUDA the GPU moves the bytes (``DeviceReader`` over the tier:
the ``SWAP`` variant of ``mlxs_copy``, on both paths); elsewhere ``TierReader`` moves them
on the host. On unified memory a bigger pool does better for the same memory; the host
variant exists so that the tier's bookkeeping runs, and is tested, on any machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

import numpy as np

from ..format import ExpertChecksumError, record_checksum
from .futures import Done

MARGIN = 1 << 30  # host memory the tier leaves to the rest of the process


class TierError(RuntimeError):
    """The swap tier cannot say where a record is (the message says why); the model must
    be loaded again."""


class SwapTier:
    """Each layer's records outside its pool, and where every record is.

    Args:
        meta: The expert directory's ``ExpertMeta``.
        pools: ``{layer: LayerPool}``, empty: the tier fills slot ``s`` with expert ``s``.
        cuda: The CUDA runtime module (``io.cuda``) for page-locked, device-mapped memory
            and copies into cuda pools, or None (host pools).
        checksums: Check each record as it is read.
        available: Bytes of host memory the tier may take (default: the machine's
            available memory, ``mem.machine_memory``).

    ``home[layer][e]``: the tier slot holding expert ``e`` (-1 while it is in a pool slot);
    ``held[layer][s]``: the expert whose record pool slot ``s`` holds.

    Raises:
        MemoryError: the tier would not fit in ``available`` (saying both sizes).
        OSError: a file cannot be read, or is short (naming it).
        ExpertChecksumError: a corrupt record (naming the file and the expert).
    """

    def __init__(self, meta, pools: dict, cuda=None, checksums: bool = True, available=None):
        self.meta, self.pools, self._cuda = meta, pools, cuda
        need = sum(
            max(0, meta.layers[li].num_experts - p.slots) * meta.layers[li].stride
            for li, p in pools.items()
        )
        if available is None:
            from ..mem import machine_memory

            available = machine_memory()[1]
        self._short = (
            f"the swap tier needs {need / 1e9:.2f} GB of host memory (the experts the pools "
            f"do not hold) and {MARGIN / 1e9:.2f} GB left to the process beside it, and "
            f"{available / 1e9:.2f} GB are available: give the pools more (--slots, "
            "--budget-gb) or drop --swap-tier"
        )
        if need + MARGIN > available:
            raise MemoryError(self._short)
        self.broken: str | None = None
        self.home: dict[int, np.ndarray] = {}
        self.held: dict[int, np.ndarray] = {}
        self.slabs: dict[int, np.ndarray] = {}  # [tier slots, stride] bytes per layer
        self.sources: dict[int, int] = {}  # each slab's address (the device's, on CUDA)
        self.nbytes = 0
        try:
            for li in sorted(pools):
                self._load(li, checksums)
            if cuda is not None:  # the pools' pageable copies have landed, on any stream
                cuda.device_synchronize()
        except BaseException:
            self.close()
            raise

    def _load(self, li: int, checksums: bool) -> None:
        lay, pool = self.meta.layers[li], self.pools[li]
        n, slots = lay.num_experts, min(pool.slots, lay.num_experts)
        nbytes = (n - slots) * lay.stride
        if self._cuda is not None:
            try:
                flat, self.sources[li] = self._cuda.shared_host(nbytes)
            except Exception as e:  # page-locked memory is scarcer than memory
                raise MemoryError(f"{self._short} ({e})") from e
        else:
            flat = np.zeros(nbytes, np.uint8)
            self.sources[li] = flat.ctypes.data
        self.slabs[li] = slab = flat.reshape(n - slots, lay.stride)
        self.nbytes += nbytes
        self.held[li] = np.arange(slots, dtype=np.int32)
        self.home[li] = home = np.full(n, -1, np.int32)
        home[slots:] = np.arange(n - slots)
        path, staging = self.meta.file(li), np.empty(lay.stride, np.uint8)
        with open(path, "rb") as f:
            for e in range(n):
                row = slab[home[e]] if home[e] >= 0 else staging
                got = os.preadv(f.fileno(), [memoryview(row)], e * lay.stride)
                if got < lay.record_bytes:
                    raise OSError(
                        f"{path}: expert {e} of layer {li} is cut short ({got} of "
                        f"{lay.record_bytes} bytes): split the model again"
                    )
                if checksums and lay.checksums:
                    if record_checksum(row[: lay.record_bytes]) != lay.checksums[e]:
                        raise ExpertChecksumError(
                            f"expert {e} of layer {li} in {path} fails its checksum: the "
                            "file is corrupt; split the model again"
                        )
                if home[e] < 0:
                    self._into_slot(li, e, row)

    def _into_slot(self, li: int, slot: int, record: np.ndarray) -> None:
        """Copy ``record``'s parts into pool slot ``slot`` (at load)."""
        pool = self.pools[li]
        for p, (addr, row) in zip(pool.layout.parts, pool.row_pointers()):
            src = record.ctypes.data + p.offset
            if self._cuda is not None:
                self._cuda.copy_now(addr + slot * row, src, p.nbytes)
            else:
                ctypes.memmove(addr + slot * row, src, p.nbytes)

    def plan(self, layer: int, experts, slots) -> list[tuple[int, int, int]]:
        """The trades that bring ``experts`` into pool ``slots``: ``(expert, tier row,
        slot)``, in order. An expert whose record is already in its slot (left there when
        a load failed before its trade and its slot was freed) needs none. Changes
        nothing: ``moved`` updates the tables once the bytes have moved.

        Raises:
            TierError: the tier is broken (a trade was interrupted part way), or an
                expert is neither in the tier nor in its slot; the model must be loaded
                again.
        """
        if self.broken:
            raise TierError(self.broken)
        home, held = self.home[layer], self.held[layer]
        out = []
        for e, s in zip(np.asarray(experts).tolist(), np.asarray(slots).tolist()):
            h = int(home[e])
            if h >= 0:
                out.append((e, h, s))
            elif held[s] != e:
                raise TierError(
                    f"layer {layer}: expert {e} is in neither the swap tier nor slot {s} "
                    "(a defect: please report it); load the model again"
                )
        return out

    def moved(self, layer: int, trades) -> None:
        """The tables after ``trades`` (``plan``'s) moved their bytes: each slot's
        record (its victim) takes the home of the expert that took its place."""
        home, held = self.home[layer], self.held[layer]
        for e, h, s in trades:
            v = int(held[s])
            home[e], held[s] = -1, e
            if v >= 0:
                home[v] = h

    @contextlib.contextmanager
    def moving(self):
        """Around a move of bytes and its ``moved``: interrupted part way (an error, a
        Ctrl-C), the tables no longer say where the records are, and every later
        ``plan`` refuses, rather than serve the wrong bytes."""
        try:
            yield
        except BaseException as e:
            self.broken = (
                f"the swap tier lost track of its records when a trade was interrupted "
                f"({type(e).__name__}); load the model again"
            )
            raise

    def trade_on_host(self, layer: int, trades) -> None:
        """Exchange the tier rows and host pool slots of ``trades`` (``plan``'s), part by
        part."""
        slab, pool = self.slabs[layer], self.pools[layer]
        for _, h, s in trades:
            for p, (addr, row) in zip(pool.layout.parts, pool.row_pointers()):
                cell = (ctypes.c_uint8 * p.nbytes).from_address(addr + s * row)
                slot = np.frombuffer(cell, np.uint8)
                there = slab[h, p.offset : p.offset + p.nbytes]
                kept = slot.copy()
                slot[:] = there
                there[:] = kept

    def close(self) -> None:
        """Let go of the slabs (freed with their arrays; idempotent)."""
        self.slabs, self.sources, self.nbytes = {}, {}, 0


class TierReader:
    """The store's reader over a ``SwapTier`` of host pools: each miss trades places with
    its victim, on the calling thread."""

    wave = None  # any number of records per start

    def __init__(self, tier: SwapTier):
        self.tier = tier

    @property
    def mapped_bytes(self) -> int:
        return self.tier.nbytes

    def start(self, layer: int, experts, slots) -> Done:
        """Trade ``experts`` into ``slots`` now; the result is the bytes brought in.

        Raises:
            TierError: see ``SwapTier.plan`` (nothing moved).
        """
        trades = self.tier.plan(layer, experts, slots)
        with self.tier.moving():
            self.tier.trade_on_host(layer, trades)
            self.tier.moved(layer, trades)
        return Done(len(trades) * self.tier.meta.layers[layer].record_bytes)

    def read_gbps(self) -> float:
        return 0.0  # nothing is read from the disk after load

    def reset_counters(self) -> None:
        pass

    def close(self) -> None:
        self.tier.close()
