"""Hot and cold precision against uniform widths, at equal memory, on the real trace.

Builds the DeepSeek-V2-Lite-shaped CPU checkpoint (4-bit experts, a few layers), takes
the hot experts of each layer from the first half of the DeepSeek-V2-Lite trace, and
prints per configuration: mean bytes per expert, KL and top-1 agreement against the
source experts (second half's routing; random weights: a relative guide), and the LRU hit
rate and bytes loaded per token with a pool of equal bytes (25% of a layer at 4 bits).

    python benchmarks/hotcold.py --json benchmarks/results/hotcold-cpu.json
"""

from __future__ import annotations

import time

from harness import build, finish, log, parser, routing_trace


def main():
    p = parser(__doc__, trace="required", workdir="scratch/hotcold")
    p.set_defaults(num_layers=7)  # 1 dense + 6 MoE layers
    p.add_argument("--budget-fraction", type=float, default=0.25)
    a = p.parse_args()

    from mlx_streaming.analysis.precision import hot_cold_study

    t0 = time.perf_counter()
    ck, _, _ = build(a)
    out = hot_cold_study(ck, routing_trace(a)[0], budget_fraction=a.budget_fraction)
    out = finish(a, "hotcold", out, t0, quiet=("rows",))
    log(
        f"{'config':<34} {'bytes/expert':>12} {'vs 4-bit':>8} {'KL':>9} {'top-1':>6} "
        f"{'hit rate':>8} {'MB/token':>9}"
    )
    for r in out["rows"]:
        log(
            f"{r['config']:<34} {r['mean_expert_bytes']:>12} {r['bytes_vs_hot']:>8} "
            f"{r['kl']:>9.5f} {r['top1_agreement']:>6.3f} {r['hit_rate']:>8.3f} "
            f"{r['bytes_loaded_per_token'] / 1e6:>9.2f}"
        )


if __name__ == "__main__":
    main()
