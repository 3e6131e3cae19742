"""Guess the next MoE layer's experts and read them ahead.

Two predictors:

* ``RouterPredictor``: the next layer's router applied to the current layer's input
  (the residual stream changes little from one layer to the next). Its lazy part is
  evaluated together with the current routing, so it costs no extra host sync.
* ``TransitionPredictor``: co-activation counts ``C[l][e, e']`` (expert ``e`` at MoE layer
  ``l`` and ``e'`` at ``l + 1`` for the same token), learned from a recorded trace. It
  needs no hidden state, so it also works when a trace replaces the routing.

``Prefetcher`` turns predictions into ``FileExpertStore.prefetch`` calls, issued as soon
as the current layer's own reads have landed and its expert graph is launched: the
guesses load while the host builds the rest of the layer and the next one's attention
(on the native reader, as its one started read), and no read-ahead holds the reader
while a layer's misses wait. The store scores them against the routing that follows
(precision and recall in its report).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class RouterPredictor:
    """Top-``m`` of the next layer's router logits on the current layer's input."""

    name = "router"

    def __init__(self, routers: list[nn.Module | None], m: int):
        self.routers, self.m = routers, m

    def lazy(self, pos: int, x: mx.array) -> mx.array | None:
        if pos + 1 >= len(self.routers) or self.routers[pos + 1] is None:
            return None
        r = self.routers[pos + 1]
        if isinstance(r, (nn.Linear, nn.QuantizedLinear)):
            logits = r(x)
        else:  # e.g. DeepSeek's MoEGate: a bare weight, plus a selection bias
            logits = x @ r.weight.T
            if "e_score_correction_bias" in r:
                logits = mx.sigmoid(logits.astype(mx.float32)) + r.e_score_correction_bias
        m = min(self.m, logits.shape[-1])
        return mx.argpartition(-logits, kth=m - 1, axis=-1)[..., :m]

    def predict(self, pos: int, host_ids: np.ndarray, lazy: np.ndarray | None) -> np.ndarray:
        return np.unique(lazy) if lazy is not None else np.zeros(0, np.int64)


class TransitionPredictor:
    """Experts that most often follow the current ones in the next layer."""

    name = "transition"

    def __init__(self, counts: np.ndarray, m: int):
        self.counts, self.m = counts, m  # [L - 1, E, E]

    @classmethod
    def from_trace(cls, trace, m: int) -> TransitionPredictor:
        e = trace.experts.astype(np.int64)  # [T, L, k]
        T, L, k = e.shape
        E = trace.num_experts
        counts = np.zeros((L - 1, E, E), np.float32)
        for li in range(L - 1):
            a = np.repeat(e[:, li, :], k, axis=1).reshape(-1)
            b = np.tile(e[:, li + 1, :], (1, k)).reshape(-1)
            np.add.at(counts[li], (a, b), 1)
        return cls(counts, m)

    def lazy(self, pos: int, x: mx.array) -> None:
        return None

    def predict(self, pos: int, host_ids: np.ndarray, lazy=None) -> np.ndarray:
        if pos >= len(self.counts):
            return np.zeros(0, np.int64)
        score = self.counts[pos][np.unique(host_ids)].sum(axis=0)
        m = min(self.m * max(1, host_ids.size // host_ids.shape[-1]), score.size)
        return np.sort(np.argpartition(-score, m - 1)[:m])


class Prefetcher:
    """Reads ahead the next MoE layer's predicted experts; the store scores each
    prediction against the routing that follows (``FileExpertStore.note_prediction``)."""

    def __init__(self, store, layers: list[int], predictor, max_tokens: int = 4):
        self.store, self.layers, self.predictor = store, layers, predictor
        self.max_tokens = max_tokens
        self._last: dict[int, np.ndarray] = {}  # layer position -> prediction for it

    def lazy(self, pos: int, x: mx.array, indices: mx.array) -> mx.array | None:
        if indices.size // indices.shape[-1] > self.max_tokens:
            return None
        return self.predictor.lazy(pos, x)

    def issue(self, pos: int) -> None:
        """Read ahead the experts predicted for layer position ``pos`` (called once the
        call before it has launched its experts)."""
        pred = self._last.get(pos)  # popped, and scored, by layer ``pos``'s ``step``
        if pred is not None:
            self.store.prefetch(self.layers[pos], pred)

    def step(self, pos: int, host_ids: np.ndarray, lazy: np.ndarray | None) -> None:
        """Score the prediction made for this layer, then predict the next."""
        guess = self._last.pop(pos, None)
        if guess is not None:
            self.store.note_prediction(self.layers[pos], guess, np.unique(host_ids))
        if host_ids.size // host_ids.shape[-1] > self.max_tokens or pos + 1 >= len(self.layers):
            return
        pred = self.predictor.predict(pos, host_ids, lazy)
        if len(pred):
            self._last[pos + 1] = pred
