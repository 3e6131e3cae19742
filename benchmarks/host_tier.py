"""Beneath the pools, the page cache or a host tier of the store's own (issue 33, item 4)?

A replay, no model run: the larger-than-RAM rows of ``speed.py --beyond-ram memlimit``
(their JSON files, given as arguments) replayed through the two-tier simulator
(``planning.tiers.simulate_tiers``) with the same trace, start, calls, policy, slots and
page-cache room the run had, twice:

* ``page cache``: what the run had. The OS keeps recently read records, one LRU over
  every layer's, so a record the pool has just loaded is also the page cache's newest
  page: the two tiers hold it twice;
* ``exclusive tier``: a host tier of the same size that takes the records the pools
  evict and gives up those a pool takes back (on CUDA: page-locked, the victim copied back
  over the link), so no record is held twice.

Each row prints the disk bytes per token the run measured beside both predictions: the
first checks the simulator against the run, the second is what a store-managed tier would
read from the disk in the same run.

    python benchmarks/host_tier.py benchmarks/results/gpu/2026-12-04p-cgroup*/speed-*.json \
      --json benchmarks/results/host-tier-2026-12-04.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from beyond_ram import run_calls
from harness import finish, log

from mlx_streaming.planning.tiers import simulate_tiers
from mlx_streaming.planning.trace import RoutingTrace

PROMPT_TOKENS = 32  # gpu_suite.sh's speed runs


def replay(run: dict, row: dict, trace: RoutingTrace, exclusive: bool) -> float:
    """Disk MB per token the simulator predicts for ``row`` of ``run``."""
    ids = run.get("prompt_tokens") or PROMPT_TOKENS  # recorded since 2026-12-04
    if row.get("window") == "decode":  # the run counted decode steps only
        calls, counted = run_calls(ids, run["tokens"], run["repeat"])
    else:  # before: every forward, prompts included, as the run's prediction did
        calls = [ids, *([ids, *[1] * (run["tokens"] - 1)] * run["repeat"])]
        counted = [False, *[True] * (len(calls) - 1)]
    moe = run.get("moe_layers") or trace.layers  # recorded since 2026-12-04q
    r = simulate_tiers(
        trace, row["runtime"]["policy"], row["slots"], int(row["page_cache_room_gb"] * 1e9),
        run.get("record_bytes") or int(run["expert_mb"] * 1e6),  # recorded since 2026-12-04q
        layers=range(min(moe, trace.layers)), model_layers=moe,
        start=run["trace_start"], calls=calls, counted=counted, exclusive=exclusive,
    )  # fmt: skip
    return r.disk_bytes_per_token / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="speed.py --beyond-ram memlimit JSON results")
    p.add_argument("--trace", default=None, help="the runs' trace (default: as recorded)")
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()
    t0 = time.perf_counter()
    rows = []
    for path in a.runs:
        run = json.loads(Path(path).read_text())
        trace_file = a.trace or run["trace"]
        trace = RoutingTrace.load(trace_file)
        for row in run["rows"]:
            if row["method"] != "memlimit" or row.get("predictor"):
                continue  # the simulator has no read-ahead
            out = {
                "run": path,
                "residency": row["residency"],
                "slots": row["slots"],
                "page_cache_room_gb": row["page_cache_room_gb"],
                "measured_disk_mb_per_token": round(row["disk_bytes_per_token"] / 1e6, 1),
                "run_predicted_disk_mb_per_token": round(
                    (row["predicted_disk_bytes_per_token"] or 0) / 1e6, 1
                ),
                "page_cache_disk_mb_per_token": round(replay(run, row, trace, False), 1),
                "exclusive_tier_disk_mb_per_token": round(replay(run, row, trace, True), 1),
                "store_mb_per_token": round(row["bytes_read_per_token"] / 1e6, 1),
            }
            log(out)
            rows.append(out)
    finish(a, "host-tier", {"rows": rows}, t0)


if __name__ == "__main__":
    main()
