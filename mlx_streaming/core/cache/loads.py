"""Loading experts into reserved slots: reads on the reader's threads, checksums, and
the commit that makes them resident (or the abort that frees their slots).

A ``Loader`` serves one store. ``begin`` reserves slots for the misses among a call's
experts and issues their reads at once (straight into slot rows in host mode, else
through staging rows); ``Ticket.wait`` finishes a load. Read-aheads (``prefetch``) are
tickets settled by the layer's next call. A slot is marked resident only once its bytes
are in place and checked.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import xxhash

from ..format import ExpertChecksumError, ExpertMeta
from ..io.native import Started
from ..io.reader import Done, RecordJob, RecordReader
from .pool import LayerPool
from .slots import SlotCache
from .staging import Staging
from .stats import LayerStats


class Ticket:
    """A load in flight: slots reserved, reads issued. ``wait`` finishes it."""

    def __init__(
        self,
        layer,
        experts,
        misses,
        placed,
        future,
        rows,
        prefetch,
        finish: Callable[[Ticket], None],
    ):
        self.layer, self.experts, self.misses, self.placed = layer, experts, misses, placed
        self.future, self.rows, self.prefetch = future, rows, prefetch
        self.t0 = time.perf_counter()
        self.read_in_issue = False  # read before issue returned (native, begin(now=))
        self.done = False
        self._finish = finish

    def wait(self) -> int:
        """Finish the load (commit, or abort and raise); returns the misses loaded."""
        if not self.done:
            self.done = True
            self._finish(self)
        return len(self.misses)


class Loader:
    """The loading half of a store, over its slot tables, pools and reader."""

    def __init__(
        self,
        meta: ExpertMeta,
        caches: dict[int, SlotCache],
        pools: dict[int, LayerPool],
        reader: RecordReader,
        stats: dict[int, LayerStats],
        checksums: bool,
        clear_on_evict: bool,
        before_write: Callable[[int], None],
        lock=None,
        native=None,
    ):
        self.meta, self.caches, self.pools, self.reader = meta, caches, pools, reader
        self.stats, self.checksums, self.clear_on_evict = stats, checksums, clear_on_evict
        self._before_write = before_write  # settles lazy work reading a layer's pool
        self._lock = lock or contextlib.nullcontext()
        self._staging: dict[int, Staging] = {}
        self._inflight: dict[int, list[Ticket]] = {li: [] for li in caches}  # read-aheads
        self.native = native  # the native reader (host and cuda pools), or None
        self._helper = None  # one thread for native read-aheads that must not block
        self._started: Ticket | None = None  # the native reader's one started read
        # records that passed their checksum: each is checked the first time it is read
        self._checked = {li: np.zeros(meta.layers[li].num_experts, bool) for li in caches}

    def close(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=True)

    def _stage(self, layer: int) -> Staging:
        stride = self.meta.layers[layer].stride
        if stride not in self._staging:
            pinned = self.pools[layer].mode == "cuda"  # page-locked for fast copies
            self._staging[stride] = Staging(stride, pinned=pinned)
        return self._staging[stride]

    def begin(self, layer: int, experts: np.ndarray, now: bool = False) -> Ticket:
        """Start making distinct ``experts`` resident (they must fit): reserve slots and
        issue the reads (``now``: read them before returning, on the native reader's
        threads where there is one). ``Ticket.wait()`` finishes; until then only the
        experts that were already resident (``ticket.misses`` excluded) may be used."""
        self.settle_started()
        cache = self.caches[layer]
        _, misses = cache.split(experts)
        load = misses
        if cache.capacity >= cache.num_experts:  # room for all: load the whole layer once
            load = cache.split(np.arange(cache.num_experts))[1]
        placed = []
        if len(load):
            with self._lock:  # the policy picks victims (prefetch may run beside)
                placed = cache.reserve(np.sort(load), protect=experts)
        return self.issue(layer, experts, misses, placed, prefetch=False, now=now)

    def settle_started(self) -> None:
        """Finish a started read whose call was abandoned (it raised before waiting):
        its slots are committed or freed before any new reservation (or before the
        device path takes the table)."""
        t, self._started = self._started, None
        if t is not None and not t.done:
            with contextlib.suppress(Exception):  # its call has already raised
                t.wait()

    def flush(self, layer: int) -> None:
        """Apply ``layer``'s queued policy updates now (see ``SlotCache.flush``)."""
        with self._lock:
            self.caches[layer].flush()

    def fetch(self, layer: int, experts: np.ndarray) -> int:
        """Make distinct ``experts`` resident now; returns the number of misses loaded."""
        return self.begin(layer, experts, now=True).wait()

    def prefetch(self, layer: int, experts, limit: int | None = None) -> int:
        """Read ahead experts a coming call of ``layer`` is expected to need, into free
        or evictable slots (never pinned ones, nor ``experts`` themselves). Best effort;
        the next call of the layer settles them. Returns how many were issued."""
        self.settle_started()
        cache = self.caches[layer]
        experts = np.asarray(experts, dtype=np.int64)
        todo = [int(e) for e in experts if cache.slot_of[e] < 0 and e not in cache.pending]
        if not todo:
            return 0
        with self._lock:
            placed = cache.reserve(todo, protect=np.unique(experts), limit=limit)
        if not placed:
            return 0
        t = self.issue(layer, experts, np.array([e for e, _, _ in placed]), placed, prefetch=True)
        self._inflight[layer].append(t)
        st = self.stats[layer]
        st.prefetched += len(placed)
        st.prefetch_bytes += len(placed) * self.meta.layers[layer].record_bytes
        return len(placed)

    def settle(self, layer: int, needed: np.ndarray | None = None) -> None:
        """Finish this layer's read-aheads; count those ``needed`` now."""
        if not self._inflight[layer]:
            return
        tickets, self._inflight[layer] = self._inflight[layer], []
        need = set() if needed is None else set(needed.tolist())
        st = self.stats[layer]
        for t in tickets:
            on_time = t.future.done()
            try:
                t.wait()
            except Exception:  # noqa: BLE001 - a failed read-ahead is retried on demand
                continue
            used = need.intersection(t.misses.tolist())
            st.prefetch_used += len(used)
            st.prefetch_on_time += len(used) if on_time else 0

    def issue(self, layer, experts, misses, placed, prefetch, now=False) -> Ticket:
        """Read the records of ``placed`` ((expert, slot, victim) reservations)."""
        pool, lay = self.pools[layer], self.meta.layers[layer]
        if not placed:
            return Ticket(layer, experts, misses, placed, Done(0), None, prefetch, self._finish)
        self._before_write(layer)
        if self.native is not None:
            fut = self._native_read(layer, placed, now, prefetch)
            t = Ticket(layer, experts, misses, placed, fut, None, prefetch, self._finish)
            t.read_in_issue = now
            if isinstance(fut, Started):
                self._started = t
            return t
        direct = pool.mode == "host" and not self.reader.aligned
        rows = None if direct else self._stage(layer).take(len(placed))
        jobs = []
        for i, (e, s, _) in enumerate(placed):
            if direct:
                bufs = pool.record_bufs(s)
            else:
                bufs = [rows[i] if self.reader.aligned else rows[i][: lay.record_bytes]]
            copy = (
                (lambda a, b, s=s, r=rows[i]: pool.copy_range(s, r, a, b))
                if pool.mode == "cuda"
                else None
            )
            after = self._after(
                layer,
                e,
                bufs,
                (lambda s=s, r=rows[i]: pool.place(s, r))
                if pool.mode == "host" and rows is not None
                else None,
            )
            jobs.append(RecordJob(e, bufs, after, copy))
        fut = self.reader.submit(layer, jobs)
        return Ticket(layer, experts, misses, placed, fut, rows, prefetch, self._finish)

    def _native_read(self, layer, placed, now: bool, prefetch: bool):
        """The native reader reads and copies without the GIL: on the calling thread
        (``now``), else started on its threads (a load of at most a wave: a demand load
        while the caller builds its graph, or a read-ahead while the next layer is built,
        settled by that layer's call), else on one helper thread (larger read-aheads)."""
        experts = [e for e, _, _ in placed]
        slots = [s for _, s, _ in placed]
        if now:
            try:
                return Done(self.native.read(layer, experts, slots))
            except Exception as e:  # noqa: BLE001 - raised by Ticket.wait, after the abort
                return Done(error=e)
        if len(placed) <= self.native.wave:  # begin and prefetch settled any before
            try:
                return self.native.start(layer, experts, slots)
            except Exception as e:  # noqa: BLE001 - raised by Ticket.wait, after the abort
                return Done(error=e)
        if self._helper is None:
            from concurrent.futures import ThreadPoolExecutor

            self._helper = ThreadPoolExecutor(1, thread_name_prefix="mlxs-read")
        return self._helper.submit(self.native.read, layer, experts, slots)

    def _after(self, layer, expert, bufs, place):
        """Work done on the reader thread once a record has landed."""
        want = self.meta.layers[layer].checksums
        nbytes = self.meta.layers[layer].record_bytes
        checked = self._checked[layer]
        check = self.checksums and bool(want) and not checked[expert]

        def after():
            if check:
                h = xxhash.xxh3_64()
                left = nbytes
                for b in bufs:
                    h.update(b[:left])
                    left -= min(left, b.nbytes)
                if h.hexdigest() != want[expert]:
                    raise ExpertChecksumError(
                        f"expert {expert} of layer {layer} in {self.meta.file(layer)} fails its "
                        f"checksum ({h.hexdigest()} != {want[expert]}): the file is corrupt; "
                        "split the model again"
                    )
                checked[expert] = True
            if place is not None:  # O_DIRECT: staging -> slot
                place()

        return after

    def _finish(self, t: Ticket) -> None:
        t0 = time.perf_counter()
        with self._lock:
            self._finish_locked(t)
        if not t.prefetch:  # the time the caller waited: what was left of the read, or,
            # read on the caller's thread, all of it
            self.stats[t.layer].read_s += time.perf_counter() - (t.t0 if t.read_in_issue else t0)

    def _finish_locked(self, t: Ticket) -> None:
        cache, pool, st = self.caches[t.layer], self.pools[t.layer], self.stats[t.layer]
        try:
            nbytes = t.future.result()
            if t.placed and pool.mode == "mlx":
                pool.write(
                    [e for e, _, _ in t.placed], [s for _, s, _ in t.placed], np.stack(t.rows)
                )
                mx.eval(pool.state())  # staging rows are reused next
        except BaseException:
            cache.abort(t.placed)  # no slot stays marked resident with bad or partial data
            raise
        finally:
            if t.rows is not None:
                self._stage(t.layer).give(t.rows)
        if t.placed:
            pool.set_lut([e for e, _, _ in t.placed], [s for _, s, _ in t.placed])
        cache.commit(t.placed)
        if not t.prefetch:
            cache.access(t.experts, len(t.misses))
            if any(v >= 0 for _, _, v in t.placed) and self.clear_on_evict:
                mx.clear_cache()
        st.bytes_read += nbytes
        st.records_read += len(t.placed)
