"""Whether the GPU can read a plain (pageable, unregistered) file mapping itself: CUDA's
heterogeneous memory management (HMM) on Linux, where a kernel's access to host memory
faults the page in through the OS, from the disk if need be.

If it can, the device path would not need every expert file page-locked (issue 33,
item 5: larger than half of RAM on CUDA): the plan kernel could copy a miss's record
straight from the mapping, the OS reading it on the fault. A kernel copies a file's
mapping into a device array, once with the file dropped from the page cache (faults
served from the disk) and once warm; the copy is compared with the file's bytes and
timed. Without HMM the kernel's first access is an illegal address (a sticky CUDA
error): run it in a process of its own.

    python benchmarks/probes/hmm_read.py --mb 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

SOURCE = """
    const uint4* src = (const uint4*)(meta[0]);
    const long long words = meta[1] / 16;
    uint4* dst = (uint4*)out;
    const long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long nth = (long long)gridDim.x * blockDim.x;
    for (long long w = tid; w < words; w += nth) dst[w] = src[w];
"""


def _addressing_mode() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "-q"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    lines = [x.strip() for x in out.splitlines() if "Addressing Mode" in x]
    return lines[0] if lines else "not reported"


def _copy(kernel, address: int, n: int) -> tuple[np.ndarray, float]:
    meta = mx.array(np.array([address, n], np.int64))
    t0 = time.perf_counter()
    (out,) = kernel(
        inputs=[meta], grid=(1024 * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(n,)], output_dtypes=[mx.uint8],
    )  # fmt: skip
    mx.eval(out)
    return np.array(out), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--json")
    args = ap.parse_args()
    n = args.mb << 20
    path = Path(args.dir) / "mlxs-hmm-probe.bin"
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    result = {"mb": args.mb, "addressing_mode": _addressing_mode()}
    print(result, flush=True)
    kernel = mx.fast.cuda_kernel(
        name="mlxs_hmm_probe", input_names=["meta"], output_names=["out"], source=SOURCE
    )
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        m = mmap.mmap(fd, n, prot=mmap.PROT_READ)
        address = np.frombuffer(m, np.uint8).ctypes.data
        got, dt = _copy(kernel, address, 4096)  # compiles the kernel; the first fault
        result["first_4k"] = {"exact": bool(np.array_equal(got, data[:4096])), "s": dt}
        print(result["first_4k"], flush=True)
        for case in ("cold", "warm"):
            if case == "cold":
                os.posix_fadvise(fd, 0, n, os.POSIX_FADV_DONTNEED)
            got, dt = _copy(kernel, address, n)
            result[case] = {
                "exact": bool(np.array_equal(got, data)),
                "s": round(dt, 4),
                "gbps": round(n / dt / 1e9, 3),
            }
            print(case, result[case], flush=True)
    finally:
        os.close(fd)
        path.unlink()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
