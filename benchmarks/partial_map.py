"""The CUDA device path beyond half of RAM: does it pay with part of the experts mapped?

Issue 33, item 5. The device path plans on the GPU and copies each miss from page-locked
host memory without the host learning of it: no host synchronisation per layer, which is
its whole gain over the host path (about 0.36 of stock against 0.8 on the H200, warm).
When the expert files do not fit in RAM, only a part ``m`` of the experts can be mapped
and page-locked. A miss outside that part must come from the disk, through the host,
before the layer's matmul; the host can learn of it only by waiting for the layer's
routing, which is the host path's cost. Two ways the device path could still run:

- **fault per layer**: wait for each layer's routing (to know whether it faults): the
  host path's synchronisation on every layer, so no gain, whatever ``m``;
- **speculate per token**: run the token on the device path, flag the layers whose misses
  fall outside the mapped part, and at the token's end (the one synchronisation the
  device path has) redo the token from its first flagged layer on the host path (its KV
  entries rewritten). It pays only where few tokens fault.

This replays the DeepSeek-V2-Lite trace (held-out second half) through the store's slot
tables and policy (``SlotCache``, ``predictive``) at 50/25/12.5% of the experts on the
GPU, with the mapped part either static (each layer's experts most often routed in the
first half: the best a load-time choice does) or an LRU tier of the misses (what the page
cache does, updated at the host's per-token synchronisation). It counts the layer calls
and the tokens that would fault, and where the first fault falls, then models tok/s from
the H200's measured device-path and host-path times (inputs, printed with the result).

    python benchmarks/partial_map.py --json benchmarks/results/partial-map-2026-12-02.json
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np
from harness import finish, log, parser, routing_trace

# H200, DeepSeek-V2-Lite shape, warm (benchmarks/RESULTS.md, 2026-12-02g and the issue)
DEVICE_TOK_S = {0.5: 48.7, 0.25: 43.6, 0.125: 46.5}  # the device path, every miss mapped
HOST_TOK_S = 28.6  # the host path at 50%, mapped files
DISK_GBPS = 1.15  # record reads at the reader's queue depth (2026-12-02i)
RECORD_MB = 4.866


def replay(trace, slots: int, mapped: np.ndarray | int, start: int, tokens: int) -> dict:
    """Fault counts of one residency: ``mapped`` is a [layers, experts] bool table (static)
    or an int (an LRU tier of that many records per layer)."""
    from mlx_streaming.core.cache.policy import make_policy
    from mlx_streaming.core.cache.slots import SlotCache

    L, E = trace.layers, trace.num_experts
    caches = [SlotCache(E, slots, make_policy("predictive", E)) for _ in range(L)]
    tiers = [OrderedDict() for _ in range(L)] if isinstance(mapped, int) else None
    rows = trace.experts[start : start + tokens].astype(np.int64)
    misses = outside = faulty_calls = faulty_tokens = 0
    redo = []  # per faulting token: the share of its layers from the first fault on
    for t in range(len(rows)):
        first = None
        for li in range(L):
            got = [e for e, _, _ in caches[li].lookup(np.unique(rows[t, li]))]
            misses += len(got)
            if tiers is None:
                out = int((~mapped[li, got]).sum()) if got else 0
            else:
                out = sum(e not in tiers[li] for e in got)
                for e in got:  # read into the tier (from the disk when it was not there)
                    tiers[li][e] = None
                    tiers[li].move_to_end(e)
                    if len(tiers[li]) > mapped:
                        tiers[li].popitem(last=False)
            outside += out
            if out:
                faulty_calls += 1
                first = li if first is None else first
        if first is not None:
            faulty_tokens += 1
            redo.append((L - first) / L)
    n = len(rows)
    return {
        "misses_per_token": round(misses / n, 3),
        "disk_misses_per_token": round(outside / n, 3),
        "disk_mb_per_token": round(outside / n * RECORD_MB, 1),
        "faulting_layer_calls": round(faulty_calls / (n * L), 4),
        "faulting_tokens": round(faulty_tokens / n, 4),
        "redo_share_when_faulting": round(float(np.mean(redo)), 3) if redo else 0.0,
    }


def model(row: dict, residency: float) -> dict:
    """Predicted tok/s (reads after compute, as the host path does them today)."""
    t_dev, t_host = 1 / DEVICE_TOK_S[residency], 1 / HOST_TOK_S
    t_disk = row["disk_mb_per_token"] / 1e3 / DISK_GBPS
    speculate = t_dev + row["faulting_tokens"] * row["redo_share_when_faulting"] * t_host
    return {  # faulting per layer is the host path's synchronisations: its tok/s
        "host_path_tok_s": round(1 / (t_host + t_disk), 2),
        "speculate_tok_s": round(1 / (speculate + t_disk), 2),
    }


def main() -> None:
    p = parser(__doc__, preset=None, trace="required", workdir=None)
    p.add_argument("--tokens", type=int, default=4000, help="held-out tokens replayed")
    a = p.parse_args()
    from mlx_streaming.planning.simulate import routing_counts

    t0 = time.perf_counter()
    trace, half = routing_trace(a)
    counts = routing_counts(trace, 0, half)  # [layers, experts], learned on the first half
    E = trace.num_experts
    order = np.argsort(-counts, axis=1, kind="stable")
    rows = []
    for residency in (0.5, 0.25, 0.125):
        slots = int(E * residency)
        for m in (0.5, 0.75, 0.9, 1.0):
            n = int(round(E * m))
            hot = np.zeros(counts.shape, bool)
            np.put_along_axis(hot, order[:, :n], True, axis=1)
            for tier, mapped in (("static hottest", hot), ("lru of misses", n)):
                if m == 1.0 and tier != "static hottest":
                    continue
                r = replay(trace, slots, mapped, half, a.tokens)
                r |= model(r, residency)
                r |= {"residency": residency, "mapped": m, "tier": tier}
                rows.append(r)
                log(
                    f"{residency:>5} mapped {m:.2f} {tier:15} faulting tokens "
                    f"{r['faulting_tokens']:.3f} layer calls {r['faulting_layer_calls']:.3f} "
                    f"redo {r['redo_share_when_faulting']:.2f} disk {r['disk_mb_per_token']} MB "
                    f"host {r['host_path_tok_s']} speculate {r['speculate_tok_s']} "
                    f"(all mapped {DEVICE_TOK_S[residency]})"
                )
    finish(a, "partial-map", {
        "trace": a.trace, "held_out_start": half, "tokens": a.tokens, "policy": "predictive",
        "inputs": {"device_tok_s": DEVICE_TOK_S, "host_tok_s": HOST_TOK_S,
                   "disk_gbps": DISK_GBPS, "record_mb": RECORD_MB},
        "rows": rows,
    }, t0)  # fmt: skip


if __name__ == "__main__":
    main()
