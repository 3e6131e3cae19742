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


class MemorySampler:
    """Samples RSS and MLX active memory on a thread while a ``with`` block runs; keeps
    the peaks and a time series."""

    def __init__(self, every_s: float = 0.02):
        import threading
        import time

        self._time, self.every = time, every_s
        self.peak_rss = rss_bytes()
        self.peak_mlx = mx.get_active_memory()
        self.series: list[tuple[float, int, int]] = []  # (seconds, rss, mlx active)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        t0 = self._time.perf_counter()
        while not self._stop.is_set():
            r, m = rss_bytes(), mx.get_active_memory()
            self.peak_rss, self.peak_mlx = max(self.peak_rss, r), max(self.peak_mlx, m)
            self.series.append((round(self._time.perf_counter() - t0, 3), r, m))
            self._time.sleep(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_rss = max(self.peak_rss, rss_bytes())


def machine_memory() -> tuple[int, int]:
    """``(total, available)`` bytes of memory for this process's model: on Apple GPUs
    MLX's recommended working set (for both); elsewhere the system's total and available
    memory, capped by a cgroup limit if one is set."""
    if mx.metal.is_available():
        ws = int(mx.device_info()["max_recommended_working_set_size"])
        return ws, ws
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
    try:  # a cgroup (v2) limit: what the group may still take
        cg = Path("/sys/fs/cgroup")
        raw = (cg / "memory.max").read_text().strip()
        if raw != "max":
            used = int((cg / "memory.current").read_text())
            total, avail = min(total, int(raw)), min(avail, max(0, int(raw) - used))
    except (OSError, ValueError):
        pass
    return total, avail
