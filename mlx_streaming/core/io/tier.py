"""A swap tier: the experts a layer's pool does not hold, in host memory (page-locked and
mapped into the device's address space on CUDA), filled from the expert files once, at
load, by the store's file reader (``cache.readers.fill_tier``: the tier reads nothing).

Each record lives in one place: a pool slot, or a tier slot (its ``home``). The pool is
full from load (slot ``s`` holds expert ``s``), so every miss has a victim, and a miss is
a trade: the miss's record comes into the victim's slot and the victim's goes out to the
tier slot the miss leaves, its new home. Pools and tier hold the model once; no miss reads
the disk after load. The tier knows where records are, not why they move (the slot tables
and the policy decide). On CUDA the GPU moves the bytes (``DeviceReader`` over the tier:
the ``SWAP`` variant of ``mlxs_copy``, on both paths); elsewhere ``TierReader``
(``tier_reader``) moves them on the host. On unified memory a bigger pool does better for
the same memory; the host variant exists so that the tier's bookkeeping runs, and is
tested, on any machine.

A tier given fewer bytes than the rest (``rows``) holds the records the pools gave up
last: a miss outside it is read from its file (the store's own reader, ``TierReader``'s
``files``), its victim going out to the row of the tier's coldest record (the slot
tables' ``heat``, given by the store's loader; the oldest written of equals), whose
record is dropped (it is in its file). This is the exclusive host tier
``planning.tiers`` models.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable

import numpy as np

from .futures import Done
from .tier_moves import Moves, TierError, bounded_rows, plan_moves

# host memory the tier leaves to what the process allocates after it is sized (on CUDA
# the pools and KV cache live on the GPU; DS2-Lite at 25% in a 6 GB cgroup held 0.30 GB
# as an auto tier was sized, 0.56 GB loaded and 0.97 GB decoding: 512 MiB was OOM-killed)
MARGIN = 1 << 30


class SwapTier:
    """Each layer's records outside its pool, and where every record is.

    Args:
        meta: The expert directory's ``ExpertMeta``.
        pools: ``{layer: LayerPool}``, empty: the fill reads expert ``s`` into slot ``s``.
        cuda: The CUDA runtime module (``io.cuda``) for page-locked, device-mapped memory
            (the pools are cuda pools), or None (host pools).
        available: Bytes of host memory the tier may take (default: the machine's
            available memory, ``mem.machine_memory``).
        limit: Bytes the tier may hold (default: every record the pools do not), or
            ``"auto"``: as many as ``available`` holds beside ``MARGIN`` and ``reserve``.
        reserve: Bytes of host memory the load still takes after the tier, beside the
            ``MARGIN`` (the trunk as it loads and, off CUDA, the KV cache:
            ``model_builder.host_reserve``; the staging of the reader of the files
            beyond an ``auto`` tier).

    ``home[layer][e]``: the tier slot holding expert ``e`` (-1 while it is in a pool slot);
    ``held[layer][s]``: the expert whose record pool slot ``s`` holds.

    Raises:
        MemoryError: the tier would not fit in ``available`` (saying both sizes).
    """

    def __init__(
        self,
        meta,
        pools: dict,
        cuda=None,
        available=None,
        limit=None,
        reserve: int = 0,
    ):
        self.meta, self.pools, self._cuda = meta, pools, cuda
        slots = {li: p.slots for li, p in pools.items()}
        rest, (full, one) = tier_rows(meta, slots), tier_bytes(meta, slots)
        if available is None:
            from ..mem import machine_memory

            available = machine_memory()[1]
        auto = isinstance(limit, str)  # "auto": what the available memory holds
        if auto:
            limit = max(0, available - MARGIN - reserve)
        self.rows = bounded_rows(rest, {li: lay.stride for li, lay in meta.layers.items()}, limit)
        self.partial = any(self.rows[li] < n for li, n in rest.items())
        need = rows_bytes(meta, self.rows)
        trunk = (f", {reserve / 1e9:.2f} GB of them for the rest of the load (the trunk; off "
                 "CUDA, an auto tier's KV cache of --context tokens; beside an auto tier, the "
                 "staging of the reads beyond it: on CUDA the request ring's and a record)"
                 if reserve else "")  # fmt: skip
        self._short = (
            f"the swap tier needs {need / 1e9:.2f} GB of host memory (the experts the pools "
            f"do not hold) and {(MARGIN + reserve) / 1e9:.2f} GB left to the process beside "
            f"it{trunk}, and {available / 1e9:.2f} GB are available: give the pools more "
            "(--slots, --budget-gb), bound the tier (--swap-tier-gb) or go without it "
            "(--no-swap-tier)"
        )
        if auto and full and not need:  # less room than a record for each layer
            raise MemoryError(
                f"no room for a swap tier: {available / 1e9:.2f} GB available, "
                f"{(MARGIN + reserve) / 1e9:.2f} GB of them left to the process{trunk}, and "
                f"a record for each layer takes {one / 1e9:.2f} GB: give it more memory, a "
                "shorter --context (off CUDA), or go without it (--no-swap-tier)"
            )
        if full and not fits_beside(need, reserve, available):  # (pools may hold them all)
            raise MemoryError(self._short)
        self.broken: str | None = None
        self.moves = 0  # moves begun (``moving``)
        self.traded_bytes = 0  # bytes brought into the pools by trades (``take``'s), since
        # the readers' ``reset_counters`` (as the store's ``bytes_read``)
        self.home: dict[int, np.ndarray] = {}
        self.held: dict[int, np.ndarray] = {}
        self.owner: dict[int, np.ndarray] = {}  # the expert in each tier row (-1: none)
        self.stamp: dict[int, np.ndarray] = {}  # when each row was written (for eviction)
        self._clock = 0
        # each layer's heat per expert (the slot tables': ``SlotCache.heat``, which the
        # store's loader gives it): a full bounded tier drops its coldest record first,
        # the oldest written of equals (until then all are equal: the oldest)
        self.heat: Callable[[int], list] = lambda li: [0.0] * meta.layers[li].num_experts
        self.slabs: dict[int, np.ndarray] = {}  # [tier slots, stride] bytes per layer
        self.sources: dict[int, int] = {}  # each slab's address (the device's, on CUDA)
        self.nbytes = 0
        try:
            for li in sorted(pools):
                self._alloc(li)
        except BaseException:
            self.close()
            raise

    def _alloc(self, li: int) -> None:
        lay, pool = self.meta.layers[li], self.pools[li]
        n, slots, rows = lay.num_experts, min(pool.slots, lay.num_experts), self.rows[li]
        nbytes = rows * lay.stride
        if self._cuda is not None:
            try:
                flat, self.sources[li] = self._cuda.shared_host(nbytes)
            except Exception as e:  # page-locked memory is scarcer than memory
                raise MemoryError(f"{self._short} ({e})") from e
        else:
            flat = np.zeros(nbytes, np.uint8)
            self.sources[li] = flat.ctypes.data
        self.slabs[li] = flat.reshape(rows, lay.stride)
        self.nbytes += nbytes
        self.held[li] = np.arange(slots, dtype=np.int32)
        self.home[li] = home = np.full(n, -1, np.int32)
        home[slots : slots + rows] = np.arange(rows)
        self.owner[li] = np.arange(slots, slots + rows, dtype=np.int32)
        self.stamp[li] = np.zeros(rows, np.int64)

    def row_pools(self) -> dict:
        """Each layer's tier rows as a reader sees a pool (``TierRows``): what fills them
        at load (``cache.readers.fill_tier``) reads ``owner[layer]`` into rows 0, 1, ...
        Layers without rows are left out."""
        return {li: TierRows(slab, self.meta.layers[li]) for li, slab in self.slabs.items()
                if len(slab)}  # fmt: skip

    def plan(self, layer: int, experts, slots) -> Moves:
        """What brings ``experts`` into pool ``slots``, as ``Moves``: trades of tier rows
        and slots (a miss from the tier, or a victim going out to a row whose record is
        dropped), then reads from the files (misses outside a partial tier). An expert
        whose record is already in its slot (left there when a load failed before its
        trade and its slot was freed) needs none. Changes nothing: ``moved`` sets the
        tables once the bytes have moved.

        Raises:
            TierError: the tier is broken (a trade was interrupted part way), or (a whole
                tier) an expert is neither in the tier nor in its slot; the model must be
                loaded again.
        """
        if self.broken:
            raise TierError(self.broken)
        # as lists: a call's few ids one at a time (numpy's cold calls cost tens of µs)
        tables = [t[layer].tolist() for t in (self.home, self.held, self.owner, self.stamp)]
        heat = lambda: self.heat(layer)  # noqa: E731
        return plan_moves(layer, tables, self._clock, experts, slots, heat, self.partial)

    def moved(self, layer: int, moves: Moves) -> None:
        """The tables once ``moves`` (``plan``'s) have moved their bytes."""
        home, held, owner, stamp = moves.tables
        self.home[layer][:], self.held[layer][:] = home, held
        self.owner[layer][:], self.stamp[layer][:] = owner, stamp
        self._clock = moves.clock

    def placed(self, layer: int, home, held, owner=None, stamp=None, clock: int = 0) -> None:
        """The tables as another mover left them (the device path's plan kernel): ``home``
        and ``held``; a whole tier's row owners follow from them, a bounded tier's come
        with their ``stamp`` and the mover's ``clock`` (the tier's own then runs on from
        the later of the two, so that rows written later still rank later)."""
        self.home[layer][:], self.held[layer][:] = home, held
        if owner is not None:
            self.owner[layer][:], self.stamp[layer][:] = owner, stamp
            self._clock = max(self._clock, int(clock))
            return
        owner = self.owner[layer]
        owner[:] = -1
        away = np.flatnonzero(home >= 0)  # the experts in the tier
        owner[home[away]] = away

    @property
    def clock(self) -> int:
        """The tier's clock: the stamp its next write takes, less one."""
        return self._clock

    def take(self, layer: int, experts, slots, move, files):
        """Bring ``experts`` into ``slots``: ``plan``, ``move(layer, trades)`` the trades'
        bytes (done, or queued ahead of whatever ``files`` copies: on CUDA both on MLX's
        stream), ``moved``, then the reads of the rest (``read_rest``), which land in
        their slots after the trades (the victims are out first). The one sequence of
        every reader over the tier.

        Raises:
            TierError: see ``plan`` (nothing moved).
        """
        moves = self.plan(layer, experts, slots)
        if files is not None:  # a read it still holds (its caller interrupted) lands first
            files.wait_started()
        with self.moving():
            if moves.trades:
                move(layer, moves.trades)
            self.moved(layer, moves)
        traded = moves.brought * self.meta.layers[layer].record_bytes
        self.traded_bytes += traded
        return self.read_rest(layer, moves, files, traded)

    def read_rest(self, layer: int, moves: Moves, files, traded: int):
        """Start ``moves``' reads from the files with ``files`` (the store's file reader;
        on CUDA the request ring's, ``device_reader.RingReads``): a future of their bytes
        plus ``traded``. The read slots' records are known to the tables only once the
        reads have landed (until then, and after a failure or an interrupt, -1: unknown)."""
        if not moves.reads:
            return Done(traded)
        experts, slots = (list(x) for x in zip(*moves.reads))

        def landed():
            self.held[layer][slots] = experts

        return _Reads(files.start(layer, experts, slots), traded, landed)

    @contextlib.contextmanager
    def moving(self):
        """Around a move of bytes and its ``moved``: interrupted part way (an error, a
        Ctrl-C), the tables no longer say where the records are, and every later
        ``plan`` refuses, rather than serve the wrong bytes."""
        self.moves += 1  # the loader restores a failed load's victims only if unchanged
        try:
            yield
        except BaseException as e:
            self.broken = (
                f"the swap tier lost track of its records when a trade was interrupted "
                f"({type(e).__name__}); load the model again"
            )
            raise

    def trade_on_host(self, layer: int, trades) -> None:
        """Exchange the tier rows and host pool slots of ``trades`` (``Moves.trades``),
        part by part."""
        slab, pool = self.slabs[layer], self.pools[layer]
        for h, s in trades:
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


def staging_beside(meta, ring: bool) -> int:
    """Bytes of host memory a bounded tier leaves beside it for the staging of the reads
    beyond it: the files' native reader's wave, or on CUDA (``ring``) ``ring_records``."""
    from . import engine_lib

    if not ring:
        return engine_lib.staging(meta)[1]
    return ring_records() * max((lay.stride for lay in meta.layers.values()), default=0)


def ring_records() -> int:
    """Records of staging beside a bounded tier on CUDA: the request ring's entries
    (``io.ring.DEVICE_ENTRIES``, read when called), through which both paths read, and
    the files' reader's one (its own reads are never started: ``cache.readers``)."""
    from . import ring

    return ring.DEVICE_ENTRIES + 1


def tier_bytes(meta, slots: dict[int, int]) -> tuple[int, int]:
    """Host bytes of a whole tier beside pools of ``slots``, and of its least bounded
    form (a record for each layer whose pool lacks one)."""
    rest = tier_rows(meta, slots)
    return rows_bytes(meta, rest), rows_bytes(meta, {li: min(1, n) for li, n in rest.items()})


def fits_beside(need: int, reserve: int, available: int) -> bool:
    """Whether ``need`` bytes of tier fit in ``available`` beside ``MARGIN`` and
    ``reserve`` (the one test, for ``runtime.resolve`` and the tier itself)."""
    return need + MARGIN + reserve <= available


def tier_rows(meta, slots: dict[int, int]) -> dict[int, int]:
    """Each layer's rows in a whole tier: every expert its pool of ``slots`` does not hold."""
    return {li: max(0, meta.layers[li].num_experts - s) for li, s in slots.items()}


def rows_bytes(meta, rows: dict[int, int]) -> int:
    """Host bytes of ``rows`` tier rows per layer (each a record's stride)."""
    return sum(n * meta.layers[li].stride for li, n in rows.items())


def tier_totals(reader, bytes_read: int) -> dict:
    """A store's swap tier in its totals: its host memory, and of ``bytes_read`` (reads
    and trades) those read from the files (none after load with a whole tier, whose
    misses the device path may trade on the GPU)."""
    tier = getattr(reader, "tier", None)
    if tier is None:
        return {"swap_tier_bytes": 0, "file_bytes_read": bytes_read}
    files = bytes_read - tier.traded_bytes if tier.partial else 0
    return {"swap_tier_bytes": tier.nbytes, "file_bytes_read": max(0, files)}


class _Reads:
    """A file reader's future whose result adds the bytes traded before it; once the
    reads have landed, the tier hears of it (``landed``)."""

    def __init__(self, future, traded: int, landed):
        self.future, self.traded, self.landed = future, traded, landed

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout=None) -> int:
        n = self.future.result() if timeout is None else self.future.result(timeout)
        if self.landed is not None:
            self.landed()
            self.landed = None
        return n + self.traded


class TierRows:
    """A layer's tier rows as the readers see a pool: ``slots`` rows a stride apart, each
    record's parts at their offsets in the file (``row_pointers`` for the compiled reader,
    ``record_bufs`` for the Python one)."""

    def __init__(self, slab: np.ndarray, lay):
        self.slab, self.slots, self.record_bytes = slab, slab.shape[0], lay.record_bytes
        base = slab.ctypes.data
        self._pointers = [(base + p.offset, lay.stride) for p in lay.parts]

    def row_pointers(self) -> list[tuple[int, int]]:
        return self._pointers

    def record_bufs(self, row: int) -> list[memoryview]:
        return [memoryview(self.slab[row])[: self.record_bytes]]
