"""Two tiers under the pools: where a pool miss is read from.

A miss is read through the OS page cache unless the store reads with O_DIRECT: the RAM
the pools, the trunk and the process leave free holds recently read records, and a miss
found there costs a memory copy, not a disk read. ``simulate_tiers`` replays a trace
through the store's own slot tables and policy (the pool tier) and, beneath them, a page
cache of a given size holding whole records (one LRU over every layer's records: a
model of Linux's active and inactive lists moved its prediction by 2% only), and counts
per token the pool hits, the misses the page cache serves and the misses read from the
disk. Sampled layers share a page cache scaled to their share of the model's layers.
With ``exclusive`` the tier beneath is a host tier of the store's own instead, which
holds no record the pools hold (``benchmarks/host_tier.py`` compares the two).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np

from ..core.cache.policy import make_policy
from ..core.cache.slots import SlotCache
from .simulate import layer_lookups
from .trace import RoutingTrace


@dataclass
class TierResult:
    tokens: int
    pool_hits: int
    page_cache_hits: int  # pool misses found in the page cache
    disk_reads: int  # pool misses read from the disk
    page_cache_bytes_per_token: float  # bytes copied from the page cache
    disk_bytes_per_token: float  # bytes read from the disk

    @property
    def lookups(self) -> int:
        return self.pool_hits + self.page_cache_hits + self.disk_reads

    def shares(self) -> dict[str, float]:
        n = max(1, self.lookups)
        return {
            "pool": self.pool_hits / n,
            "page_cache": self.page_cache_hits / n,
            "disk": self.disk_reads / n,
        }

    def time_per_token(self, t_compute: float, mem_gbps: float, disk_gbps: float,
                       overlap: bool = True) -> float:  # fmt: skip
        """Predicted seconds per token: compute and reads overlapped, or one after the
        other."""
        io = self.page_cache_bytes_per_token / (mem_gbps * 1e9) + self.disk_bytes_per_token / (
            disk_gbps * 1e9
        )
        return max(t_compute, io) if overlap else t_compute + io


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
    store's own host tier, not the page cache: it takes the records the pools evict
    (least recently evicted out first) and gives up a record a pool takes back, so no
    record is held twice; a disk read goes to the pool only."""
    layers = list(range(trace.layers)) if layers is None else list(layers)
    model_layers = model_layers or trace.layers
    E = trace.num_experts
    capacity = int(page_cache_bytes * len(layers) / model_layers) // max(1, record_bytes)
    if calls is None:
        seqs = {li: layer_lookups(trace, li, start, tokens) for li in layers}
    else:
        bounds = np.cumsum([0, *calls]) + start
        rows = trace.experts.astype(np.int64)
        seqs = {
            li: [np.unique(rows[a:b, li]) for a, b in zip(bounds[:-1], bounds[1:])] for li in layers
        }
    caches = {li: SlotCache(E, slots, make_policy(policy, E)) for li in layers}
    page: OrderedDict[tuple[int, int], None] = OrderedDict()
    hits = pc = disk = 0
    T = min(len(s) for s in seqs.values())
    if counted is None:
        counted = [True] * T
    for t in range(T):
        before = (hits, pc, disk)
        for li in layers:
            cache, placed = caches[li], []
            if cache.whole and not cache.complete:  # as the store: a pool with a slot per
                # expert loads its whole layer at its first call
                hits += int((cache.slot_of[seqs[li][t]] >= 0).sum())
                placed = cache.lookup(np.arange(E))
            for group in [] if placed else cache.groups(seqs[li][t]):  # more than fit:
                got = cache.lookup(group)  # one at a time
                hits += len(group) - len(got)
                placed += got
            read = []  # the call's misses are looked up beneath together, then kept
            for e, _, _ in placed:
                key = (li, int(e))
                if key not in page:
                    disk += 1
                    read.append(key)
                    continue
                pc += 1
                if exclusive:
                    del page[key]
                else:
                    page.move_to_end(key)
            kept = [(li, int(v)) for _, _, v in placed if v >= 0] if exclusive else read
            for key in kept if capacity else ():
                page[key] = None
                if len(page) > capacity:
                    page.popitem(last=False)
        if not counted[t]:
            hits, pc, disk = before
    n_tokens = sum(c for c, on in zip(calls or [1] * T, counted[:T]) if on)
    scale = record_bytes * model_layers / len(layers) / max(1, n_tokens)
    return TierResult(n_tokens, hits, pc, disk, pc * scale, disk * scale)


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
) -> list[dict]:
    """The memory ``memory_bytes`` left after the trunk split between pools and the
    tier beneath them, ``steps`` ways from all pools downwards: each split's slots per
    layer, tier size, hits per tier and predicted tok/s (overlap bound), best first.
    ``beneath``: the tiers to model under the pools, "page cache" (the OS's, holding
    what the pools hold too) and "swap" (the store's exclusive host tier, ``--swap-tier``;
    whole where it has room for every record the pools do not hold)."""
    model_layers = model_layers or trace.layers
    most = min(trace.num_experts, memory_bytes // (slot_bytes * model_layers))
    if most < top_k:
        raise ValueError(
            f"{memory_bytes / 1e9:.2f} GB holds {most} slots per layer, below top_k={top_k}"
        )
    splits = [
        (s, memory_bytes - s * slot_bytes * model_layers)
        for s in sorted({int(x) for x in np.linspace(top_k, most, steps)}, reverse=True)
    ]
    return split_rows(trace, policy, splits, slot_bytes, record_bytes, t_compute, mem_gbps,
                      disk_gbps, layers, model_layers, tokens, beneath)  # fmt: skip


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
) -> list[dict]:
    """Each ``(slots per layer, bytes of the tier beneath)`` split, with each tier of
    ``beneath`` under the pools: hits per tier, disk bytes and predicted tok/s, best
    first. ``best_split`` makes the splits of one memory; pools in a GPU's own memory
    (``plan --host-gb``) have the same host bytes beneath each pool size."""
    unknown = set(beneath) - {"page cache", "swap"}
    if unknown:
        raise ValueError(f"unknown tier {sorted(unknown)}; known: 'page cache', 'swap'")
    sim = dict(layers=layers, model_layers=model_layers or trace.layers, tokens=tokens)
    rates = (t_compute, mem_gbps, disk_gbps)
    rows = [
        _row(trace, policy, s, slot_bytes, record_bytes, tier_bytes, tier, rates, sim)
        for s, tier_bytes in splits
        for tier in beneath
        if tier != "swap" or s < trace.num_experts  # a full pool leaves a tier nothing
    ]
    return sorted(rows, key=lambda r: -r["predicted_tok_per_s"])


def _row(trace, policy, s, slot_bytes, record_bytes, tier_bytes, tier, rates, sim) -> dict:
    """One split's simulated hits per tier, bytes and predicted tok/s (overlap bound)."""
    swap = tier == "swap"
    r = simulate_tiers(trace, policy, s, tier_bytes, record_bytes, exclusive=swap, **sim)
    rest = (trace.num_experts - s) * record_bytes * sim["model_layers"]
    # a trade moves the victim out as the miss comes in: twice the tier's bytes
    timed = replace(r, page_cache_bytes_per_token=r.page_cache_bytes_per_token * (1 + swap))
    return {
        "slots": s,
        "tier": tier,
        "pool_gb": round(s * slot_bytes * sim["model_layers"] / 1e9, 3),
        "page_cache_gb": round(tier_bytes / 1e9, 3),
        **{f"{k}_share": round(v, 4) for k, v in r.shares().items()},
        "disk_mb_per_token": round(r.disk_bytes_per_token / 1e6, 3),
        "page_cache_mb_per_token": round(r.page_cache_bytes_per_token / 1e6, 3),
        "predicted_tok_per_s": round(1 / timed.time_per_token(*rates), 3),
        "flags": _flags(s, swap, tier_bytes, rest),
    }


def _flags(slots: int, swap: bool, tier_bytes: int, rest_bytes: int) -> str:
    """The store's flags for a split: its slots, and the swap tier (whole where it holds
    every record the pools do not, else bounded)."""
    if not swap:
        return f"--slots {slots}"
    if tier_bytes >= rest_bytes:
        return f"--slots {slots} --swap-tier"
    return f"--slots {slots} --swap-tier --swap-tier-gb {tier_bytes / 1e9:.3g}"
