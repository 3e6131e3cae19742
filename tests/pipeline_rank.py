"""One rank of a pipelined streamed model: run under ``mlx.launch`` by
``test_pipeline.py``. Writes this rank's greedy trace and memory to OUT/rank<r>.npz."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="{rank} becomes the rank")
    p.add_argument("--expert-dir", required=True, help="{rank} becomes the rank")
    p.add_argument("--slots", type=int)
    p.add_argument("--budget-gb", help="GB of pools, or auto")
    p.add_argument("--split")
    p.add_argument("--prompt", required=True, help="comma-separated token ids")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--prefill", type=int, default=4)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--die-after-load", type=int, help="this rank exits after loading")
    a = p.parse_args()

    from mlx_streaming import load
    from mlx_streaming.analysis.verify import greedy_trace
    from mlx_streaming.parallel import PipelineError, init_pipeline, lost_peer, parse_split

    group = init_pipeline(a.timeout)
    rank = group.rank()
    out = Path(a.out)
    try:
        model, _, store = load(
            a.model.format(rank=rank),
            a.expert_dir.format(rank=rank),
            slots=a.slots,
            budget_gb=a.budget_gb if a.budget_gb in (None, "auto") else float(a.budget_gb),
            pool_profile=False,
            progress=False,
            pipeline_group=group,
            pipeline_split=parse_split(a.split),
        )
        if a.die_after_load == rank:
            os._exit(5)
        ids = [int(x) for x in a.prompt.split(",")]
        t0 = time.perf_counter()
        try:
            trace = greedy_trace(model, ids, a.tokens, a.prefill)
        except RuntimeError as e:
            raise lost_peer(e) from e
        np.savez(
            out / f"rank{rank}.npz",
            tokens=np.array(trace.tokens),
            logits=trace.logits,
            layers=np.array(store.layers),
            report_layers=np.array(sorted(store.layer_report())),
            seconds=time.perf_counter() - t0,
        )
        store.close()
    except (PipelineError, ValueError) as e:
        (out / f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}")
        print(f"rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(4)


if __name__ == "__main__":
    main()
