"""Every streaming option, written once: ``StreamConfig``.

Each field carries its type, default and help, and (where a command exposes it) its
flag. The commands build their flags from these fields (``commands/_args.py``) and one
``StreamConfig`` from the flags; ``load``, ``FileExpertStore``, ``patch_model_filebacked``
and the benchmarks all take that object (or keyword overrides of its fields). Where a
field's default is None ("by backend"), ``runtime.resolve`` decides it, once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from .cache.policy import DEFAULT_POLICY, POLICIES


class PoolMode(str, Enum):
    """Where slots live: ``host`` memory, written in place (CPU, unified memory), or
    ``cuda`` device memory, written by copies."""

    HOST = "host"
    CUDA = "cuda"


class Reader(str, Enum):
    """Who reads records into host or unmapped cuda slots: the compiled reader or Python
    threads (with the files mapped on CUDA the GPU copies them itself)."""

    NATIVE = "native"
    PYTHON = "python"


class Rows(str, Enum):
    """How a call that runs only some rows computes them (see ``StreamedExperts``)."""

    SUBSET = "subset"  # only the call's rows run
    MASKED = "masked"  # every row runs, the others against the zero slot
    MIXED = "mixed"  # masked below mlx-lm's sort threshold (64 rows), subset from it up


def option(default, help: str, *, flag: str | None = "", **cli):
    """A ``StreamConfig`` field: ``flag`` None for options no command exposes ("" : the
    field's name as a flag); ``cli``: argparse's ``type``, ``action``..."""
    return field(default=default, metadata={"help": help, "flag": flag, "cli": cli})


@dataclass(frozen=True)
class StreamConfig:
    """How a model streams its experts. Every choice has one default; None means "by
    backend" where the help says so."""

    slots: int | None = option(
        None, "expert slots per MoE layer (default: half the layer's experts, at least top-k)"
    )
    budget_gb: float | str | None = option(
        None, "total GB for all expert pools, instead of slots; auto: what the machine (on "
        "CUDA, the GPU) has left after the trunk, the KV cache for --context tokens and a "
        "headroom"
    )  # fmt: skip
    context: int = option(
        4096, "tokens of context --budget-gb auto keeps KV cache room for (and, off "
        "CUDA, --swap-tier-gb auto)",
    )  # fmt: skip
    pool_profile: str = option(
        "auto", "slots per layer from a profile: auto (EXPERT_DIR/pool_profile.json or "
        "EXPERT_POOL_PROFILE), none, or a path"
    )  # fmt: skip
    policy: str = option(
        DEFAULT_POLICY, "eviction policy (on every path: the device path evicts by the same ranking)",
        choices=sorted(POLICIES),
    )  # fmt: skip
    threads: int | None = option(
        None, "read threads (default: 4; 0, reading inline, for records of at most 256 KiB on "
        "the CPU; on CUDA one per core but one, at most 15)"
    )  # fmt: skip
    reader: Reader | None = option(
        None, "who reads records into the slots: native (the compiled reader; the default "
        "on the CPU and CUDA) or python (the default on Metal); CUDA with the files "
        "mapped needs none: the GPU copies them", choices=[r.value for r in Reader]
    )  # fmt: skip
    direct_io: bool | None = option(
        None, "bypass the page cache (O_DIRECT / F_NOCACHE) (default: on Linux with the "
        "native reader, beneath a swap tier bounded to what memory holds, which leaves the "
        "page cache no room, where the files' filesystem takes O_DIRECT reads; else off)",
    )  # fmt: skip
    map_files: bool | None = option(
        None, "CUDA: map the expert files, page-locked, so that the GPU copies each record "
        "from them itself, on every path; they stay in host memory (default: when they fit "
        "in half the available memory, and not with --direct-io)",
    )  # fmt: skip
    swap_tier: bool | None = option(
        None, "keep the experts the pools do not hold in a swap tier in host memory "
        "(page-locked on CUDA), read from the files once at load: each miss trades places "
        "with its victim, so pools and tier hold the model once and no miss reads the disk; "
        "host memory needed: the experts less the pools (default: on CUDA where the files "
        "do not fit in half of memory, whole where it fits, else bounded to what memory "
        "holds; on unified memory a bigger pool does better)",
    )  # fmt: skip
    swap_tier_gb: float | str | None = option(
        None, "with --swap-tier: at most this many GB of host memory for the tier, or auto: "
        "as much as the available memory holds beside the process's margin and the trunk's "
        "load (whole where the experts the pools do not hold fit); the hottest records the "
        "pools gave up stay in a bounded tier, the rest are read from the files (around "
        "the page cache where the tier is auto: see --direct-io): on CUDA asked of the "
        "native reader through its request ring (by the GPU itself on the device path: "
        "see --device-reads), elsewhere by the store's reader on the host path",
    )  # fmt: skip
    device_reads: bool | None = option(
        None, "CUDA: a decode step's misses are planned and copied by the GPU itself, "
        "inside the step's graph, with no host synchronisation per MoE layer; prompts "
        "read their routing on the host; both evict by --policy (default: on with the "
        "files mapped or a swap tier, unless --prefetch; over a bounded tier the kernel "
        "asks the native reader for the records beyond it through a request ring: 1.88x "
        "the host path's tok/s at 25%% in a 6 GB cgroup on an H100; forced on where it "
        "cannot run: refused)",
    )  # fmt: skip
    ring_readers: int | None = option(
        None, "CUDA beyond a bounded swap tier: the request ring's reader threads, 1 to 16 "
        "(default 8; a measurement's knob: benchmarks/speed.py --ring-readers)", flag=None,
    )  # fmt: skip
    ring_pieces: int | None = option(
        None, "CUDA beyond a bounded swap tier: the reads the request ring cuts each record "
        "in, 1 to its readers (default: one a reader, at most 8)", flag=None,
    )  # fmt: skip
    checksums: bool = option(
        True, "check each record's checksum the first time it is read (--no-checksums: "
        "skip, for benchmarks of the raw read path)", flag="--no-checksums",
    )  # fmt: skip
    pool_mode: PoolMode | None = option(
        None, "where the slots live (default: cuda on CUDA, host elsewhere)",
        choices=[m.value for m in PoolMode]
    )  # fmt: skip
    zero_slot: bool | None = option(
        None, "an all-zero slot per partial pool, for masked rows (default: off the CPU)",
        flag=None,
    )  # fmt: skip
    record: bool = option(False, "count routing per expert (for pinning hot ones)", flag=None)
    clear_on_evict: bool = option(False, "release MLX's buffer cache after evictions")
    cache_limit_gb: float | None = option(
        None, "cap on MLX's cache of freed buffers (default: 5%% of the pools, at least 32 MB)"
    )
    overlap: bool | None = option(
        None,
        "compute resident experts while misses load (default: on the CPU, for records "
        "above 256 KiB)",
    )
    prefetch: bool = option(False, "read the next layer's predicted experts ahead")
    predictor: object = option(
        "router", "next-layer predictor: router, or a predictor object", flag=None
    )
    rows: Rows | None = option(
        None, "how partial calls run (default: subset on the CPU, masked on Metal, "
        "mixed on CUDA)",
        choices=[r.value for r in Rows],
    )  # fmt: skip
    kernel_check: bool | None = option(
        None, "check at start-up that pools take stock's kernels (default: on GPUs; "
        "--no-kernel-check: skip, exactness then rests on the kernel rule alone)",
        flag="--no-kernel-check",
    )  # fmt: skip
    kernel_check_file: str | Path | None = option(
        None, "JSON file remembering the kernel checks passed", flag=None
    )

    def __post_init__(self):
        if isinstance(self.budget_gb, str) and self.budget_gb != "auto":
            raise ValueError(f"budget_gb must be a number of GB or 'auto', got {self.budget_gb!r}")
        g = self.swap_tier_gb
        if g is not None and g != "auto" and (isinstance(g, str) or not g > 0):
            raise ValueError(f"swap_tier_gb must be a positive number of GB or 'auto', got {g!r}")
        readers, pieces = self.ring_readers, self.ring_pieces
        if readers is not None or pieces is not None:
            from .io.ring import DEVICE_READERS, MAX_READERS

            if readers is not None and not (
                isinstance(readers, int) and 1 <= readers <= MAX_READERS
            ):
                raise ValueError(
                    f"ring_readers must be 1 to {MAX_READERS} threads, got {readers!r}"
                )
            most = readers or DEVICE_READERS  # the cut the ring would take (device_cut)
            if pieces is not None and not (isinstance(pieces, int) and 1 <= pieces <= most):
                raise ValueError(
                    f"ring_pieces must be 1 to the ring's readers ({most}), got {pieces!r}"
                )
        if self.policy not in POLICIES:
            raise ValueError(
                f"unknown cache policy {self.policy!r}; choose one of {sorted(POLICIES)}"
            )
        for name, enum in (("pool_mode", PoolMode), ("reader", Reader), ("rows", Rows)):
            v = getattr(self, name)
            if v is not None and not isinstance(v, enum):
                try:
                    object.__setattr__(self, name, enum(v))
                except ValueError:
                    raise ValueError(
                        f"{name} must be one of {[e.value for e in enum]}, got {v!r}"
                    ) from None
        profile = {True: "auto", False: "none", None: "none"}.get(self.pool_profile)
        if profile is not None:  # load(pool_profile=True/False), as before
            object.__setattr__(self, "pool_profile", profile)

    def replace(self, **changes) -> StreamConfig:
        """A copy with ``changes`` (field names; an unknown name raises TypeError)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(
                f"unknown streaming option(s) {unknown}; the options are StreamConfig's "
                f"fields: {[f.name for f in dataclasses.fields(self)]}"
            )
        return dataclasses.replace(self, **changes)


# options ``load`` applies around the store, and where: the store itself ignores them
_LOAD_ONLY = {
    "budget_gb": "load(..., budget_gb=G), or planning.budget.store_slots for capacity and layer_caps",
    "pool_profile": "load(...), or layer_caps=model_builder.load_pool_profile(dir)",
    "context": "load(..., budget_gb='auto', context=N)",
    "cache_limit_gb": "load(...), or mx.set_cache_limit",
}


def refuse_load_only(options: dict, config, capacity) -> None:
    """Refuse, for ``FileExpertStore``, the options it would silently drop: those
    ``load`` applies around it (``_LOAD_ONLY``, with where each applies)."""
    given = sorted(set(options) & set(_LOAD_ONLY))
    if given:
        name = given[0]
        raise ValueError(f"FileExpertStore does not apply {name}: {_LOAD_ONLY[name]} does")
    if capacity is None and config is not None and config.budget_gb is not None:
        raise ValueError(
            f"the config's budget_gb ({config.budget_gb}) sizes no pool here: pass the "
            f"store its capacity and layer_caps ({_LOAD_ONLY['budget_gb']})"
        )
    slots = options.get("slots")
    if capacity is not None and slots is not None and slots != capacity:
        raise ValueError(f"capacity={capacity} and slots={slots} disagree: give one")
