"""Records asked for by a kernel through the engine's request ring (``io.ring``), against
the same records read by the host path's reader, each record read whole or cut in pieces
that several ring threads read at once (``--pieces``): the transport a device path over a
bounded swap tier would use for each miss beyond the tier (benchmarks/RESULTS.md, "The
design this opens").

On CUDA a kernel posts each request in an entry of page-locked host memory mapped into
the device (every block of the request posts the same words: no block waits on another
being scheduled), spins on the entry's done word (acquire loads at system scope, bounded
by a timeout) and copies the record from the entry's staging record into device memory;
the engine's ring threads read the record with ``pread`` (O_DIRECT with ``--direct``)
and answer with a plain store. Every call's bytes are checked against the file.
Reported, for 1, 2, 4 and 6 records a call: the call's wall time and the kernel's own
wait from its request to the answer, beside ``NativeReader``'s ordinary read of the same
records into pool slots (the host path's read); then a chain of one call a layer between
matrix products in one evaluation, against the chain without them (the ring inside
MLX's graph). On the CPU (no kernels) the host posts and waits through the same ring.

    python benchmarks/probes/ring_read.py --preset dsv2-lite --num-layers 4 \
        --workdir /tmp/mlxs [--direct] --json out.json
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from harness import build, finish, log, numbers, parser  # noqa: E402

TIMEOUT_MS = 2000
BLOCKS = 16  # copy blocks per record
ASK = """
    const int i = blockIdx.x / C, c = blockIdx.x % C;
    int* words = (int*)(ring[0]);
    const unsigned char* staging = (const unsigned char*)(ring[1]);
    const int k = req[3 * i], w = k * 16;
    __shared__ int ok;
    if (threadIdx.x == 0) {  // every block of request i posts it alike, then waits
        const int s = seq[i];
        unsigned long long start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        words[w + 1] = req[3 * i + 1];
        words[w + 2] = req[3 * i + 2];
        asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(words + w), "r"(s) : "memory");
        int v = 0;
        while (true) {
            asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(words + w + 3) : "memory");
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if (v == s || now - start > (unsigned long long)TIMEOUT * 1000000ULL) break;
            __nanosleep(128);
        }
        ok = v == s && words[w + 4] == 0;
        if (c == 0) {
            info[3 * i] = v == s;
            info[3 * i + 1] = (long long)(now - start);
            info[3 * i + 2] = v == s ? words[w + 4] : -1;
        }
    }
    __syncthreads();
    if (!ok) return;
    const uint4* src = (const uint4*)(staging + (size_t)k * STRIDE);
    uint4* dst = (uint4*)(out + (size_t)i * NBYTES);
    const int n16 = NBYTES / 16, per = (n16 + C - 1) / C;
    const int hi = min(n16, (c + 1) * per);
    for (int j = c * per + threadIdx.x; j < hi; j += blockDim.x) dst[j] = src[j];
"""


class Asker:
    """Calls that ask the ring for records: a kernel on CUDA, the host's post and wait
    elsewhere. ``seqs`` tracks each entry's next number on the host."""

    def __init__(self, ring, meta, on_cuda: bool):
        self.ring, self.meta, self.on_cuda = ring, meta, on_cuda
        self.next = ring.words[:, 0].astype(np.int64)
        self.nbytes = -(-max(lay.record_bytes for lay in meta.layers.values()) // 16) * 16
        if on_cuda:
            self.kernel = mx.fast.cuda_kernel(
                name="probe_ring_ask", input_names=["ring", "req", "seq", "after"],
                output_names=["out", "info"], source=ASK,
            )  # fmt: skip
            self.addr = mx.array(np.array([ring.device_words, ring.device_staging], np.int64))

    def call(self, asks, after=None):
        """``asks`` [(entry, layer, expert)]: (out [n, nbytes] uint8, info [n, 3]) lazily."""
        self.next[[k for k, _, _ in asks]] += 1
        if not self.on_cuda:
            seqs = [self.ring.post(k, li, e) for k, li, e in asks]
            got = [self.ring.wait(k, s)[: self.nbytes] for (k, _, _), s in zip(asks, seqs)]
            info = [[1, 0, 0] for _ in asks]
            return mx.array(np.stack(got)), mx.array(np.array(info, np.int64))
        req = np.array([[k, self.ring.reader.pos[li], e] for k, li, e in asks], np.int32)
        seq = np.array([self.next[k] for k, _, _ in asks], np.int32)
        n = len(asks)
        return self.kernel(
            inputs=[self.addr, mx.array(req.ravel()), mx.array(seq),
                    after if after is not None else mx.zeros((1,))],
            template=[("C", BLOCKS), ("STRIDE", self.ring.stride), ("NBYTES", self.nbytes),
                      ("TIMEOUT", TIMEOUT_MS)],
            grid=(n * BLOCKS * 256, 1, 1), threadgroup=(256, 1, 1),
            output_shapes=[(n, self.nbytes), (n, 3)], output_dtypes=[mx.uint8, mx.int64],
        )  # fmt: skip


def check(meta, asks, out, info, want) -> int:
    """Requests answered wrong or not at all (bytes against the file's)."""
    out, info = np.array(out), np.array(info)
    bad = 0
    for i, (_, li, e) in enumerate(asks):
        rb = meta.layers[li].record_bytes
        bad += not (
            info[i, 0] == 1 and info[i, 2] == 0 and np.array_equal(out[i, :rb], want(li, e))
        )
    return bad


def main():
    p = parser(__doc__, preset="dsv2-lite", workdir="/tmp/mlxs", trace=False)
    p.add_argument("--repeat", type=int, default=21)
    p.add_argument("--direct", action="store_true", help="read with O_DIRECT (the disk)")
    p.add_argument("--readers", type=int, default=8, help="the ring's reader threads (the "
                   "device's DEVICE_READERS)")  # fmt: skip
    p.add_argument("--pieces", type=numbers(int, 1), default=[1],
                   help="the reads a record is cut in, a ring each (e.g. 1,4,8: side by side)")  # fmt: skip
    a = p.parse_args()
    from mlx_streaming.core.cache.expert_store import FileExpertStore
    from mlx_streaming.core.io import cuda
    from mlx_streaming.core.io.native import NativeReader
    from mlx_streaming.core.io.ring import RequestRing

    t0 = time.perf_counter()
    _, ed, meta = build(a)
    store = FileExpertStore(ed, 8)
    on_cuda = store.pool_mode == "cuda"
    dev = cuda if on_cuda else None
    reader = NativeReader(meta, store.pools, threads=3, direct=a.direct, cuda=dev)
    layers, rng = sorted(meta.layers), np.random.default_rng(0)
    cache = {}

    def want(li, e):
        if (li, e) not in cache:
            with open(meta.file(li), "rb") as f:
                f.seek(e * meta.layers[li].stride)
                cache[li, e] = np.frombuffer(f.read(meta.layers[li].record_bytes), np.uint8)
        return cache[li, e]

    def pick(n):
        li = layers[int(rng.integers(len(layers)))]
        return li, rng.choice(meta.num_experts, n, replace=False).tolist()

    rows, bad, ring = [], 0, None
    for n, pieces in [(n, p) for p in a.pieces for n in (1, 2, 4, 6)]:
        if ring is None or ring.pieces != pieces:  # a ring of its own for each cut
            if ring is not None:
                ring.close()
            ring = RequestRing(reader, entries=12, readers=a.readers, cuda=dev, pieces=pieces)
            ask = Asker(ring, meta, on_cuda)
        ring_ms, wait_us, host_ms = [], [], []
        for r in range(a.repeat + 1):
            li, es = pick(n)
            asks = [(k, li, e) for k, e in enumerate(es)]
            t = time.perf_counter()
            out, info = ask.call(asks)
            mx.eval(out, info)
            dt = time.perf_counter() - t
            bad += check(meta, asks, out, info, want)
            li, es = pick(n)
            t = time.perf_counter()
            reader.start(li, np.array(es, np.int32), np.arange(n, dtype=np.int32)).result()
            dh = time.perf_counter() - t
            if r:  # the first of each is a warm-up
                ring_ms.append(1e3 * dt)
                wait_us.append(np.array(info)[:, 1].max() / 1e3)
                host_ms.append(1e3 * dh)
        row = {"records": n, "pieces": pieces,
               "ring_call_ms": round(statistics.median(ring_ms), 3),
               "kernel_wait_us": round(statistics.median(wait_us), 1),
               "host_read_ms": round(statistics.median(host_ms), 3)}  # fmt: skip
        rows.append(row)
        log(row)
    chain = _chain(ask, meta, layers, rng, want, on_cuda, a.repeat)
    bad += chain.pop("wrong")
    c = ring.counters()
    per = max(1, c["requests"])
    result = {
        "direct": a.direct, "readers": a.readers, "device": on_cuda and "cuda" or "cpu",
        "record_mb": round(max(lay.record_bytes for lay in meta.layers.values()) / 1e6, 2),
        "calls": rows, "chain": chain, "wrong": bad,
        "ring": {"requests": c["requests"], "failed": c["failed"],
                 "read_us_per_request": round(c["read_ns"] / per / 1e3, 1),
                 "answer_us_per_request": round(c["answer_ns"] / per / 1e3, 1),
                 "longest_answer_ms": round(c["max_ns"] / 1e6, 2),
                 "reads_per_request": round(c["reads"] / per, 2)},
    }  # fmt: skip
    ring.close()
    reader.close()
    store.close()
    finish(a, "ring_read", result, t0)
    return 1 if bad else 0


def _chain(ask, meta, layers, rng, want, on_cuda, repeat) -> dict:
    """One evaluation of a matrix product per layer, with and without a ring call of two
    records after each (entries alternate so a call never waits on its predecessor's)."""
    n = 26
    x0 = mx.random.normal((4096, 4096) if on_cuda else (256, 256)) / 64
    mx.eval(x0)

    def run(with_ring: bool):
        x, outs = x0, []
        for layer in range(n):
            x = x @ x0
            if with_ring:
                li = layers[layer % len(layers)]
                a = [(2 * (layer % 2) + j, li, e) for j, e in
                     enumerate(rng.choice(meta.num_experts, 2, replace=False).tolist())]  # fmt: skip
                out, info = ask.call(a, after=x)
                outs.append((a, out, info))
                x = x + (out[0, 0].astype(mx.float32) * 0)
        mx.eval(x, *[o for _, o, i in outs], *[i for _, o, i in outs])
        return outs

    times, wrong = {False: [], True: []}, 0
    for r in range(repeat + 1):
        for with_ring in (False, True):
            t = time.perf_counter()
            outs = run(with_ring)
            if r:
                times[with_ring].append(1e3 * (time.perf_counter() - t))
            wrong += sum(check(meta, a, o, i, want) for a, o, i in outs)
    base, ringed = statistics.median(times[False]), statistics.median(times[True])
    return {"layers": n, "records_a_layer": 2, "compute_ms": round(base, 2),
            "with_ring_ms": round(ringed, 2),
            "added_ms_a_layer": round((ringed - base) / n, 3), "wrong": wrong}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
