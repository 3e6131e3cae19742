"""The host path's floor: what one host synchronisation per MoE layer costs stock mlx-lm
itself, against the streamed host path at ``--residency``.

The host path reads each layer's routing on the host before it plans that layer's loads:
one ``mx.eval`` of the routing and a device-to-host read of its ids per MoE layer call
(on CUDA through page-locked memory, ``io.transfers.IdTransfers``, as the store does;
elsewhere ``np.array``). ``stock, synced per layer`` runs stock mlx-lm with that added
(the routing evaluated and read where the streamed layer reads it) and nothing else, so
that

- stock -> synced is the cost of the synchronisation alone (the design's floor),
- synced -> streamed at ``--residency`` is the store's own work per call (planning, the
  policy, its separate launches) and the misses (trades, reads, their waits).

``stock, launched per layer`` only launches each layer's routing (``mx.async_eval``, no
wait): what splitting the evaluation costs, apart from waiting. ``shared in the
experts' launch`` (beside each residency below 1) starts no shared experts beside the
routing (``SharedAhead.start`` off): one launch fewer per call, the shared MLP computed
with the routed experts instead of while the host plans. With every expert resident the
store reads no routing (its calls take the device's slot table), so that row is stock's
model with the store's pools, not the host path.

All models are loaded at once and run in alternating rounds from the same trace
position; medians of decode tok/s and ms per token.

    python benchmarks/probes/sync_floor.py --preset dsv2-lite --workdir /tmp/mlxs \
        --residency 0.25 --json out.json
"""

from __future__ import annotations

import statistics
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import (  # noqa: E402
    PROMPT,
    RESIDENCIES,
    build,
    decode_run,
    finish,
    log,
    parser,
    rewind,
    routing_on_host,
    routing_read_through,
    routing_trace,
    slots_at,
    stock,
    streamed,
)

from mlx_streaming.core.prefetch.shared import SharedAhead  # noqa: E402

NO_SHARED_AHEAD = {"on": False}  # read by the patch below


def _shared_ahead_switch() -> None:
    """Let ``NO_SHARED_AHEAD`` turn the shared experts' early start off (for the rest of
    this process)."""
    start = SharedAhead.start

    def start_or_not(self, x):
        return None if NO_SHARED_AHEAD["on"] else start(self, x)

    SharedAhead.start = start_or_not


def main():
    """Run every row in alternating rounds and print (and write) their medians."""
    p = parser(__doc__, preset="dsv2-lite", trace="required", workdir="/tmp/mlxs")
    p.add_argument(
        "--residency", type=RESIDENCIES, default=[0.25], help="streamed residencies beside 1"
    )
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    ck, ed, meta = build(a)
    trace, start = routing_trace(a)
    _shared_ahead_switch()
    ids_read = routing_read_through()
    runs = {}  # name -> (model, tokenizer, routing, the patches' flags)
    model, tok, routing = stock(ck, trace, start)
    runs["stock"] = (model, tok, routing, {})
    runs["stock, launched per layer"] = (model, tok, routing, {"launch_only": True})
    runs["stock, synced per layer"] = (model, tok, routing, {"read": True})
    stores = []
    for r in [1.0] + sorted(set(a.residency) - {1.0}):
        name = "streamed, all resident" if r == 1.0 else f"streamed {r}"
        m, t, store, rt = streamed(ck, ed, trace, start, slots=slots_at(meta, r),
                                   device_reads=False)  # fmt: skip
        runs[name] = (m, t, rt, {})
        stores.append(store)
        if r < 1.0:
            runs[name + ", shared in the experts' launch"] = (m, t, rt, {"no_shared": True})
    tps = {name: [] for name in runs}
    for rnd in range(a.rounds + 1):  # the first round warms each up
        for name, (m, t, rt, flags) in runs.items():
            rewind(start, rt)
            on_host = flags.get("read") or flags.get("launch_only")
            NO_SHARED_AHEAD["on"] = bool(flags.get("no_shared"))
            try:
                with routing_on_host(bool(flags.get("launch_only"))) if on_host else nullcontext():
                    got = decode_run(m, t, PROMPT, a.tokens)[0]
            finally:
                NO_SHARED_AHEAD["on"] = False
            if rnd:
                tps[name].append(got)
        log(rnd, {k: round(v[-1], 1) for k, v in tps.items() if v})
    rows, base = {}, 1e3 / statistics.median(tps["stock"])
    for name, v in tps.items():
        ms = 1e3 / statistics.median(v)
        per_layer = round(1e3 * (ms - base) / len(meta.layers))
        rows[name] = {"tok_per_s": round(1e3 / ms, 2), "ms_per_token": round(ms, 2),
                      "runs": [round(x, 2) for x in v], "ms_over_stock": round(ms - base, 2),
                      "us_over_stock_per_moe_layer": per_layer}  # fmt: skip
    for s in stores:
        s.close()
    finish(a, "sync_floor", {"moe_layers": len(meta.layers), "tokens": a.tokens,
                             "rounds": a.rounds, "ids_read_through": ids_read,
                             "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
