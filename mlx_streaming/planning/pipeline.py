"""Planning a pipeline over hosts of different memory: which layers each host runs, and
what is left on each for expert pools.

Each rank of an mlx-lm pipeline holds the embeddings, final norm and head (``shared``),
the trunk of its own layers, pools for its own MoE layers with what ``load`` adds to
them (a margin and MLX's buffer-cache cap), and its layers' KV cache for the context.
``suggest_split`` finds the contiguous split (rank 0 runs the last layers, as in mlx-lm)
that gives every MoE layer the largest common share of its experts in a pool, within
each host's memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..core.discovery import find_expert_sites
from ..core.options import StreamConfig
from .budget import (
    MARGIN_BYTES,
    default_cache_limit,
    kv_bytes,
    pool_slots,
    pools_within,
    slots_for_share,
)


@dataclass(frozen=True)
class ModelBytes:
    """Where a model's bytes sit: ``shared`` by every rank, ``trunk[i]`` of layer ``i``
    (experts excluded), ``experts[i]`` all of layer ``i``'s experts (0: dense),
    ``kv[i]`` the KV cache one token adds to layer ``i``."""

    shared: int
    trunk: list[int]
    experts: list[int]
    num_experts: list[int]
    top_k: int
    kv: list[int]
    zero_slot: bool = True  # pools short of every expert get a zero slot (GPU backends;
    # the safe guess for ranks elsewhere, as from_model and SplitPlan assume)

    @classmethod
    def from_model(cls, model, zero_slot: bool = True) -> ModelBytes:
        """From an mlx-lm model (loaded lazily: nothing is read); ``zero_slot``: the
        ranks' pools have one (GPU backends; the safe guess for ranks elsewhere)."""
        from mlx.utils import tree_flatten

        sites = find_expert_sites(model)
        n = len(model.layers)
        prefixes = {s.path + ".": s for s in sites}
        shared, trunk, experts, counts = 0, [0] * n, [0] * n, [0] * n
        for s in sites:
            counts[s.layer] = s.num_experts
        for name, v in tree_flatten(model.parameters()):
            m = re.search(r"layers\.(\d+)\.", name)
            if m is None:
                shared += v.nbytes
            elif any(name.startswith(p) for p in prefixes):
                experts[int(m.group(1))] += v.nbytes
            else:
                trunk[int(m.group(1))] += v.nbytes
        top_k = next(s.top_k for s in sites if s.top_k)
        return cls(shared, trunk, experts, counts, top_k, kv_bytes(model), zero_slot)

    def pool_bytes(self, i: int, share: float) -> int:
        """Layer ``i``'s pools holding ``share`` of its experts (at least top-k slots),
        with the zero slot ``load`` adds to a pool short of every expert."""
        if not self.experts[i]:
            return 0
        e = self.num_experts[i]
        slots = slots_for_share(share, e, self.top_k)
        return self.experts[i] * pool_slots(slots, e, self.zero_slot) // e

    def rank_bytes(self, layers, share: float, context: int) -> int:
        """What a rank running ``layers`` needs: the shared part, their trunk, pools
        holding ``share`` of their experts with the margin and MLX's buffer-cache cap
        that ``load`` adds to them, and the KV cache of ``context`` tokens."""
        pools = sum(self.pool_bytes(i, share) for i in layers)
        fixed = sum(self.trunk[i] + context * self.kv[i] for i in layers)
        return self.total(pools, fixed)

    def total(self, pools: int, fixed: int) -> int:
        """A rank's bytes from its layers' pools and their trunk and KV cache."""
        return self.shared + fixed + pools + MARGIN_BYTES + default_cache_limit(pools)


@dataclass(frozen=True)
class SplitPlan:
    split: list[int]  # layers per rank, in rank order (rank 0: the last layers)
    share: float  # experts of each MoE layer held in pools
    ranks: list[dict]  # per rank: layers, trunk_gb, kv_gb, pool_budget_gb
    context: int = 0  # tokens of KV cache each rank keeps room for
    zero_slot: bool = True  # pools counted with a zero slot

    def to_json(self) -> dict:
        return {
            "split": self.split,
            "expert_share": round(self.share, 4),
            "context": self.context,
            "zero_slot": self.zero_slot,
            "ranks": self.ranks,
        }


def _pack(mb: ModelBytes, hosts: list[int], share: float, context: int) -> list[int] | None:
    """Layers per rank (rank order), or None where no contiguous split fits every rank
    with a MoE layer of its own (``load`` refuses a rank without one). The last rank
    takes layer 0 on; each rank takes as many layers as fit while the ranks after it can
    still take the rest (a search over every split point, not a greedy guess)."""
    n, size = len(mb.trunk), len(hosts)
    pools = [mb.pool_bytes(i, share) for i in range(n)]
    fixed = [mb.trunk[i] + context * mb.kv[i] for i in range(n)]
    order = hosts[::-1]  # in taking order: the last rank first

    def ends(room: int, i: int) -> list[int]:
        """Where a rank of ``room`` bytes starting at layer ``i`` may stop (exclusive):
        its layers fit and hold a MoE layer."""
        out, p, f, moe = [], 0, 0, False
        for j in range(i, n):
            p, f, moe = p + pools[j], f + fixed[j], moe or bool(mb.experts[j])
            if mb.total(p, f) > room:
                break  # bytes only grow with more layers
            if moe:
                out.append(j + 1)
        return out

    options = [[ends(order[q], i) for i in range(n)] for q in range(size)]
    done = [[False] * (n + 1) for _ in range(size + 1)]  # ranks q.. can take layers i..
    done[size][n] = True
    for q in reversed(range(size)):
        for i in range(n):
            done[q][i] = any(done[q + 1][j] for j in options[q][i])
    if not done[0][0]:
        return None
    counts, i = [], 0
    for q in range(size):
        j = max(j for j in options[q][i] if done[q + 1][j])
        counts.append(j - i)
        i = j
    return counts[::-1]


def suggest_split(
    mb: ModelBytes, machines_gb: list[float], context: int = StreamConfig.context
) -> SplitPlan:
    """The split that holds the largest share of every MoE layer's experts in pools,
    with each rank's memory ``machines_gb[rank]`` (``ModelBytes.rank_bytes``: trunk,
    pools and what ``load`` adds to them, and the KV cache of ``context`` tokens).

    Raises:
        ValueError: the hosts cannot hold the model's trunk with top-k slots per layer.
    """
    bad = [g for g in machines_gb if not g > 0]
    if bad:
        raise ValueError(f"machine memory {bad[0]} GB: each host needs a positive size")
    hosts = [int(g * 1e9) for g in machines_gb]
    if len(hosts) > len(mb.trunk):
        raise ValueError(f"{len(hosts)} hosts for {len(mb.trunk)} layers: use fewer hosts")
    if context < 0:
        raise ValueError(f"context {context}: give the tokens of context to keep room for, >= 0")
    n = len(mb.trunk)
    if _pack(mb, hosts, 0.0, context) is None:
        one = mb.rank_bytes(range(n), 0.0, context)
        need = one + (mb.shared + MARGIN_BYTES + default_cache_limit(0)) * (len(hosts) - 1)
        least = min(mb.rank_bytes([i], 0.0, context) for i in range(n) if mb.experts[i])
        if sum(hosts) >= need and min(hosts) < least:  # enough in all, one host too small
            raise ValueError(
                f"a host of {min(machines_gb)} GB cannot hold even one MoE layer with top-k "
                f"slots and a KV cache of {context} tokens ({least / 1e9:.3g} GB): no split "
                "gives every rank a MoE layer that fits; give the small hosts more memory, "
                "or use fewer"
            )
        if sum(hosts) >= need:  # enough in all: no contiguous split gives each a MoE layer
            raise ValueError(
                f"no split of this model over hosts of {machines_gb} GB gives every rank a "
                "MoE layer that fits: give the small hosts more memory, or use fewer"
            )
        raise ValueError(
            f"hosts of {machines_gb} GB cannot hold this model even with top-k slots per layer "
            f"and a KV cache of {context} tokens (about {need / 1e9:.2f} GB in all): add "
            "memory or hosts, or plan a shorter context"
        )
    lo, hi = 0.0, 1.0
    if _pack(mb, hosts, 1.0, context) is not None:
        lo = 1.0
    for _ in range(40):
        if lo == 1.0 or hi - lo < 1e-4:
            break
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _pack(mb, hosts, mid, context) is not None else (lo, mid)
    # the same share with each host as little filled as can be: memory left over is
    # spread in proportion to the hosts, not all left on the first ranks
    fill_lo, fill_hi = 0.0, 1.0
    for _ in range(30):
        mid = (fill_lo + fill_hi) / 2
        if _pack(mb, [int(h * mid) for h in hosts], lo, context) is not None:
            fill_hi = mid
        else:
            fill_lo = mid
    split = _pack(mb, [int(h * fill_hi) for h in hosts], lo, context)
    ranks = []
    for r, count in enumerate(split):
        start = sum(split[r + 1 :])
        layers = range(start, start + count)
        moe = sum(1 for i in layers if mb.experts[i])  # >= 1, as _pack checked
        trunk = mb.shared + sum(mb.trunk[i] for i in layers)
        kv = context * sum(mb.kv[i] for i in layers)
        ranks.append(
            {
                "rank": r,
                "layers": [layers.start, layers.stop - 1],
                "moe_layers": moe,
                "trunk_gb": round(trunk / 1e9, 3),
                "kv_gb": round(kv / 1e9, 3),
                # to the kB below: the flag it is passed as plans at least the share
                "pool_budget_gb": max(0, pools_within(hosts[r] - trunk - kv)) // 1000 / 1e6,
            }
        )
    return SplitPlan(split, lo, ranks, context, mb.zero_slot)
