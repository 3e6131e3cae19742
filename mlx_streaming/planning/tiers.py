"""Two tiers under the pools: where a pool miss is read from.

A miss is read through the OS page cache unless the store reads with O_DIRECT: the RAM
the pools, the trunk and the process leave free holds recently read records, and a miss
found there costs a memory copy, not a disk read. ``simulate_tiers`` replays a trace
through the store's own slot tables and policy (the pool tier) and, beneath them, a page
cache of a given size holding whole records (one LRU over every layer's records: a
model of Linux's active and inactive lists moved its prediction by 2% only), and counts
per token the pool hits, the misses the page cache serves and the misses read from the
disk. Sampled layers share a page cache scaled to their share of the model's layers.
With ``exclusive`` the tier beneath is the store's swap tier instead (``--swap-tier``),
which holds no record the pools hold, each layer in rows of its own, as
``core.io.tier.SwapTier`` keeps them (``benchmarks/host_tier.py`` compares the two).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..core.cache.policy import make_policy
from ..core.cache.slots import SlotCache
from ..core.io.tier import MARGIN, ring_records
from ..core.io.tier_moves import bounded_rows, plan_moves
from .budget import TooSmall, pool_slots
from .simulate import layer_lookups, p10_p90, stretches
from .trace import RoutingTrace


@dataclass
class TierResult:
    tokens: int
    pool_hits: int
    page_cache_hits: int  # pool misses found in the tier beneath (page cache or swap tier)
    disk_reads: int  # pool misses read from the disk
    page_cache_bytes_per_token: float  # bytes copied from the tier beneath
    disk_bytes_per_token: float  # bytes read from the disk
    tier_write_bytes_per_token: float = 0.0  # victims copied into a swap tier
    # disk reads per call and replayed layer ([calls, layers]; uncounted calls' rows 0):
    # when in a step each read is asked (``benchmarks/probes/ahead_horizon.py``)
    disk_by_call: np.ndarray | None = None
    read_bytes: float = 0.0  # a disk read's bytes, scaled to every layer of the model
    # records copied from or into the tier beneath per call, every replayed layer ([calls])
    copies_by_call: np.ndarray | None = None
    tokens_by_call: np.ndarray | None = None  # each call's counted tokens (0: uncounted)

    def disk_bytes_by_call(self) -> np.ndarray:
        """Each call's disk bytes, every layer of the model (uncounted calls 0)."""
        return self.disk_by_call.sum(axis=1) * self.read_bytes

    def windows(self, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Bytes per token copied (tier beneath) and read (disk) over each stretch of
        ``tokens`` counted tokens (``simulate.stretches``): how much a short run's bytes
        depend on where in the routing it falls."""
        n, scale = self.tokens_by_call, self.read_bytes
        copies = stretches(self.copies_by_call, n, tokens) * scale
        disk = stretches(self.disk_by_call, n, tokens) * scale
        return copies, disk

    def window_rates(self, tokens: int, t_compute: float, mem_gbps: float, disk_gbps: float,
                     host_s: float = 0.0) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """Each stretch of ``windows(tokens)``: its disk bytes per token and predicted
        tok/s (overlap bound, plus ``host_s`` seconds per token)."""
        copies, disk = self.windows(tokens)
        io = _io_seconds(copies, disk, mem_gbps, disk_gbps)
        return disk, 1 / (np.maximum(t_compute, io) + host_s)

    @property
    def lookups(self) -> int:
        return self.pool_hits + self.page_cache_hits + self.disk_reads

    def shares(self) -> dict[str, float]:
        n = max(1, self.lookups)
        return {
            "pool": self.pool_hits / n,
            "tier": self.page_cache_hits / n,
            "disk": self.disk_reads / n,
        }

    def time_per_token(self, t_compute: float, mem_gbps: float, disk_gbps: float,
                       overlap: bool = True) -> float:  # fmt: skip
        """Predicted seconds per token: compute and reads overlapped, or one after the
        other. Copies to and from the tier beneath run at ``mem_gbps``."""
        copies = self.page_cache_bytes_per_token + self.tier_write_bytes_per_token
        io = _io_seconds(copies, self.disk_bytes_per_token, mem_gbps, disk_gbps)
        return max(t_compute, io) if overlap else t_compute + io


def _io_seconds(copies, disk, mem_gbps: float, disk_gbps: float):
    """Seconds per token of the copies to and from the tier beneath and the disk's reads."""
    return copies / (mem_gbps * 1e9) + disk / (disk_gbps * 1e9)


class _PageCache:
    """The OS page cache: one LRU of whole records over every layer's; a record read
    from the disk is kept, one found there becomes the newest."""

    def __init__(self, capacity: int):
        self.capacity, self.lru = capacity, OrderedDict()

    def find(self, li: int, e: int) -> bool:
        if (li, e) not in self.lru:
            return False
        self.lru.move_to_end((li, e))
        return True

    def keep(self, li: int, placed, found: list[bool], heat) -> int:  # (heat: unused)
        for (e, _, _), hit in zip(placed, found):
            if not hit and self.capacity:
                self.lru[li, int(e)] = None
                if len(self.lru) > self.capacity:
                    self.lru.popitem(last=False)
        return 0  # the kernel writes what it reads: no copy of ours


class _SwapRows:
    """The store's swap tier (``core.io.tier.SwapTier``) without its bytes: each layer's
    own ``rows``, filled at load with the experts after the pool's, moved by the tier's
    own rule (``tier_moves.plan_moves``); a read lands at once."""

    def __init__(self, layers, slots: int, rows: int, num_experts: int):
        self.tables, self.clock = {}, 0
        for li in layers:
            home = [-1] * num_experts
            home[slots : slots + rows] = range(rows)
            self.tables[li] = [home, list(range(slots)), list(range(slots, slots + rows)),
                               [0] * rows]  # fmt: skip

    def find(self, li: int, e: int) -> bool:
        return self.tables[li][0][e] >= 0

    def keep(self, li: int, placed, found: list[bool], heat) -> int:
        experts, slots = [e for e, _, _ in placed], [s for _, s, _ in placed]
        moves = plan_moves(li, self.tables[li], self.clock, experts, slots, lambda: heat, True)
        self.clock = moves.clock
        for e, s in moves.reads:  # landed
            self.tables[li][1][s] = e
        owner = self.tables[li][2]  # the records written into rows: victims, not misses
        sent = len(moves.trades) - moves.brought
        return sum(owner[h] >= 0 for h, _ in moves.trades[: moves.brought]) + sent


def swap_rows(num_experts: int, slots: int, record_bytes: int, model_layers: int,
              limit: int | None) -> int:  # fmt: skip
    """Rows per layer of a swap tier of at most ``limit`` bytes (None: whole) beneath
    pools of ``slots``, as ``SwapTier`` sizes them."""
    rest = dict.fromkeys(range(model_layers), max(0, num_experts - slots))
    return bounded_rows(rest, dict.fromkeys(rest, record_bytes), limit).get(0, 0)


def simulate_tiers(
    trace: RoutingTrace,
    policy: str,
    slots: int,
    page_cache_bytes: int,
    record_bytes: int,
    layers=None,
    model_layers: int | None = None,
    start: int = 0,
    tokens: int | None = None,
    calls: list[int] | None = None,
    counted: list[bool] | None = None,
    exclusive: bool = False,
) -> TierResult:
    """Pool hits, page-cache hits and disk reads of ``policy`` with ``slots`` per layer
    over a page cache of ``page_cache_bytes`` (0: O_DIRECT, every miss from the disk), for
    records of ``record_bytes`` (read whole, the stride). ``layers``: the trace layers to
    replay (default all); ``model_layers``: the model's MoE layers (default the trace's),
    whose page cache the sampled layers get their share of; the bytes per token are
    scaled to every layer. ``calls``: tokens per layer call, in order (a prompt's chunk is
    one call: its distinct experts looked up once; default one token per call).
    ``counted``: which calls are counted (default: all); the others fill the tiers
    uncounted (a warm-up, a run's prompts). ``exclusive``: the tier beneath is the
    store's swap tier of at most ``page_cache_bytes`` (``--swap-tier-gb``), not the page
    cache: its rows per layer as ``SwapTier`` sizes them, the pools full from load (slot
    ``s`` holds expert ``s``) and the tier holding the next experts, so no record is held
    twice and the first touches are no reads."""
    layers = list(range(trace.layers)) if layers is None else list(layers)
    model_layers = model_layers or trace.layers
    E = trace.num_experts
    counts = None  # a call's rows per expert: its groups, hottest last, as the store's
    if calls is None:
        seqs = {li: layer_lookups(trace, li, start, tokens) for li in layers}
    else:
        bounds = np.cumsum([0, *calls]) + start
        rows = trace.experts.astype(np.int64)
        pairs = {li: [np.unique(rows[a:b, li], return_counts=True)
                      for a, b in zip(bounds[:-1], bounds[1:])] for li in layers}  # fmt: skip
        seqs = {li: [e for e, _ in p] for li, p in pairs.items()}
        counts = {li: [c for _, c in p] for li, p in pairs.items()}
    caches = {li: SlotCache(E, slots, make_policy(policy, E)) for li in layers}
    if exclusive:
        n = swap_rows(E, slots, record_bytes, model_layers, page_cache_bytes)
        beneath = _SwapRows(layers, slots, n, E)
        for cache in caches.values():  # as the store adopts the pools the tier filled
            cache.commit(cache.reserve(range(min(slots, E)), protect=np.zeros(0, np.int64)))
    else:
        room = int(page_cache_bytes * len(layers) / model_layers) // max(1, record_bytes)
        beneath = _PageCache(room)
    hits = pc = disk = writes = 0
    T = min(len(s) for s in seqs.values())
    if counted is None:
        counted = [True] * T
    by_call = np.zeros((T, len(layers)), np.int32)
    copies = np.zeros(T, np.int64)
    for t in range(T):
        before = (hits, pc, disk, writes)
        for j, li in enumerate(layers):
            on_disk = disk
            cache = caches[li]
            whole = cache.whole and not cache.complete  # as the store: a pool with a slot
            if whole:  # per expert loads its whole layer at its first call
                hits += int((cache.slot_of[seqs[li][t]] >= 0).sum())
            # more than fit: one group at a time, each loaded before the next
            n = None if counts is None else counts[li][t]
            for group in [np.arange(E)] if whole else cache.groups(seqs[li][t], n):
                placed = cache.lookup(group)
                hits += 0 if whole else len(group) - len(placed)
                # a group's misses are looked up beneath together, then kept
                found = [beneath.find(li, int(e)) for e, _, _ in placed]
                pc += sum(found)
                disk += len(found) - sum(found)
                writes += beneath.keep(li, placed, found, cache.heat)
            by_call[t, j] = disk - on_disk
        if not counted[t]:
            hits, pc, disk, writes = before
            by_call[t] = 0
        copies[t] = pc + writes - before[1] - before[3]
    n_by_call = np.array([c * bool(on) for c, on in zip(calls or [1] * T, counted[:T])])
    n_tokens = int(n_by_call.sum())
    per_read = record_bytes * model_layers / len(layers)
    scale = per_read / max(1, n_tokens)
    return TierResult(n_tokens, hits, pc, disk, pc * scale, disk * scale, writes * scale,
                      by_call, per_read, copies, n_by_call)  # fmt: skip


def best_split(
    trace: RoutingTrace,
    policy: str,
    memory_bytes: int,
    slot_bytes: int,
    record_bytes: int,
    top_k: int,
    t_compute: float,
    mem_gbps: float,
    disk_gbps: float,
    layers=None,
    model_layers: int | None = None,
    tokens: int | None = 4000,
    steps: int = 8,
    beneath: tuple[str, ...] = ("page cache",),
    zero_slot: bool = False,
    host_s: float = 0.0,
    window: int = 256,
) -> list[dict]:
    """The memory ``memory_bytes`` left after the trunk, less ``MARGIN`` (the process's
    own), split between pools (with a zero slot each where ``zero_slot``) and the tier
    beneath them, ``steps`` ways from all pools downwards: each split's slots per layer,
    tier size, hits per tier and predicted tok/s (overlap bound, plus ``host_s`` seconds
    per token of the host path's own work), best first. ``beneath``: the tiers to model
    under the pools,
    "page cache" (the OS's, holding what the pools hold too) and "swap" (the store's
    exclusive host tier, ``--swap-tier``; whole where it has room for every record the
    pools do not hold).

    Raises:
        ValueError: the memory cannot hold top-k slots in every layer (saying how much can).
    """
    model_layers = model_layers or trace.layers
    E = trace.num_experts

    def pools(s: int) -> int:
        return pool_slots(s, E, zero_slot) * slot_bytes * model_layers

    usable = memory_bytes - MARGIN  # the process's own, whichever tier is beneath
    most = max([s for s in range(top_k, E + 1) if pools(s) <= usable], default=0)
    if not most:
        raise TooSmall(
            f"{memory_bytes / 1e9:.4g} GB cannot hold top_k={top_k} slots in each of "
            f"{model_layers} MoE layers beside the {MARGIN / 1e9:.2f} GB the process "
            f"keeps: that takes {(pools(top_k) + MARGIN) / 1e9:.4g} GB"
        )
    splits = [
        (s, memory_bytes - pools(s))
        for s in sorted({int(x) for x in np.linspace(top_k, most, steps)}, reverse=True)
    ]
    return split_rows(trace, policy, splits, slot_bytes, record_bytes, t_compute, mem_gbps,
                      disk_gbps, layers, model_layers, tokens, beneath, zero_slot,
                      host_s, window=window)  # fmt: skip


def split_rows(
    trace: RoutingTrace,
    policy: str,
    splits: list[tuple[int, int]],
    slot_bytes: int,
    record_bytes: int,
    t_compute: float,
    mem_gbps: float,
    disk_gbps: float,
    layers=None,
    model_layers: int | None = None,
    tokens: int | None = 4000,
    beneath: tuple[str, ...] = ("page cache", "swap"),
    zero_slot: bool = False,
    host_s: float = 0.0,
    device_swap: bool = False,
    window: int = 256,
) -> list[dict]:
    """Each ``(slots per layer, host bytes beneath)`` split, with each tier of
    ``beneath`` under the pools: hits per tier, disk bytes and predicted tok/s, best
    first. A row served on the host path adds ``host_s`` seconds per token of its own
    work (routing reads, planning, launches), in series; with ``device_swap`` (CUDA) a
    swap tier runs the device path, which adds none, a bounded one leaving its request
    ring's staging and the files' reader's record beside it (``io.tier.ring_records``).
    ``best_split`` makes the splits of one memory; pools in a GPU's own memory (``plan
    --host-gb``) have the same host bytes beneath each pool size. Either tier gets the
    host bytes less ``MARGIN``, which the process takes after load; a swap tier of no row
    per layer is left out. Each row gives the 10th and 90th percentiles of its disk bytes
    and tok/s over stretches of ``window`` tokens: what a run that long may see."""
    unknown = set(beneath) - {"page cache", "swap"}
    if unknown:
        raise ValueError(f"unknown tier {sorted(unknown)}; known: 'page cache', 'swap'")
    sim = dict(layers=layers, model_layers=model_layers or trace.layers, tokens=tokens)
    rates = (t_compute, mem_gbps, disk_gbps)
    rest = (rates, sim, zero_slot, host_s, device_swap, window)
    rows = [
        _row(trace, policy, s, slot_bytes, record_bytes, host, tier, *rest)
        for s, host in splits
        for tier in beneath
    ]
    return sorted([r for r in rows if r], key=lambda r: -r["predicted_tok_per_s"])


def _row(
    trace, policy, s, slot_bytes, record_bytes, host, tier, rates, sim, zero, host_s, device_swap,
    window,
) -> dict | None:  # fmt: skip
    """One split's simulated hits per tier, bytes and predicted tok/s (overlap bound),
    with the flags that run it; None for a swap tier of no row per layer. ``host_s``: the
    host path's seconds per token, none for a swap tier where ``device_swap`` (the
    device path serves it: a bounded one less its request ring's staging)."""
    E, L = trace.num_experts, sim["model_layers"]
    room = size = max(0, host - MARGIN)
    flags = f"--slots {s}"
    if tier == "swap":  # whole where the room holds every record the pools do not
        room, flags = (E - s) * record_bytes * L, f"{flags} --swap-tier"
        if not size:
            return None
        host_s = 0.0 if device_swap else host_s
        if size < room:  # bounded: the flag's GB, as the store reads it, less the request
            size -= device_swap * ring_records() * record_bytes  # ring's staging (io.tier)
            if size <= 0:
                return None
            gb = _floor_gb(size)
            room, flags = int(float(gb) * 1e9), f"{flags} --swap-tier-gb {gb}"
        size = swap_rows(E, s, record_bytes, L, room) * record_bytes * L  # its own size
        if not size:
            return None
    r = simulate_tiers(trace, policy, s, room, record_bytes, exclusive=tier == "swap", **sim)
    disk, tps = r.window_rates(window, *rates, host_s)
    return {
        "slots": s,
        "tier": tier,
        "pool_gb": round(pool_slots(s, E, zero) * slot_bytes * L / 1e9, 3),
        "tier_gb": round(size / 1e9, 3),
        **{f"{k}_share": round(v, 4) for k, v in r.shares().items()},
        "disk_mb_per_token": round(r.disk_bytes_per_token / 1e6, 3),
        "tier_mb_per_token": round(r.page_cache_bytes_per_token / 1e6, 3),
        "host_ms_per_token": round(1e3 * host_s, 3),
        "predicted_tok_per_s": round(1 / (r.time_per_token(*rates) + host_s), 3),
        "serial_tok_per_s": round(1 / (r.time_per_token(*rates, overlap=False) + host_s), 3),
        "window_tokens": window,
        "disk_mb_per_token_p10_p90": [round(v / 1e6, 3) for v in p10_p90(disk)],
        "tok_per_s_p10_p90": [round(v, 3) for v in p10_p90(tps)],
        "flags": flags,
    }


def _floor_gb(nbytes: int) -> str:
    """``nbytes`` in GB to 3 significant digits, rounded down (the flag never asks for
    more than there is)."""
    p = max(0, 2 - math.floor(math.log10(nbytes / 1e9)))
    return f"{math.floor(nbytes / 1e9 * 10**p) / 10**p:.{p}f}"
