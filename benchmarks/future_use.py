"""A learned predictor of each expert's use several tokens ahead, from the hidden state.

Issue 33, the policy bar (close half of the LRU-to-Belady gap in misses): ``predictive``
(a linear score of each expert's id history) closes about a third on the trained model,
and even a perfect next-token router oracle closes 0.32 at 16 slots and 0.11 at 32
(``router_eviction.py``): what Belady knows is reuse several tokens ahead. This asks
whether the model's own hidden state says it: per MoE layer, a linear "future-use head"
from the MoE block's input (what the host has when it evicts at that layer: the token's
hidden state before the experts run, optionally with its router probabilities) to one
score per expert, fitted by ridge regression (closed form) on the first half of the
held-out tokens of ``checkpoints/tiny-stdlib-moe``, measured on the second half.

- Target (one per run of the head): the discounted future use of each expert over the
  next ``N`` tokens at the layer, ``sum_{j=1..N} gamma^(j-1) used(e, t+j)``
  (``use N/gamma``), or the discounted distance to its next use, ``gamma^(d-1)`` for a
  next use ``d <= N`` tokens ahead, else 0 (``next N/gamma``: Belady's ranking, softened).
  Rows: tokens whose ``N_max`` = 32 next tokens lie in the same 256-token window (no
  target crosses a window boundary), and per expert only the tokens that do not use it
  (only those can evict it). Ridge strength per layer and head chosen by two-fold
  cross-validation over the first half's windows (halves of them).
- ``blend``: per layer, least squares of the same target on the head's out-of-fold score
  and the six history features of ``predictive`` (what the shipped score weighs), i.e. a
  fitted combination; ``history (refit)``: the same without the head (the control).
- Heads on the hidden state alone are fitted for their cross-validated error only (the
  router's probabilities change it in the fourth digit); the heads simulated read both.
- Demand caching per layer at 8, 16 and 32 of 64 slots on the second half, through the
  store's ``SlotCache``, with ``ScorePolicy``: the resident expert outside this token's
  set with the lowest score leaves, ties to the least recently used, then the lowest id
  (the order of the package's ranking). ``lru``, ``predictive`` (shipped weights, the
  package's own policy) and ``belady`` on the same tokens give the gap;
  ``predictive (score)`` is the shipped score through ``ScorePolicy`` (a check: the same
  misses), ``lru`` through it is minus the log recency.

Accuracy of each score: the mean Spearman correlation, over evictions (every fourth
lookup's, three candidates or more), between the score of the eviction candidates and minus their next-use distance
(1: Belady's order); the share of evictions whose victim is one Belady would pick (used
farthest ahead among the candidates); and, policy-free, the share of the experts used in
the next 8 tokens (not this token's) among the ``slots - |this token's|`` others it ranks
highest.

    nice -n 19 python benchmarks/future_use.py --windows 48 \
        --json benchmarks/results/future-use-2026-12-03.json
"""

from __future__ import annotations

import time

import numpy as np
from harness import ROOT, finish, log, parser
from router_eviction import CHECKPOINT, held_out, layer_misses, record

from mlx_streaming.core.cache.base_policy import Policy

SEQ = 256
N_MAX = 32  # the longest horizon: rows whose horizon crosses a window are left out
TARGETS = {"use 8/0.8": ("use", 8, 0.8), "use 32/0.9": ("use", 32, 0.9),
           "next 32/0.9": ("next", 32, 0.9)}  # fmt: skip
INPUTS = ("hidden", "hidden + router")
ALPHAS = (0.1, 1.0, 10.0)  # ridge strength, times the rows
RECALL_AHEAD = 8


def uses(top: np.ndarray, E: int) -> np.ndarray:
    """[T, E] 0/1: the experts of each token at one layer (``top`` [T, k])."""
    u = np.zeros((len(top), E))
    np.put_along_axis(u, top, 1.0, axis=1)
    return u


def target(use: np.ndarray, kind: str, n: int, gamma: float) -> np.ndarray:
    """[T, E]: the discounted use over the next ``n`` tokens (``use``) or ``gamma^(d-1)``
    for the next use ``d <= n`` tokens ahead (``next``). Rows near the end of the stream
    see fewer tokens (``rows`` leaves them out)."""
    y = np.zeros_like(use)
    seen = np.zeros_like(use, dtype=bool)
    for j in range(1, n + 1):
        ahead = np.zeros_like(use)
        ahead[:-j] = use[j:]
        if kind == "use":
            y += gamma ** (j - 1) * ahead
        else:
            first = (ahead > 0) & ~seen
            y[first] = gamma ** (j - 1)
            seen |= ahead > 0
    return y


def next_distance(use: np.ndarray) -> np.ndarray:
    """[T, E]: tokens to each expert's next use after t (a large number: never)."""
    T, E = use.shape
    d = np.full((T, E), 10 * T, dtype=np.int64)
    nxt = np.full(E, 10 * T + T, dtype=np.int64)
    for t in range(T - 1, -1, -1):
        d[t] = nxt - t
        nxt = np.where(use[t] > 0, t, nxt)
    return d


def history(top: np.ndarray, E: int) -> np.ndarray:
    """[T, E, 6]: the ``predictive`` features of every expert at each lookup, as the
    policy sees them when it picks victims (history up to the previous lookup, the
    transition term following this one's experts)."""
    from mlx_streaming.core.cache.scored import Scored

    pol = Scored(E, weights=(0.0,) * 6, native=False)
    out = np.zeros((len(top), E, 6))
    for t, row in enumerate(top):
        need = np.unique(row)
        out[t] = pol.features(need)
        pol.access(need)
    return out


def rows(T: int) -> np.ndarray:
    """Tokens whose next ``N_MAX`` tokens lie in the same window."""
    t = np.arange(T)
    return t[(t % SEQ) + N_MAX < SEQ]


def ridge(Z: np.ndarray, Y: np.ndarray, mask: np.ndarray, alphas) -> np.ndarray:
    """Per expert e and target k, ridge of ``Y[:, e, k]`` on ``Z`` (last column: the bias,
    unpenalised) over the rows where ``mask[:, e]``: weights [len(alphas), E, D, K]
    (float32)."""
    Z, Y = Z.astype(np.float32), Y.astype(np.float32)  # float32: half the time
    T, E, K = Y.shape
    D = Z.shape[1]
    G, B = Z.T @ Z, np.einsum("td,tek->edk", Z, Y)
    Gs = np.empty((E, D, D), np.float32)
    for e in range(E):
        off = ~mask[:, e]
        Zo = Z[off]
        Gs[e], B[e] = G - Zo.T @ Zo, B[e] - Zo.T @ Y[off, e]
    pen = np.ones(D, np.float32)
    pen[-1] = 0
    n = mask.sum(0).mean()
    return np.stack([np.linalg.solve(Gs + float(a * n) * np.diag(pen), B) for a in alphas])


def spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    def ranks(x):
        _, inv = np.unique(x, return_inverse=True)
        r = np.empty(len(x))
        r[np.argsort(x, kind="stable")] = np.arange(len(x))
        return (np.bincount(inv, r) / np.bincount(inv))[inv]

    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


class ScorePolicy(Policy):
    """Evicts the resident experts with the lowest ``score`` (set before each lookup),
    ties to the least recently used, then the lowest id: the order of the package's
    ranking (``Scored.victims``) with an outside score. Logs, at every ``sample``-th
    lookup with an eviction, the eviction accuracy against ``dist`` [T, E] (tokens to
    each expert's next use)."""

    def __init__(self, E: int, dist: np.ndarray, sample: int = 4):
        super().__init__(E)
        self.resident = np.zeros(E, bool)
        self.last = np.full(E, -1, np.int64)
        self.t, self.score, self.dist, self.sample = 0, np.zeros(E), dist, sample
        self.rho: list[float] = []
        self.agree: list[float] = []

    def access(self, experts):
        self.last[np.asarray(experts, np.int64)] = self.t
        self.t += 1

    def insert(self, expert):
        self.resident[expert] = True

    def remove(self, expert):
        self.resident[expert] = False

    def victims(self, n, protect):
        ok = self.resident & (self._pinned == 0)
        ok[np.asarray(protect, np.int64)] = False
        cand = np.flatnonzero(ok)
        if len(cand) <= n:
            return cand.tolist()
        order = np.lexsort((cand, self.last[cand], self.score[cand]))
        out = cand[order[:n]]
        if self.t % self.sample == 0:
            d = self.dist[self.t, cand]
            if len(cand) >= 3:
                r = spearman(self.score[cand], -d)
                if r is not None:
                    self.rho.append(r)
            self.agree.append(float(np.isin(self.dist[self.t, out], np.sort(d)[-n:]).mean()))
        return out.tolist()


def scored_misses(top: np.ndarray, S: np.ndarray, capacity: int, dist: np.ndarray):
    """Misses of one layer evicting the lowest of ``S`` [T, E] through ``SlotCache``,
    with the eviction accuracy: (misses, [spearman], [victim is one Belady would pick])."""
    from mlx_streaming.core.cache.slots import SlotCache

    pol = ScorePolicy(S.shape[1], dist)
    cache = SlotCache(S.shape[1], capacity, pol)
    for t, row in enumerate(top):
        cache.flush()  # the previous lookup's access, so that pol.t == t
        pol.score = S[t]
        cache.lookup(np.unique(row))
    return cache.stats.misses, pol.rho, pol.agree


def recall(top: np.ndarray, S: np.ndarray, capacity: int) -> tuple[int, int]:
    """(hits, asked): experts used in the next ``RECALL_AHEAD`` tokens (not this
    token's) among the ``capacity - |this token's|`` others ``S`` ranks highest."""
    T, E = S.shape
    use = uses(top, E) > 0
    t = rows(T)
    cur = use[t]
    fut = np.zeros_like(cur)
    for j in range(1, RECALL_AHEAD + 1):
        fut |= use[t + j]
    fut &= ~cur
    s = np.where(cur, -np.inf, S[t])
    rank = np.argsort(np.argsort(-s, axis=1, kind="stable"), axis=1)
    keep = rank < (capacity - cur.sum(1, keepdims=True))
    return int((fut & keep).sum()), int(fut.sum())


def main() -> None:
    p = parser(__doc__, preset=None, trace=False, workdir=None)
    p.add_argument("--windows", type=int, default=48, help="held-out windows of 256 tokens")
    a = p.parse_args()
    from mlx_streaming.core.cache.scored import PREDICTIVE_WEIGHTS

    t0 = time.perf_counter()
    model, ids, windows = held_out(a.windows, SEQ)
    windows -= windows % 4  # halves of whole windows, each half in two folds
    top, probs, hid = record(model, ids, SEQ, windows, hidden=True)
    del model
    T, L, E = probs.shape
    half = T // 2
    log(f"recorded {T} tokens x {L} layers x {E} experts, hidden {hid.shape[-1]}, "
        f"in {time.perf_counter() - t0:.0f}s")  # fmt: skip

    # ---- fit, per layer, on the first half
    tr = rows(half)
    fold = (tr // SEQ) < (half // SEQ) // 2  # first and second half of the windows
    test = {}  # layer -> name -> score [T - half, E]
    fitted = {}
    for li in range(L):
        use = uses(top[:, li], E)
        hist = history(top[:half, li], E), history(top[half:, li], E)
        mu, sd = hid[:half, li].mean(0), hid[:half, li].std(0) + 1e-6
        z = (hid[:, li] - mu) / sd
        Zs = {"hidden": z, "hidden + router": np.hstack([z, probs[:, li]])}
        Zs = {k: np.hstack([v, np.ones((T, 1))]) for k, v in Zs.items()}
        avail = use[:half][tr] == 0  # experts this token does not use: the candidates
        Y = np.stack([target(use, *v)[:half][tr] for v in TARGETS.values()], -1)
        H = hist[0][tr]
        S = {"lru": -hist[1][..., 0], "predictive (score)": hist[1] @ np.array(PREDICTIVE_WEIGHTS)}
        info = {}
        # out of fold, each expert's mean target (over the tokens that do not use it)
        base = []
        for k in range(len(TARGETS)):
            pred = np.zeros(Y.shape[:2])
            for f in (fold, ~fold):
                m = np.where(avail[~f], Y[~f, :, k], 0).sum(0) / avail[~f].sum(0)
                pred[f] = m
            base.append(float(((pred - Y[..., k]) ** 2)[avail].mean()))
        info["cv_mse_expert_mean"] = dict(zip(TARGETS, [round(b, 5) for b in base]))
        for inp in INPUTS:
            Z = Zs[inp][:half][tr]
            # two folds (halves of the windows): the ridge strength, out-of-fold scores
            oof = np.zeros((len(ALPHAS), len(tr), E, len(TARGETS)))
            for f in (fold, ~fold):
                W = ridge(Z[~f], Y[~f], avail[~f], ALPHAS)
                oof[:, f] = np.einsum("td,aedk->atek", Z[f], W)
            W = ridge(Z, Y, avail, ALPHAS)
            for k, tname in enumerate(TARGETS):
                y = Y[..., k]
                err = [float(((o[..., k] - y) ** 2)[avail].mean()) for o in oof]
                i = int(np.argmin(err))
                info[f"{tname} ({inp})"] = {
                    "alpha": ALPHAS[i], "cv_mse": round(err[i], 5),
                    "cv_r2_over_expert_mean": round(1 - err[i] / base[k], 4),
                }  # fmt: skip
                if inp != INPUTS[-1]:
                    continue  # fitted, not simulated: the router adds nothing (cv_mse)
                head = Zs[inp][half:] @ W[i, :, :, k].T
                S[f"head {tname} ({inp})"] = head
                # the blend: the same target on [head (out of fold), history, 1]
                X = np.concatenate([oof[i, ..., k, None], H, np.ones(H.shape[:2] + (1,))], -1)
                b, *_ = np.linalg.lstsq(X[avail], y[avail], rcond=None)
                S[f"blend {tname}"] = np.concatenate([head[..., None], hist[1]], -1) @ b[:-1]
                info[f"{tname} ({inp})"]["blend"] = [round(float(v), 5) for v in b]
                if k == 0:  # the control: history alone, as fit_predictive fits it
                    c, *_ = np.linalg.lstsq(X[avail][:, 1:], y[avail], rcond=None)
                    S["history (refit)"] = hist[1] @ c[:-1]
                    info["history (refit)"] = [round(float(v), 5) for v in c]
        test[li], fitted[li] = S, info
        log(f"layer {li} fitted ({time.perf_counter() - t0:.0f}s)")

    # ---- demand caching on the second half
    names = list(test[0])
    dists = [next_distance(uses(top[half:, li], E)) for li in range(L)]
    held, accuracy = {}, {}
    for c in (8, 16, 32):
        res = {k: sum(layer_misses(top[half:, li], probs[half:, li], c, policy=k)
                      for li in range(L)) for k in ("lru", "predictive", "belady")}  # fmt: skip
        acc = {}
        for k in names:
            m, rho, agree, hit, asked = 0, [], [], 0, 0
            for li in range(L):
                mi, r, g = scored_misses(top[half:, li], test[li][k], c, dists[li])
                h, n = recall(top[half:, li], test[li][k], c)
                m, rho, agree, hit, asked = m + mi, rho + r, agree + g, hit + h, asked + n
            res[k] = m
            acc[k] = {
                "eviction_spearman": round(float(np.mean(rho)), 3) if rho else None,
                "victim_is_belady_choice": round(float(np.mean(agree)), 3) if agree else None,
                f"recall_next_{RECALL_AHEAD}": round(hit / asked, 3),
            }
        lru, best = res["lru"], res["belady"]
        key = f"{c} slots"
        held[key] = {
            k: {"misses_per_token": round(v / (T - half), 3),
                "gap_closed": round((lru - v) / (lru - best), 3) if lru > best else 0}
            for k, v in res.items()
        }  # fmt: skip
        accuracy[key] = acc
        log(f"{key} ({time.perf_counter() - t0:.0f}s): " + ", ".join(
            f"{k} {v['gap_closed']}" for k, v in held[key].items()))  # fmt: skip
    finish(
        a,
        "future-use",
        {
            "checkpoint": str(CHECKPOINT.relative_to(ROOT)),
            "tokens": T,
            "fit_tokens": half,
            "fit_rows": int(len(tr)),
            "layers": L,
            "experts": E,
            "top_k": int(top.shape[-1]),
            "hidden": int(hid.shape[-1]),
            "targets": {k: list(v) for k, v in TARGETS.items()},
            "held_out_second_half": held,
            "accuracy": accuracy,
            "fitted": {str(k): v for k, v in fitted.items()},
        },
        t0,
    )


if __name__ == "__main__":
    main()
