"""What fewer bits per expert cost on a trained model: held-out perplexity, and KL
divergence and top-1 agreement of next-token distributions against the unquantized model,
for 8/4/3/2-bit experts and mixed profiles (per projection, and per layer and projection
allocated under a byte target from measured errors).

The model is ``train-tiny``'s unquantized output (``--float-out``); the held-out text is
the one saved with it (``held_out.txt``: the start of every n-th standard-library file). Each format's
experts are requantized from the float experts; the rest of the model stays float. Every
format is run streamed with all experts resident (streaming is exact, so this is also
what stock mlx-lm gives on the requantized model).

    python benchmarks/trained_quality.py --model /tmp/tiny-float --json quality.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from harness import finish, log, parser

FORMATS = {
    "8-bit": {"bits": 8},
    "4-bit": {"bits": 4},
    "3-bit": {"bits": 3},
    "2-bit": {"bits": 2},
    "mixed gate=3,up=3,down=4": {"bits": 4, "proj_bits": "gate=3,up=3,down=4"},
    "mixed gate=2,up=2,down=3": {"bits": 4, "proj_bits": "gate=2,up=2,down=3"},
    "allocated at 3-bit bytes": {"target": 3},
    "allocated at 2.5-bit bytes": {"target": 2.5},
}


def main():
    p = parser(__doc__, preset=None, trace=False, workdir="scratch/trained-quality")
    p.add_argument("--model", required=True, help="the unquantized trained model")
    p.add_argument("--positions", type=int, default=2048, help="held-out tokens scored")
    a = p.parse_args()
    import mlx.core as mx
    from mlx_lm import load as mlx_load

    from mlx_streaming import load
    from mlx_streaming.analysis.quality import (
        allocate_bits,
        capture_arrays,
        compare_distributions,
        error_table,
        proj_bytes,
    )
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.prep.requantize import requantize
    from mlx_streaming.prep.split_experts import ensure_split
    from mlx_streaming.synthetic.train import held_out_loss, held_out_text

    t0 = time.perf_counter()
    root = Path(a.workdir)
    info = json.loads((Path(a.model) / "training.json").read_text())
    cfg = info["config"]
    if a.positions < cfg["seq"]:
        raise SystemExit(f"--positions {a.positions} is below one window of the model's "
                         f"{cfg['seq']} tokens: give {cfg['seq']} or more")  # fmt: skip
    held_text = held_out_text(a.model)
    stock, tok = mlx_load(a.model)
    ids = np.array(tok.encode(held_text), dtype=np.int32)
    seq = cfg["seq"]
    score = ids[: a.positions].tolist()
    src = root / "experts-float"
    meta = ensure_split(a.model, src)
    inputs = capture_arrays(stock, score[:512])
    table = error_table(meta, inputs, candidates=(2, 3, 4, 8))
    ref_loss = held_out_loss(stock, ids, seq, windows=a.positions // seq)
    rows = [{"format": "float (reference)", "expert_bytes": meta.expert_bytes(),
             "perplexity": round(float(np.exp(ref_loss)), 3), "kl": 0.0, "top1": 1.0}]  # fmt: skip
    log(rows[-1])
    for name, spec in FORMATS.items():
        ed = root / ("experts-" + name.replace(" ", "_").replace(",", "").replace("=", ""))
        spec = dict(spec)
        if "target" in spec:  # same bytes as uniform `target` bits, spent where errors are
            at3 = sum(proj_bytes(meta.layers[li], p, 3, 64) for li in table for p in table[li])
            budget = int(spec.pop("target") / 3 * at3 * meta.num_experts)
            spec = {"bits": 4, "layer_bits": allocate_bits(meta, table, budget, 64)[0]}
        requantize(src, ed, progress=False, **spec)
        model, _, store = load(a.model, ed, slots=meta.num_experts, progress=False)
        loss = held_out_loss(model, ids, seq, windows=a.positions // seq)
        cmp = compare_distributions(stock, model, score)
        store.close()
        rows.append({
            "format": name,
            "expert_bytes": load_meta(ed).expert_bytes(),
            "perplexity": round(float(np.exp(loss)), 3),
            "kl": round(cmp["kl"], 5),
            "kl_max": round(cmp["kl_max"], 4),
            "top1": round(cmp["top1_agreement"], 4),
        })  # fmt: skip
        log(rows[-1])
        mx.clear_cache()
    finish(a, "trained_quality", {"model": a.model, "positions": a.positions,
                                  "training": {k: info[k] for k in ("config", "held_out_loss")},
                                  "rows": rows}, t0)  # fmt: skip


if __name__ == "__main__":
    main()
