"""What benchmarks measure beside tok/s: raw read bandwidth, a cold page cache, MLX's
memory limits for a run, and the physical limit of decode.

The limit: per token, ``miss_bytes`` must come from storage at bandwidth ``B`` while the
model computes for ``t_compute`` (stock's time per token). Fully overlapped,
``t >= max(t_compute, miss_bytes / B)``; serialised, the sum. ``efficiency`` is the
overlap bound's time over the measured time per token.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import mlx.core as mx
import numpy as np

from ..core.io.reader import RecordReader, aligned_buffer


@contextlib.contextmanager
def memory_limits(wired_gb: float | None, cache_gb: float | None):
    """Set MLX's wired and cache limits for the duration, restoring them after."""
    old = {}
    try:
        if wired_gb is not None and hasattr(mx, "set_wired_limit"):
            old["wired"] = mx.set_wired_limit(int(wired_gb * 1e9))
        if cache_gb is not None:
            old["cache"] = mx.set_cache_limit(int(cache_gb * 1e9))
        yield
    finally:
        if "wired" in old:
            mx.set_wired_limit(old["wired"])
        if "cache" in old:
            mx.set_cache_limit(old["cache"])


def enter_memory_limit(limit_bytes: int, name: str = "mlx_streaming") -> str:
    """Move this process into a new memory cgroup limited to ``limit_bytes`` (v2, else
    v1), so that what it maps or reads, the page cache of the expert files included,
    stays within it: a machine with less memory than the model. The group is removed at
    exit, and any left by a process of the same ``name`` that was killed outright. Returns
    its path.

    Raises:
        OSError: no writable memory cgroup here (it needs root); the message says what
            to use instead.
    """
    import atexit
    from pathlib import Path

    pid = os.getpid()
    tries = [
        (Path("/sys/fs/cgroup"), "memory.max", "cgroup.procs"),
        (Path("/sys/fs/cgroup/unified"), "memory.max", "cgroup.procs"),
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "cgroup.procs"),
    ]
    errors = []
    for root, limit_file, procs in tries:
        if not (root / procs).exists() or (limit_file == "memory.max" and "memory" not in
                                          _read(root / "cgroup.controllers")):  # fmt: skip
            continue
        _remove_stale(root, name)
        group = root / f"{name}-{pid}"
        try:
            if limit_file == "memory.max" and "memory" not in _read(
                root / "cgroup.subtree_control"
            ):
                (root / "cgroup.subtree_control").write_text("+memory")
            group.mkdir(exist_ok=True)
            (group / limit_file).write_text(str(int(limit_bytes)))
            if (group / "memory.swap.max").exists():  # v2: no swapping past the limit
                (group / "memory.swap.max").write_text("0")
            (group / procs).write_text(str(pid))
        except OSError as e:
            errors.append(f"{group}: {e}")
            with contextlib.suppress(OSError):  # not left behind half made
                group.rmdir()
            continue

        def leave(root=root, group=group, procs=procs):
            try:
                (root / procs).write_text(str(os.getpid()))
                group.rmdir()
            except OSError:
                pass

        atexit.register(leave)
        return str(group)
    raise OSError(
        "a memory limit needs a writable memory cgroup (root, cgroup v1 or v2): "
        + ("; ".join(errors) or "none found")
        + "; keep the experts out of RAM with --direct-io instead"
    )


def _remove_stale(root, name: str) -> None:
    """Remove the groups ``enter_memory_limit`` made for processes that are gone (one
    killed outright never ran its ``atexit``); a group still holding a process stays."""
    for group in root.glob(f"{name}-*"):
        pid = group.name.rsplit("-", 1)[1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        with contextlib.suppress(OSError):
            group.rmdir()


def _read(path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def drop_page_cache(paths) -> None:
    """Evict files from the OS page cache (POSIX_FADV_DONTNEED; no root needed).

    Raises:
        ValueError: the OS has no ``posix_fadvise`` (macOS).
    """
    if not hasattr(os, "posix_fadvise"):
        raise ValueError(
            f"cold runs need posix_fadvise, which {sys.platform} lacks; on macOS flush the "
            "page cache with `sudo purge` before a warm-cache run instead, and use "
            "--direct-io (F_NOCACHE) to keep expert reads out of the cache"
        )
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure_read_gbps(
    meta,
    threads: int,
    direct: bool,
    records: int = 64,
    cold: bool = False,
    engine: bool = False,
) -> float:
    """Bandwidth of random whole-record reads from the expert files (GB/s), through the
    store's Python reader, or with ``engine`` through the native reader (its reads and
    copies into host rows)."""
    rng = np.random.default_rng(1)
    layers = list(meta.layers)
    if cold:
        drop_page_cache([meta.file(li) for li in layers])
    if engine:
        return _engine_read_gbps(meta, threads, records, rng, cold, direct)
    reader = RecordReader(threads=threads, direct=direct)
    try:
        picks: dict[int, list[int]] = {}
        for i in range(records):
            li = layers[i % len(layers)]
            picks.setdefault(li, []).append(int(rng.integers(meta.layers[li].num_experts)))
        outs = {}  # files opened and buffers allocated outside the timed reads
        for li, ids in picks.items():
            reader.open(li, meta.file(li), meta.layers[li].stride)
            outs[li] = aligned_buffer(len(ids) * meta.layers[li].stride).reshape(len(ids), -1)
        for _ in range(1 if cold else 2):  # warm: the timed pass is the second
            total, t0 = 0, time.perf_counter()
            for li, ids in picks.items():
                total += reader.read(li, ids, outs[li])
            dt = time.perf_counter() - t0
        return total / dt / 1e9
    finally:
        reader.close()


def store_read_gbps(meta, runtime, records: int = 64, cold: bool = False, ring=None) -> float:
    """``measure_read_gbps`` as the store reads its files: ``runtime``'s threads and
    direct reads, through the native reader unless its files are read by Python (a swap
    tier's files reader, else its own); through ``ring`` where the store reads by one (a
    bounded tier's, ``DeviceReader.ring``), at its queue depth (``ring_read_gbps``)."""
    if ring is not None:
        if cold:
            drop_page_cache([meta.file(li) for li in meta.layers])
        gbps, _ = ring_read_gbps(ring, meta, records)
        if cold and not runtime.direct_io:  # leave the cache as the probe found it
            drop_page_cache([meta.file(li) for li in meta.layers])
        return gbps
    python = (runtime.files_reader or runtime.reader) == "python"
    return measure_read_gbps(meta, runtime.threads, runtime.direct_io, records, cold, not python)


def ring_read_gbps(ring, meta, records: int = 64, depth: int | None = None, seed: int = 1):
    """Random records asked of a request ring (``io.ring``) from the host, ``depth`` in
    flight (its entries by default: the most its device path keeps asked; 1: a lone
    miss's), each read in the ring's pieces by its threads: the disk at the reader's own
    queue depth. Returns (GB/s, the median ms from a record's post to its answer, its
    wait in the queue included).

    Raises:
        TimeoutError, RuntimeError: the ring did not answer or stopped (``RequestRing``).
    """
    from ..core.io.ring import READ_WAIT_S

    depth = ring.entries if depth is None else depth
    if not 1 <= depth <= ring.entries:
        raise ValueError(f"depth={depth}: 1 to the ring's {ring.entries} entries")
    rng, layers = np.random.default_rng(seed), sorted(meta.layers)
    picks = []
    for i in range(records):
        li = layers[i % len(layers)]
        picks.append((li, int(rng.integers(meta.layers[li].num_experts))))
    todo, live, waits, total = iter(picks), {}, [], 0
    t0 = time.perf_counter()

    def post(k):
        nxt = next(todo, None)
        if nxt is not None:
            live[k] = (ring.post(k, *nxt), time.perf_counter(), meta.layers[nxt[0]].record_bytes)

    try:
        for k in range(depth):
            post(k)
        while live:  # each entry asked again once answered (in order: they are answered so)
            for k in sorted(live):
                seq, at, nbytes = live.pop(k)
                ring.answered(k, seq, READ_WAIT_S)
                waits.append(time.perf_counter() - at)
                total += nbytes
                post(k)
    finally:  # a failure leaves no entry of the store's ring asked
        for k, (seq, _, _) in live.items():
            with contextlib.suppress(Exception):
                ring.answered(k, seq, READ_WAIT_S)
    return total / (time.perf_counter() - t0) / 1e9, 1e3 * float(np.median(waits))


class _HostRows:
    """Host rows standing in for a pool: where the native reader lands records."""

    def __init__(self, layout, slots: int):
        self.slots = slots
        self.rows = [np.zeros((slots, p.nbytes), np.uint8) for p in layout.parts]

    def row_pointers(self):
        return [(r.ctypes.data, r.shape[1]) for r in self.rows]


def _engine_read_gbps(meta, threads: int, records: int, rng, cold: bool, direct: bool) -> float:
    from ..core.io.native import NativeReader

    li = sorted(meta.layers)[0]
    lay = meta.layers[li]
    n = min(records, lay.num_experts)
    reader = NativeReader(
        meta, {li: _HostRows(lay, n)}, threads=threads, direct=direct, checksums=False
    )
    try:
        ids = rng.choice(lay.num_experts, n, replace=False)
        for _ in range(1 if cold else 2):  # warm: the timed pass is the second
            t0 = time.perf_counter()
            nbytes = reader.start(li, ids, np.arange(n)).result()
            dt = time.perf_counter() - t0
        return nbytes / dt / 1e9
    finally:
        reader.close()


def measure_h2d_gbps(nbytes: int = 64 << 20, repeat: int = 5) -> float | None:
    """Host-to-device bandwidth of ``cudaMemcpyAsync`` from page-locked memory into
    MLX's CUDA memory (GB/s); None without a CUDA runtime."""
    from ..core.io import cuda

    if mx.default_device() == mx.cpu or not cuda.available():
        return None
    src = cuda.page_locked(nbytes)
    src[:] = 1
    from ..core.cache.pool import device_address

    dst = mx.zeros((nbytes,), mx.uint8)
    mx.eval(dst)
    ptr = device_address(dst)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        cuda.copy_to_device(ptr, src.ctypes.data, nbytes)
        cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def bounds(
    t_compute: float | None,
    bytes_per_token: float,
    gbps: float | None,
    decode_tps: float,
    step_bytes=None,
) -> dict:
    """The overlap and serial bounds of decode and the efficiency against them; with
    ``step_bytes`` (each decode step's disk bytes, e.g. the tier simulator's), the step
    bound too: each step's reads hidden under its own compute, ``mean(max(t_compute,
    bytes_s / B))`` a step (reads that come in bursts leave the disk idle in the quiet
    steps between, which the overlap bound, on the mean, does not see)."""
    if not t_compute or not gbps:
        return {}
    io = bytes_per_token / (gbps * 1e9)
    overlap, serial = max(t_compute, io), t_compute + io
    actual = 1.0 / decode_tps if decode_tps else float("inf")
    out = {
        "t_compute_ms": round(t_compute * 1e3, 3),
        "t_io_ms": round(io * 1e3, 3),
        "bound_tok_per_s": round(1 / overlap, 2),
        "serial_bound_tok_per_s": round(1 / serial, 2),
        "efficiency": round(overlap / actual, 4),
        "efficiency_vs_serial": round(serial / actual, 4),
    }
    if step_bytes is not None and len(step_bytes):
        step = float(np.mean(np.maximum(t_compute, np.asarray(step_bytes) / (gbps * 1e9))))
        out["step_bound_tok_per_s"] = round(1 / step, 2)
        out["efficiency_vs_step"] = round(step / actual, 4)
    return out
