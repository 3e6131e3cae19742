"""Which reader a store gets: the native reader (with its page-locked mappings on CUDA),
or none, where the Python reader serves."""

from __future__ import annotations

import os
import warnings

import mlx.core as mx

from ..format import ExpertDirError, ExpertMeta
from ..mem import machine_memory
from ..options import StreamConfig


def native_reader(meta: ExpertMeta, pools: dict, pool_mode: str, cfg: StreamConfig, want):
    """The native reader, chosen once: asked for (``want``), or by default for cuda pools
    and for host pools on the CPU (where it holds no GIL while the main thread plans;
    Metal's host pools keep the Python reader, untested natively there). None: the
    Python reader serves."""
    default = pool_mode == "cuda" or (pool_mode == "host" and mx.default_device() == mx.cpu)
    if want == "python" or pool_mode == "mlx" or (want is None and not default):
        if want == "native":
            raise ExpertDirError("reader='native' needs host or cuda pools, not mlx")
        return None
    from ..io import cuda
    from ..io.native import NativeReader, library

    if library() is None:
        if want == "native":
            raise OSError("reader='native': the compiled reader is not installed")
        return None
    on_cuda = pool_mode == "cuda"
    threads = cfg.threads
    if threads is None:
        threads = min(15, (os.cpu_count() or 2) - 1) if on_cuda else 4
    mapped = map_files(meta, pools, cfg, on_cuda)
    kw = dict(
        threads=threads,
        direct=cfg.direct_io,
        checksums=cfg.checksums,
        cuda=cuda if on_cuda else None,
    )
    try:
        return NativeReader(meta, pools, map_files=mapped, **kw)
    except OSError as e:
        if not mapped or cfg.map_files:  # asked for: the error is the answer
            raise
        warnings.warn(f"{e}; the store reads with pread instead", RuntimeWarning, stacklevel=4)
        return NativeReader(meta, pools, map_files=False, **kw)


def map_files(meta: ExpertMeta, layers, cfg: StreamConfig, on_cuda: bool) -> bool:
    """Whether the native reader copies from mappings of the files (``map_files``): by
    default on CUDA when the files fit in half the available host memory (they stay
    page-locked there), so that the device copies straight from the page cache."""
    if cfg.map_files and cfg.direct_io:
        raise ValueError(
            "map_files and direct_io exclude each other (a mapping reads through the "
            "page cache, which direct_io bypasses): drop one"
        )
    if cfg.map_files is not None:
        return cfg.map_files
    if not on_cuda or cfg.direct_io:
        return False
    files = sum(meta.file(li).stat().st_size for li in layers)
    return files <= machine_memory()[1] // 2
