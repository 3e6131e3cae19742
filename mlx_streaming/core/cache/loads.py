"""Loading experts into reserved slots: the reader's reads, and the commit that makes
them resident (or the abort that frees their slots).

A ``Loader`` serves one store. ``begin`` reserves slots for the misses among a call's
experts and starts their reads at once (``reader.start``: the store's one reader, whose
reads check each record's checksum on its first read); ``Ticket.wait`` finishes a load.
Read-aheads (``prefetch``) are tickets finished by the layer's next call. A slot is marked
resident only once its bytes are in place and checked (the device reader: once its copy
is queued on MLX's stream, ahead of every computation that reads the slot). Before a
pool's slots are written, the lazy outputs still reading that pool are evaluated
(``Outputs``).
"""

from __future__ import annotations

import contextlib
import time
import warnings

import mlx.core as mx
import numpy as np

from ..format import ExpertMeta
from ..io.futures import Done
from .pool import LayerPool
from .slots import SlotCache
from .stats import LayerStats

TRACK_EVAL_BYTES = 1 << 20  # outputs larger than this are evaluated, not held


class Outputs:
    """Lazy outputs that read each layer's pool, evaluated before the pool is next
    written outside MLX's graph: host pools by the reader's threads, cuda pools by the
    native reader's own CUDA streams."""

    def __init__(self, layers):
        self._lazy: dict[int, list[mx.array]] = {li: [] for li in layers}

    def track(self, layer: int, y: mx.array) -> None:
        if y.nbytes > TRACK_EVAL_BYTES:  # a long prompt's output: evaluate it now rather
            mx.eval(y)  # than hold its buffer until the pool is next written
            return
        lazy = self._lazy[layer]
        lazy.append(y)
        if len(lazy) > 8:  # calls that wrote nothing: evaluate the older ones
            mx.eval(lazy[:-1])
            del lazy[:-1]

    def evaluate(self, layer: int) -> None:
        """Evaluate the outputs still reading ``layer``'s pool."""
        if self._lazy[layer]:
            mx.eval(self._lazy[layer])  # already evaluated in the usual flow: free
            self._lazy[layer].clear()


class Ticket:
    """A load in flight: slots reserved, reads started. ``wait`` finishes it."""

    def __init__(self, loader: Loader, layer, experts, misses, placed, future, prefetch):
        self.layer, self.experts, self.misses, self.placed = layer, experts, misses, placed
        self.future, self.prefetch = future, prefetch
        self.done = False
        self.late = False  # still reading when a later load had to wait for it
        self.error: BaseException | None = None  # a failed load fails every wait
        self.restore = False  # a failed load's victims are back in their slots
        self._loader = loader

    def wait(self) -> int:
        """Finish the load (commit, or abort and raise); returns the misses loaded."""
        if not self.done:
            self.done = True
            try:
                self._loader.finish(self)
            except BaseException as e:
                self.error = e
                raise
        if self.error is not None:  # e.g. finished by finish_open for a later load
            raise self.error
        return len(self.misses)


class Loader:
    """The loading half of a store, over its slot tables, pools and reader."""

    def __init__(
        self,
        meta: ExpertMeta,
        caches: dict[int, SlotCache],
        pools: dict[int, LayerPool],
        reader,
        stats: dict[int, LayerStats],
        clear_on_evict: bool,
    ):
        self.meta, self.caches, self.pools, self.reader = meta, caches, pools, reader
        self.stats, self.clear_on_evict = stats, clear_on_evict
        self.outputs = Outputs(caches)
        self._inflight: dict[int, list[Ticket]] = {li: [] for li in caches}  # read-aheads
        self._started: Ticket | None = None  # the latest load, maybe not yet finished
        self._warned_read_ahead = False
        tier = getattr(reader, "tier", None)
        if tier is not None:  # a bounded tier drops the record its layer looked up least
            tier.heat = lambda li: caches[li].heat

    def begin(self, layer: int, experts: np.ndarray) -> Ticket:
        """Start making distinct ``experts`` resident (they must fit): reserve slots and
        start the reads. ``Ticket.wait()`` finishes; until then only the experts that were
        already resident (``ticket.misses`` excluded) may be used."""
        self.finish_open()
        cache = self.caches[layer]
        _, misses = cache.split(experts)
        load = misses
        if cache.whole:  # room for all: load the whole layer once
            load = cache.split(np.arange(cache.num_experts))[1]
        placed = []
        if len(load):
            placed = cache.reserve(sorted(load.tolist()), protect=experts)
        return self._issue(layer, experts, misses, placed, prefetch=False)

    def adopt(self, layer: int, experts: np.ndarray) -> None:
        """Make ``experts`` resident in slots 0, 1... as the reader filled them at load (a
        swap tier: its pools are full from the start)."""
        cache = self.caches[layer]
        placed = cache.reserve(np.asarray(experts).tolist(), protect=np.zeros(0, np.int64))
        assert [s for _, s, _ in placed] == list(range(len(experts))), "a fresh table"
        cache.commit(placed)
        self.pools[layer].set_lut(np.asarray(experts), np.arange(len(experts)))

    def finish_open(self) -> None:
        """Finish the latest started load, if still open: a read-ahead still reading (the
        reader takes one started read at a time), or the load of a call that raised
        before waiting. Its slots are committed or freed before any new reservation (or
        before the device path takes the table)."""
        t, self._started = self._started, None
        if t is not None and not t.done:
            t.late = not t.future.done()  # a read-ahead a later load had to wait for
            with contextlib.suppress(Exception):  # its call has already raised
                t.wait()

    def flush(self, layer: int) -> None:
        """Apply ``layer``'s queued policy updates now (see ``SlotCache.flush``)."""
        self.caches[layer].flush()

    def fetch(self, layer: int, experts: np.ndarray) -> int:
        """Make distinct ``experts`` resident now; returns the number of misses loaded."""
        return self.begin(layer, experts).wait()

    def prefetch(self, layer: int, experts, limit: int | None = None) -> int:
        """Read ahead experts a coming call of ``layer`` is expected to need, into free
        or evictable slots (never pinned ones, nor ``experts`` themselves), at most
        ``limit`` and one of the reader's waves (where it has one). Best effort: as many
        as fit; the next call of the layer finishes them. Returns how many were issued."""
        self.finish_open()
        cache = self.caches[layer]
        experts = np.asarray(experts, dtype=np.int64)
        todo = [int(e) for e in experts if cache.slot_of[e] < 0 and e not in cache.pending]
        if not todo:
            return 0
        wave = getattr(self.reader, "wave", None)
        limit = min(x for x in (limit, wave, len(todo)) if x is not None)  # a limit: best effort
        placed = cache.reserve(todo, protect=np.unique(experts), limit=limit)
        if not placed:
            return 0
        t = self._issue(layer, experts, np.array([e for e, _, _ in placed]), placed, prefetch=True)
        self._inflight[layer].append(t)
        st = self.stats[layer]
        st.prefetched += len(placed)
        st.prefetch_bytes += len(placed) * self.meta.layers[layer].record_bytes
        return len(placed)

    def pin(self, layer: int, ids: np.ndarray) -> None:
        """Load distinct ``ids`` now (the caller then pins them)."""
        self.finish_open()  # as begin and prefetch: no abandoned load under a reservation
        self.finish_read_aheads(layer)
        cache = self.caches[layer]
        _, misses = cache.split(ids)
        placed = cache.reserve(misses, protect=ids)
        self._issue(layer, ids, misses, placed, prefetch=True).wait()

    def finish_read_aheads(self, layer: int, needed: np.ndarray | None = None) -> None:
        """Finish this layer's read-aheads; count those ``needed`` now."""
        if not self._inflight[layer]:
            return
        tickets, self._inflight[layer] = self._inflight[layer], []
        need = set() if needed is None else set(needed.tolist())
        st = self.stats[layer]
        for t in tickets:
            on_time = t.future.done() and not t.late
            try:
                t.wait()
            except Exception as e:  # noqa: BLE001 - a failed read-ahead is retried on demand
                st.prefetch_failed += len(t.placed)
                if not self._warned_read_ahead:
                    self._warned_read_ahead = True
                    warnings.warn(
                        f"a read-ahead of layer {layer} failed ({e}); its experts are read "
                        "on demand when needed (counted in prefetch_failed; warned once)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                continue
            used = need.intersection(t.misses.tolist())
            st.prefetch_used += len(used)
            st.prefetch_on_time += len(used) if on_time else 0

    def _issue(self, layer, experts, misses, placed, prefetch) -> Ticket:
        """Start the reads of ``placed`` ((expert, slot, victim) reservations)."""
        if not placed:
            return Ticket(self, layer, experts, misses, placed, Done(0), prefetch)
        tier = getattr(self.reader, "tier", None)  # a swap tier's victims stay in their
        moves = tier.moves if tier is not None else None  # slots until a move begins
        restore = False
        try:
            self.finish_open()  # the reader takes one started read at a time
            self.outputs.evaluate(layer)  # nothing queued still reads the slots written now
            t0 = time.perf_counter()
            try:
                fut = self.reader.start(
                    layer, [e for e, _, _ in placed], [s for _, s, _ in placed]
                )  # fmt: skip
            except Exception as e:  # noqa: BLE001 - raised by Ticket.wait, after the abort
                fut, restore = Done(error=e), tier is not None and tier.moves == moves
        except BaseException:  # e.g. an interrupt (a read the files' reader still holds
            # lands before the tier's next trades: SwapTier.take)
            self._abort(layer, placed, restore=tier is not None and tier.moves == moves)
            raise
        t = Ticket(self, layer, experts, misses, placed, fut, prefetch)
        t.restore = restore  # the victims go back to their untouched slots on failure
        self._started = t  # finished by its caller, or before the next load
        if fut.done() and not prefetch:  # read before start returned (over a wave, inline)
            self.stats[layer].read_s += time.perf_counter() - t0
        return t

    def _abort(self, layer: int, placed, restore: bool) -> None:
        """A load failed: its slots are freed, or with ``restore`` hold their victims
        again. A swap tier's trades that moved are kept (the tier says where their
        records went: freed, a whole tier would find them in no slot it is given)."""
        tier, kept = getattr(self.reader, "tier", None), []
        if tier is not None and not restore and not tier.broken:
            kept = [p for p in placed if tier.held[layer][p[1]] == p[0]]
        if kept:
            self.pools[layer].set_lut([e for e, _, _ in kept], [s for _, s, _ in kept])
            self.caches[layer].commit(kept)
        self.caches[layer].abort([p for p in placed if p not in kept], restore)

    def finish(self, t: Ticket) -> None:
        """Commit a load's slots once its reads have landed (abort them if one failed)."""
        t0 = time.perf_counter()
        cache, pool, st = self.caches[t.layer], self.pools[t.layer], self.stats[t.layer]
        try:
            nbytes = t.future.result()
        except BaseException:
            self._abort(t.layer, t.placed, t.restore)  # no slot resident with bad bytes
            raise
        if t.placed:
            pool.set_lut([e for e, _, _ in t.placed], [s for _, s, _ in t.placed])
        cache.commit(t.placed)
        if not t.prefetch:
            cache.access(t.experts, len(t.misses))
            if any(v >= 0 for _, _, v in t.placed) and self.clear_on_evict:
                mx.clear_cache()
        st.bytes_read += nbytes
        st.records_read += len(t.placed)
        if not t.prefetch:  # the time the caller waited for what was left of the reads
            st.read_s += time.perf_counter() - t0
