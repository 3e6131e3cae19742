"""Hot and cold precision against uniform widths, at equal memory, on the real trace.

Builds the DeepSeek-V2-Lite-shaped CPU checkpoint (4-bit experts, a few layers), takes
the hot experts of each layer from the first half of the DeepSeek-V2-Lite trace, and
prints per configuration: mean bytes per expert, KL and top-1 agreement against the
source experts (second half's routing; random weights: a relative guide), and the LRU hit
rate and bytes loaded per token with a pool of equal bytes (25% of a layer at 4 bits).

    python benchmarks/hotcold.py --json benchmarks/results/hotcold-cpu.json
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
    p.add_argument("--preset", default="dsv2-lite-cpu")
    p.add_argument("--num-layers", type=int, default=7, help="1 dense + 6 MoE layers")
    p.add_argument("--workdir", default="scratch/hotcold")
    p.add_argument("--trace", default=str(Path(__file__).resolve().parents[2] / "shared"
                                          / "traces" / "deepseek-v2-lite.npz"))
    p.add_argument("--budget-fraction", type=float, default=0.25)
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()

    from mlx_streaming.analysis.precision import hot_cold_study
    from mlx_streaming.synthetic import make_checkpoint
    from mlx_streaming.planning.trace import RoutingTrace

    t0 = time.perf_counter()
    ck = make_checkpoint(Path(a.workdir) / f"{a.preset}-{a.num_layers}l", a.preset,
                         num_layers=a.num_layers)
    out = hot_cold_study(ck, RoutingTrace.load(a.trace), budget_fraction=a.budget_fraction)
    out.update(benchmark="hotcold", date=time.strftime("%Y-%m-%d"),
               machine=f"{os.uname().sysname} {os.uname().machine}, {os.cpu_count()} cores",
               command="python " + " ".join(sys.argv), wall_s=round(time.perf_counter() - t0))
    print(f"{'config':<34} {'bytes/expert':>12} {'vs 4-bit':>8} {'KL':>9} {'top-1':>6} "
          f"{'hit rate':>8} {'MB/token':>9}")
    for r in out["rows"]:
        print(f"{r['config']:<34} {r['mean_expert_bytes']:>12} {r['bytes_vs_hot']:>8} "
              f"{r['kl']:>9.5f} {r['top1_agreement']:>6.3f} {r['hit_rate']:>8.3f} "
              f"{r['bytes_loaded_per_token'] / 1e6:>9.2f}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
