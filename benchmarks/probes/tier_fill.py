"""How long a swap tier takes to fill at load, cold: a store opened on the preset's expert
files with a whole tier and with one bounded to half of the rest, read through the page
cache and (bounded) with O_DIRECT, the page cache dropped before each (root; else warm, and said).

Each row is the store's opening in seconds (median of ``--repeat``), the bytes the fill
read (pools and tier) and their rate. Since 2026-12-06c the store's own file reader fills
the tier (``cache.readers.fill_tier``: the compiled reader's threads, O_DIRECT where the
runtime chose it), where the tier had read each record with one ``preadv`` after another.

    python benchmarks/probes/tier_fill.py --json /tmp/tier-fill.json
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import build, finish, parser  # noqa: E402


def drop_caches() -> bool:
    """Drop the page cache (root on Linux): False where it cannot."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def opened_s(ed, slots: int, gb, direct: bool) -> tuple[float, int, bool]:
    """Seconds to open the store with a tier of ``gb`` (None: whole), the bytes its pools
    and tier hold, and whether the page cache was dropped first."""
    from mlx_streaming.core.cache.expert_store import FileExpertStore

    cold = drop_caches()
    t0 = time.perf_counter()
    store = FileExpertStore(ed, slots, swap_tier=True, swap_tier_gb=gb, direct_io=direct)
    dt = time.perf_counter() - t0
    held = store.reader.tier.nbytes + sum(p.nbytes for p in store.pools.values())
    store.close()
    return dt, held, cold


def main(argv=None) -> dict:
    p = parser(__doc__, trace=False)
    p.add_argument("--slots", type=int, default=16, help="pool slots per layer")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    _, ed, meta = build(a)
    rest = sum((meta.layers[li].num_experts - a.slots) * meta.layers[li].stride
               for li in meta.moe_layers)  # fmt: skip
    rows = []
    for name, gb in (("whole", None), ("bounded", round(rest / 2e9, 3))):
        for direct in (False, True) if gb else (False,):  # a whole tier reads no files after
            runs = [opened_s(ed, a.slots, gb, direct) for _ in range(a.repeat)]
            s, held = statistics.median(r[0] for r in runs), runs[0][1]
            rows.append({"tier": name, "tier_gb": gb, "direct_io": direct, "open_s": round(s, 3),
                         "runs_s": [round(r[0], 3) for r in runs], "held_gb": round(held / 1e9, 3),
                         "gbps": round(held / s / 1e9, 3), "cold": all(r[2] for r in runs)})  # fmt: skip
            print(rows[-1], flush=True)
    return finish(a, "tier_fill", {"slots": a.slots, "rows": rows}, t0)


if __name__ == "__main__":
    main()
