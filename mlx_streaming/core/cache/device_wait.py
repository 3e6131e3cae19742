"""Layer calls served by the native engine: the device-wait path and its host twin.

``kernel`` transport (CUDA): the host never blocks inside a decode step. Per MoE layer
call, one CUDA kernel (``mx.fast.cuda_kernel``) writes the routed ids into a mailbox in
page-locked host memory mapped into the GPU, then waits, on the GPU, until the native
engine (``io.native``, a thread that needs no GIL) has made those experts resident and
answered with their slots; the expert matmul then runs on the slots. The host queues
whole tokens as stock mlx-lm does and reads nothing back. The wait is bounded: past the
timeout the kernel gives up, flags the mailbox, and the store's next call raises
``StreamingError``.

``host`` transport (any backend): the host reads the routing (one sync, as the host path
does) and the engine serves the call at once: the same engine, tables and policy fold,
with the Python bookkeeping of the host path off the critical path.

The engine logs each call. A Python thread folds the log into the layer's policy and
counters and hands the policy's eviction order back to the engine as a victim queue:
policy bookkeeping is off the critical path (the engine never waits for it; a stale
queue only means a worse victim).
"""

from __future__ import annotations

import os
import threading
import time

import mlx.core as mx
import numpy as np

from ..io import cuda
from ..io.native import Engine, EngineLayer

MAX_ROWS = 256  # routed rows per call the mailbox carries (decode of 25 sequences, top-10)
IDS = 16  # mailbox word where the ids start (see engine.c)

KERNEL = """
    // The request goes to the mailbox in host memory (system-scope stores); the answer
    // comes back in device memory (ans), copied there by the engine; the call number
    // comes from a counter in device memory that only these kernels advance.
    unsigned int* box = reinterpret_cast<unsigned int*>(mb[0]);
    unsigned int* counter = const_cast<unsigned int*>(ctr);
    __shared__ unsigned int seq;
    __shared__ int ok;
    const int t = threadIdx.x;
    if (t == 0) {
        seq = atomicAdd(counter, 1u) + 1u;
        ok = 1;
    }
    __syncthreads();
    for (int r = t; r < R; r += blockDim.x) {
        unsigned int v = (unsigned int)ids[r];
        asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(box + 16 + r), "r"(v) : "memory");
    }
    __syncthreads();
    if (t == 0) {
        unsigned int lay = (unsigned int)layer[0], rows = (unsigned int)R, st = 0, echo = 0;
        asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(box + 1), "r"(lay) : "memory");
        asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(box + 2), "r"(rows) : "memory");
        asm volatile("fence.sc.sys;" ::: "memory");
        asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(box + 0), "r"(seq) : "memory");
        unsigned long long start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        // the engine copies its answer into device memory (ans), the seq word last
        const unsigned int* a = reinterpret_cast<const unsigned int*>(ans);
        while (true) {
            unsigned int got;
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(got) : "l"(a + MAXR + 2) : "memory");
            if (got == seq) break;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if (now - start > (unsigned long long)TIMEOUT_MS * 1000000ULL) {
                ok = 0;
                asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(box + 5), "r"(seq) : "memory");
                break;
            }
            __nanosleep(128);
        }
        if (ok) {
            asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(st) : "l"(a + MAXR) : "memory");
            asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(echo) : "l"(a + MAXR + 1) : "memory");
            if (st != 0 || echo != lay) ok = 0;
        }
    }
    __syncthreads();
    for (int r = t; r < R; r += blockDim.x) {
        unsigned int v = 0;
        if (ok) asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(reinterpret_cast<const unsigned int*>(ans) + r) : "memory");
        slots[r] = (int)v;
    }
"""


class StreamingError(RuntimeError):
    """Streaming failed inside a token (a read, a checksum, or a GPU wait that timed out)."""


class DeviceWait:
    """Serves decode calls of a store's layers through the engine.

    Args:
        store: The ``FileExpertStore`` whose tables, pools and policies it shares.
        transport: ``kernel`` (CUDA: the GPU waits) or ``host`` (the host reads the
            routing, the engine serves at once).
        threads: The engine's worker threads.
        timeout_s: Longest a GPU waits for one call's experts.
        queue: Length of the victim queue handed to the engine per layer.
        lock: Guards the policies against the store's own use of them.
    """

    def __init__(
        self,
        store,
        transport: str = "kernel",
        threads: int = 8,
        timeout_s: float = 10.0,
        queue: int = 64,
        lock: threading.RLock | None = None,
    ):
        if transport not in ("kernel", "host"):
            raise ValueError(f"transport must be 'kernel' or 'host', got {transport!r}")
        self.store, self.transport = store, transport
        self.timeout_ms = int(timeout_s * 1000)
        self.lock = lock or threading.RLock()
        self.pos = {li: i for i, li in enumerate(store.layers)}
        self._fds = []
        layers = []
        for li in store.layers:
            lay, cache, pool = store.meta.layers[li], store.caches[li], store.pool(li)
            flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if store.reader.aligned else 0)
            fd = os.open(store.meta.file(li), flags)
            self._fds.append(fd)
            rows = pool.row_pointers()
            sums = (
                np.array([int(c, 16) for c in lay.checksums], np.uint64)
                if store.verify and lay.checksums
                else None
            )
            el = EngineLayer(
                fd,
                lay,
                cache.capacity,
                cache.slot_of,
                cache.expert_in,
                [a for a, _ in rows],
                [b for _, b in rows],
                pool.lut_host,
                pool.lut_device,
                sums,
                queue,
                owner=pool,
            )
            el.pinned = cache.pinned_mask  # shared: pins made later reach the engine
            layers.append(el)
        on_cuda = store.pool_mode == "cuda"
        self.engine = Engine(
            layers, threads=threads, max_rows=MAX_ROWS, cuda=cuda if on_cuda else None
        )
        if transport == "kernel":
            from .pool import device_address

            box, dev = cuda.mapped(4 * (IDS + 2 * MAX_ROWS))
            self.box = box.view(np.int32)
            self._mb = mx.array(np.array([dev], np.uint64))
            mx.clear_cache()  # fresh device buffers, not recycled managed ones
            self._counter = mx.zeros((1,), dtype=mx.uint32)  # call numbers
            self._answer = mx.zeros((MAX_ROWS + 8,), dtype=mx.int32)  # the engine's answers
            mx.eval(self._counter, self._answer)
            self._answer_host = cuda.pinned(4 * (MAX_ROWS + 8)).view(np.int32)
            self.engine.start(
                self.box.ctypes.data, self._answer_host.ctypes.data, device_address(self._answer)
            )
            self._layer = {li: mx.array(np.array([p], np.int32)) for li, p in self.pos.items()}
            self._kernel = mx.fast.cuda_kernel(
                name="mlxs_wait_for_slots",
                input_names=["ids", "mb", "layer", "ctr", "ans"],
                output_names=["slots"],
                source=KERNEL,
            )
        else:
            self.box = np.zeros(IDS, np.int32)  # no mailbox: nothing waits on a GPU
            self.engine.start(None)
        for li in store.layers:
            self._queue(li)
        self._stop = threading.Event()
        self._seen = 0
        self._thread = threading.Thread(target=self._fold_loop, name="mlxs-policy", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the call
    def serves(self, layer: int, indices: mx.array) -> bool:
        """Whether the engine can serve this call: few enough rows, all fitting in the
        pool beside its pins."""
        cache = self.store.caches[layer]
        return indices.size <= min(MAX_ROWS, cache.capacity - int(cache.pinned_mask.sum()))

    def call(self, layer: int, indices: mx.array) -> mx.array:
        """The slots of ``indices``: with the kernel transport a lazy array the GPU fills
        once they are resident; with the host transport, once the engine served them."""
        self.check()
        if self.transport == "host":
            t0 = time.perf_counter()
            mx.eval(indices)  # the host transport's one sync (raises what the graph did)
            ids = np.array(indices)
            self.store.stats[layer].sync_s += time.perf_counter() - t0
            status, slots = self.engine.serve(self.pos[layer], ids)
            if status:
                self.check()
            return mx.array(slots.reshape(indices.shape))
        n = indices.size
        threads = min(1024, max(32, -(-n // 32) * 32))
        out = self._kernel(
            inputs=[indices.reshape(-1), self._mb, self._layer[layer], self._counter, self._answer],
            template=[("R", n), ("MAXR", MAX_ROWS), ("TIMEOUT_MS", self.timeout_ms)],
            grid=(threads, 1, 1),
            threadgroup=(threads, 1, 1),
            output_shapes=[(n,)],
            output_dtypes=[mx.int32],
        )[0]
        return out.reshape(indices.shape)

    def check(self) -> None:
        """Raise what went wrong inside earlier tokens, if anything did."""
        err = self.engine.error()
        if self.box[5]:
            err = (
                f"a GPU wait for expert slots timed out after {self.timeout_ms} ms (call "
                f"{int(self.box[5])}); the engine was {self.engine.state()}"
                f"{': ' + err if err else ''}"
            )
        if err:
            raise StreamingError(
                f"expert streaming failed: {err}. The tokens generated since "
                "then are not to be trusted: reload the model"
            )

    # ------------------------------------------------------------ the policy, off the path
    def _fold_loop(self) -> None:
        while not self._stop.is_set():
            if self.engine.wait_log(self._seen, 20000):
                self.sync()

    def sync(self) -> None:
        """Fold the engine's log into the policies and counters, and refresh the victim
        queues of the layers it touched."""
        with self.lock:
            calls, dropped = self.engine.drain()
            self._seen = int(self.engine.log_state[0])
            touched = set()
            layers = self.store.layers
            for pos, used, placed, nbytes in calls:
                li = layers[pos]
                cache, st = self.store.caches[li], self.store.stats[li]
                for e, _, v in placed.tolist():
                    if v >= 0:
                        cache.policy.remove(v)
                        cache.stats.evictions += 1
                    if e >= 0:
                        cache.policy.insert(e)
                cache.access(used, len(placed))
                st.wait_calls += 1
                st.bytes_read += nbytes
                st.records_read += nbytes // self.store.meta.layers[li].record_bytes
                if len(placed):
                    st.fallback += 1
                else:
                    st.fastpath += 1
                touched.add(li)
            if dropped:  # the ring overflowed: rebuild the policies from the tables
                self.engine.log_state[2] = 0
                for li in layers:
                    self._rebuild(li)
                touched = set(layers)
            for li in touched:
                self._queue(li)

    def _queue(self, layer: int) -> None:
        cache = self.store.caches[layer]
        order = cache.policy.victims(len(self.engine.layers[0].victims), cache.pinned)
        self.engine.layers[self.pos[layer]].queue_victims(order)

    def _rebuild(self, layer: int) -> None:
        from .policy import make_policy

        cache = self.store.caches[layer]
        cache.policy = make_policy(self.store.policy_name, cache.num_experts, cache.capacity)
        for e in np.flatnonzero(cache.slot_of >= 0):
            cache.policy.insert(int(e))

    def engine_seconds(self, layer: int) -> float:
        """Time the engine spent serving ``layer``'s calls (the GPU waited as long)."""
        return float(self.engine.layers[self.pos[layer]].counters[6]) / 1e9

    def reset(self) -> None:
        for lay in self.engine.layers:
            lay.counters[:] = 0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.engine.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        time.sleep(0)
