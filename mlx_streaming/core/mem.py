"""Memory readings: process RSS and MLX's active / peak / cache bytes."""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx


@dataclass(frozen=True)
class MemSnapshot:
    rss_bytes: int  # resident set size of this process now
    peak_rss_bytes: int  # the process's peak RSS so far
    mlx_active_bytes: int
    mlx_peak_bytes: int
    mlx_cache_bytes: int


def rss_bytes(pid: int | None = None) -> int:
    """Current resident set size of this process (or of process ``pid``)."""
    if sys.platform.startswith("linux"):
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    try:  # macOS: no /proc; psutil (a dependency there)
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        if pid is not None:
            raise
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (never reset).

    On Linux, ``VmHWM`` of this process's own address space: ``getrusage``'s ru_maxrss
    carries the parent's peak at fork across ``exec``, so a benchmark started by a large
    process would report that process's peak.
    """
    if sys.platform.startswith("linux"):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def snapshot() -> MemSnapshot:
    """Memory now: RSS, peak RSS, MLX active, peak and cache bytes."""
    return MemSnapshot(
        rss_bytes(),
        peak_rss_bytes(),
        mx.get_active_memory(),
        mx.get_peak_memory(),
        mx.get_cache_memory(),
    )


def keep_wired_limit(nbytes: int):
    """A ``prompt_progress_callback`` for mlx-lm's ``stream_generate`` that sets MLX's
    wired limit to ``nbytes`` as each generation starts.

    mlx-lm raises the wired limit to the device's recommended working set for the
    duration of every generation (and restores the previous limit after), which would
    silently override a limit set beforehand; its first progress call comes inside that
    span, before any computation.
    """

    def callback(processed: int, total: int) -> None:
        if processed == 0 and hasattr(mx, "set_wired_limit"):
            mx.set_wired_limit(nbytes)

    return callback


def reset_peak() -> None:
    """Reset MLX's peak memory counter."""
    mx.reset_peak_memory()


def clear_cache() -> None:
    """Return MLX's cached free buffers to the system."""
    mx.clear_cache()


def limit_malloc_arenas(n: int) -> bool:
    """Cap glibc's malloc arenas at ``n`` (``mallopt(M_ARENA_MAX)``; elsewhere nothing):
    whether it took effect. glibc gives a thread that mallocs while the others' arenas
    are busy an arena of its own, up to 8 per core, and freed blocks stay resident in
    it, so a server that starts a thread per connection grows in steps of a few MB with
    the connections that ever overlapped, not with live memory. Call it before other
    threads allocate: glibc fixes the cap the first time it needs a second arena."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_ARENA_MAX, n))


M_ARENA_MAX = -8  # glibc's malloc.h


class Sampler:
    """Calls ``probe`` (which returns a tuple) on a thread every ``every_s`` seconds while
    a ``with`` block runs, and once more at its end; ``series`` keeps
    ``(seconds, *probe())``."""

    def __init__(self, probe, every_s: float = 0.02):
        import threading
        import time

        self.probe, self.every, self._time = probe, every_s, time
        self.series: list[tuple] = []
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self):
        self.series.append((round(self._time.perf_counter() - self._t0, 3), *self.probe()))

    def _run(self):
        while True:
            self._sample()
            if self._stop.wait(self.every):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()


class MemorySampler(Sampler):
    """Samples RSS and MLX active memory on a thread while a ``with`` block runs; keeps
    the peaks and a time series of ``(seconds, rss, mlx active)``."""

    def __init__(self, every_s: float = 0.02):
        super().__init__(lambda: (rss_bytes(), mx.get_active_memory()), every_s)
        self._start = (rss_bytes(), mx.get_active_memory())

    @property
    def peak_rss(self) -> int:
        return max([self._start[0], *(r for _, r, _ in self.series)])

    @property
    def peak_mlx(self) -> int:
        return max([self._start[1], *(m for _, _, m in self.series)])


def machine_memory() -> tuple[int, int]:
    """``(total, available)`` bytes of memory for this process's model: on Apple GPUs
    MLX's recommended working set, less what MLX holds already (pools, a loaded trunk);
    elsewhere the system's total and available memory, capped by a cgroup limit if one
    is set."""
    if mx.metal.is_available():
        ws = int(mx.device_info()["max_recommended_working_set_size"])
        return ws, max(0, ws - mx.get_active_memory())
    if not sys.platform.startswith("linux"):
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":")
            info[k] = int(v.split()[0]) * 1024
    total, avail = info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    limit = cgroup_memory()
    if limit is not None:  # what the process's group may still take (its page cache
        cap, used, cache = limit  # is reclaimable, so it counts as available)
        total, avail = min(total, cap), min(avail, max(0, cap - used + cache))
    return total, avail


def pool_memory() -> tuple[int, int, str]:
    """``(total, available, whose)`` bytes where the model's trunk, pools and KV cache
    live: on CUDA the GPU's own memory (``whose`` "GPU"; free there counts as available,
    and host memory holds only what lies beneath the pools), elsewhere ``machine_memory``
    ("machine")."""
    from .dispatch import backend

    if backend() == "cuda":
        from .io import cuda

        if cuda.available():
            return (*cuda.device_memory(), "GPU")
    return (*machine_memory(), "machine")


def cgroup_memory() -> tuple[int, int, int] | None:
    """``(limit, used, page cache)`` bytes of this process's memory cgroup (v2 or v1),
    or None where it has no limit (or no cgroup can be read). The page cache is what the
    kernel may reclaim, its file lists: not shared memory (CUDA's page-locked host memory,
    a swap tier's, is charged as such) nor locked pages, which the group's ``file`` holds."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        path = path.lstrip("/")
        if ctrls == "":  # v2
            names = ("memory.max", "memory.current", "")  # (memory.stat's key prefix)
            roots = [Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")]
        elif "memory" in ctrls.split(","):  # v1
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_")
            roots = [Path("/sys/fs/cgroup/memory")]
        else:
            continue
        for root in roots:
            d = root / path
            try:
                raw = (d / names[0]).read_text().strip()
                used = int((d / names[1]).read_text())
                stat = dict(x.split() for x in (d / "memory.stat").read_text().splitlines())
            except (OSError, ValueError):
                continue
            if raw == "max" or int(raw) >= 1 << 60:  # v1 writes "no limit" as ~2**63
                continue
            lists = (f"{names[2]}{k}_file" for k in ("active", "inactive"))
            return int(raw), used, sum(int(stat.get(k, 0)) for k in lists)
    return None


def host_key() -> str:
    """This host among a pipeline's ranks: on Linux its kernel's boot id (containers of
    one machine share its memory whatever their names), elsewhere its name."""
    import socket

    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


@dataclass(frozen=True)
class HostShare:
    """What a store may plan with of this host's memory: its share of what is available
    (``ranks`` of one pipeline on this host split ``base``, what was available when they
    counted each other, before any of them took its share), and beside it ``reserve``
    bytes that the rest of its load and its run take (the trunk as it loads, off CUDA
    the KV cache: ``model_builder.host_reserve``)."""

    ranks: int = 1
    reserve: int = 0
    base: int | None = None

    def available(self, measured: int | None = None) -> int:
        """This rank's share: of ``base`` where the ranks measured it, never more than
        ``measured`` (default: ``machine_memory``'s available) holds."""
        now = machine_memory()[1] if measured is None else measured
        if self.ranks <= 1:
            return now
        return min(now, (now if self.base is None else self.base) // self.ranks)

    def said(self) -> str:
        """How the share reads in a message ("" for a process alone on its host)."""
        return f" (a share: {self.ranks} ranks on this host)" if self.ranks > 1 else ""
