"""Exactness against stock mlx-lm: identical tokens and identical logits.

``greedy_trace`` runs a model the way ``mlx_lm.generate_step`` does (prompt in chunks of
``prefill_step_size``, then one token at a time, greedy) and keeps every step's logits;
``compare`` runs two models that way and reports the first difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache


@dataclass
class Trace:
    tokens: list[int]
    logits: np.ndarray  # [steps, vocab] float32 (bit-exact copy of the model's logits)


def _batched(prompts) -> mx.array:
    arr = mx.array(prompts)
    return arr if arr.ndim == 2 else arr[None]


def greedy_trace(model, prompt, max_tokens: int, prefill_step_size: int = 2048) -> Trace:
    """Greedy decode of ``prompt`` (token ids, or a [B, T] list) keeping all logits."""
    toks = _batched(prompt)
    cache = make_prompt_cache(model)
    i, n = 0, toks.shape[1]
    while n - i > 1:
        m = min(prefill_step_size, n - 1 - i)
        model(toks[:, i : i + m], cache=cache)
        mx.eval([c.state for c in cache])
        i += m
    y = toks[:, i:]
    tokens, logits = [], []
    for _ in range(max_tokens):
        lg = model(y, cache=cache)[:, -1, :]
        nxt = mx.argmax(lg, axis=-1)
        mx.eval(lg, nxt)
        logits.append(np.array(lg.astype(mx.float32)))
        tokens.append(nxt.tolist())
        y = nxt[:, None]
    arr = np.stack(logits, axis=1)  # [B, steps, vocab]
    if arr.shape[0] == 1:
        return Trace([t[0] for t in tokens], arr[0])
    return Trace([list(t) for t in zip(*tokens)], arr)


@dataclass
class Comparison:
    tokens_equal: bool
    logits_equal: bool
    max_abs_diff: float
    first_token_diff: int | None  # step of the first differing token

    @property
    def exact(self) -> bool:
        return self.tokens_equal and self.logits_equal

    def to_json(self) -> dict:
        return {
            "exact": self.exact,
            "tokens_equal": self.tokens_equal,
            "logits_equal": self.logits_equal,
            "max_abs_logit_diff": self.max_abs_diff,
            "first_token_diff": self.first_token_diff,
        }


def compare_traces(a: Trace, b: Trace) -> Comparison:
    first = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
    same_shape = a.logits.shape == b.logits.shape
    diff = float(np.abs(a.logits - b.logits).max()) if same_shape else float("inf")
    return Comparison(
        a.tokens == b.tokens,
        same_shape and np.array_equal(a.logits, b.logits, equal_nan=True),
        diff,
        first,
    )


def compare(
    reference, candidate, prompt, max_tokens: int, prefill_step_size: int = 2048
) -> Comparison:
    """Run both models greedily on ``prompt`` and compare tokens and logits."""
    ref = greedy_trace(reference, prompt, max_tokens, prefill_step_size)
    got = greedy_trace(candidate, prompt, max_tokens, prefill_step_size)
    return compare_traces(ref, got)
