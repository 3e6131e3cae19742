"""Routing of the trained model on held-out text, beside DeepSeek-V2-Lite's trace, and what
next-layer prediction from real hidden states buys.

1. Trace: the trained checkpoint (``checkpoints/tiny-stdlib-moe``) runs over its held-out
   text in windows; each MoE layer's top-k is recorded in the project's trace format.
2. Statistics of both traces: per-layer routing entropy, reuse distance (tokens since the
   expert was last used at that layer), and hit rates per policy at 1/8, 1/4 and 1/2 of
   the experts (demand caching; Belady is the ceiling for demand policies).
3. Prediction: layer L+1's experts guessed from layer L, through layer L+1's own router,
   (a) on layer L's MoE input (what the streamed model has in hand), (b) the same input
   re-normed with layer L+1's norm weights (``RouterPredictor`` with ``renorm``: before
   layer L's experts run), and (c) on layer L's output through layer L+1's
   post-attention norm (streamlx's choice, after them); recall of the true top-k.
4. Read-ahead (simulated on the trace): the guesses loaded before each lookup; misses and
   reads per token beside LRU and Belady, and the share of the gap from LRU's misses to
   Belady's that policy plus read-ahead close. Beside it, the DeepSeek-V2-Lite trace with
   the transition predictor (learned on its first half), which needs no hidden states.
5. CPU decode: stock against streamed at half the experts, read-ahead off and on.

    python benchmarks/trained_routing.py --json benchmarks/results/trained-routing.json
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from harness import ROOT, finish, log, parser

CHECKPOINT = ROOT / "checkpoints" / "tiny-stdlib-moe"
POLICIES = ("lru", "lfu", "predictive", "belady")


def _tap(inner, sink):
    """``inner`` wrapped in a module that keeps (input, output) of each call in ``sink``."""
    import mlx.nn as nn

    class Tap(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def __call__(self, x, *a, **k):
            out = self.inner(x, *a, **k)
            sink.append((x, out))
            return out

    return Tap()


def record(model, ids: np.ndarray, seq: int, windows: int):
    """True top-k [T, L, k] and three next-layer guesses [T, L, k] (-1 at layer 0)."""
    import mlx.core as mx

    layers = model.model.layers
    E, k = layers[0].mlp.num_experts, layers[0].mlp.top_k
    moe_io, layer_io = [], []
    mlps = [layer.mlp for layer in layers]
    for layer in layers:
        layer.mlp = _tap(layer.mlp, moe_io)
    model.model.layers = [_tap(layer, layer_io) for layer in layers]

    def top(logits):
        return np.array(mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k])[0].astype(np.int64)

    # layer L's MoE input re-normed with layer L+1's weights: RMSNorm ignores scale, so
    # x * w[L+1] / w[L] is norm[L+1] of the residual before the MoE
    norm_w = [layer.post_attention_layernorm.weight for layer in layers]
    true, by_input, by_output, by_residual = [], [], [], []
    try:
        for w in range(windows):
            moe_io.clear(), layer_io.clear()
            model(mx.array(ids[w * seq : (w + 1) * seq])[None])
            t = [top(mlps[i].gate(moe_io[i][0])) for i in range(len(layers))]
            a = [np.full_like(t[0], -1)] + [
                top(mlps[i + 1].gate(moe_io[i][0])) for i in range(len(layers) - 1)
            ]
            b = [np.full_like(t[0], -1)] + [
                top(mlps[i + 1].gate(layers[i + 1].post_attention_layernorm(layer_io[i][1])))
                for i in range(len(layers) - 1)
            ]
            c = [np.full_like(t[0], -1)] + [
                top(mlps[i + 1].gate(moe_io[i][0] * (norm_w[i + 1] / norm_w[i])))
                for i in range(len(layers) - 1)
            ]
            true.append(np.stack(t, 1)), by_input.append(np.stack(a, 1))
            by_output.append(np.stack(b, 1)), by_residual.append(np.stack(c, 1))
    finally:
        model.model.layers = layers
        for layer, mlp in zip(layers, mlps):
            layer.mlp = mlp
    return E, *(np.concatenate(x) for x in (true, by_input, by_output, by_residual))


def recall(true: np.ndarray, guess: np.ndarray, layers=None) -> list[float]:
    """Per layer (default: 1 on): mean share of a token's true experts that were guessed."""
    out = []
    for li in layers or range(1, true.shape[1]):
        hit = (true[:, li, :, None] == guess[:, li, None, :]).any(-1)
        out.append(round(float(hit.mean()), 3))
    return out


def stats(trace, layers, tokens: int) -> dict:
    """Entropy, reuse distance and hit rates per policy and budget."""
    from mlx_streaming.planning.simulate import routing_counts, routing_entropy, simulate

    E = trace.num_experts
    ent = routing_entropy(routing_counts(trace, 0, tokens)[layers])
    dists = []
    for li in layers:
        last = np.full(E, -1)
        for t, row in enumerate(trace.experts[:tokens, li]):
            for e in np.unique(row):
                if last[e] >= 0:
                    dists.append(t - last[e])
                last[e] = t
    d = np.array(dists)
    hits = {}
    for frac in (8, 4, 2):
        c = E // frac
        hits[f"1/{frac}"] = {
            pol: round(simulate(trace, pol, c, layers, 0, tokens).hit_rate, 3) for pol in POLICIES
        }
    return {
        "layers": len(layers),
        "tokens": tokens,
        "entropy_bits_mean": round(float(ent.mean()), 3),
        "entropy_bits_min": round(float(ent.min()), 3),
        "max_bits": round(float(np.log2(E)), 3),
        "reuse_distance_median": float(np.median(d)),
        "reuse_next_token": round(float((d == 1).mean()), 3),
        "reuse_within_8": round(float((d <= 8).mean()), 3),
        "hit_rate": hits,
    }


def readahead(trace, guesses: dict, slots: int, layers, tokens: int, start: int = 0) -> dict:
    """Misses and reads per token: LRU, predictive, each with read-ahead, and Belady."""
    from mlx_streaming.planning.simulate import simulate

    def run(pol, ahead=None):
        r = simulate(trace, pol, slots, layers, start, tokens, ahead=ahead)
        return r.misses_per_token(), r.reads_per_token()

    lru, best = run("lru"), run("belady")
    rows = {"lru": lru, "belady": best, "predictive": run("predictive")}
    for name, g in guesses.items():
        for pol in ("lru", "predictive"):
            rows[f"{pol} + read-ahead ({name})"] = run(pol, {li: g[:, li] for li in layers})
    out = {}
    for name, (miss, reads) in rows.items():
        gap = (lru[0] - miss) / (lru[0] - best[0]) if lru[0] > best[0] else 0.0
        out[name] = {"misses_per_token": round(miss, 3), "reads_per_token": round(reads, 3),
                     "gap_closed": round(gap, 3)}  # fmt: skip
    return out


def decode(a, ck: Path) -> dict:
    """Stock against streamed at half the experts, read-ahead off and on (CPU tok/s)."""
    from mlx_streaming.bench.run import BenchConfig, run_bench
    from mlx_streaming.core.options import StreamConfig
    from mlx_streaming.synthetic.train import held_out_text

    prompt = held_out_text(ck)[:600]
    out = {}
    for name, prefetch in (("no read-ahead", False), ("read-ahead (router)", True)):
        r = run_bench(
            BenchConfig(
                model=str(ck),
                expert_dir=str(Path(a.workdir) / "experts"),
                stream=StreamConfig(slots=32, prefetch=prefetch),
                prompt=prompt,
                max_tokens=a.tokens,
                repeat=a.repeat,
                compare_stock=True,
            )
        )
        keys = ("decode_tok_per_s", "stock_decode_tok_per_s", "decode_ratio_vs_stock",
                "decode_hit_rate", "exact_vs_stock", "prefetched", "prediction_precision",
                "prediction_recall", "host_us_per_layer_call")  # fmt: skip
        out[name] = {k: r.get(k) for k in keys}
        log(name, out[name])
    return out


def main():
    p = parser(__doc__, preset=None, trace=True, workdir="scratch/trained-routing")
    p.add_argument("--model", default=str(CHECKPOINT), help="a train-tiny checkpoint")
    p.add_argument("--windows", type=int, default=64, help="held-out windows of 256 tokens")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per timed run")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--save-trace", help="write the held-out routing trace here (.npz)")
    a = p.parse_args()
    from mlx_lm import load

    from mlx_streaming.core.prefetch.predictor import TransitionPredictor
    from mlx_streaming.planning.trace import RoutingTrace
    from mlx_streaming.synthetic.train import held_out_text

    t0 = time.perf_counter()
    model, tok = load(a.model)
    seq = 256
    ids = np.array(tok.encode(held_out_text(a.model)), dtype=np.int32)
    windows = min(a.windows, len(ids) // seq)
    E, true, by_input, by_output, by_residual = record(model, ids, seq, windows)
    offsets = np.arange(0, windows * seq + 1, seq, dtype=np.int64)
    trace = RoutingTrace(true.astype(np.uint8), offsets, E, f"{a.model} on held-out text")
    if a.save_trace:
        trace.save(a.save_trace)
    T, L = trace.tokens, trace.layers
    log(f"trace: {T} tokens, {L} layers, top-{trace.top_k} of {E}")
    result = {
        "model": a.model,
        "trace": {"tokens": T, "layers": L, "top_k": trace.top_k, "experts": E},
        "recall": {"router on layer L's MoE input": recall(true, by_input),
                   "router on layer L's MoE input, re-normed for L+1": recall(true, by_residual),
                   "router on layer L's output (norm of L+1)": recall(true, by_output)},
        "stats": {"trained": stats(trace, list(range(L)), T)},
    }  # fmt: skip
    log(result["recall"])
    guesses = {"router on input": by_input, "router on input re-normed": by_residual,
               "router on output": by_output}  # fmt: skip
    result["read_ahead"] = {
        f"{E // f} of {E}": readahead(trace, guesses, E // f, list(range(L)), T) for f in (4, 2)
    }
    log(result["read_ahead"])
    if a.trace != "none":
        ds = RoutingTrace.load(a.trace)
        layers = list(range(0, ds.layers, 5))
        result["stats"]["deepseek-v2-lite"] = stats(ds, layers, 20000)
        half = ds.tokens // 2
        first, _ = ds.split(0.5)
        pred = TransitionPredictor.from_trace(first, ds.top_k)
        g = np.full((ds.tokens, ds.layers, ds.top_k), -1, np.int64)
        span = slice(half, min(half + 20000, ds.tokens))
        dl = [li for li in layers if li > 0]
        for li in dl:
            for t in range(span.start, span.stop):
                g[t, li] = pred.predict(li - 1, ds.experts[t, li - 1][None])[: ds.top_k]
        rec = recall(ds.experts[span], g[span], dl)
        result["recall"]["deepseek-v2-lite transition (trace), layers " + str(dl)] = rec
        result["read_ahead_deepseek_v2_lite"] = {
            f"{ds.num_experts // f} of {ds.num_experts}": readahead(
                ds, {"transition": g}, ds.num_experts // f, dl, 20000, half
            )
            for f in (4, 2)
        }
    result["decode_cpu"] = decode(a, Path(a.model))
    finish(a, "trained_routing", result, t0)


if __name__ == "__main__":
    main()
