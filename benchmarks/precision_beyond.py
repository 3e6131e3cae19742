"""Fewer bits per expert where bytes are the speed: larger than RAM at 8, 4, 3 and mixed
bits (issue 33, item 3).

The preset's checkpoint (4-bit experts) is requantized to each format (``requantize``,
a whole checkpoint beside the expert directory, so that stock mlx-lm runs the same
model); then for each, ``speed.py --beyond-ram`` in a process of its own: stock on that
model first, then the streamed model cold at ``--residency``, its experts kept out of RAM
by O_DIRECT (``--method direct``) or a memory cgroup (``--method memlimit
--memory-limit-gb G``, where fewer bits may let a whole swap tier fit), exact against
that stock. What each row costs in quality is the trained model's table
(``trained_quality.py``; random weights here say nothing about it).

    python benchmarks/precision_beyond.py --json benchmarks/results/precision-beyond-cpu.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import RESIDENCIES, add_trace_start, build, finish, log, parser, routing_trace

FORMATS = {
    "8-bit": {"bits": 8},
    "4-bit": None,  # the preset's own experts
    "mixed-3/3/4": {"bits": 4, "proj_bits": "gate=3,up=3,down=4"},  # gate, up, down
    "3-bit": {"bits": 3},
}
KEEP = ("tok_per_s", "decode_runs", "ratio_vs_stock", "hit_rate", "bytes_read_per_token",
        "disk_bytes_per_token", "predicted_disk_bytes_per_token", "swap_tier_gb",
        "storage_gbps", "t_compute_ms", "t_io_ms", "efficiency", "efficiency_vs_serial",
        "exact_vs_stock", "runtime")  # fmt: skip
# a row's stretch of routing against the held-out routing's, where the simulator ran
STRETCH = ("typical_disk_bytes_per_token", "stretch_vs_typical", "stretch_percentile")


def chosen(spec: str) -> list[str]:
    """The formats ``--formats`` names, in ``FORMATS``' order.

    Raises:
        ValueError: a name not in ``FORMATS``.
    """
    wanted = [f.strip() for f in spec.split(",")]
    unknown = [f for f in wanted if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown formats {unknown}; choose from {list(FORMATS)}")
    return [f for f in FORMATS if f in wanted]


def main() -> None:
    p = parser(__doc__, workdir="scratch/precision-beyond")
    p.add_argument("--residency", type=RESIDENCIES, default=[0.25])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    add_trace_start(p)
    p.add_argument(
        "--formats",
        default=",".join(FORMATS),
        help=f"which formats, comma-separated, of {', '.join(FORMATS)} (a device call "
        "may fit only some)",
    )
    p.add_argument(
        "--method",
        choices=["direct", "memlimit"],
        default="direct",
        help="how the experts are kept out of RAM (speed.py --beyond-ram)",
    )
    p.add_argument("--memory-limit-gb", type=float, default=0.0,
                   help="with --method memlimit: the cgroup's limit")  # fmt: skip
    a = p.parse_args()
    if a.method == "memlimit" and not a.memory_limit_gb:
        p.error("--method memlimit needs --memory-limit-gb")
    if a.method == "direct" and a.memory_limit_gb:
        p.error("--memory-limit-gb is the cgroup of --method memlimit: add it, or drop the limit")
    try:
        wanted = chosen(a.formats)
    except ValueError as e:
        p.error(str(e))
    routing_trace(a)  # --trace-start checked before the build, not in each format's run
    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.prep.requantize import requantize

    t0 = time.perf_counter()
    ck, src, meta = build(a)
    root = Path(a.workdir)
    rows = []
    for name in wanted:
        spec, model = FORMATS[name], ck
        if spec is not None:
            tag = name.replace("/", "")
            model = root / f"model-{tag}"
            if not (model / "config.json").exists():
                requantize(src, root / f"experts-{tag}", model_out=model, model=ck, **spec)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            cmd = [
                sys.executable,
                str(Path(__file__).with_name("speed.py")),
                "--checkpoint",
                str(model),
                "--workdir",
                str(root),
                "--residency",
                ",".join(map(str, a.residency)),
                "--tokens",
                str(a.tokens),
                "--repeat",
                str(a.repeat),
                "--beyond-ram",
                a.method,
                "--json",
                str(out),
            ]
            cmd += ["--memory-limit-gb", str(a.memory_limit_gb)] if a.memory_limit_gb else []
            cmd += ["--trace", a.trace] if a.trace else []  # fmt: skip
            cmd += ["--trace-start", str(a.trace_start)] if a.trace_start is not None else []
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            r = json.loads(out.read_text())
        ed = root / f"{model.name}-experts"
        for row in r["rows"]:
            rows.append({"format": name, "residency": row["residency"],
                         "expert_mb": round(load_meta(ed).expert_bytes() / 1e6, 3),
                         "stock_tok_per_s": r["stock_tok_per_s"],
                         **{k: row[k] for k in KEEP},
                         **{k: row[k] for k in STRETCH if k in row}})  # fmt: skip
            log(rows[-1])
    method = "O_DIRECT" if a.method == "direct" else f"{a.memory_limit_gb:g} GB cgroup"
    finish(
        a,
        "precision-beyond-ram",
        {"preset": a.preset, "source_expert_mb": round(meta.expert_bytes() / 1e6, 3),
         "method": method, "tokens": a.tokens, "repeat": a.repeat,
         "trace_start": a.trace_start, "rows": rows},
        t0,
    )  # fmt: skip


if __name__ == "__main__":
    main()
