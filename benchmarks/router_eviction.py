"""Eviction by the model's own router: how much of the LRU-to-Belady gap it closes.

Issue 33, item 3: history alone closes about a quarter of the gap between LRU's misses and
Belady's (the offline optimum) on DeepSeek-V2-Lite's routing. What Belady knows and
history does not is when each resident expert will next be used. The model's router says
more about that than the ids alone: an expert that scored just below the top-k at this
token is likely to be chosen soon. The DeepSeek-V2-Lite trace holds ids only, so this
runs on the trained model (``checkpoints/tiny-stdlib-moe``, real routers on held-out
Python), whose router probabilities at every token and layer it records.

Demand caching per MoE layer at 1/8, 1/4 and 1/2 of the experts, one lookup per token
(the token's distinct experts must be resident; victims are chosen among the others):

- ``lru``, ``belady``: the two ends of the gap; ``predictive``: the package's default
  (its weights as shipped), through the store's own slot tables;
- ``soft-ema b``: evict the resident expert with the lowest exponential average (decay
  ``b``) of its router probability, this token's included (what the host knows when it
  evicts: this token's routing is in hand);
- ``soft-ema b + lru``: the same, ties and near-ties broken by recency (the average
  plus a small recency term);
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


def record(model, ids: np.ndarray, seq: int, windows: int):
    """Top-k ids [T, L, k] and router probabilities [T, L, E] over held-out windows."""
    import mlx.core as mx

    layers = model.model.layers
    k = layers[0].mlp.top_k
    seen = []
    gates = [layer.mlp.gate for layer in layers]

    class Tap:
        def __init__(self, gate):
            self.gate = gate

        def __call__(self, x):
            out = self.gate(x)
            seen.append(out)
            return out

    for layer, g in zip(layers, gates):
        layer.mlp.gate = Tap(g)
    top, probs = [], []
    try:
        for w in range(windows):
            seen.clear()
            model(mx.array(ids[w * seq : (w + 1) * seq])[None])
            logits = mx.stack([s[0] for s in seen], 1).astype(mx.float32)  # [S, L, E]
            p = mx.softmax(logits, axis=-1)
            top.append(np.array(mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]))
            probs.append(np.array(p))
    finally:
        for layer, g in zip(layers, gates):
            layer.mlp.gate = g
    return np.concatenate(top).astype(np.int64), np.concatenate(probs)


def simulate_layer(top: np.ndarray, probs: np.ndarray, capacity: int, policy: str,
                   decay: float = 0.5) -> tuple[int, float]:  # fmt: skip
    """Misses of one layer's demand cache (``top`` [T, k], ``probs`` [T, E]) and, for the
    soft averages, the predictor's accuracy (share of the next token's experts among
    its ``capacity`` best-ranked)."""
    T, E = probs.shape
    resident = np.zeros(E, bool)
    last = np.full(E, -1.0)
    ema = np.zeros(E)
    next_use = None
    if policy == "belady":
        next_use = np.full((T, E), np.inf)
        upcoming = np.full(E, np.inf)
        for t in range(T - 1, -1, -1):
            next_use[t] = upcoming
            upcoming[np.unique(top[t])] = t
    misses, hit_next, asked = 0, 0, 0
    for t in range(T):
        need = np.unique(top[t])
        if policy.startswith("soft-ema") or policy == "next-router+ema":
            ema = decay * ema + (1 - decay) * probs[t]
            if t + 1 < T:
                ranked = np.argsort(-ema)[:capacity]
                nxt = np.unique(top[t + 1])
                hit_next += np.isin(nxt, ranked).sum()
                asked += len(nxt)
        last[need] = t
        miss = need[~resident[need]]
        misses += len(miss)
        free = capacity - int(resident.sum())
        over = len(miss) - free
        if over > 0:
            cand = np.flatnonzero(resident)
            cand = cand[~np.isin(cand, need)]
            if policy == "lru":
                score = last[cand]
            elif policy == "belady":
                score = -next_use[t][cand]
            elif policy == "soft-ema":
                score = ema[cand]
            elif policy == "soft-ema+lru":
                score = ema[cand] + 1e-3 * last[cand] / T
            elif policy == "next-router":
                score = probs[min(t + 1, T - 1)][cand]
            elif policy == "next-router+ema":
                score = probs[min(t + 1, T - 1)][cand] + ema[cand]
            else:
                raise ValueError(policy)
            resident[cand[np.argsort(score, kind="stable")[:over]]] = False
        resident[miss] = True
    return misses, (hit_next / asked if asked else float("nan"))


def router_scored(E: int, weights, extra=(0.0, 0.0), decay: float = 0.95):
    """The package's ranking (numpy reference) with two more terms: the soft average of
    the expert's router probability (this token's included) and this token's."""
    from mlx_streaming.core.cache.scored import Scored

    class RouterScored(Scored):
        def __init__(self):
            super().__init__(E, weights=weights, native=False)
            self.ema, self.cur, self.extra = np.zeros(E), np.zeros(E), extra

        def see(self, p: np.ndarray) -> None:
            self.ema = decay * self.ema + (1 - decay) * p
            self.cur = p

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


def scored_misses(top, probs, capacity, weights, extra) -> int:
    """Misses of one layer under ``router_scored`` through the store's ``SlotCache``."""
    from mlx_streaming.core.cache.slots import SlotCache

    E = probs.shape[-1]
    pol = router_scored(E, weights, extra)
    cache = SlotCache(E, capacity, pol)
    for t in range(len(top)):
        pol.see(probs[t])
        cache.lookup(np.unique(top[t]))
    return cache.stats.misses


def package_policy(top: np.ndarray, capacity: int, name: str) -> int:
    """Misses of the package's own policy ``name`` through ``SlotCache``."""
    from mlx_streaming.core.cache.policy import make_policy
    from mlx_streaming.core.cache.slots import SlotCache

    E = int(top.max()) + 1
    cache = SlotCache(E, capacity, make_policy(name, E, capacity))
    before = cache.stats.misses
    for row in top:
        cache.lookup(np.unique(row))
    return cache.stats.misses - before


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--windows", type=int, default=48, help="held-out windows of 256 tokens")
    a = p.parse_args()
    from mlx_lm import load

    from mlx_streaming.synthetic.train import held_out_text

    t0 = time.perf_counter()
    model, tok = load(str(CHECKPOINT))
    seq = 256
    ids = np.array(tok.encode(held_out_text(CHECKPOINT)), dtype=np.int32)
    windows = min(a.windows, len(ids) // seq)
    top, probs = record(model, ids, seq, windows)
    T, L, E = probs.shape
    log(f"recorded {T} tokens x {L} layers x {E} experts in {time.perf_counter() - t0:.0f}s")
    rows = {}
    for frac in (8, 4, 2):
        c = E // frac
        res: dict[str, dict] = {}
        named = [("lru", "lru", 0), ("belady", "belady", 0)]
        named += [(f"soft-ema {b}", "soft-ema", b) for b in (0.5, 0.9, 0.95, 0.98, 0.99)]
        named += [(f"soft-ema {b} + lru", "soft-ema+lru", b) for b in (0.95,)]
        named += [("next-router (oracle)", "next-router", 0)]
        named += [("next-router + soft-ema 0.95 (oracle)", "next-router+ema", 0.95)]
        for label, pol, b in named:
            out = [simulate_layer(top[:, li], probs[:, li], c, pol, b) for li in range(L)]
            res[label] = {"misses": sum(m for m, _ in out),
                          "predictor_accuracy": round(float(np.mean([x for _, x in out])), 3)
                          if pol.startswith("soft") else None}  # fmt: skip
        res["predictive"] = {
            "misses": sum(package_policy(top[:, li], c, "predictive") for li in range(L)),
            "predictor_accuracy": None,
        }
        check = sum(package_policy(top[:, li], c, "lru") for li in range(L))
        assert check == res["lru"]["misses"], (check, res["lru"])  # the same bookkeeping
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
    from mlx_streaming.core.cache.scored import PREDICTIVE_WEIGHTS

    held = {}
    for frac in (8, 4, 2):
        c = E // frac
        res = {}
        for label, pol in (("lru", "lru"), ("belady", "belady")):
            res[label] = sum(
                simulate_layer(top[half:, li], probs[half:, li], c, pol)[0] for li in range(L)
            )  # fmt: skip
        cases = {"predictive (shipped)": (PREDICTIVE_WEIGHTS, (0.0, 0.0)), **learned}
        for label, (w, extra) in cases.items():
            res[label] = sum(
                scored_misses(top[half:, li], probs[half:, li], c, w, extra) for li in range(L)
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
