"""The one way to build a streamed model (``load``), and the seed's pool-profile helper.

``load`` chains the separate steps: resolve the model, split it once, size the pools,
load the model lazily with mlx-lm, open a store, patch, read the trunk. Each step is a
public function of its own module.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from pathlib import Path

import mlx.core as mx

from . import config as env
from . import parallel, peers
from .core.cache.expert_store import FileExpertStore
from .core.cache.pool import capacities
from .core.discovery import find_expert_sites, fingerprint
from .core.mem import HostShare, machine_memory
from .core.options import StreamConfig
from .core.prefetch.patch import patch_model_filebacked
from .core.runtime import backend_name, pool_zero_slot, resolve
from .planning.budget import MemoryPlan, default_cache_limit, store_slots
from .planning.profiles import PROFILE_NAME, read_pool_profile, read_profile
from .prep.hub import resolve_model_path
from .prep.split_experts import ensure_split


def pool_profile_path(expert_dir: str | Path, settings: env.Settings | None = None) -> Path | None:
    """The pool profile ``load`` uses for ``expert_dir`` by default, or None:
    ``expert_dir/pool_profile.json`` when present; the environment variable
    ``EXPERT_POOL_PROFILE`` (``settings``' default: read now) names another file instead,
    or ``none`` for no profile."""
    override = (settings or env.settings()).pool_profile
    if override is not None:
        return None if override.lower() == "none" else Path(override)
    path = Path(expert_dir) / PROFILE_NAME
    return path if path.exists() else None


def load_pool_profile(expert_dir: str | Path) -> dict[int, int] | None:
    """Per-layer slot caps for ``expert_dir`` (``pool_profile_path``), or None."""
    path = pool_profile_path(expert_dir)
    return None if path is None else read_pool_profile(path)


def default_expert_dir(model: str | Path, settings: env.Settings | None = None) -> Path:
    """Where ``load`` splits a model when no expert directory is given (under
    ``settings``' home, default: the environment's now)."""
    p = Path(model).expanduser()
    key = str(p.resolve()) if p.exists() else str(model)
    name = Path(key).name or "model"
    home = (settings or env.settings()).home_dir
    return home / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def expert_dir_for(
    path_or_repo: str | Path,
    expert_dir: str | Path | None = None,
    settings: env.Settings | None = None,
) -> Path:
    """The expert directory ``load(path_or_repo, expert_dir)`` splits into and reads."""
    return Path(expert_dir) if expert_dir else default_expert_dir(path_or_repo, settings)


def load(
    path_or_repo: str | Path,
    expert_dir: str | Path | None = None,
    config: StreamConfig | None = None,
    *,
    progress: bool | None = None,
    pipeline_group=None,
    pipeline_split: list[int] | None = None,
    pipeline_watch: peers.PeerWatch | None = None,
    tokenizer_config: dict | None = None,
    **options,
):
    """Load a MoE model with its experts streamed from disk.

    Splits the experts on first use (into ``expert_dir``, by default a cache folder keyed
    by the model), loads the trunk lazily with mlx-lm, patches every MoE layer and reads
    the trunk. The model then works unchanged with mlx-lm's ``generate``,
    ``stream_generate`` and prompt caches.

    Args:
        path_or_repo: MLX model directory or Hugging Face repo id.
        expert_dir: Expert directory (created by a split when missing).
        config: The streaming options (``StreamConfig``: slots or budget, policy, reader,
            pool mode, cache limit, decode path...).
        progress: Progress bars (default: on a terminal).
        pipeline_group: An ``mx.distributed`` group to pipeline the model over with
            mlx-lm's ``pipeline`` (``parallel.init_pipeline``): this rank loads, splits,
            pools and patches only its own layers; ``slots`` and ``budget_gb`` are this
            rank's. Every rank must call ``load`` with the same model and arguments.
        pipeline_split: Decoder layers per rank, in rank order (rank 0 runs the last
            layers); default: even.
        pipeline_watch: The group's ``peers.PeerWatch`` (the commands make it as they
            join the group): the load's exchanges with the other ranks run under it
            (``peers.Pace``: the ranks exchange a word between pieces of their own
            work: a layer's split, a layer's swap-tier fill or file mapping, a kernel
            check case, a block of the trunk; so a rank slower to load is waited for,
            and a silent one ends this one), and every layer call of the store beats
            it. None: no time limit.
        tokenizer_config: Passed to mlx-lm's tokenizer (e.g. ``{"chat_template": t}``).
        **options: Overrides of ``config``'s fields, e.g. ``load(path, slots=32)`` or
            ``load(path, budget_gb=16, policy="lru")``.

    Returns:
        ``(model, tokenizer, store)``.

    Raises:
        TypeError: an option that is not a ``StreamConfig`` field.
    """
    from mlx_lm import load as mlx_load

    cfg = (config or StreamConfig()).replace(**options)
    settings = env.settings()  # the environment, read once
    model_dir = resolve_model_path(path_or_repo)
    expert_dir = expert_dir_for(path_or_repo, expert_dir, settings)
    model, tokenizer = mlx_load(str(model_dir), tokenizer_config=tokenizer_config or {}, lazy=True)
    model_fp, pace, ranks, base = None, None, 1, None
    if pipeline_group is None:
        meta = ensure_split(model_dir, expert_dir, progress=progress)
    else:
        pace = peers.Pace(pipeline_group, pipeline_watch)
        meta, model_fp, ranks = pipeline_share(
            model, model_dir, expert_dir, pace, pipeline_split, progress
        )
        base = machine_memory()[1]  # as the ranks meet, before any takes its share
    p = cfg.pool_profile
    path = pool_profile_path(expert_dir, settings) if p == "auto" else None if p == "none" else p
    caps, whole = (None, []) if path is None else read_profile(path)
    if cfg.budget_gb == "auto":
        plan = auto_budget_for(model, cfg.context, ranks=ranks, base=base)
        cfg = cfg.replace(budget_gb=plan.budget_bytes / 1e9)
    zero_slot = pool_zero_slot(cfg)  # the pools' size, then the rest by it
    capacity, layer_caps = store_slots(meta, cfg.slots, cfg.budget_gb, caps, zero_slot, whole)
    host = HostShare(ranks, host_reserve(model, cfg), base)  # what a tier leaves room for
    runtime = resolve(cfg, meta, slots=capacities(meta, capacity, layer_caps), host=host)
    tick = pace.tick if pace else None  # between pieces of work: a round with the peers
    store = FileExpertStore(
        meta, capacity, layer_caps, config=cfg, runtime=runtime, tick=tick, host=host
    )
    if pipeline_watch is not None:
        store.watch(pipeline_watch.beat)  # a step's progress
    try:  # a failure from here on releases the store (threads, files, page-locked maps)
        if cfg.kernel_check_file is None:
            cfg = cfg.replace(kernel_check_file=settings.kernel_check_file)
        patch_model_filebacked(model, store, config=cfg, model_fingerprint=model_fp, tick=tick)
        mx.set_cache_limit(memory_plan(model, store, cfg.cache_limit_gb).cache_limit_bytes)
        print(store.runtime.line(), file=sys.stderr, flush=True)
        load_trunk(model, progress, tick)
        if pace is not None:
            pace.done()  # every rank loaded
    except BaseException:
        store.close()
        raise
    return model, tokenizer, store


def auto_budget_for(
    model,
    context: int,
    machine: tuple[int, int] | None = None,
    ranks: int = 1,
    base: int | None = None,
):
    """``budget_gb="auto"`` for a lazily loaded ``model`` (its trunk: every parameter
    outside the experts) on this machine, in the memory the pools live in (on CUDA the
    GPU's; ``machine``: ``(total, available)`` bytes, to simulate another), of which a
    pipeline's ``ranks`` on this host each plan with their share of ``base`` (what was
    available as they met; a GPU's memory is its own); prints what it chose and why."""
    from .core.mem import pool_memory
    from .planning.budget import auto_budget, kv_bytes

    trunk = sum(v.nbytes for block in trunk_blocks(model) for v in block)
    kv = sum(kv_bytes(model))
    total, available, whose = (*machine, "machine") if machine else pool_memory()
    if ranks > 1 and whose == "machine":  # the ranks on this host split its memory
        share = HostShare(ranks, base=base)
        total, available = total // ranks, share.available(available)
        whose += share.said()
    plan = auto_budget(trunk, kv, context, total, available, whose)
    print(plan.why(), file=sys.stderr, flush=True)
    return plan


def pipeline_share(model, model_dir, expert_dir, pace: peers.Pace, split, progress=None):
    """Pipeline the lazily loaded ``model`` over ``pace.group`` and split this rank's
    experts; returns ``(meta of this rank's layers, the whole model's fingerprint, the
    ranks on this host)``.

    Every rank checks with the others that they loaded the same model and the same
    expert directory contents before any of them goes on (``pace``: they hear from one
    another between the split's layers, and the check runs under its watch); they also
    count the ranks on each host, which split its memory.
    """
    group = pace.group
    sites = find_expert_sites(model)
    model_fp = fingerprint(model, sites)
    own = parallel.pipeline_model(model, group, split)
    mine = [s.layer for s in sites if s.layer in own]
    if not mine:
        raise ValueError(
            f"rank {group.rank()} runs layers {own.start}-{own.stop - 1}, which hold no "
            "experts: choose a --pipeline-split that gives every rank a MoE layer"
        )
    meta = ensure_split(model_dir, expert_dir, layers=mine, progress=progress, tick=pace.tick)
    pace.done()
    with pace.watch or contextlib.nullcontext():
        parallel.check_same_everywhere(
            group,
            {"model": parallel.digest(model_fp), "experts": parallel.digest(meta.fingerprint)},
            {
                "model": "every rank must load the same model (same files on every host)",
                "experts": "their expert directories were split from different models: "
                "split this model into each host's directory again",
            },
        )
        ranks = parallel.ranks_on_this_host(group)
    return meta.subset(mine), model_fp, ranks


def trunk_blocks(model) -> list[list[mx.array]]:
    """The model's arrays outside its experts, in the blocks ``load_trunk`` reads at
    once: a decoder layer each (``model.layers.N``), the rest by top-level attribute
    (``model``: the embeddings and the final norm; ``lm_head``)."""
    from mlx.utils import tree_flatten

    sites = find_expert_sites(model)
    experts = {id(v) for s in sites for _, v in tree_flatten(s.module.parameters())}
    groups: dict[str, list] = {}
    for name, v in tree_flatten(model.parameters()):
        if id(v) in experts:
            continue
        parts = name.split(".")
        key = ".".join(parts[:3]) if len(parts) > 3 and parts[2].isdigit() else parts[0]
        groups.setdefault(key, []).append(v)
    return list(groups.values())


def trunk_host_bytes(model, backend: str | None = None) -> int:
    """Host memory the (lazily loaded) trunk of ``model`` takes beside a swap tier: on
    CUDA its largest block (MLX reads each array into a host buffer that it frees once
    the copy to the GPU is done; ``load_trunk`` reads a block at a time), elsewhere all of
    it (it stays in the memory the tier takes from)."""
    sizes = [sum(v.nbytes for v in block) for block in trunk_blocks(model)]
    if (backend or backend_name()) == "cuda":
        return max(sizes, default=0)
    return sum(sizes)


def host_reserve(model, cfg: StreamConfig, backend: str | None = None) -> int:
    """Host memory a swap tier sized to what memory holds leaves beside itself for the
    (lazily loaded) ``model``: its trunk's load (``trunk_host_bytes``) and, where the KV
    cache lives in host memory too (not on CUDA) and the tier takes what memory holds
    (``swap_tier_gb="auto"``), the cache of ``cfg.context`` tokens, which grows after the
    tier is sized."""
    from .planning.budget import kv_bytes

    b = backend or backend_name()
    auto = cfg.swap_tier and cfg.swap_tier_gb == "auto"
    kv = cfg.context * sum(kv_bytes(model)) if auto and b != "cuda" else 0
    return trunk_host_bytes(model, b) + kv


def load_trunk(model, progress: bool | None = None, tick=None) -> None:
    """Read the (lazily loaded) trunk weights now, one block at a time (``trunk_blocks``),
    with a progress bar on a terminal, so the first token does not pay for them;
    ``tick()`` after each block (a pipeline's ``Pace.tick``)."""
    from tqdm import tqdm

    for arrays in tqdm(
        trunk_blocks(model),
        desc="load trunk",
        unit="block",
        disable=None if progress is None else not progress,
    ):
        mx.eval(arrays)
        if tick is not None:
            tick()


def memory_plan(model, store: FileExpertStore, cache_limit_gb: float | None = None) -> MemoryPlan:
    """Trunk, pool, buffer-cache and swap-tier bytes of a patched model (nothing is
    evaluated); ``cache_limit_gb`` as given to ``load``."""
    from mlx.utils import tree_flatten

    params = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    pools = store.pool_bytes()
    cap = int(cache_limit_gb * 1e9) if cache_limit_gb is not None else default_cache_limit(pools)
    tier = getattr(getattr(store.reader, "tier", None), "nbytes", 0)  # host memory
    return MemoryPlan(params - pools, pools, cap, tier)
