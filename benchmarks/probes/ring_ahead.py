"""Read-ahead through the request ring, on real files and the real ring, with the compute
stood in for by waits: whether guesses pay, and whether the ring's guess class (read
only while no demand read waits) is what makes them pay (issue 33; the I/O half of the
design ``ahead_horizon.py`` models).

A measured larger-than-RAM row (``speed.py --beyond-ram ... --json``) and its trace give
each decode step's disk reads by layer (``ahead_horizon.row_steps``) and the compute a
layer takes (its ``t_compute`` over its MoE layers). Each step is played on this
machine: a layer waits out ``--split`` of its compute, asks the ring for its misses
(records of the preset's files, read with O_DIRECT) and waits for them, then waits out
the rest. With read-ahead, after a layer's routing the next layer's guesses are asked
too: each of its misses with probability ``recall``, and ``1 / precision - 1`` other
records for each; a miss guessed is taken from its guess's entry (asked for ``now``), and
the wrong guesses are taken back (``RequestRing.drop``) when their layer has run. Guesses go to the ring's
guesses' entries (``priority``), or to demand entries beside the misses (``fifo``).
Cases alternate in each of ``--repeat`` rounds; the table gives medians against no
read-ahead, beside the storage probe through the same ring and the model's prediction.

    python benchmarks/probes/ring_ahead.py --row <row.json> --trace <trace.npz> \\
        --preset dsv2-lite --num-layers 4 --workdir /tmp/mlxs --json out.json
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ahead_horizon import decode_time, row_steps  # noqa: E402
from harness import build, finish, log, parser  # noqa: E402

QUALITIES = ((1.0, 1.0), (0.78, 0.78), (0.46, 0.2))
DEMAND, GUESSES = 16, 16  # the ring's entries of each kind


def wait_until(t: float) -> None:
    """Sleep until ``perf_counter()`` reaches ``t`` (the last 100 µs spun)."""
    left = t - time.perf_counter()
    if left > 1e-4:
        time.sleep(left - 1e-4)
    while time.perf_counter() < t:
        pass


class Player:
    """Plays decode steps against a ring (see the module's text)."""

    def __init__(self, ring, meta, c: float, split: float, guess_class: bool, rng):
        self.ring, self.meta, self.c, self.split, self.rng = ring, meta, c, split, rng
        self.layers = sorted(meta.layers)
        self.free_guess = list(
            ring.guess_entries if guess_class else range(DEMAND, DEMAND + GUESSES)
        )

    def picks(self, g: int, n: int, avoid=()) -> list[int]:
        E = self.meta.layers[self.layers[g % len(self.layers)]].num_experts
        pool = np.setdiff1d(np.arange(E), np.asarray(list(avoid), np.int64))
        return self.rng.choice(pool, min(n, len(pool)), replace=False).tolist()

    def play(self, misses: np.ndarray, lead: int, recall: float, precision: float):
        """Seconds for the layers ``misses`` (disk reads each), played in a row, and the
        seconds of it the player spent asking, guessing and taking back (its own cost,
        which a kernel's posts would not have). Every draw is made before the clock starts."""
        ring, n = self.ring, len(misses)
        wanted = [self.picks(g, int(m)) for g, m in enumerate(misses)]
        ahead = [self.draw(g, wanted[g], recall, precision) if lead else [] for g in range(n)]
        guesses: dict[int, list] = {}  # layer: [(entry, seq, expert)]
        t0 = time.perf_counter()
        t, own = t0, 0.0
        for g in range(n):
            wait_until(t + self.split * self.c)
            a = time.perf_counter()
            held = {e: (k, q) for k, q, e in guesses.get(g, [])}
            posted, k = [], 0
            for e in wanted[g]:  # the layer's own misses first, then the next one's guesses
                if e in held:  # a guess proved right: read now, as a demand read
                    posted.append(held.pop(e))
                    ring.now(*posted[-1])
                else:
                    posted.append((k, ring.post(k, self.layers[g % len(self.layers)], e)))
                    k += 1
            if lead and g + lead < n:
                self.guess(g + lead, ahead[g + lead], guesses)
            own += time.perf_counter() - a
            for k, q in posted:
                ring.answered(k, q, 30)
            a = time.perf_counter()
            for k, q in held.values():  # wrong guesses: taken back
                ring.drop(k, q)
            self.free_guess += [k for k, _, _ in guesses.pop(g, [])]
            own += time.perf_counter() - a
            t = time.perf_counter() + (1 - self.split) * self.c
            wait_until(t)
        return time.perf_counter() - t0, own

    def draw(self, g, wanted, recall, precision) -> list[int]:
        """Layer ``g``'s guesses: each miss with probability ``recall``, and for each
        ``1 / precision - 1`` others (a Poisson draw)."""
        right = [e for e in wanted if self.rng.random() < recall]
        n_wrong = int(self.rng.poisson(len(right) * (1 / precision - 1)))
        return right + (self.picks(g, n_wrong, wanted) if n_wrong else [])

    def guess(self, g, experts, guesses) -> None:
        li = self.layers[g % len(self.layers)]
        for e in experts:
            k = next((k for k in self.free_guess if self.ring.free(k)), None)
            if k is None:
                return  # no entry free: the rest unguessed
            self.free_guess.remove(k)
            guesses.setdefault(g, []).append((k, self.ring.post(k, li, e), e))


def main():
    p = parser(__doc__, preset="dsv2-lite", workdir="/tmp/mlxs", trace=False)
    p.add_argument("--row", required=True, help="a speed.py --beyond-ram JSON")
    p.add_argument("--trace", required=True, help="the routing trace the row replayed")
    p.add_argument("--steps", type=int, default=96, help="decode steps played per case")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--split", type=float, default=0.5)
    p.add_argument("--readers", type=int, default=16)
    a = p.parse_args()
    from mlx_streaming.bench.measure import ring_read_gbps
    from mlx_streaming.core.cache.expert_store import FileExpertStore
    from mlx_streaming.core.io.native import NativeReader
    from mlx_streaming.core.io.ring import RequestRing

    t0 = time.perf_counter()
    run, row, _, steps = row_steps(a.row, a.trace)
    _, ed, meta = build(a)
    c = row["t_compute_ms"] / 1e3 / run["moe_layers"]
    store = FileExpertStore(ed, 8)
    reader = NativeReader(meta, store.pools, threads=0, direct=True)

    def ring(guess_class: bool):  # the guess class, or guesses asked as demand reads
        if guess_class:
            return RequestRing(reader, DEMAND, a.readers, pieces=a.readers, guesses=GUESSES)
        return RequestRing(reader, DEMAND + GUESSES, a.readers, pieces=a.readers)

    probe = ring(True)  # the storage probe through the same ring
    gbps, _ = ring_read_gbps(probe, meta)
    _, lone_ms = ring_read_gbps(probe, meta, records=16, depth=1, seed=2)
    probe.close()
    log({"ring_gbps": round(gbps, 3), "lone_record_ms": round(lone_ms, 3)})
    cases = [(0, 0.0, 1.0, True)]
    cases += [(1, rc, pr, cls) for rc, pr in QUALITIES for cls in (False, True)]
    played = np.concatenate(steps[: a.steps]).astype(np.int64)
    times, read = {case: [] for case in cases}, {case: [] for case in cases}
    own = {case: [] for case in cases}
    for r in range(a.repeat):
        for case in cases:  # alternating, a ring each (one runs on an engine at a time)
            lead, recall, precision, cls = case
            rg = ring(cls)
            try:
                player = Player(rg, meta, c, a.split, cls, np.random.default_rng(r))
                took, mine = player.play(played, lead, recall, precision)
                times[case].append(took)
                own[case].append(mine)
                read[case].append(rg.counters())
            finally:
                rg.close()
    reader.close()
    store.close()
    none = statistics.median(times[cases[0]])
    n = a.steps if len(steps) >= a.steps else len(steps)
    r_s = run["record_bytes"] / (gbps * 1e9)
    out_rows = []
    for case in cases:
        lead, recall, precision, cls = case
        med = statistics.median(times[case])
        model = n / decode_time(
            steps[:n], c, a.split, r_s, lead, recall, precision, cls, np.random.default_rng(0)
        )
        out_rows.append({
            "lead": lead, "recall": recall, "precision": precision,
            "order": "priority" if cls else "fifo", "tok_per_s": round(n / med, 2),
            "vs_none": round(none / med, 3), "model_tok_per_s": round(model, 2),
            "runs_s": [round(x, 3) for x in times[case]],
            "player_ms_per_step": round(1e3 * statistics.median(own[case]) / n, 3),
            "records_read": int(statistics.median(c["requests"] - c["dropped"] for c in read[case])),
            "taken_back": int(statistics.median(c["dropped"] for c in read[case])),
        })  # fmt: skip
        log(out_rows[-1])
    finish(a, "ring_ahead", {
        "row": a.row, "steps": n, "layer_compute_ms": round(c * 1e3, 3), "split": a.split,
        "ring_gbps": round(gbps, 3), "lone_record_ms": round(lone_ms, 3),
        "readers": a.readers, "record_mb": round(run["record_bytes"] / 1e6, 2),
        "rows": out_rows,
    }, t0)  # fmt: skip


if __name__ == "__main__":
    main()
