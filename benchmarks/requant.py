"""Requantized experts: bytes per expert, speed and quality at 8/4/3/2 bits and mixed.

Builds a synthetic checkpoint with 8-bit experts, requantizes its expert directory to
each format, then for each: bytes per expert, streamed decode tok/s at half the experts
resident (median of runs), exactness against stock mlx-lm on the requantized model, and
quality against the 8-bit source (KL divergence and top-1 agreement of next-token
distributions, relative output error per projection). Random weights: a relative guide.

    python benchmarks/requant.py --json benchmarks/results/requant-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="demo")
    p.add_argument("--workdir", default="scratch/requant")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()
    from mlx_streaming.bench.run import BenchConfig, run_bench
    from mlx_streaming.commands.quality import quality
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.prep.requantize import requantize
    from mlx_streaming.prep.split_experts import split_model
    from mlx_streaming.synthetic import make_checkpoint

    root = Path(a.workdir)
    ck = make_checkpoint(root / f"{a.preset}-8bit", a.preset, bits=8)
    src = root / "experts-8bit"
    split_model(ck, src)
    meta = load_meta(src)
    formats = {"8-bit": {"bits": 8}, "4-bit": {"bits": 4}, "3-bit": {"bits": 3},
               "2-bit": {"bits": 2}, "mixed gate=2,up=2,down=3": {
                   "bits": 4, "proj_bits": "gate=2,up=2,down=3"}}
    rows = []
    for name, spec in formats.items():
        ed = root / f"experts-{name.split()[0]}{'-mixed' if 'mixed' in name else ''}"
        requantize(src, ed, model_out=root / f"model-{ed.name}", model=ck, **spec)
        q = quality(str(ck), str(ed), tokens=128)
        b = run_bench(BenchConfig(model=str(root / f"model-{ed.name}"), expert_dir=str(ed),
                                  slots=meta.num_experts // 2, max_tokens=a.tokens,
                                  repeat=a.repeat, compare_stock=True,
                                  prompt="Tell me how experts are stored on disk."))
        row = {"format": name, "expert_bytes": load_meta(ed).expert_bytes(),
               "bytes_vs_8bit": round(load_meta(ed).expert_bytes() / meta.expert_bytes(), 3),
               "kl_vs_8bit": round(q["kl"], 5), "top1_agreement": round(q["top1_agreement"], 4),
               "mean_projection_error": q["mean_projection_error"],
               "decode_tok_per_s": b["decode_tok_per_s"],
               "stock_decode_tok_per_s": b["stock_decode_tok_per_s"],
               "hit_rate": b["expert_hit_rate"],
               "bytes_read_per_token": b["bytes_read_per_token"],
               "exact_vs_stock_on_requantized_model": b["exact_vs_stock"]}
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    out = {"benchmark": "requant", "date": time.strftime("%Y-%m-%d"),
           "machine": f"{os.uname().sysname} {os.uname().machine}, {os.cpu_count()} cores",
           "command": "python benchmarks/requant.py " + " ".join(sys.argv[1:]),
           "model": f"synthetic {a.preset}, 8-bit source", "slots": meta.num_experts // 2,
           "note": "random weights: quality figures are a relative guide only",
           "formats": rows}
    print(json.dumps(out, indent=1))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
