"""Smoke test of the CUDA slot-copy path on a small synthetic model (device machine).

    python -X faulthandler benchmarks/cuda_smoke.py
"""

from __future__ import annotations

import sys

from mlx_lm import load

from mlx_streaming import FileExpertStore, patch_model_filebacked, split_model
from mlx_streaming.core.meta import load_meta
from mlx_streaming.synthetic import make_checkpoint
from mlx_streaming.analysis.verify import compare_traces, greedy_trace


def main(root="/tmp/mlxs-smoke"):
    ck = make_checkpoint(f"{root}/m", "tiny-mixtral")
    ed = f"{root}/e"
    split_model(ck, ed)
    meta = load_meta(ed)
    ref, tok = load(str(ck))
    ids = tok.encode("A mixture of experts routes each token to a few experts. " * 3)
    want = greedy_trace(ref, ids, 12, 16)
    for mode in ("cuda", "mlx"):
        print("mode", mode, flush=True)
        model, _ = load(str(ck), lazy=True)
        try:
            store = FileExpertStore(ed, capacity=meta.top_k, pool_mode=mode)
        except Exception as e:  # noqa: BLE001
            print(" unavailable:", e, flush=True)
            continue
        print(" store ok", store.pool_mode, flush=True)
        d = meta.dims
        patch_model_filebacked(model, store, d["hidden"], d["moe_inter"], d["group_size"],
                               d["bits"])
        got = greedy_trace(model, ids, 12, 16)
        print(" exact", compare_traces(want, got).to_json(), store.totals()["bytes_read"],
              flush=True)
        store.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
