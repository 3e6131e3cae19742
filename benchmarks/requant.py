"""Requantized experts: bytes per expert, speed and quality at 8/4/3/2 bits and mixed.

Builds a synthetic checkpoint with 8-bit experts (or takes ``--checkpoint``'s, whatever
their precision: the result's ``source`` names it), requantizes its expert directory to
each format, then for each: bytes per expert, streamed decode tok/s at half the experts
resident (median of runs), exactness against stock mlx-lm on the requantized model, and
quality against the source (KL divergence and top-1 agreement of next-token
distributions, relative output error per projection). Random weights: a relative guide.

    python benchmarks/requant.py --json benchmarks/results/requant-cpu.json
"""

from __future__ import annotations

from pathlib import Path

from harness import build, finish, log, parser


def main():
    p = parser(__doc__, preset="demo", trace=False, workdir="scratch/requant")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    from mlx_streaming.analysis.quality import quality_report
    from mlx_streaming.bench.run import BenchConfig, run_bench
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.core.options import StreamConfig
    from mlx_streaming.prep.requantize import requantize

    root = Path(a.workdir)
    ck, src, meta = build(a, bits=8)
    formats = {
        "8-bit": {"bits": 8},
        "4-bit": {"bits": 4},
        "3-bit": {"bits": 3},
        "2-bit": {"bits": 2},
        "mixed gate=2,up=2,down=3": {"bits": 4, "proj_bits": "gate=2,up=2,down=3"},
    }
    bits = {b for lay in meta.layers.values() for b in lay.proj_bits().values()}
    source = "/".join([f"{b}-bit" for b in sorted(bits - {None})] + ["float"] * (None in bits))
    rows = []
    for name, spec in formats.items():
        ed = root / f"experts-{name.split()[0]}{'-mixed' if 'mixed' in name else ''}"
        requantize(src, ed, model_out=root / f"model-{ed.name}", model=ck, **spec)
        q = quality_report(str(ck), str(ed), tokens=128)
        b = run_bench(
            BenchConfig(
                model=str(root / f"model-{ed.name}"),
                expert_dir=str(ed),
                stream=StreamConfig(slots=meta.num_experts // 2),
                max_tokens=a.tokens,
                repeat=a.repeat,
                compare_stock=True,
                prompt="Tell me how experts are stored on disk.",
            )
        )
        row = {
            "format": name,
            "expert_bytes": load_meta(ed).expert_bytes(),
            "bytes_vs_source": round(load_meta(ed).expert_bytes() / meta.expert_bytes(), 3),
            "kl_vs_source": round(q["kl"], 5),
            "top1_agreement": round(q["top1_agreement"], 4),
            "mean_projection_error": q["mean_projection_error"],
            "decode_tok_per_s": b["decode_tok_per_s"],
            "stock_decode_tok_per_s": b["stock_decode_tok_per_s"],
            "hit_rate": b["expert_hit_rate"],
            "bytes_read_per_token": b["bytes_read_per_token"],
            "exact_vs_stock_on_requantized_model": b["exact_vs_stock"],
        }
        log(row)
        rows.append(row)
    finish(
        a,
        "requant",
        {
            "model": str(ck) if a.checkpoint else f"synthetic {a.preset}",
            "source": source,  # the experts requantized from, and the quality reference
            "slots": meta.num_experts // 2,
            "note": "random weights: quality figures are a relative guide only",
            "formats": rows,
        },
    )


if __name__ == "__main__":
    main()
