"""The store's one reader, built as the runtime says (``Runtime.reader``): the compiled
engine, the Python reader, the GPU copying from page-locked mappings, or a swap tier
(``io.tier``; on CUDA the GPU trades with it). Each serves one call,
``start(layer, experts, slots)``, whose ``result()`` is the bytes read."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable

import numpy as np

from ..format import ExpertMeta
from ..io import engine_lib
from ..io.ring import cut_said
from ..mem import HostShare
from ..options import StreamConfig
from ..runtime import Runtime, resolve

FILL_STAGING = 64 << 20  # a swap tier's fill stages at most this (or one record)


def open_reader(
    runtime: Runtime,
    cfg: StreamConfig,
    meta: ExpertMeta,
    pools: dict,
    tick: Callable[[], None] | None = None,
    host: HostShare | None = None,
) -> tuple[object, Runtime]:
    """``(reader, runtime)``: ``make_reader``'s, with the size an ``auto`` swap tier or
    CUDA's default's took (what memory holds, whole where the device path has it) on the
    runtime's line. Where the default's page-locked mappings or swap tier cannot be had,
    a warning and the page cache's reader, the runtime saying why; where such a tier no
    longer fits whole, a warning and a bounded one (a bounded one that fails: the page
    cache's reader). What was asked for
    (``device_reads`` too), or a file's own error, is raised."""
    default = runtime.reader == "tier" and cfg.swap_tier is None  # CUDA's default's tier
    auto = cfg.swap_tier_gb == "auto" or default  # (whole where the device path has it)
    tier_gb = "auto" if default else cfg.swap_tier_gb
    try:
        reader = make_reader(runtime, meta, pools, tier_gb, tick, host)
    except MemoryError as e:
        if cfg.device_reads or runtime.bounded or not (auto and runtime.decode_path == "device"):
            return _without(runtime, cfg, meta, pools, tick, e)
        warnings.warn(f"{e}; the swap tier is bounded instead", RuntimeWarning, stacklevel=3)
        bound = cfg.replace(swap_tier=True, swap_tier_gb="auto") if default else cfg
        runtime = resolve(bound, meta, runtime.backend, host=host)  # no slots: bounded
        try:
            reader = make_reader(runtime, meta, pools, tier_gb, tick, host)
        except (MemoryError, OSError) as again:  # the default's: the page cache; else raised
            return _without(runtime, cfg, meta, pools, tick, again)
    except OSError as e:
        return _without(runtime, cfg, meta, pools, tick, e)
    if auto and runtime.reader == "tier":  # the size memory gave it
        t, gb = reader.tier, f"{reader.tier.nbytes / 1e9:.2f} GB"
        said = {}
        if t.partial:
            how = f"bounded to {gb}, the rest read by the {runtime.files_reader} reader"
            if runtime.ring_cut[0] and not runtime.bounded:  # resolved whole: the ring's words
                said = {"threads": cut_said(runtime.ring_cut)}
                if runtime.reason("ring"):
                    said["ring"] = "memory bounded the tier at load: ring_* used"
        else:  # nothing is read from the files after load
            how = f"whole, {gb}"
        asked = "swap_tier asked for" if not default else "the files do not fit in half of memory"
        runtime = runtime.revised({"reader": f"{asked}, as large as memory holds: {how}", **said})
    elif runtime.reader == "tier" and not reader.tier.partial and cfg.swap_tier_gb:
        most = f"at most {cfg.swap_tier_gb:g} GB"  # a bound above what the pools leave
        whole = f"whole, {reader.tier.nbytes / 1e9:.2f} GB: nothing read from the files"
        runtime = runtime.revised({"reader": f"swap_tier asked for, {most}: {whole}",
                                   "decode_path": f"a swap tier of {most}"})  # fmt: skip
    if runtime.reader == "tier" and not reader.tier.partial and runtime.direct_io:
        unused = ", --direct-io unused" if cfg.direct_io else ""  # O_DIRECT: no file reads
        runtime = runtime.revised({"direct_io": f"the tier is whole: no file reads{unused}"},
                                  direct_io=False)  # fmt: skip
    return reader, runtime


def _without(runtime: Runtime, cfg: StreamConfig, meta, pools, tick, e: Exception):
    """``open_reader``'s answer to ``e``, raised making the reader: the page cache's
    reader where the default's mappings or tier failed to page-lock, else ``e``."""
    from ..io.ring import RingError

    tier = runtime.reader == "tier" and cfg.swap_tier is None  # the default's tier
    failed = (
        isinstance(e, (MemoryError, RingError))
        if tier
        else runtime.mapped and isinstance(e, OSError)
    )
    if not failed or cfg.map_files or cfg.device_reads:
        raise e  # asked for (the device path needs them), or a file's own error
    warnings.warn(f"{e}; the store reads with pread instead", RuntimeWarning, stacklevel=4)
    rt = resolve(cfg.replace(map_files=False, swap_tier=False), meta)
    if isinstance(e, RingError):
        why = f"beside the bounded swap tier, {e}"
    else:
        why = f"the {'swap tier' if tier else 'files'} could not be page-locked ({e})"
    rt = rt.revised({"mapped": why, "decode_path": why, "reader": why})
    return make_reader(rt, meta, pools, tick=tick), rt


def make_reader(
    runtime: Runtime,
    meta: ExpertMeta,
    pools: dict,
    tier_gb=None,
    tick: Callable[[], None] | None = None,
    host: HostShare | None = None,
    sequential: bool = False,
    wave: int | None = None,
):
    """The reader ``runtime`` names, over ``pools``; a swap tier of at most ``tier_gb``
    (default: all the pools do not hold; ``"auto"``: what memory holds) within ``host``'s
    share of memory (``mem.HostShare``, its ``reserve`` beside it), the rest read by the
    file reader the runtime would have had (``runtime.files_reader``). ``tick()`` after
    each layer's long work (a tier's fill, a file's mapping and check; e.g. a pipeline's
    ``Pace.tick``). ``sequential``: the files are read from start to end (a fill).
    ``wave``: the native reader's records staged at once (default: a call's misses; a
    fill's, ``fill_wave``, where ``sequential``).

    Raises:
        OSError: the native reader is not installed, or the files could not be mapped.
        MemoryError: the swap tier does not fit.
        ExpertChecksumError, OSError: a record the swap tier's fill read is corrupt or
            cannot be read (``fill_tier``).
    """
    if runtime.reader == "tier":
        from ..io import cuda
        from ..io.tier import SwapTier, fits_beside, staging_beside, tier_bytes
        from ..io.tier_reader import TierReader

        on_gpu, share = runtime.pool_mode == "cuda", host or HostShare()
        if tier_gb == "auto":  # whole where the runtime chose the device path over it
            limit = None if runtime.decode_path == "device" and not runtime.bounded else "auto"
        else:
            limit = None if tier_gb is None else int(tier_gb * 1e9)
        staging, available = 0, share.available()  # staging: the files' reader's, after
        if limit == "auto" and runtime.files_reader == "native":
            whole = tier_bytes(meta, {li: p.slots for li, p in pools.items()})[0]
            if not runtime.bounded and fits_beside(whole, share.reserve, available):
                limit = None  # whole, as runtime.resolve found: no reads beyond it to stage
            else:
                staging = staging_beside(meta, on_gpu)  # on CUDA both paths ask the ring
        tier = SwapTier(
            meta,
            pools,
            cuda if on_gpu else None,
            limit=limit,
            available=available,
            reserve=share.reserve + staging,
        )
        files = None
        try:
            files_rt = runtime.replace(reader=runtime.files_reader)
            fill_tier(tier, files_rt, tick)
            if on_gpu:  # the pools' copies have landed, on any stream
                cuda.device_synchronize()
            if tier.partial:  # the rest, read from the files; on CUDA all through the
                # request ring, which stages them and reads on its own threads (the
                # engine's start is not called: no workers, a record of staging)
                rest_rt = files_rt.replace(threads=0) if on_gpu else files_rt
                files = make_reader(rest_rt, meta, pools, tick=tick, wave=1 if on_gpu else None)
            if not on_gpu:
                return TierReader(tier, files)
            from ..io.device_reader import DeviceReader

            # (it closes both on failure)
            return DeviceReader(meta, pools, tier=tier, files=files, ring=runtime.ring_cut)
        except BaseException:
            try:
                if files is not None:
                    files.close()
            finally:
                tier.close()
            raise
    if runtime.reader == "device":
        from ..io.device_reader import DeviceReader

        return DeviceReader(meta, pools, checksums=runtime.checksums, tick=tick)
    if runtime.reader == "python":
        from ..io.reader import PythonReader

        return PythonReader(meta, pools, runtime.threads, runtime.direct_io,
                            checksums=runtime.checksums, sequential=sequential)  # fmt: skip
    from ..io import cuda
    from ..io.native import NativeReader

    return NativeReader(
        meta,
        pools,
        threads=runtime.threads,
        direct=runtime.direct_io,
        checksums=runtime.checksums,
        cuda=cuda if runtime.pool_mode == "cuda" else None,
        wave=wave or (fill_wave(meta) if sequential else engine_lib.staging(meta)[0]),
        sequential=sequential,
    )


def fill_wave(meta) -> int:
    """A fill's wave: its staging within ``FILL_STAGING`` bytes (one record where a record
    is larger), not the misses' wave of the largest records (Mixtral-8x22B at 4 bits:
    8 x 170 MB, page-locked on CUDA, beside a tier that fills memory); the engine's
    threads split each record in pieces, so one record a wave still reads in parallel."""
    wave, nbytes = engine_lib.staging(meta)
    stride = nbytes // wave
    return max(1, min(wave, FILL_STAGING // max(1, stride)))


def fill_tier(tier, runtime: Runtime, tick: Callable[[], None] | None = None) -> None:
    """Fill a new swap tier from the files with ``runtime``'s reader (the one the files
    beyond a bounded tier are read with; a whole tier's fill goes through the page cache,
    as nothing else reads the files), one reader at a time: expert ``s`` into pool slot
    ``s`` of every layer, then the records the tier holds into its rows
    (``tier.row_pools()``, host memory); ``tick()`` after each layer of each. The readers
    read the files from start to end (``sequential``), checking each record's checksum,
    and are closed here. The pages read are let go of the page cache where the files
    were read through it: the pools and the tier hold those records now.

    Raises:
        MemoryError: a reader's staging could not be page-locked (CUDA).
        ExpertChecksumError, OSError: a record is corrupt or cannot be read (naming it).
    """
    from ..io.cuda import CudaError

    meta, runtime = tier.meta, runtime if tier.partial else runtime.replace(direct_io=False)
    rows = tier.row_pools()  # the layers with rows
    passes = [(tier.pools, runtime, tier.held), (rows, runtime.replace(pool_mode="host"),
                                                 tier.owner)]  # fmt: skip
    for pools, rt, experts in passes:
        if not pools:
            continue  # no layer has rows
        try:
            reader = make_reader(rt, meta, pools, sequential=True)
        except CudaError as e:  # page-locked memory is scarcer than memory
            raise MemoryError(f"the swap tier's fill could not stage its reads ({e})") from e
        try:
            for li in sorted(pools):
                n = len(experts[li])
                if n:
                    reader.start(li, experts[li], np.arange(n, dtype=np.int32)).result()
                if experts is tier.owner or li not in rows:  # the layer's last read
                    n = len(tier.held[li]) + len(tier.owner[li])
                    forget_pages(meta.file(li), n * meta.layers[li].stride)
                if tick is not None:
                    tick()
        finally:
            reader.close()


def forget_pages(path, nbytes: int) -> None:
    """Let go of the page cache's copy of ``path``'s first ``nbytes`` (a hint: Linux)."""
    if not hasattr(os, "posix_fadvise"):
        return
    with contextlib.suppress(OSError), open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, nbytes, os.POSIX_FADV_DONTNEED)
