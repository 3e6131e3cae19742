"""Why a decode step's host work costs more than the same code in a loop (issue 31,
item 7): numpy's indexing code is cold between layer calls.

1. Synthetic: a graph of 20 matmuls (4 MB of weights) evaluated, then one numpy fancy
   index of six ids into a 64-entry table, twice; median µs of the first and the second.
2. In the demo's decode (the trained model, 32 of 64 experts resident): the slot table's
   split of a call's experts into resident and missing, the first such lookup of each
   layer call, by numpy's fancy and boolean indexing, and by the store's own
   ``SlotCache.split`` (Python lists over the same table, since 2026-12-03); each
   variant timed first in turn.

    python benchmarks/probes/cold_numpy.py --json benchmarks/results/cold-numpy-cpu.json
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import ROOT, finish, parser  # noqa: E402

CHECKPOINT = ROOT / "checkpoints" / "tiny-stdlib-moe"
PROMPT = 'import os\n\n\ndef read_config(path):\n    """'


def synthetic(rounds: int = 300) -> dict:
    """First and second fancy index after a blocking evaluation, median µs."""
    import mlx.core as mx

    table = np.full(64, -1, np.int32)
    ids = np.array([1, 5, 9, 12, 40, 63], np.int32)
    x, w = mx.random.normal((1, 1024)), mx.random.normal((1024, 1024))
    mx.eval(x, w)
    first, second = [], []
    for _ in range(rounds):
        y = x
        for _ in range(20):
            y = mx.tanh(y @ w)
        mx.eval(y)
        for out in (first, second):
            t = time.perf_counter()
            table[ids]
            out.append(time.perf_counter() - t)
    return {"first_us": _us(first), "second_us": _us(second)}


def by_numpy(slot_of: np.ndarray, experts: np.ndarray):
    r = slot_of[experts] >= 0
    return experts[r], experts[~r]


def in_decode(workdir: str, runs: int) -> dict:
    """Each variant's time when it is a layer call's first lookup, median µs."""
    from mlx_lm import stream_generate

    from mlx_streaming.core.cache.slots import SlotCache
    from mlx_streaming.core.options import StreamConfig
    from mlx_streaming.model_builder import load
    from mlx_streaming.prep.split_experts import ensure_split

    ed = f"{workdir}/experts"
    ensure_split(CHECKPOINT, ed)
    model, tok, _ = load(CHECKPOINT, ed, StreamConfig(slots=32), progress=False)
    split = SlotCache.split  # the store's own: Python lists
    variants = {"numpy": lambda c, e: by_numpy(c.slot_of, e), "lists": split}
    times = {k: [] for k in variants}
    turn = itertools.cycle(variants)

    def timed(self, experts):
        name = next(turn)
        t = time.perf_counter()
        variants[name](self, experts)
        times[name].append(time.perf_counter() - t)
        return split(self, experts)

    SlotCache.split = timed
    try:
        for _ in range(runs):
            for _ in stream_generate(model, tok, PROMPT, max_tokens=64):
                pass
    finally:
        SlotCache.split = split
    return {f"{k}_us": _us(v) for k, v in times.items()} | {"lookups": len(times["numpy"])}


def _us(ts: list[float]) -> float:
    return round(1e6 * float(np.median(ts)), 1)


def main() -> None:
    p = parser(__doc__, preset=None, trace=False, workdir="scratch/cold-numpy")
    p.add_argument("--runs", type=int, default=4)
    a = p.parse_args()
    t0 = time.perf_counter()
    result = {"synthetic": synthetic(), "decode": in_decode(a.workdir, a.runs)}
    finish(a, "cold-numpy", result, t0)


if __name__ == "__main__":
    main()
