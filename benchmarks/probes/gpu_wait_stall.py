"""Why the removed kernel transport stalled (CUDA only): a GPU kernel spins on a flag in
device memory while a native-style thread answers it with ``cudaMemcpyAsync`` (pinned
source, non-blocking stream), as the engine did. Between the launch and the answer the
main thread does one thing MLX does during a decode step; if that thing takes a lock the
copy needs, or waits for the device, the answer only lands once the spin times out.

    python benchmarks/probes/gpu_wait_stall.py   # on the GPU machine; prints JSON
"""

from __future__ import annotations

import json
import sys
import threading
import time

import mlx.core as mx

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # its docstring is its help
    print(__doc__)
    sys.exit(0)
if __name__ == "__main__" and not mx.cuda.is_available():
    sys.exit(f"{__file__}: a probe of MLX's CUDA backend, which this machine lacks")
import numpy as np

from mlx_streaming.core.cache.pool import device_address
from mlx_streaming.core.io import cuda

TIMEOUT_MS = 3000  # template ints are 32-bit
SPIN = """
    if (threadIdx.x == 0) {
        unsigned long long start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        unsigned int ok = 0;
        while (true) {
            unsigned int v;
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
            if (v == want[0]) { ok = 1; break; }
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if (now - start > (unsigned long long)TIMEOUT * 1000000ULL) break;
            __nanosleep(256);
        }
        out[0] = ok;
    }
"""


def main():
    spin = mx.fast.cuda_kernel(
        name="probe_spin", input_names=["flag", "want"], output_names=["out"], source=SPIN
    )
    mx.clear_cache()
    flag = mx.zeros((16 << 20,), mx.uint32)  # large: plain device memory, not managed
    mx.eval(flag)
    flag_dev = device_address(flag)
    src = cuda.page_locked(4).view(np.uint32)
    big = []

    actions = {
        "nothing": lambda: None,
        "host_array_to_device": lambda: mx.eval(mx.array(np.ones(4096, np.float32)) + 1),
        "new_allocation_256mb": lambda: big.append(mx.zeros((256 << 20,), mx.uint8)),
        "clear_cache_frees_buffers": mx.clear_cache,
        "new_kernel_compiled": lambda: mx.eval(
            mx.fast.cuda_kernel(
                name=f"probe_new_{time.time_ns()}",
                input_names=["a"],
                output_names=["b"],
                source="b[threadIdx.x] = a[threadIdx.x] * 2.0f;",
            )(
                inputs=[mx.ones((32,))],
                grid=(32, 1, 1),
                threadgroup=(32, 1, 1),
                output_shapes=[(32,)],
                output_dtypes=[mx.float32],
            )[0]
        ),
        "synchronize_mlx_stream": lambda: mx.synchronize(),
    }
    out = {}
    for trial, (name, act) in enumerate(actions.items(), start=1):
        big.clear()
        want = mx.array(np.array([trial], np.uint32))
        mx.eval(want)
        res = spin(
            inputs=[flag, want],
            template=[("TIMEOUT", TIMEOUT_MS)],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.uint32],
        )[0]
        mx.async_eval(res)
        copy_s = {}

        def answer(trial=trial, copy_s=copy_s):
            time.sleep(0.05)
            t = time.perf_counter()
            src[0] = trial
            cuda.copy_to_device(flag_dev, src.ctypes.data, 4)
            cuda.synchronize()
            copy_s["s"] = time.perf_counter() - t

        th = threading.Thread(target=answer)
        t0 = time.perf_counter()
        th.start()
        time.sleep(0.01)
        act()  # what MLX's thread does while the GPU waits
        th.join(timeout=30)
        mx.eval(res)
        out[name] = {
            "kernel_saw_answer": bool(res.item()),
            "answer_copy_ms": round(1e3 * copy_s.get("s", float("nan")), 2),
            "wall_ms": round(1e3 * (time.perf_counter() - t0), 1),
        }
        print(name, out[name], flush=True)
    print(json.dumps({"timeout_ms": TIMEOUT_MS, "cases": out}, indent=1))


if __name__ == "__main__":
    main()
