"""Pipeline benchmark: memory and speed per rank of a streamed model pipelined over local
``ring`` ranks, against one streamed process, and the measured cost of one hop.

Runs, each in fresh processes, on the DeepSeek-V2-Lite-shaped checkpoint with the real
routing trace replayed:

* ``single``: ``python -m mlx_streaming bench`` in one process (slots per layer as given);
* ``pipeline``: the same command with ``--pipeline`` under ``mlx.launch --backend ring
  -n RANKS`` (127.0.0.1): each rank holds its share of the trunk and its own pools;
* ``hop``: the median one-way time of a hidden state (decode: 1 token; prefill: a chunk)
  sent rank to rank over the same ring, for planning hosts apart on paper.

Each rank's expected resident bytes are its share of the trunk (its layers' attention,
norms, routers, shared experts, plus the embeddings and head every rank keeps) plus its
pools; the table sets them beside its measured peak RSS (which also holds the Python,
MLX and tokenizer baseline, measured here as ``baseline_rss_gb``).

    python benchmarks/pipeline.py --json benchmarks/results/pipeline-cpu.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import build, finish, log, parser

HERE = Path(__file__).resolve()
LAUNCH = Path(sys.executable).with_name("mlx.launch")


def hop_probe(hidden: int, chunk: int, iters: int) -> None:
    """Rank side of the hop measurement (run under mlx.launch): ping-pong a hidden state."""
    import mlx.core as mx

    g = mx.distributed.init(backend="ring", strict=True)
    other = 1 - g.rank()
    out = {}
    for name, tokens in (("decode", 1), ("prefill", chunk)):
        x = mx.ones((1, tokens, hidden), dtype=mx.bfloat16)
        times = []
        for i in range(iters + 5):
            t0 = time.perf_counter()
            if g.rank() == 0:
                mx.eval(mx.distributed.send(x, other, stream=mx.cpu))
                y = mx.distributed.recv_like(x, other, stream=mx.cpu)
            else:
                y = mx.distributed.recv_like(x, other, stream=mx.cpu)
                mx.eval(y)
                y = mx.distributed.send(y, other, stream=mx.cpu)
            mx.eval(y)
            if i >= 5:
                times.append((time.perf_counter() - t0) / 2)
        times.sort()
        out[name] = {
            "tokens": tokens,
            "bytes": x.nbytes,
            "one_way_us_median": round(times[len(times) // 2] * 1e6, 1),
        }
    if g.rank() == 0:
        print("HOP " + json.dumps(out), flush=True)


def trunk_shares(ck: Path, split: list[int] | None, ranks: int) -> list[dict]:
    """Each rank's trunk bytes (experts excluded), from the checkpoint's parameters."""
    import re

    from mlx.utils import tree_flatten
    from mlx_lm import load

    model, _ = load(str(ck), lazy=True)
    n = len(model.model.layers)
    if split is None:
        base, extra = divmod(n, ranks)
        split = [base + (1 if r < extra else 0) for r in range(ranks)]
    shared, per_layer = 0, [0] * n
    for name, v in tree_flatten(model.parameters()):
        if ".switch_mlp." in name:
            continue
        m = re.search(r"layers\.(\d+)\.", name)
        if m:
            per_layer[int(m.group(1))] += v.nbytes
        else:
            shared += v.nbytes
    out = []
    for r in range(ranks):
        start = sum(split[r + 1 :])
        layers = range(start, start + split[r])
        out.append(
            {
                "rank": r,
                "layers": [layers.start, layers.stop - 1],
                "trunk_gb": round((shared + sum(per_layer[i] for i in layers)) / 1e9, 4),
            }
        )
    out.append({"rank": "single", "trunk_gb": round((shared + sum(per_layer)) / 1e9, 4)})
    return out


def baseline_rss() -> float:
    code = (
        "import mlx.core, mlx_lm, mlx_streaming, transformers\n"
        "from mlx_streaming.core.mem import peak_rss_bytes\n"
        "print(peak_rss_bytes())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return round(int(out.stdout.strip()) / 1e9, 3)


def bench_json(cmd: list[str], out: Path) -> dict:
    log("$", " ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if not out.exists():
        sys.exit(f"no result from {' '.join(cmd)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--split", help="layers per rank, rank order (default: even)")
    p.add_argument("--slots", type=int, default=16, help="slots per MoE layer (both runs)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--port", type=int, default=38400)
    p.add_argument("--hop-iters", type=int, default=200)
    p.add_argument("--hop-probe", action="store_true", help=argparse_hidden())
    p.add_argument("--hidden", type=int, default=2048, help=argparse_hidden())  # the probe's
    p.add_argument("--chunk", type=int, default=512)
    a = p.parse_args()
    if a.hop_probe:
        return hop_probe(a.hidden, a.chunk, a.hop_iters)
    t0 = time.perf_counter()
    ck, ed, meta = build(a)
    common = ["--model", str(ck), "--expert-dir", str(ed), "--slots", str(a.slots)]
    common += ["--max-tokens", str(a.tokens), "--repeat", str(a.repeat), "--pool-profile", "none"]
    if a.trace != "none":
        common += ["--routing-trace", a.trace]
    launch = [str(LAUNCH), "--backend", "ring", "-n", str(a.ranks), "-p", str(a.port), "--"]
    with tempfile.TemporaryDirectory() as tmp:
        single = bench_json(
            [sys.executable, "-m", "mlx_streaming", "bench", *common, "--json", f"{tmp}/1.json"],
            Path(tmp, "1.json"),
        )
        pipe_cmd = [sys.executable, "-m", "mlx_streaming", "bench", *common, "--pipeline"]
        pipe_cmd += ["--pipeline-split", a.split] if a.split else []
        piped = bench_json([*launch, *pipe_cmd, "--json", f"{tmp}/2.json"], Path(tmp, "2.json"))
    hop_cmd = [*launch, sys.executable, str(HERE), "--hop-probe"]
    hop_cmd += ["--hidden", str(meta.dims["hidden"]), "--chunk", str(a.chunk)]
    hop_cmd += ["--hop-iters", str(a.hop_iters)]
    r = subprocess.run(hop_cmd, capture_output=True, text=True, timeout=600)
    hop_line = next((x for x in r.stdout.splitlines() if x.startswith("HOP ")), None)
    hop = json.loads(hop_line[4:]) if hop_line else {"error": r.stderr[-2000:]}

    split = [int(x) for x in a.split.split(",")] if a.split else None
    shares = trunk_shares(ck, split, a.ranks)
    keys = ("peak_rss_gb", "timed_peak_rss_gb", "pool_gb", "decode_tok_per_s", "tok_per_s")
    rows = [{"run": "single", **{k: single[k] for k in keys}, "trunk_gb": shares[-1]["trunk_gb"]}]
    for pr, share in zip(piped["pipeline"]["per_rank"], shares):
        rows.append(
            {
                "run": f"rank {pr['rank']}",
                "layers": share["layers"],
                **{k: pr[k] for k in keys},
                "trunk_gb": share["trunk_gb"],
            }
        )
    for row in rows:
        row["expected_gb"] = round(row["trunk_gb"] + row["pool_gb"], 4)
    result = {
        "preset": a.preset,
        "moe_layers": len(meta.layers),
        "expert_mb": round(meta.expert_bytes() / 1e6, 3),
        "slots": a.slots,
        "ranks": a.ranks,
        "split": a.split or "even",
        "tokens": a.tokens,
        "trace": a.trace,
        "baseline_rss_gb": baseline_rss(),
        "rows": rows,
        "pipeline_decode_ratio_vs_single": round(
            piped["decode_tok_per_s"] / single["decode_tok_per_s"], 3
        ),
        "hop": hop,
        "bytes_read_per_token": {
            "single": single["bytes_read_per_token"],
            "pipeline_all_ranks": piped["pipeline"]["bytes_read_per_token_all_ranks"],
        },
    }
    finish(a, "pipeline", result, t0)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
