"""Replay a routing trace through the store's own slot tables and policies.

``simulate`` drives ``SlotCache`` (the bookkeeping the live ``FileExpertStore`` uses) with
one lookup per token and MoE layer: the token's distinct experts must all be resident
(demand caching). Belady's offline optimum runs through the same machinery with a policy
that knows the future, as the ceiling for any demand policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.cache.policy import Belady, make_policy
from ..core.cache.recording import hottest
from ..core.cache.slots import SlotCache
from .trace import RoutingTrace


@dataclass
class SimResult:
    policy: str
    slots: dict[int, int]  # trace layer -> slots
    hits: dict[int, int]
    misses: dict[int, int]
    evictions: dict[int, int]
    tokens: int
    read_ahead: dict[int, int] = field(default_factory=dict)  # experts loaded on a guess
    misses_by_token: np.ndarray | None = None  # each token's misses, every simulated layer

    def window_misses(self, tokens: int) -> np.ndarray:
        """Misses per token and simulated layer over each stretch of ``tokens`` tokens
        (``stretches``; ``[0.]`` where nothing was simulated)."""
        m = self.misses_by_token
        if m is None or not len(m):
            return np.zeros(1)
        return stretches(m, np.ones(len(m), np.int64), tokens) / max(1, len(self.slots))

    def reads_per_token(self) -> float:
        """Experts loaded per token: demand misses plus read-ahead."""
        return (sum(self.misses.values()) + sum(self.read_ahead.values())) / max(1, self.tokens)

    @property
    def hit_rate(self) -> float:
        h, m = sum(self.hits.values()), sum(self.misses.values())
        return h / (h + m) if h + m else 0.0

    def layer_hit_rate(self, layer: int) -> float:
        h, m = self.hits[layer], self.misses[layer]
        return h / (h + m) if h + m else 0.0

    def misses_per_token(self) -> float:
        return sum(self.misses.values()) / max(1, self.tokens)


def stretches(values: np.ndarray, tokens_by_call: np.ndarray, tokens: int) -> np.ndarray:
    """``values`` (per call, any shape after the first axis) per counted token over each
    stretch of ``tokens`` counted tokens, in order: a last, shorter stretch left out; the
    whole run where it is shorter than one. A stretch is what one run that long sees."""
    edges, got = [0], 0
    for i, k in enumerate(tokens_by_call):
        got += int(k)
        if got >= tokens:
            edges, got = [*edges, i + 1], 0
    if len(edges) == 1:
        edges.append(len(tokens_by_call))
    return np.array([values[a:b].sum() / max(1, int(tokens_by_call[a:b].sum()))
                     for a, b in zip(edges[:-1], edges[1:])])  # fmt: skip


def p10_p90(x: np.ndarray) -> list[float]:
    """The 10th and 90th percentiles of ``x``, or [] over fewer than 5 values."""
    return np.percentile(x, [10, 90]).tolist() if len(x) >= 5 else []


def layer_lookups(
    trace: RoutingTrace, layer: int, start: int = 0, tokens: int | None = None
) -> list[np.ndarray]:
    """Distinct experts of each token at one trace layer."""
    end = trace.tokens if tokens is None else min(trace.tokens, start + tokens)
    return [np.unique(r) for r in trace.experts[start:end, layer].astype(np.int64)]


def simulate(
    trace: RoutingTrace,
    policy: str,
    slots,
    layers=None,
    start: int = 0,
    tokens: int | None = None,
    pins: dict | None = None,
    ahead: dict | None = None,
    **policy_kw,
) -> SimResult:
    """Hit/miss counts of ``policy`` with ``slots`` per layer (an int or {layer: slots}).

    Args:
        trace: The routing to replay.
        policy: A name from ``POLICIES`` or ``"belady"``.
        slots: Slots per layer, or a dict per trace layer.
        layers: Trace layers to simulate (default: all).
        start, tokens: The span of the trace to replay.
        pins: {layer: experts} kept resident from the start and never evicted.
        ahead: {layer: [T, m] experts} read ahead before each token's lookup (a
            predictor's guesses, -1 for none): loaded into slots the policy frees, not
            counted as misses but in ``read_ahead``.
    """
    layers = list(range(trace.layers)) if layers is None else list(layers)
    E = trace.num_experts
    res = SimResult(policy, {}, {}, {}, {}, 0)
    by_token = None
    for li in layers:
        c = slots[li] if isinstance(slots, dict) else int(slots)
        seq = layer_lookups(trace, li, start, tokens)
        pol = Belady(E, seq) if policy == "belady" else make_policy(policy, E, **policy_kw)
        cache = SlotCache(E, c, pol)
        pinned = np.asarray(sorted((pins or {}).get(li, [])), dtype=np.int64)
        if len(pinned):
            cache.commit(cache.reserve(pinned, np.zeros(0, np.int64)))
            cache.pinned = set(pinned.tolist())
        guesses = None if ahead is None else ahead.get(li)
        res.read_ahead[li] = 0
        if by_token is None:
            by_token = np.zeros(len(seq), np.int64)
        for t, need in enumerate(seq):
            before = cache.stats.misses
            if guesses is not None:
                g = np.unique(guesses[start + t])
                g = g[g >= 0]
                _, miss = cache.split(g)  # a guess never evicts another guessed expert
                placed = cache.reserve(miss, g, limit=len(miss))
                cache.commit(placed)
                res.read_ahead[li] += len(placed)
            cache.lookup(need)
            by_token[t] += cache.stats.misses - before
        res.slots[li] = c
        res.hits[li], res.misses[li] = cache.stats.hits, cache.stats.misses
        res.evictions[li] = cache.stats.evictions
        res.tokens = len(seq)
    res.misses_by_token = by_token
    return res


def routing_counts(trace: RoutingTrace, start: int = 0, tokens: int | None = None) -> np.ndarray:
    """How often each expert of each trace layer was routed to over a span: [L, E]."""
    end = trace.tokens if tokens is None else min(trace.tokens, start + tokens)
    return np.stack(
        [
            np.bincount(trace.experts[start:end, li].reshape(-1), minlength=trace.num_experts)
            for li in range(trace.layers)
        ]
    )


def routing_entropy(counts: np.ndarray) -> np.ndarray:
    """Bits of each layer's routing distribution, from counts per expert [L, E]
    (``log2(E)`` when uniform)."""
    p = counts / np.maximum(counts.sum(-1, keepdims=True), 1)
    return -(p * np.log2(np.where(p > 0, p, 1))).sum(-1)


def static_hot(
    trace: RoutingTrace, n: int, start: int = 0, tokens: int | None = None
) -> dict[int, list[int]]:
    """Each layer's ``n`` most used experts over a span (for pinning)."""
    hot = hottest(routing_counts(trace, start, tokens), n)
    return {li: hot[li].tolist() for li in range(trace.layers)}


def fit_predictive(
    trace: RoutingTrace, layers=None, tokens: int = 20000, horizon: int = 8, discount: float = 0.8
) -> tuple[float, ...]:
    """Least-squares weights for the ``predictive`` policy's score, from a trace.

    The target for each expert at each lookup is its discounted use over the next
    ``horizon`` lookups; the features are exactly those the policy computes live.
    """
    from ..core.cache.scored import Scored

    layers = list(range(0, trace.layers, max(1, trace.layers // 6))) if layers is None else layers
    E = trace.num_experts
    Xs, ys = [], []
    for li in layers:
        seq = layer_lookups(trace, li, 0, tokens)
        use = np.zeros((len(seq), E))
        for t, need in enumerate(seq):
            use[t, need] = 1
        target = np.zeros_like(use)
        for j in range(1, horizon + 1):
            target[:-j] += discount ** (j - 1) * use[j:]
        pol = Scored(E)
        for t, need in enumerate(seq[:-horizon]):
            if t % 4 == 0 and t > 64:  # a sample of the steps is plenty
                Xs.append(pol.features(need))
                ys.append(target[t])
            pol.access(need)
    X, y = np.concatenate(Xs), np.concatenate(ys)
    w, *_ = np.linalg.lstsq(np.hstack([X, np.ones((len(X), 1))]), y, rcond=None)
    return tuple(round(float(v), 5) for v in w[:-1])
