"""Pair ratios of several ``speed.py`` runs pooled per residency: the median and
quartiles of every streamed/stock pair, as the README and RESULTS quote them (one run's
pairs move by ±0.15 on a shared GPU; pooling runs of one lease narrows the median).

Beside them, the step: the median ms per token that streaming adds to stock's, and the
ms that the bytes it reads per token take over the host-to-device link at the rate
measured in the same run. Where the added time follows the link time across
residencies, the copies are on the device's critical path (a fast host); where it does
not, the host's own work is (a slow host).

    python benchmarks/pooled.py benchmarks/results/gpu/2026-12-04h-*/speed-gpu-dsv2-pairs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def pooled(paths: list[str]) -> dict[float, dict]:
    """Per residency: the pairs (streamed run over the stock run beside it) of every
    run in ``paths``, their median and quartiles, and each run's own median."""
    pairs, runs, added, link = defaultdict(list), defaultdict(list), defaultdict(list), {}
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        for c in result.get("configs", []):
            if c.get("predictor"):  # read-ahead what-ifs are not the default's pairs
                continue
            ratios = [s / k for s, k in zip(c["decode_runs"], c["stock_runs"])]
            pairs[c["residency"]] += ratios
            added[c["residency"]] += [
                1e3 / s - 1e3 / k for s, k in zip(c["decode_runs"], c["stock_runs"])
            ]
            if result.get("h2d_gbps") and c.get("bytes_read_per_token") is not None:
                link[c["residency"]] = c["bytes_read_per_token"] / 1e6 / result["h2d_gbps"]
            runs[c["residency"]].append(round(statistics.median(ratios), 4))
    out = {}
    for r, v in sorted(pairs.items(), reverse=True):
        q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
        out[r] = {
            "pairs": len(v),
            "median": round(statistics.median(v), 4),
            "quartiles": [round(q[0], 4), round(q[2], 4)],
            "run_medians": runs[r],
            "added_ms": round(statistics.median(added[r]), 2),
            "link_ms": round(link[r], 2) if r in link else None,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="speed.py JSON files (one lease's runs)")
    a = p.parse_args()
    for r, row in pooled(a.results).items():
        print(f"{r:g}: {row['pairs']} pairs, median {row['median']}, "
              f"quartiles {row['quartiles']}, runs {row['run_medians']}; "
              f"ms added per token {row['added_ms']}, link ms {row['link_ms']}")  # fmt: skip


if __name__ == "__main__":
    main()
