"""How well each guess of a MoE layer's experts matches its routing, on the trained model
(issue 33, item 3: read-ahead needs guesses right ~90% of the time to pay).

``checkpoints/tiny-stdlib-moe`` (8 MoE layers, 64 experts, top-6, real routers) over
held-out windows. Per layer L and token, the share of the true top-k found among:

- ``next router`` (``RouterPredictor``, the read-ahead default): layer L+1's router on
  layer L's MoE input, the guess available one whole layer ahead;
- ``pre-attention``: layer L's own router on layer L's input before attention (through
  L's post-attention norm), available as soon as layer L-1's output is, one attention
  block ahead; other projects report 93-97.6% for predictors of this kind on large
  models;
- ``previous token``: the same layer's experts at the token before (history).

Each row is a guess of ``m`` experts (k, k + 2 and 2k): the share of the true top-k among
the guess's top m (m - k extra reads per layer bought for the recall).

    python benchmarks/probes/predictor_accuracy.py --json benchmarks/results/predictor-accuracy.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import finish, log, parser  # noqa: E402
from router_eviction import CHECKPOINT, held_out  # noqa: E402


def _top(logits, m: int) -> np.ndarray:
    import mlx.core as mx

    return np.array(mx.argpartition(-logits.astype(mx.float32), kth=m - 1, axis=-1)[..., :m])


def record(model, ids: np.ndarray, seq: int, windows: int, m: int) -> dict[str, np.ndarray]:
    """Per guess, [T, L, m] ids aligned with the layer they guess (-1: no guess);
    ``truth``: [T, L, k]. The decoder layers run one by one, as mlx-lm's do."""
    import mlx.core as mx

    layers = model.model.layers
    L, k = len(layers), layers[0].mlp.top_k
    names = ("truth", "next router", "pre-attention")
    out = {n: [] for n in names}
    for w in range(windows):
        h = model.model.embed_tokens(mx.array(ids[w * seq : (w + 1) * seq])[None])
        inputs, moe_in = [], []
        for layer in layers:
            inputs.append(h)
            h = h + layer.self_attn(layer.input_layernorm(h), "causal", None)
            moe_in.append(layer.post_attention_layernorm(h))
            h = h + layer.mlp(moe_in[-1])
        none = np.full((seq, m), -1)

        def gate(i, x, n):
            return _top(layers[i].mlp.gate(x), n)[0]

        out["truth"].append(np.stack([gate(i, moe_in[i], k) for i in range(L)], 1))
        out["pre-attention"].append(np.stack(
            [gate(i, layers[i].post_attention_layernorm(inputs[i]), m) for i in range(L)], 1
        ))  # fmt: skip
        # guesses for layer i made at layer i - 1
        out["next router"].append(np.stack(
            [gate(i, moe_in[i - 1], m) if i else none for i in range(L)], 1
        ))  # fmt: skip
    return {n: np.concatenate(v) for n, v in out.items()}


def recall(guess: np.ndarray, truth: np.ndarray, layers) -> float:
    """Share of the true ids (over ``layers``) found in the guess of the same row."""
    hit = n = 0
    for t in range(len(truth)):
        for li in layers:
            g = guess[t, li]
            hit += np.isin(truth[t, li], g[g >= 0]).sum()
            n += truth.shape[-1]
    return round(hit / n, 4)


def main() -> None:
    p = parser(__doc__, preset=None, trace=False, workdir=None)
    p.add_argument("--windows", type=int, default=16, help="held-out windows of 256 tokens")
    a = p.parse_args()
    t0 = time.perf_counter()
    seq = 256
    model, ids, windows = held_out(a.windows, seq)
    k = model.model.layers[0].mlp.top_k
    rows = []
    for m in (k, k + 2, 2 * k):
        rec = record(model, ids, seq, windows, m)
        truth = rec["truth"]
        L = truth.shape[1]
        prev = np.concatenate([np.full((1, L, k), -1), truth[:-1]])  # token before
        row = {"guess": m, "tokens": len(truth)}
        row["pre-attention"] = recall(rec["pre-attention"], truth, range(L))
        row["next router"] = recall(rec["next router"], truth, range(1, L))
        row["previous token"] = recall(prev, truth, range(L)) if m == k else None
        log(row)
        rows.append(row)
    finish(a, "predictor_accuracy", {"checkpoint": str(CHECKPOINT), "windows": windows,
                                     "top_k": k, "rows": rows}, t0)  # fmt: skip


if __name__ == "__main__":
    main()
