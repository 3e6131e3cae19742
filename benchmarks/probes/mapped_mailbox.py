"""A GPU kernel that asks the host for something and waits for the answer, both through
page-locked host memory mapped into the device (CUDA only): the round trip a device
path with a bounded swap tier would take at each miss beyond the tier, in place of the
host path's routing read at every layer (453-580 µs a layer on an H100,
``probes/sync_floor.py``).

The kernel posts a sequence number in the mailbox's first word (a system-scope release
store) and spins on its second (acquire loads, bounded by a timeout); a responder process
(forked before MLX starts, so that it holds no GPU state and no share of this process's
interpreter lock, as the engine's native threads would not) polls the first word and
answers in the second with a plain store: no CUDA call on the answering side, unlike the
removed kernel transport (``probes/gpu_wait_stall.py``: its answer was a
``cudaMemcpyAsync``). The mailbox is a shared anonymous page both processes map,
page-locked and mapped into the device by this one (``cudaHostRegister``). Reported: the
round trip over ``--rounds`` calls (the kernel's own wait from its request to the
answer, and the host's time from the launch to the result), then, one call each, the
same while MLX's thread does something MLX does in a decode step (a new kernel compiled,
a large allocation, the cache cleared, an array from the host, a synchronisation):
whether the answer still reaches the kernel at once.

    python benchmarks/probes/mapped_mailbox.py --json out.json   # on the GPU machine
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import time

import numpy as np

STOP = 3  # the mailbox's word that stops the responder

TIMEOUT_MS = 2000
SPIN = """
    if (threadIdx.x == 0) {
        unsigned int* mb = (unsigned int*)(box[0]);
        unsigned int seq = want[0];
        asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(mb), "r"(seq) : "memory");
        unsigned long long start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        unsigned long long ok = 0;
        while (true) {
            unsigned int v;
            asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(mb + 1) : "memory");
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if (v == seq) { ok = 1; break; }
            if (now - start > (unsigned long long)TIMEOUT * 1000000ULL) break;
            __nanosleep(64);
        }
        out[0] = ok;
        out[1] = now - start;
    }
"""


def _respond(page: mmap.mmap) -> None:
    """The responder: answer every request (word 0) in word 1 until told to stop, or
    until its parent is gone (or ten minutes pass)."""
    mb = np.frombuffer(page, np.uint32)
    parent, end, n = os.getppid(), time.monotonic() + 600, 0
    while not mb[STOP]:
        seq = mb[0]
        if seq != mb[1]:
            mb[1] = seq
        n += 1
        if n % 100000 == 0 and (os.getppid() != parent or time.monotonic() > end):
            return


def _register(page: mmap.mmap) -> int:
    """Page-lock ``page`` and map it into the device: its device address."""
    from mlx_streaming.core.io import cuda

    lib = cuda.lib()
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(page))
    err = lib.cudaHostRegister(ctypes.c_void_p(ptr), ctypes.c_size_t(len(page)), 2)
    if err:
        raise RuntimeError(f"cudaHostRegister failed ({err})")
    dev = ctypes.c_void_p()
    err = lib.cudaHostGetDevicePointer(ctypes.byref(dev), ctypes.c_void_p(ptr), 0)
    if err:
        raise RuntimeError(f"cudaHostGetDevicePointer failed ({err})")
    return dev.value


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()
    page = mmap.mmap(-1, mmap.PAGESIZE)  # shared and anonymous: the child sees our writes
    child = os.fork()
    if child == 0:  # before MLX or CUDA start here
        try:
            _respond(page)
        finally:
            os._exit(0)
    mb = np.frombuffer(page, np.uint32)
    try:
        out = _measure(a, page)
    finally:
        mb[STOP] = 1
        os.waitpid(child, 0)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


def _measure(a, page: mmap.mmap) -> dict:
    import mlx.core as mx

    spin = mx.fast.cuda_kernel(
        name="probe_mailbox", input_names=["box", "want"], output_names=["out"], source=SPIN
    )
    box = mx.array(np.array([_register(page)], np.int64))
    seqs = iter(range(1, 1 << 30))
    big = []

    def new_kernel():
        k = mx.fast.cuda_kernel(
            name=f"probe_new_{time.time_ns()}",
            input_names=["a"],
            output_names=["b"],
            source="b[threadIdx.x] = a[threadIdx.x] * 2.0f;",
        )
        (b,) = k(inputs=[mx.ones((32,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                 output_shapes=[(32,)], output_dtypes=[mx.float32])  # fmt: skip
        mx.eval(b)

    def call(act=None) -> dict:
        want = mx.array(np.array([next(seqs)], np.uint32))
        (res,) = spin(inputs=[box, want], template=[("TIMEOUT", TIMEOUT_MS)],
                      grid=(32, 1, 1), threadgroup=(32, 1, 1),
                      output_shapes=[(2,)], output_dtypes=[mx.uint64])  # fmt: skip
        t0 = time.perf_counter()
        mx.async_eval(res)
        if act is not None:
            act()  # what MLX's thread does while the kernel waits
        mx.eval(res)
        ok, waited_ns = res.tolist()
        return {"answered": bool(ok), "kernel_wait_us": round(waited_ns / 1e3, 1),
                "call_us": round(1e6 * (time.perf_counter() - t0), 1)}  # fmt: skip

    for _ in range(5):  # compile and warm
        call()
    rows = [call() for _ in range(a.rounds)]
    lat = {
        k: {"median": statistics.median(r[k] for r in rows),
            "p90": sorted(r[k] for r in rows)[int(0.9 * len(rows))],
            "max": max(r[k] for r in rows)}
        for k in ("kernel_wait_us", "call_us")
    }  # fmt: skip
    lat["answered"] = sum(r["answered"] for r in rows)
    print("round trips", json.dumps(lat), flush=True)
    actions = {
        "nothing": None,
        "host_array_to_device": lambda: mx.eval(mx.array(np.ones(4096, np.float32)) + 1),
        "new_allocation_256mb": lambda: big.append(mx.zeros((256 << 20,), mx.uint8)),
        "clear_cache": mx.clear_cache,
        "new_kernel_compiled": new_kernel,
        "synchronize": mx.synchronize,
    }
    cases = {}
    for name, act in actions.items():
        big.clear()
        cases[name] = call(act)
        print(name, cases[name], flush=True)
    return {"benchmark": "mapped_mailbox", "date": time.strftime("%Y-%m-%d"),
            "device": mx.device_info().get("device_name", str(mx.default_device())),
            "timeout_ms": TIMEOUT_MS, "rounds": a.rounds, "round_trip": lat, "cases": cases}  # fmt: skip


if __name__ == "__main__":
    main()
