"""The one-call API (``load``) and pool profiles.

``load`` chains the separate steps: resolve the model, split it once, load it lazily with
mlx-lm, open a store, patch. Each step is a public function of its own module.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from . import config as env
from .core.cache.expert_store import FileExpertStore
from .core.cache.policy import DEFAULT_POLICY
from .core.format import load_meta
from .core.prefetch.patch import StreamOptions, patch_model_filebacked
from .prep.split_experts import resolve_model_path, split_model

PROFILE_NAME = "pool_profile.json"
PROFILE_FORMAT = "mlx_streaming.pool_profile"


def read_pool_profile(path: str | Path) -> dict[int, int]:
    """``{layer: slots}`` from a pool profile file.

    Raises:
        ValueError: the file is not a valid pool profile (names the file).
    """
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"pool profile {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"pool profile {path} is not valid JSON ({e})") from e
    layers = d.get("layers") if isinstance(d, dict) else None
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"pool profile {path} has no 'layers' object of {{layer: slots}}; "
                         "write one with `python -m mlx_streaming profile`")
    out = {}
    for k, v in layers.items():
        if not str(k).isdigit() or isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"pool profile {path}: entry {k!r}: {v!r} must map a layer "
                             "index to a positive slot count")
        out[int(k)] = v
    return out


def write_pool_profile(path: str | Path, caps: dict[int, int], **info) -> None:
    """Write ``{layer: slots}`` (plus descriptive ``info``) as a pool profile."""
    from .core.format import write_json_atomic

    write_json_atomic(Path(path), {"format": PROFILE_FORMAT, "version": 1, **info,
                                   "layers": {str(k): int(v) for k, v in sorted(caps.items())}})


def load_pool_profile(expert_dir: str | Path) -> dict[int, int] | None:
    """Per-layer slot caps for ``expert_dir``, or None.

    Uses ``expert_dir/pool_profile.json`` when present; the environment variable
    ``EXPERT_POOL_PROFILE`` names another file instead, or ``none`` to use no profile.
    """
    override = env.pool_profile_override()
    if override is not None:
        if override.lower() == "none":
            return None
        return read_pool_profile(override)
    path = Path(expert_dir) / PROFILE_NAME
    return read_pool_profile(path) if path.exists() else None


def default_expert_dir(model: str | Path) -> Path:
    """Where ``load`` splits a model when no expert directory is given."""
    p = Path(model).expanduser()
    key = str(p.resolve()) if p.exists() else str(model)
    name = Path(key).name or "model"
    return env.cache_dir() / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def store_kwargs_from(meta, *, slots=None, budget_gb=None, layer_caps=None) -> dict:
    """``capacity`` and ``layer_caps`` for a store from slots, a budget or a profile."""
    if slots is not None and budget_gb is not None:
        raise ValueError("give either slots or budget_gb, not both")
    if budget_gb is not None:
        from .planning.budget import plan_budget

        plan = plan_budget(meta, budget_gb)
        return {"capacity": plan.default_slots, "layer_caps": plan.slots}
    if slots is None:
        slots = max(meta.top_k, meta.num_experts // 2)
    return {"capacity": slots, "layer_caps": layer_caps}


def load(path_or_repo: str | Path, expert_dir: str | Path | None = None, *,
         slots: int | None = None, budget_gb: float | None = None, policy: str = DEFAULT_POLICY,
         pool_profile: str | Path | None | bool = True, threads: int = 4,
         direct_io: bool = False, verify: bool = True, progress: bool | None = None,
         cache_limit_gb: float | None = None, options=None):
    """Load a MoE model with its experts streamed from disk.

    Splits the experts on first use (into ``expert_dir``, by default a cache folder keyed
    by the model), loads the trunk lazily with mlx-lm and patches every MoE layer. The
    model then works unchanged with mlx-lm's ``generate``, ``stream_generate`` and
    prompt caches.

    Args:
        path_or_repo: MLX model directory or Hugging Face repo id.
        expert_dir: Expert directory (created by a split when missing).
        slots: Expert slots per MoE layer (default: half the experts, at least top-k).
        budget_gb: Total bytes for expert pools instead of ``slots``.
        policy: Eviction policy.
        pool_profile: True: use ``expert_dir/pool_profile.json`` when present (or
            ``EXPERT_POOL_PROFILE``); a path: that profile; None/False: no profile.
        threads, direct_io, verify: Reader options (see ``FileExpertStore``).
        progress: Progress bars (default: on a terminal).
        cache_limit_gb: Cap on MLX's cache of freed buffers (default: 5% of the pools,
            at least 32 MB; ``mx.set_cache_limit``). ``store.memory_plan`` reports it
            with the trunk and pool sizes.
        options: ``StreamOptions`` (overlap, prefetch...).

    Returns:
        ``(model, tokenizer, store)``.
    """
    from mlx_lm import load as mlx_load

    model_dir = resolve_model_path(path_or_repo)
    expert_dir = Path(expert_dir) if expert_dir else default_expert_dir(path_or_repo)
    split_model(model_dir, expert_dir, progress=progress)
    meta = load_meta(expert_dir)
    if pool_profile is True:
        caps = load_pool_profile(expert_dir)
    elif pool_profile:
        caps = read_pool_profile(pool_profile)
    else:
        caps = None
    kw = store_kwargs_from(meta, slots=slots, budget_gb=budget_gb, layer_caps=caps)
    model, tokenizer = mlx_load(str(model_dir), lazy=True)
    store = FileExpertStore(expert_dir, policy=policy, threads=threads, direct_io=direct_io,
                            verify=verify, **kw)
    d = meta.dims
    options = options or StreamOptions()
    if options.kernel_cache is None:
        options = replace(options, kernel_cache=env.kernel_cache_file())
    try:
        patch_model_filebacked(model, store, d["hidden"], d["moe_inter"], d.get("group_size"),
                               d.get("bits"), proj_bits=d.get("proj_bits"),
                               layer_proj_bits=_int_keys(d.get("per_layer_proj_bits")),
                               options=options)
    except Exception:
        store.close()
        raise
    store.memory_plan = memory_plan(model, store, cache_limit_gb)
    mx.set_cache_limit(store.memory_plan.cache_limit_bytes)
    load_trunk(model, progress)
    return model, tokenizer, store


def load_trunk(model, progress: bool | None = None) -> None:
    """Read the (lazily loaded) trunk weights now, one block at a time, with a progress
    bar on a terminal, so the first token does not pay for them."""
    from mlx.utils import tree_flatten
    from tqdm import tqdm

    groups: dict[str, list] = {}
    for name, v in tree_flatten(model.parameters()):
        parts = name.split(".")
        key = ".".join(parts[:3]) if len(parts) > 3 and parts[2].isdigit() else parts[0]
        groups.setdefault(key, []).append(v)
    for arrays in tqdm(groups.values(), desc="load trunk", unit="block",
                       disable=None if progress is None else not progress):
        mx.eval(arrays)


def memory_plan(model, store, cache_limit_gb: float | None = None):
    """Trunk, pool and buffer-cache bytes of a patched model (nothing is evaluated)."""
    from mlx.utils import tree_flatten

    from .planning.budget import MemoryPlan, default_cache_limit

    params = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    pools = store.pool_bytes()
    cap = int(cache_limit_gb * 1e9) if cache_limit_gb is not None else default_cache_limit(pools)
    return MemoryPlan(params - pools, pools, cap)


def _int_keys(d: dict | None) -> dict | None:
    return {int(k): v for k, v in d.items()} if d else None
