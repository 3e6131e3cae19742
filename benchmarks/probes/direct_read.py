"""Can the device read records straight from the page cache, skipping the host copy?

The native reader ``pread``s each record into pinned staging, then copies it to the
device: a lone 4.87 MB record takes ~380 µs, most of it the host copy. This probe maps a
layer's expert file, registers the mapping with CUDA (``cudaHostRegister``, read-only)
and times host-to-device copies straight from it, beside the staged path: whether the
registration works on file pages at all, what it costs (whole file, one record), and
µs per record for 1, 2 and 4 records in 1, 4 or 16 pieces (one stream each). Also
timed: ``pread`` and ``memcpy`` from the mapping into pinned memory, one thread, and a
copy straight from the unregistered mapping (the driver stages it).

    python benchmarks/probes/direct_read.py --preset dsv2-lite --workdir /tmp/mlxs
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from harness import build, finish, log, median_us, parser  # noqa: E402

READ_ONLY = 8  # cudaHostRegisterReadOnly


def main():
    p = parser(__doc__, preset="dsv2-lite", trace=False, workdir="/tmp/mlxs")
    p.add_argument("--repeat", type=int, default=21)
    a = p.parse_args()
    from mlx_streaming.core.io import cuda

    ck, ed, meta = build(a)
    layer = sorted(meta.layers)[len(meta.layers) // 2]
    lay = meta.layers[layer]
    path = meta.file(layer)
    size = os.path.getsize(path)
    rec, stride = lay.record_bytes, lay.stride
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    view = np.frombuffer(mm, dtype=np.uint8)
    base = view.ctypes.data
    out = {"layer": layer, "file_bytes": size, "record_bytes": rec, "rows": []}
    t = time.perf_counter()
    checksum = int(view[::4096].sum())  # touch every page: page cache and page tables warm
    out["touch_ms"] = round(1e3 * (time.perf_counter() - t), 1)
    log(f"file {size >> 20} MB, record {rec} B, touch {out['touch_ms']} ms ({checksum})")
    if not cuda.available():
        log("no CUDA runtime: nothing to measure")
        finish(a, "direct_read", out)
        return
    rt = cuda.lib()
    n_dev = 4 * stride
    dev = ctypes.c_void_p()
    cuda._check(rt.cudaMalloc(ctypes.byref(dev), ctypes.c_size_t(n_dev)), "cudaMalloc")
    streams = [ctypes.c_void_p(cuda.new_stream()) for _ in range(16)]
    staging = cuda.page_locked(4 * stride)
    stage = staging.ctypes.data

    def copy(src: int, nrec: int, pieces: int, spread: bool = True):
        per = -(-rec // pieces)
        k = 0
        for r in range(nrec):
            for lo in range(0, rec, per):
                n = min(per, rec - lo)
                s = streams[k % len(streams)]
                err = rt.cudaMemcpyAsync(
                    ctypes.c_void_p(dev.value + r * stride + lo),
                    ctypes.c_void_p(src + (r * 7 % 13 if spread else r) * stride + lo),
                    ctypes.c_size_t(n), 1, s,
                )  # fmt: skip
                cuda._check(err, "cudaMemcpyAsync")
                k += 1
        for s in streams[: min(k, len(streams))]:
            cuda._check(rt.cudaStreamSynchronize(s), "cudaStreamSynchronize")

    rows = out["rows"]

    def row(what, **kw):
        rows.append({"what": what, **kw})
        log(rows[-1])

    # host copies, one thread, one record
    buf = staging[:rec]
    row(
        "pread into pinned, 1 thread",
        us=median_us(lambda: os.preadv(fd, [buf], 5 * stride), a.repeat),
    )
    row("memcpy mapping to pinned, 1 thread",
        us=median_us(lambda: ctypes.memmove(stage, base + 5 * stride, rec), a.repeat))  # fmt: skip
    row("pageable copy (unregistered mapping)", records=1, pieces=1,
        us=median_us(lambda: copy(base, 1, 1), a.repeat))  # fmt: skip
    # register one record, then the whole file
    one = base + 20 * stride

    def reg_one():
        cuda._check(rt.cudaHostRegister(ctypes.c_void_p(one), ctypes.c_size_t(stride), READ_ONLY),
                    "cudaHostRegister(record)")  # fmt: skip
        cuda._check(rt.cudaHostUnregister(ctypes.c_void_p(one)), "cudaHostUnregister")

    try:
        row("register + unregister one record", us=median_us(reg_one, a.repeat))
    except cuda.CudaError as e:
        row("register one record failed", error=str(e))
    t = time.perf_counter()
    err = rt.cudaHostRegister(ctypes.c_void_p(base), ctypes.c_size_t(size), READ_ONLY)
    reg_ms = round(1e3 * (time.perf_counter() - t), 1)
    if err:
        rt.cudaGetLastError()
        row("register whole file failed", ms=reg_ms, error=err)
    else:
        row("register whole file", ms=reg_ms, gb=round(size / 1e9, 2))
        for nrec in (1, 2, 4):
            for pieces in (1, 4, 16):
                us = median_us(lambda n=nrec, k=pieces: copy(base, n, k), a.repeat)
                row("direct copy (registered mapping)", records=nrec, pieces=pieces, us=us,
                    gbps=round(nrec * rec / us / 1e3, 1))  # fmt: skip
        # the same copies from pinned staging, for the side-by-side
        for nrec in (1, 2, 4):
            us = median_us(lambda n=nrec: copy(stage, n, 4, spread=False), a.repeat)
            row("staged copy (pinned to device)", records=nrec, pieces=4, us=us,
                gbps=round(nrec * rec / us / 1e3, 1))  # fmt: skip
        # correctness: bytes on the device equal the file's
        copy(base, 1, 4)
        back = np.empty(rec, np.uint8)
        cuda._check(rt.cudaMemcpy(ctypes.c_void_p(back.ctypes.data), dev, ctypes.c_size_t(rec), 2),
                    "cudaMemcpy")  # fmt: skip
        row("direct copy equals the file", ok=bool(np.array_equal(back, view[:rec])))
        t = time.perf_counter()
        rt.cudaHostUnregister(ctypes.c_void_p(base))
        row("unregister whole file", ms=round(1e3 * (time.perf_counter() - t), 1))
    finish(a, "direct_read", out)


if __name__ == "__main__":
    main()
