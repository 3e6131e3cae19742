"""Every choice left to the backend, made once: ``resolve`` turns the streaming options
(``StreamConfig``), the expert directory and the machine into a frozen ``Runtime`` that
the store, the patch, ``load`` and the benchmarks read. The few choices still made
elsewhere are listed, each with its reason, in ``docs/ARCHITECTURE.md`` (step 2).

The choices, per backend (``docs/ARCHITECTURE.md`` has the table, checked by a test):

* pools: ``host`` (slot arrays in host memory: the CPU, Apple's unified memory) or
  ``cuda`` (device memory, written by copies).
* reader: ``native`` (the compiled engine: ``pread`` into staging, copied into the slots),
  ``python`` (``preadv`` straight into host slots; Metal, where the engine is untested,
  and the tests' oracle), ``device`` (CUDA with the files mapped: the GPU copies each
  record from the page-locked mapping itself, on both paths) or ``tier`` (the experts the
  pools do not hold, in host memory; each miss trades places with its victim, on CUDA by
  the GPU: asked for, or CUDA's default where the files do not fit in half of memory:
  whole where it fits, else bounded to what memory holds, the rest read from the files).
* decode path: ``device`` (CUDA, files mapped or a swap tier, a bounded one's misses asked
  of the request ring: a step's misses planned and copied on the GPU, no host
  synchronisation) or ``host`` (the routing read on the host each MoE layer call).
* rows, overlap, zero slot, threads, kernel check.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

from . import mem
from .io import engine_lib
from .io.reader import INLINE_BYTES
from .io.ring import cut_said, device_cut
from .mem import HostShare
from .options import StreamConfig

GB = 1e9
# On the CPU, records of at most INLINE_BYTES (the reader's threshold) are read inline, without
# the overlap split (its second launch ~100 µs on two cores, waking the threads ~40 µs): the demo
# model's 31 KiB records 0.85 of stock so, 0.77-0.79 split; DS2-Lite's 0.55 MB 0.854 split, 0.811
# not (benchmarks/demo_gap.py, 2026-12-02/03).


class RuntimeChoiceError(ValueError):
    """A forced choice that cannot run here (the message says why and what to do)."""


@dataclass(frozen=True)
class Runtime:
    """The resolved runtime of a store (see the module's text). ``why`` says, per choice
    that had a reason, what decided it; ``why["ids"]``, a reason without a field, that
    the ids' transfers failed their check on CUDA (the routing read the usual way)."""

    backend: str  # cpu | metal | cuda
    pool_mode: str  # host | cuda
    reader: str  # native | python | device | tier
    mapped: bool  # the expert files mapped and page-locked for the GPU
    decode_path: str  # host | device
    rows: str  # subset | masked | mixed
    zero_slot: bool
    overlap: bool
    threads: int
    policy: str
    prefetch: bool
    checksums: bool
    direct_io: bool
    kernel_check: bool
    files_reader: str = ""  # a bounded swap tier's reader of the rest (native | python)
    bounded: bool = False  # the swap tier holds part of the rest: the others in the files
    ring_cut: tuple[int, int] = (0, 0)  # the request ring's (threads, pieces) if a tier needs it
    why: tuple[tuple[str, str], ...] = ()

    def reason(self, choice: str) -> str:
        return dict(self.why).get(choice, "")

    def line(self) -> str:
        """One line for the log: the decode path with its reason, then the rest."""
        path = f"{self.decode_path} path"
        if self.reason("decode_path"):
            path += f" ({self.reason('decode_path')})"
        reader = self.reader + (f" ({self.reason('reader')})" if self.reason("reader") else "")
        why = self.reason("direct_io")
        direct = ", O_DIRECT" if self.direct_io else ", no O_DIRECT" if why else ""
        direct += f" ({why})" if why else ""
        return (
            f"mlx_streaming: {self.backend}, {path}; reader {reader}, {self.pool_mode} "
            f"pools, rows {self.rows}, policy {self.policy}, "
            + (
                "trades inline"
                if self.reader == "tier"
                else f"{self.threads} threads"
                if self.threads
                else "reads inline"
            )  # fmt: skip
            + direct
            + (", read-ahead" if self.prefetch else "")
            + (f"; {self.reason('ids')}" if self.reason("ids") else "")
        )

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["why"] = dict(self.why)
        return d

    def replace(self, **changes) -> Runtime:
        return dataclasses.replace(self, **changes)

    def revised(self, reasons: dict[str, str], **changes) -> Runtime:
        """A copy with ``changes`` and ``reasons`` (a choice revised after ``resolve``,
        or a reason alone, e.g. ``ids``: the routing read the usual way)."""
        why = tuple(sorted({**dict(self.why), **reasons}.items()))
        return dataclasses.replace(self, why=why, **changes)


def backend_name() -> str:
    from .dispatch import backend

    return backend()


def resolve(
    cfg: StreamConfig,
    meta=None,
    backend: str | None = None,
    memory: tuple[int, int] | None = None,
    cuda_available: bool | None = None,
    engine_available: bool | None = None,
    slots: dict[int, int] | None = None,
    host: HostShare | None = None,
) -> Runtime:
    """The ``Runtime`` for ``cfg`` on ``backend`` (default: MLX's default device's), with
    the expert directory's ``meta`` (its files' size decides the mapping on CUDA), the
    machine's ``(total, available)`` memory (default: measured; of it, ``host``'s share:
    ``mem.HostShare``) and the pools' ``slots`` per layer (where the files do not fit,
    whether a whole swap tier does, beside the ``host.reserve`` the rest of the load
    takes: without slots, it is not considered).

    Raises:
        RuntimeChoiceError: an option forced to a value that cannot run here.
    """
    b = backend or backend_name()
    why: dict[str, str] = {}
    share = host or HostShare()

    def available() -> int:  # this process's share of the memory available
        return share.available((memory if memory is not None else mem.machine_memory())[1])

    def refuse(msg: str):
        raise RuntimeChoiceError(msg)

    # pools
    pool_mode = cfg.pool_mode.value if cfg.pool_mode is not None else None
    if pool_mode is None:
        pool_mode = "cuda" if b == "cuda" else "host"
    if pool_mode == "cuda" and b != "cuda":
        refuse(f"pool_mode='cuda' needs MLX's CUDA backend (this is {b}): drop --pool-mode")
    if pool_mode == "host" and b == "cuda":
        refuse("pool_mode='host' puts slots in host memory, which MLX's CUDA kernels do not "
               "read: drop --pool-mode")  # fmt: skip
    if pool_mode == "cuda":
        if cuda_available is None:
            from .io import cuda

            cuda_available = cuda.available()
        if not cuda_available:
            refuse("cuda pools need the CUDA runtime (libcudart), which was not found: "
                   "install MLX's CUDA build (pip install 'mlx[cuda]')")  # fmt: skip

    # the files mapped for the GPU (CUDA only)
    if cfg.map_files and cfg.direct_io:
        refuse("map_files and direct_io exclude each other (a mapping reads through the "
               "page cache, which direct_io bypasses): drop one")  # fmt: skip
    if cfg.map_files and pool_mode != "cuda":
        refuse(f"map_files lets the GPU copy records from page-locked mappings; on {b} the "
               "reader reads straight into the slots: drop --map-files")  # fmt: skip
    if cfg.swap_tier:
        for name, why_not in (
            ("map_files", "the tier holds what the pools do not; the mappings would hold it all"),
            (
                "direct_io",
                "the tier reads each record once, at load; bound it with "
                "--swap-tier-gb to read the rest from the files",
            ),
            ("prefetch", "read-ahead is not built for the tier"),
            ("reader", "the tier is the reader"),
        ):
            if getattr(cfg, name) and not (name == "direct_io" and cfg.swap_tier_gb is not None):
                refuse(f"swap_tier and {name} exclude each other ({why_not}): drop one")
    if cfg.swap_tier_gb is not None and not cfg.swap_tier:
        refuse("swap_tier_gb bounds the swap tier: add --swap-tier")
    bounded = cfg.swap_tier_gb is not None  # the records beyond it read from the files
    ring = pool_mode == "cuda"  # a bounded tier's misses asked of the request ring
    if cfg.swap_tier and cfg.swap_tier_gb == "auto" and slots:  # whole where it fits
        bounded = not _tier_fits(meta, slots, available(), "", share.reserve, ring)[0]
    swap_tier = bool(cfg.swap_tier)  # None: CUDA's default where the files do not fit
    if pool_mode != "cuda" or swap_tier:
        mapped = False
    elif cfg.map_files is not None:
        mapped = cfg.map_files
        why["mapped"] = "asked for" if mapped else "turned off"
    else:
        files, avail = files_bytes(meta), available()
        fit = files <= avail // 2
        mapped = fit and not cfg.direct_io
        why["mapped"] = (
            f"expert files {files / GB:.1f} GB {'fit' if fit else 'do not fit'} in half "
            f"of {avail / GB:.0f} GB available{share.said()}"
            + ("; direct_io reads around the page cache" if cfg.direct_io else "")
        )
        if not fit and cfg.swap_tier is None and not (cfg.prefetch or cfg.reader):
            whole, bounded, why["mapped"] = _tier_fits(
                meta, slots, avail, why["mapped"], share.reserve, ring
            )
            swap_tier = whole or bounded  # (with direct_io: the files beyond a bounded one)

    # the reader
    want = cfg.reader.value if cfg.reader is not None else None
    if mapped:
        if want is not None:
            refuse(f"reader={want!r}: with the files mapped the GPU copies each record "
                   "itself; drop --reader, or turn map_files off")  # fmt: skip
        reader = "device"
    elif want == "python" and pool_mode == "cuda":
        refuse("reader='python' reads into host slots only; on CUDA the native reader "
               "serves: drop --reader")  # fmt: skip
    elif want == "python" and cfg.direct_io and b != "metal" and _linux():
        refuse("reader='python' with direct_io: O_DIRECT needs aligned whole-record reads, "
               "which the native reader does; drop --reader")  # fmt: skip
    elif want is not None:
        reader = want
    elif b == "metal" or not _linux():  # macOS on its CPU backend too
        reader, why["reader"] = "python", "the native reader is untested off Linux"
    else:
        reader = "native"
    if reader == "native":
        if engine_available is None:
            engine_available = engine_lib.library() is not None
            missing = engine_lib.why_unavailable()
        else:
            missing = "not available"
        direct = cfg.direct_io and _linux()  # O_DIRECT: whole aligned records, read natively
        if not engine_available and (want is not None or pool_mode == "cuda" or direct):
            refuse(f"the native reader is not installed ({missing}): pip install the package"
                   + (" (direct_io needs it: O_DIRECT reads whole aligned records)"
                      if direct else ""))  # fmt: skip
        if not engine_available:
            reader, why["reader"] = "python", f"the native reader is not installed ({missing})"
    files_reader = reader  # a partial swap tier's reader of the rest
    if swap_tier:  # asked for, or CUDA's default
        auto, gb = cfg.swap_tier_gb == "auto", cfg.swap_tier_gb
        most = "what memory holds" if auto or gb is None else f"{gb:g} GB"
        asked = "swap_tier asked for" if cfg.swap_tier else "the files do not fit in half of memory"
        reader, why["reader"] = "tier", asked + (
            f", at most {most}: the rest read by the {files_reader} reader" if bounded
            else ", as large as memory holds: whole" if auto else "")  # fmt: skip
    direct_io = bool(cfg.direct_io)  # default: beneath a tier that fills memory (whole: off)
    fills = meta is not None and (cfg.swap_tier_gb == "auto" or bounded and not cfg.swap_tier_gb)
    if cfg.direct_io is None and swap_tier and fills and files_reader == "native" and _linux():
        refused = engine_lib.direct_refused([meta.file(li) for li in meta.layers])
        direct_io, why["direct_io"] = not refused, (
            f"O_DIRECT refused ({refused}): through the page cache" if refused else
            "the bounded tier leaves the page cache no room: the files beyond it read "
            "around it (--no-direct-io: through it)")  # fmt: skip

    # the decode path: the GPU copies from the mappings or trades with the tier
    gpu_source = pool_mode == "cuda" and (mapped or reader == "tier")
    if cfg.device_reads:
        if swap_tier and not gpu_source:
            refuse(f"device_reads: the GPU trades with the swap tier on CUDA only (this is {b})"
                   ": drop --device-reads")  # fmt: skip
        if not gpu_source:
            refuse("device_reads: the GPU copies misses from page-locked mappings of the "
                   f"expert files or a swap tier, which this run has not ({why.get('mapped') or b}"
                   "); drop --device-reads, or give the files room (map_files), or add "
                   "--swap-tier")  # fmt: skip
        if cfg.prefetch:
            refuse("device_reads and prefetch exclude each other (read-ahead reads on the "
                   "host, the device path reads nothing there): drop one")  # fmt: skip
    if cfg.device_reads is False:
        decode_path, why["decode_path"] = "host", "device_reads turned off"
    elif gpu_source and not cfg.prefetch:
        decode_path = "device"
        why["decode_path"] = why.get("mapped", "") or "the swap tier" + (
            ": misses beyond it asked of the request ring" if bounded else "")  # fmt: skip
    else:
        decode_path = "host"
        why["decode_path"] = (
            "read-ahead is on"
            if mapped
            else why.get("mapped", "")
            if pool_mode == "cuda"
            else f"{b}: the routing is read on the host"
        )

    # rows and the zero slot they need
    rows, zero_slot = _rows(cfg, b), pool_zero_slot(cfg, b)
    if rows != "subset" and not zero_slot:
        refuse(f"rows={rows!r} points skipped rows at a zero slot: drop zero_slot=False")

    biggest = max((lay.record_bytes for lay in meta.layers.values()), default=0) if meta else 0
    small = b == "cpu" and meta is not None and biggest <= INLINE_BYTES
    size = f"records of {biggest / 1024:.0f} KiB {'are at most' if small else 'exceed'} "
    size += f"{INLINE_BYTES // 1024} KiB"
    if cfg.overlap is not None:
        overlap = cfg.overlap
    elif swap_tier:  # trades precede the layer's kernels; a bounded tier's file reads
        # land after them (on CUDA copied from the ring behind them): a second launch
        # there is not measured yet
        overlap = False
    else:  # the split's second launch pays only where a record's read outlasts it
        overlap = b == "cpu" and not small
        if b == "cpu" and meta is not None:
            why["overlap"] = size
    if cfg.threads is not None:
        threads = cfg.threads
        if reader == "native" and threads > engine_lib.MAX_THREADS:
            refuse(f"threads={threads}: the native reader runs at most {engine_lib.MAX_THREADS} "
                   "threads; give --threads a smaller number")  # fmt: skip
    elif small:  # waking the reader's threads costs more than reading a small record
        threads = 0
        why["threads"] = size + ": read inline"
    else:
        threads = min(15, (os.cpu_count() or 2) - 1) if pool_mode == "cuda" else 4
    ring_cut = (0, 0)  # a CUDA tier's that is bounded or may be at load (auto, the default)
    if swap_tier and ring and (bounded or cfg.swap_tier_gb == "auto" or cfg.swap_tier is None):
        ring_cut = device_cut(cfg.ring_readers, cfg.ring_pieces)
    if ring_cut[0] and bounded:  # the threads fill the tier; the ring reads past it
        why["threads"] = cut_said(ring_cut)
    elif cfg.ring_readers or cfg.ring_pieces:
        why["ring"] = ("the swap tier is whole: ring_* used only if memory bounds it at load"
                       if ring_cut[0] else "no request ring here (CUDA beyond a bounded swap "
                       "tier): ring_* unused")  # fmt: skip
    return Runtime(
        backend=b,
        pool_mode=pool_mode,
        reader=reader,
        mapped=mapped,
        decode_path=decode_path,
        rows=rows,
        zero_slot=bool(zero_slot),
        overlap=bool(overlap),
        threads=int(threads),
        policy=cfg.policy,
        prefetch=bool(cfg.prefetch),
        checksums=bool(cfg.checksums),
        direct_io=direct_io,
        kernel_check=bool(cfg.kernel_check if cfg.kernel_check is not None else b != "cpu"),
        files_reader=files_reader,
        bounded=bool(swap_tier and bounded),
        ring_cut=ring_cut,
        why=tuple(sorted((k, v) for k, v in why.items() if v)),
    )


def _rows(cfg: StreamConfig, b: str) -> str:
    default = {"cpu": "subset", "metal": "masked"}.get(b, "mixed")
    return cfg.rows.value if cfg.rows is not None else default


def pool_zero_slot(cfg: StreamConfig, backend: str | None = None) -> bool:
    """Whether the pools keep a zero slot (rows other than ``subset`` point skipped rows
    at it): the one choice sizing the pools needs before ``resolve`` weighs the rest."""
    b = backend or backend_name()
    return cfg.zero_slot if cfg.zero_slot is not None else _rows(cfg, b) != "subset"


def _tier_fits(meta, slots, avail: int, why: str, reserve=0, ring=False):
    """``(whole, bounded, why)``: whether a whole swap tier fits beside ``MARGIN`` and
    ``reserve`` where the files do not; else a bounded one beside the files' reader and,
    on CUDA (``ring``), the request ring's staging, through which both paths read the
    records beyond it."""
    from .io.tier import MARGIN, fits_beside, staging_beside, tier_bytes

    if not slots:
        return False, False, why
    (need, one), beside = tier_bytes(meta, slots), MARGIN + reserve
    if fits_beside(need, reserve, avail):
        why += f"; the swap tier fits ({need / GB:.1f} GB of experts the pools do not hold): "
        return True, False, why + "the GPU trades with it (--no-swap-tier: the page cache)"
    beside += staging_beside(meta, ring)  # the readers' beside a bounded one
    room = avail - beside >= one > 0
    trunk = f", {reserve / GB:.1f} GB of them for the trunk as it loads" if reserve else ""
    why += f"; nor does a whole swap tier ({need / GB:.1f} GB and {beside / GB:.1f} GB "
    why += f"beside it{trunk}): "
    if not room:
        return False, False, why + "misses read from the files"
    why += f"a bounded one ({(avail - beside) / GB:.1f} GB) holds the experts the pools gave up "
    beyond = "asked of the request ring" if ring else "read from the files"
    why += f"last, misses beyond it {beyond} (--swap-tier-gb G: another bound; "
    return False, True, why + "--no-swap-tier: the page cache alone)"


def files_bytes(meta) -> int:
    """Bytes of the expert files of ``meta``'s layers (0 without a meta)."""
    return sum(meta.file(li).stat().st_size for li in meta.layers) if meta is not None else 0


def _linux() -> bool:
    return sys.platform.startswith("linux")
