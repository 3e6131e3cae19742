"""Where one decode step's time goes: the host building its graph, the host launching
it, and the wait for the device, stock against streamed (issue 31, item 8).

A loop shaped as mlx-lm's ``generate_step`` (build token t+1's graph, launch it with
``mx.async_eval``, then wait for token t), timed per token: ``build`` (the model call and
the argmax, Python and MLX's graph), ``launch`` (MLX encoding and launching it) and
``wait`` (the token before, on the device). Then the same loop synchronised per token:
``synced`` = build + launch + the device's tail after the last launch. A wait near 0
means the host bounds the step; a wait > 0, the device.

Models, all loaded at once and run in alternating rounds (the same trace position each
run, so that the machine's drift hits each alike): stock; streamed at ``--residency``;
the same with the kernel's copies dropped, and with no kernel (both inexact, in their
own pools: what the copies and the kernel cost); the same with a second, empty kernel
after each call (the launches of the two-kernel device path before 2026-12-04), and
with the kernel's grid at 1,024 blocks instead of 128 (the copy's parallelism); every
expert resident. Wall time and the main thread's CPU time, medians in ms per token, and
the excess over stock per MoE layer call in µs.

    python benchmarks/probes/decode_split.py --preset dsv2-lite --residency 0.5 \
        --workdir /tmp/mlxs --json out.json
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from harness import (  # noqa: E402
    PROMPT,
    build,
    finish,
    log,
    parser,
    rewind,
    routing_trace,
    slots_at,
    stock,
    streamed,
)


def _ms(xs: list[float]) -> float:
    return round(1e3 * statistics.median(xs), 3)


def split(model, tok, tokens: int, synced: bool = False) -> dict:
    """Per-token medians (ms) over ``tokens`` decode steps: wall time of build, launch and
    wait, and the main thread's CPU time of build and launch."""
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    ids = mx.array(tok.encode(PROMPT))
    with mx.stream(generation_stream):
        y = mx.argmax(model(ids[None], cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)
    rows = []
    t_prev = time.perf_counter()
    for _ in range(tokens):
        t0, c0 = time.perf_counter(), time.thread_time()
        with mx.stream(generation_stream):
            nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        t1, c1 = time.perf_counter(), time.thread_time()
        mx.async_eval(nxt)
        t2, c2 = time.perf_counter(), time.thread_time()
        (nxt if synced else y).item()
        t3 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t3 - t2, t3 - t_prev, c1 - c0, c2 - c1))
        t_prev, y = t3, nxt
    mx.eval(y)
    rows = rows[4:]  # warm-up steps
    names = ("build_ms", "launch_ms", "wait_ms", "step_ms", "build_cpu_ms", "launch_cpu_ms")
    return {n: _ms([r[i] for r in rows]) for i, n in enumerate(names)}


def _no_parts(meta: mx.array, word: int) -> tuple[mx.array, int]:
    """A layer's copy description with no parts to copy."""
    m = np.array(meta)
    m[2] = 0
    return mx.array(m), word


def _second_kernel(dev):
    """``dev.slots`` followed by the reader's fill kernel on an empty list: the host and
    launch cost of the second kernel per call that the device path had until 2026-12-04
    (exact: it copies nothing)."""
    slots, empty = dev.slots, mx.zeros((1,), mx.int32)

    def call(layer, ids):
        return dev.reader.fill(layer, empty, slots(layer, ids))

    return call


def main():
    p = parser(__doc__, preset="dsv2-lite", workdir="/tmp/mlxs")
    p.add_argument("--residency", type=float, default=0.5)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    ck, ed, meta = build(a)
    trace, start = routing_trace(a)
    slots = slots_at(meta, a.residency)
    ref, tok, routing = stock(ck, trace, start)
    models = {"stock": (ref, routing, None)}
    for name, n, variant in (
        (f"streamed_{a.residency}", slots, None),
        (f"streamed_{a.residency}_no_copies", slots, "no_copies"),
        (f"streamed_{a.residency}_no_kernels", slots, "no_kernels"),
        (f"streamed_{a.residency}_second_kernel", slots, "second_kernel"),
        (f"streamed_{a.residency}_1024_blocks", slots, "1024_blocks"),
        ("streamed_resident", meta.num_experts, None),
    ):
        model, _, store, r = streamed(ck, ed, trace, start, slots=n)
        dev = store.device
        if variant == "no_copies" and dev is not None:  # the plan runs, copying no part
            dev.reader.copy_meta = lambda layer, f=dev.reader.copy_meta: _no_parts(*f(layer))
        if variant == "no_kernels" and dev is not None:  # no kernel: slots in range
            dev.slots = lambda layer, ids, cap=n: mx.minimum(ids, cap - 1)
        if variant == "second_kernel" and dev is not None:  # as before 2026-12-04: the
            dev.slots = _second_kernel(dev)  # plan, then a fill kernel (here empty)
        if variant == "1024_blocks" and dev is not None:  # the fill kernel's grid
            dev.blocks = 1024
        models[name] = (model, r, store)
    # inexact variants write wrong bytes in their own pools only; the rounds alternate
    # the models so that the machine's drift hits each alike
    per = {name: [] for name in models}
    for _ in range(a.rounds):
        for name, (model, r, _) in models.items():
            rewind(start, r)
            per[name].append(split(model, tok, a.tokens))
    runs = {}
    for name, rs in per.items():
        runs[name] = {k: round(statistics.median(x[k] for x in rs), 3) for k in rs[0]}
        runs[name]["step_ms_rounds"] = [x["step_ms"] for x in rs]
        store = models[name][2]
        if store is not None:
            runs[name]["decode_path"] = store.runtime.decode_path
        rewind(start, models[name][1])
        runs[name]["synced"] = split(models[name][0], tok, a.tokens, synced=True)
        log(name, runs[name])
    base = runs["stock"]
    for r in runs.values():
        r["extra_per_moe_layer_us"] = {
            k: round(1e3 * (r[k] - base[k]) / len(meta.layers), 1)
            for k in ("build_cpu_ms", "launch_cpu_ms", "step_ms")
        }
    finish(
        a, "decode_split", {"slots": slots, "tokens": a.tokens, "rounds": a.rounds, "runs": runs}
    )


if __name__ == "__main__":
    main()
