"""Eviction by the model's own router: how much of the LRU-to-Belady gap it closes.

Issue 33, item 3: history alone closes about a quarter of the gap between LRU's misses and
Belady's (the offline optimum) on DeepSeek-V2-Lite's routing. What Belady knows and
history does not is when each resident expert will next be used. The model's router says
more about that than the ids alone: an expert that scored just below the top-k at this
token is likely to be chosen soon. The DeepSeek-V2-Lite trace holds ids only, so this
runs on the trained model (``checkpoints/tiny-stdlib-moe``, real routers on held-out
Python), whose router probabilities at every token and layer it records.

Demand caching per MoE layer at 1/8, 1/4 and 1/2 of the experts, one lookup per token
(the token's distinct experts must be resident; victims are chosen among the others),
every row through the store's own slot tables (``SlotCache``); the router rankings are
the package's ranking with its history weights at 0 and router terms added (ties to the
least recently used):

- ``lru``, ``belady``: the two ends of the gap; ``predictive``: the package's default
  (its weights as shipped);
- ``soft-ema b``: evict the resident expert with the lowest exponential average (decay
  ``b``) of its router probability, this token's included (what the host knows when it
  evicts: this token's routing is in hand);
- ``next-router (oracle)``: evict by the next token's router probability at this layer,
  which no online policy has: how far a perfect next-token router predictor would go;
  ``+ soft-ema 0.95``: that oracle plus the history of the averages.

Each row: misses per token, the share of the gap closed, and for the soft averages the
predictor's accuracy: the share of the next token's experts among the ``capacity``
experts it ranks highest.

    python benchmarks/router_eviction.py --json benchmarks/results/router-eviction.json
"""

from __future__ import annotations

import time

import numpy as np
from harness import ROOT, finish, log, parser

CHECKPOINT = ROOT / "checkpoints" / "tiny-stdlib-moe"


def held_out(windows: int, seq: int = 256):
    """The trained model, its held-out text's token ids, and how many of the ``windows``
    of ``seq`` tokens that text holds: ``(model, ids, windows)``."""
    from mlx_lm import load

    from mlx_streaming.synthetic.train import held_out_text

    model, tok = load(str(CHECKPOINT))
    ids = np.array(tok.encode(held_out_text(CHECKPOINT)), dtype=np.int32)
    return model, ids, min(windows, len(ids) // seq)


def record(model, ids: np.ndarray, seq: int, windows: int, hidden: bool = False):
    """Top-k ids [T, L, k] and router probabilities [T, L, E] over held-out windows; with
    ``hidden``, also each MoE block's input [T, L, D] (what the router reads, before the
    experts run)."""
    import mlx.core as mx

    layers = model.model.layers
    k = layers[0].mlp.top_k
    seen, inputs = [], []
    gates = [layer.mlp.gate for layer in layers]

    class Tap:
        def __init__(self, gate):
            self.gate = gate

        def __call__(self, x):
            out = self.gate(x)
            seen.append(out)
            if hidden:
                inputs.append(x)
            return out

    for layer, g in zip(layers, gates):
        layer.mlp.gate = Tap(g)
    top, probs, xs = [], [], []
    try:
        for w in range(windows):
            seen.clear()
            inputs.clear()
            model(mx.array(ids[w * seq : (w + 1) * seq])[None])
            logits = mx.stack([s[0] for s in seen], 1).astype(mx.float32)  # [S, L, E]
            p = mx.softmax(logits, axis=-1)
            top.append(np.array(mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]))
            probs.append(np.array(p))
            if hidden:
                xs.append(np.array(mx.stack([x[0] for x in inputs], 1).astype(mx.float32)))
    finally:
        for layer, g in zip(layers, gates):
            layer.mlp.gate = g
    out = np.concatenate(top).astype(np.int64), np.concatenate(probs)
    return (*out, np.concatenate(xs)) if hidden else out


def ema_accuracy(top: np.ndarray, probs: np.ndarray, capacity: int, decay: float) -> float:
    """Share of each next token's experts among the ``capacity`` experts with the highest
    soft average of router probabilities (this token's included): the soft averages'
    accuracy as a predictor of the next token's routing."""
    ema, hit, asked = np.zeros(probs.shape[-1]), 0, 0
    for t in range(len(top) - 1):
        ema = decay * ema + (1 - decay) * probs[t]
        nxt = np.unique(top[t + 1])
        hit += np.isin(nxt, np.argsort(-ema)[:capacity]).sum()
        asked += len(nxt)
    return hit / asked


def router_scored(E: int, weights, extra=(0.0, 0.0), decay: float = 0.95):
    """The package's ranking (numpy reference) with two more terms: the soft average of
    the expert's router probability (this token's included) and this token's (or, for
    the oracles, the next token's)."""
    from mlx_streaming.core.cache.scored import Scored

    class RouterScored(Scored):
        def __init__(self):
            super().__init__(E, weights=weights, native=False)
            self.ema, self.cur, self.extra = np.zeros(E), np.zeros(E), extra

        def see(self, p: np.ndarray, ahead: np.ndarray | None = None) -> None:
            self.ema = decay * self.ema + (1 - decay) * p
            self.cur = p if ahead is None else ahead

        def scores(self, current):
            return super().scores(current) + self.extra[0] * self.ema + self.extra[1] * self.cur

    return RouterScored()


def fit(top: np.ndarray, probs: np.ndarray, router: bool, horizon=8, discount=0.8):
    """Least-squares weights, as ``planning.simulate.fit_predictive`` fits the shipped
    ones (target: discounted use over the next ``horizon`` lookups), on ``top``/``probs``
    [T, L, ...]; with ``router``, the two router terms too. Returns (weights, extra)."""
    T, L, E = probs.shape
    Xs, ys = [], []
    for li in range(L):
        use = np.zeros((T, E))
        for t in range(T):
            use[t, top[t, li]] = 1
        target = np.zeros_like(use)
        for j in range(1, horizon + 1):
            target[:-j] += discount ** (j - 1) * use[j:]
        pol = router_scored(E, (0.0,) * 6)
        for t in range(T - horizon):
            need = np.unique(top[t, li])
            pol.see(probs[t, li])
            if t % 4 == 0 and t > 64:
                f = pol.features(need)
                if router:
                    f = np.hstack([f, pol.ema[:, None], pol.cur[:, None]])
                Xs.append(f)
                ys.append(target[t])
            pol.access(need)
    X, y = np.concatenate(Xs), np.concatenate(ys)
    w, *_ = np.linalg.lstsq(np.hstack([X, np.ones((len(X), 1))]), y, rcond=None)
    w = [round(float(v), 5) for v in w[:-1]]
    return tuple(w[:6]), (tuple(w[6:]) if router else (0.0, 0.0))


def layer_misses(top: np.ndarray, probs: np.ndarray, capacity: int, policy: str,
                 weights=(0.0,) * 6, extra=(0.0, 0.0), decay: float = 0.95) -> int:  # fmt: skip
    """Misses of one layer (``top`` [T, k], ``probs`` [T, E]) through the store's
    ``SlotCache``: ``lru``, ``predictive`` or ``belady`` (the package's policies), or
    ``router`` (``router_scored`` with ``weights``, ``extra`` and ``decay``) or
    ``router-ahead`` (the same, its second term the next token's probabilities)."""
    from mlx_streaming.core.cache.policy import Belady, make_policy
    from mlx_streaming.core.cache.slots import SlotCache

    E = probs.shape[-1]
    lookups = [np.unique(row) for row in top]
    if policy == "belady":
        pol = Belady(E, lookups)
    elif policy.startswith("router"):
        pol = router_scored(E, weights, extra, decay)
    else:
        pol = make_policy(policy, E)
    cache = SlotCache(E, capacity, pol)
    for t, need in enumerate(lookups):
        if policy == "router":
            pol.see(probs[t])
        elif policy == "router-ahead":
            pol.see(probs[t], probs[min(t + 1, len(top) - 1)])
        cache.lookup(need)
    return cache.stats.misses


def main() -> None:
    p = parser(__doc__, preset=None, trace=False, workdir=None)
    p.add_argument("--windows", type=int, default=48, help="held-out windows of 256 tokens")
    a = p.parse_args()
    t0 = time.perf_counter()
    seq = 256
    model, ids, windows = held_out(a.windows, seq)
    top, probs = record(model, ids, seq, windows)
    T, L, E = probs.shape
    log(f"recorded {T} tokens x {L} layers x {E} experts in {time.perf_counter() - t0:.0f}s")
    rows = {}
    for frac in (8, 4, 2):
        c = E // frac
        res: dict[str, dict] = {}
        named = {"lru": {"policy": "lru"}, "belady": {"policy": "belady"}}
        named |= {f"soft-ema {b}": {"policy": "router", "extra": (1.0, 0.0), "decay": b}
                  for b in (0.5, 0.9, 0.95, 0.98, 0.99)}  # fmt: skip
        named["next-router (oracle)"] = {"policy": "router-ahead", "extra": (0.0, 1.0)}
        named["next-router + soft-ema 0.95 (oracle)"] = {"policy": "router-ahead",
                                                         "extra": (1.0, 1.0)}  # fmt: skip
        named["predictive"] = {"policy": "predictive"}
        for label, kw in named.items():
            res[label] = {
                "misses": sum(layer_misses(top[:, li], probs[:, li], c, **kw) for li in range(L)),
                "predictor_accuracy": round(float(np.mean([
                    ema_accuracy(top[:, li], probs[:, li], c, kw["decay"]) for li in range(L)
                ])), 3) if "decay" in kw else None,
            }  # fmt: skip
        lru, best = res["lru"]["misses"], res["belady"]["misses"]
        for r in res.values():
            r["misses_per_token"] = round(r["misses"] / T, 3)
            r["gap_closed"] = round((lru - r["misses"]) / (lru - best), 3) if lru > best else 0
        rows[f"1/{frac} ({c} slots)"] = res
        log(f"1/{frac}: " + ", ".join(f"{k} {v['gap_closed']}" for k, v in res.items()))
    # learned on the first half of the tokens, measured on the second
    half = T // 2
    learned = {"history (refit here)": fit(top[:half], probs[:half], False),
               "history + router": fit(top[:half], probs[:half], True)}  # fmt: skip
    held = {}
    for frac in (8, 4, 2):
        c = E // frac
        res = {}
        cases = {"lru": {"policy": "lru"}, "belady": {"policy": "belady"},
                 "predictive (shipped)": {"policy": "predictive"}}  # fmt: skip
        cases |= {
            k: {"policy": "router", "weights": w, "extra": x} for k, (w, x) in learned.items()
        }
        for label, kw in cases.items():
            res[label] = sum(
                layer_misses(top[half:, li], probs[half:, li], c, **kw) for li in range(L)
            )  # fmt: skip
        lru, best = res["lru"], res["belady"]
        held[f"1/{frac} ({c} slots)"] = {
            k: {"misses_per_token": round(v / (T - half), 3),
                "gap_closed": round((lru - v) / (lru - best), 3) if lru > best else 0}
            for k, v in res.items()
        }  # fmt: skip
        log(f"held-out 1/{frac}: " + ", ".join(
            f"{k} {v['gap_closed']}" for k, v in held[f"1/{frac} ({c} slots)"].items()))  # fmt: skip
    finish(
        a,
        "router-eviction",
        {
            "checkpoint": str(CHECKPOINT.relative_to(ROOT)),
            "tokens": T,
            "layers": L,
            "experts": E,
            "top_k": int(top.shape[-1]),
            "rows": rows,
            "learned_weights": {k: {"history": w, "router": x} for k, (w, x) in learned.items()},
            "held_out_second_half": held,
        },
        t0,
    )


if __name__ == "__main__":
    main()
