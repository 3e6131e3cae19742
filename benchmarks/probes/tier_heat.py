"""Which record a full bounded swap tier should drop, on real routing. Rules (``--rules``):

- ``coldest``: the store's, by the slot tables' decayed lookups (``SlotCache.heat``);
- ``oldest``: the row written longest ago (the store's before 2026-12-06);
- ``lru``: the record whose expert was looked up longest ago;
- ``decay:D``: lookups decayed by D per token (the store's heat decays by 0.97);
- ``ridge-own`` / ``ridge-all``: a learned guess of each expert's use over the next
  tokens (lookups discounted by 0.97 a token), a ridge regression on the trace's first
  half from the layer's own decayed lookups, or every layer's (each rule, as the store's
  heat, counts from the window's start);
- ``prior:W``: each expert's share of the lookups in the trace's first half (a recorded
  trace's popularity, fixed), plus W times the window's lookups decayed by 0.97;
- ``seqreset:F``: the store's heat (lookups decayed by 0.97), scaled by F at each of the
  trace's sequence starts, as a server could at each new request (F=0: forgotten);
- ``furthest``: the expert next used furthest ahead, Belady's choice among the rows,
  which no store can know: the headroom left to the tier's rule (the victim itself
  always takes a row, as in the store).

The two-tier simulator (``planning.tiers.simulate_tiers``, exclusive: the store's swap
tier, which the store matches call for call) replays two windows of the trace's second
half, one token a call, through the default policy's pools and a bounded tier beneath
them, every other layer; each row is disk MB per token at DeepSeek-V2-Lite's record size
per rule, and each rule's ratio to ``coldest``.

    python benchmarks/probes/tier_heat.py --json /tmp/tier-heat.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from harness import finish, parser  # noqa: E402

from mlx_streaming.planning import tiers  # noqa: E402
from mlx_streaming.planning.simulate import layer_lookups  # noqa: E402
from mlx_streaming.planning.trace import RoutingTrace  # noqa: E402

KNOWN = ("coldest", "oldest", "lru", "ridge-own", "ridge-all", "furthest")
NUMBERED = ("decay", "prior", "seqreset")  # rules that take a number: decay:0.99
RECORD = 4_866_048  # DS2-Lite's 4-bit expert record, bytes
SPLITS = ((8, 4.43), (16, 4.43), (16, 2.0), (32, 3.0))  # slots per layer, tier GB
DISCOUNT = 0.97  # the learned rules' target: lookups over the next tokens, discounted


class _Rule(tiers._SwapRows):
    """The tier with the rows ranked by ``score(layer, call)`` (lowest out first) in
    place of the heat; one token a call, so a layer's k-th ``keep`` is its k-th call."""

    score = None  # (layer, call in the window) -> a score per expert; None: the heat

    def __init__(self, layers, slots, rows, num_experts):
        super().__init__(layers, slots, rows, num_experts)
        self.calls = dict.fromkeys(layers, 0)

    def keep(self, li, placed, found, heat):
        t, self.calls[li] = self.calls[li], self.calls[li] + 1
        return super().keep(li, placed, found, heat if self.score is None else self.score(li, t))


def usage(trace) -> np.ndarray:
    """Each token's lookups, one-hot per (layer, expert): [tokens, layers * experts]."""
    T, L, E = trace.tokens, trace.layers, trace.num_experts
    ex = trace.experts.astype(np.int64)
    x = np.zeros((T, L * E), np.float32)
    x[np.repeat(np.arange(T), L * ex.shape[2]), (np.arange(L)[None, :, None] * E + ex).ravel()] = 1
    return x


def decayed(x: np.ndarray, d: float, ahead: bool = False) -> np.ndarray:
    """Lookups decayed by ``d`` a token: up to each token (itself included), or after it."""
    out, acc = np.empty_like(x), np.zeros(x.shape[1], np.float32)
    for t in range(len(x) - 1, -1, -1) if ahead else range(len(x)):
        if ahead:
            out[t] = acc
        acc *= d
        acc += x[t]
        if not ahead:
            out[t] = acc
    return out


def ridge(x: np.ndarray, y: np.ndarray, lam: float = 10.0) -> np.ndarray:
    """Weights (with a bias row last) fitting ``y`` from ``x``."""
    a = np.hstack([x, np.ones((len(x), 1), np.float32)]).astype(np.float64)
    return np.linalg.solve(a.T @ a + lam * np.eye(a.shape[1]), a.T @ y.astype(np.float64))


def scores(trace, rule: str, start: int, tokens: int, x, past):
    """``rule``'s ``_Rule.score`` over the window at ``start`` (None: the store's heat),
    from its lookups since ``start`` (``past``: the first half's decayed lookups, to fit)."""
    E, window = trace.num_experts, x[start : start + tokens]
    own = lambda li: slice(li * E, (li + 1) * E)  # noqa: E731
    if rule == "coldest":
        return None
    if rule == "oldest":
        return lambda li, t: np.zeros(E)  # all equal: the oldest written out first
    if rule == "lru":
        last = np.full(window.shape, -np.inf, np.float32)
        seen = np.full(window.shape[1], -np.inf, np.float32)
        for t in range(len(window)):
            seen[window[t] > 0] = t
            last[t] = seen
        return lambda li, t: last[t, own(li)]
    if rule.startswith("decay:"):
        h = decayed(window, float(rule.split(":")[1]))
        return lambda li, t: h[t, own(li)]
    if rule.startswith("prior:"):  # the first half's share of lookups, a recorded trace's
        half, w = trace.tokens // 2, float(rule.split(":")[1])
        prior = x[:half].mean(0)
        h = decayed(window, DISCOUNT)
        return lambda li, t: (prior + w * h[t])[own(li)]
    if rule.startswith("seqreset:"):  # the heat, scaled by F where a sequence starts
        f, starts = float(rule.split(":")[1]), set(trace.offsets.tolist())
        h, acc = np.empty_like(window), np.zeros(window.shape[1], np.float32)
        for t in range(len(window)):
            acc *= DISCOUNT * (f if start + t in starts else 1.0)
            acc += window[t]
            h[t] = acc
        return lambda li, t: h[t, own(li)]
    if rule == "furthest":
        nxt = {}
        for li in range(0, trace.layers, 2):
            seq, ahead = layer_lookups(trace, li, start, tokens), np.full(E, np.inf)
            nxt[li] = np.empty((len(seq), E))
            for t in range(len(seq) - 1, -1, -1):  # each call's next use, after it
                nxt[li][t], ahead[seq[t]] = ahead, t
        return lambda li, t: -nxt[li][t]
    half = trace.tokens // 2  # the learned rules fit the first half only
    future, now = decayed(x[:half], DISCOUNT, ahead=True), decayed(window, DISCOUNT)
    if rule == "ridge-all":
        w = ridge(past, future)
        return lambda li, t: np.append(now[t], 1.0) @ w[:, own(li)]
    if rule == "ridge-own":
        w = {li: ridge(past[:, own(li)], future[:, own(li)]) for li in range(trace.layers)}
        return lambda li, t: np.append(now[t, own(li)], 1.0) @ w[li]
    raise SystemExit(f"unknown rule {rule!r}: see --help")


def disk_mb(trace, slots: int, gb: float, start: int, tokens: int, score) -> float:
    real = tiers._SwapRows
    _Rule.score = staticmethod(score) if score is not None else None
    tiers._SwapRows = _Rule
    try:
        r = tiers.simulate_tiers(
            trace, "predictive", slots, int(gb * 1e9), RECORD, layers=range(0, trace.layers, 2),
            model_layers=trace.layers, start=start, tokens=tokens, exclusive=True,
        )  # fmt: skip
    finally:
        tiers._SwapRows = real
    return r.disk_bytes_per_token / 1e6


def main() -> None:
    p = parser(__doc__, preset=None, trace="required", workdir=None)
    p.add_argument("--tokens", type=int, default=2000, help="tokens replayed per window")
    p.add_argument("--rules", default="oldest,coldest,furthest",
                   help="comma-separated, of: coldest, oldest, lru, decay:D, prior:W, "
                   "seqreset:F, ridge-own, ridge-all, furthest")  # fmt: skip
    a = p.parse_args()
    trace = RoutingTrace.load(a.trace)
    rules = a.rules.split(",")
    for r in rules:  # before any work: a bad rule or number stops here
        name, _, arg = r.partition(":")
        if name in NUMBERED and not arg.replace(".", "", 1).isdigit():
            p.error(f"--rules {r}: give {name}:NUMBER, e.g. {name}:0.99")
        if name not in NUMBERED and r not in KNOWN:
            p.error(f"--rules names {r!r}: choose from {', '.join(KNOWN)}, decay:D, prior:W, "
                    "seqreset:F")  # fmt: skip
    x = usage(trace)
    half = trace.tokens // 2
    past = decayed(x[:half], DISCOUNT) if any(r.startswith("ridge") for r in rules) else None
    rows = []
    for start in (half, half + (trace.tokens - half) // 2):  # two held-out windows
        score = {r: scores(trace, r, start, a.tokens, x, past) for r in rules}
        for slots, gb in SPLITS:
            mb = {r: disk_mb(trace, slots, gb, start, a.tokens, score[r]) for r in rules}
            row = {"start": start, "slots": slots, "tier_gb": gb}
            row.update({f"{r}_mb": round(v, 2) for r, v in mb.items()})
            if "coldest" in mb:
                row.update({f"{r}_vs_coldest": round(v / mb["coldest"], 3)
                            for r, v in mb.items() if r != "coldest"})  # fmt: skip
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    finish(
        a, "tier_heat", {"record_bytes": RECORD, "tokens": a.tokens, "rules": rules, "rows": rows}
    )


if __name__ == "__main__":
    main()
