"""Whole layers resident, the rest streamed, at equal slots: fewer device-path calls for
more bytes (issue 31, item 8).

On the H200 a decode step at 50% is bound by the host: each streamed MoE layer call costs
about 63 us of host time more than a resident one (``decode_split.py``, 2026-12-04a:
10.81 ms per token streamed, 9.17 with every expert resident, 26 MoE layers). A layer
whose pool holds every expert takes the resident path and no kernel. This probe makes
the F layers with the most misses whole and shares the other slots among the rest by
their hit curves (``build_profile(whole_layers=F)``, as ``profile --whole-layers F``;
until 2026-12-04f it shared them evenly),
simulates the DeepSeek-V2-Lite trace's held-out half under the policy, and writes one
pool profile per F for ``speed.py --pool-profile`` (``gpu_suite.sh layers``). Its
prediction, a rough model to choose the runs from, not a result:
``max(host + streamed layers * call, gpu + bytes / copy rate)`` against stock's
``max(host, gpu)``, with the constants below fitted to the sixteenth session's runs.

    python benchmarks/probes/resident_layers.py --out /tmp/profiles \
        --json benchmarks/results/resident-layers.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import finish, log, parser  # noqa: E402


def main():
    p = parser(__doc__, preset=None, trace="required", workdir=None)
    p.add_argument("--residency", type=float, default=0.5)
    p.add_argument("--full", default="0,2,4,6,8,10,12", help="whole layers, F")
    p.add_argument("--policy", default="predictive")
    p.add_argument("--tokens", type=int, default=4000, help="held-out tokens replayed")
    p.add_argument(
        "--first-layer", type=int, default=1, help="model index of the trace's first MoE layer"
    )
    p.add_argument("--out", default=None, help="write layers-F.json pool profiles here")
    p.add_argument("--expert-mb", type=float, default=4.87)
    p.add_argument("--host-ms", type=float, default=9.17, help="a step's host time, all resident")
    p.add_argument("--call-us", type=float, default=63.0, help="host cost of a streamed call")
    p.add_argument("--gpu-ms", type=float, default=6.5, help="a step's GPU compute")
    p.add_argument("--copy-gbps", type=float, default=55.0, help="host-to-device copy rate")
    a = p.parse_args()
    from mlx_streaming.planning.budget import PoolShape
    from mlx_streaming.planning.profiles import build_profile, write_pool_profile
    from mlx_streaming.planning.simulate import simulate
    from mlx_streaming.planning.trace import RoutingTrace

    trace = RoutingTrace.load(a.trace)
    calib, held = trace.split(0.5)
    L, E, k = trace.layers, trace.num_experts, trace.top_k
    u = max(k, round(a.residency * E))  # speed.py's uniform slots
    shape = PoolShape([1] * L, [E] * L, k, list(range(a.first_layer, a.first_layer + L)))
    stock = max(a.host_ms, a.gpu_ms)
    rows = []
    for f in (int(x) for x in a.full.split(",")):
        if f == 0:  # the uniform default
            caps, whole = dict.fromkeys(shape.layers, u), []
        else:  # the package's profile (``profile --whole-layers F``) at the same bytes
            try:
                prof = build_profile(
                    trace, shape, slots=u, policy=a.policy, tokens=a.tokens,
                    zero_slot=False, whole_layers=f,
                )  # fmt: skip
            except ValueError as e:
                log(f"F={f}: {e}")
                continue
            caps, whole = prof.slots, prof.whole_layers
        sim = simulate(held, a.policy, dict(zip(range(L), caps.values())), tokens=a.tokens)
        mb = sim.misses_per_token() * a.expert_mb
        streamed = sum(c < E for c in caps.values())
        host = a.host_ms + streamed * a.call_us / 1e3
        gpu = a.gpu_ms + mb / a.copy_gbps
        row = {
            "full": f,
            "layers_whole": sorted(li for li, c in caps.items() if c >= E),
            "slots_streamed": sorted({c for c in caps.values() if c < E}),
            "hit_rate": round(sim.hit_rate, 4),
            "mb_per_token": round(mb, 1),
            "predicted_host_ms": round(host, 2),
            "predicted_gpu_ms": round(gpu, 2),
            "predicted_of_stock": round(stock / max(host, gpu), 3),
        }
        log(row)
        rows.append(row)
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            write_pool_profile(
                Path(a.out) / f"layers-{f}.json",
                caps,
                note=f"resident_layers.py: {f} whole layers at residency {a.residency}",
                whole_layers=whole,
            )
    finish(a, "resident_layers", {"trace": a.trace, "residency": a.residency, "rows": rows,
                                  "constants": {k_: getattr(a, k_) for k_ in
                                                ("host_ms", "call_us", "gpu_ms", "copy_gbps",
                                                 "expert_mb")}})  # fmt: skip


if __name__ == "__main__":
    main()
