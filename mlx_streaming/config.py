"""Every environment variable mlx_streaming reads, read here and nowhere else.

Library functions take explicit arguments; these helpers give the defaults that the
commands and the seed script take from the environment.

  PREFILL_CHUNK         prompt tokens per prefill step for the seed script (default 2;
                        0 = mlx-lm's default of 2048)
  EXPERT_POOL_PROFILE   pool profile to use instead of EXPERT_DIR/pool_profile.json,
                        or "none" to use none
  MLX_STREAMING_CACHE   where expert directories of downloaded models go
                        (default ~/.cache/mlx_streaming)
"""

from __future__ import annotations

import os
from pathlib import Path


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    if v < 0:
        raise ValueError(f"environment variable {name}={raw!r} must be >= 0")
    return v


def prefill_chunk() -> int:
    """Prompt tokens per prefill step (env ``PREFILL_CHUNK``, default 2; 0 = mlx-lm's)."""
    return _int_env("PREFILL_CHUNK", 2)


def pool_profile_override() -> str | None:
    """Env ``EXPERT_POOL_PROFILE``: a profile path, ``"none"``, or None when unset."""
    v = os.environ.get("EXPERT_POOL_PROFILE")
    return v if v else None


def cache_dir() -> Path:
    """Root for expert directories of models given by repo id (env ``MLX_STREAMING_CACHE``)."""
    return Path(os.environ.get("MLX_STREAMING_CACHE", "~/.cache/mlx_streaming")).expanduser()


def kernel_cache_file() -> Path:
    """Where the kernel-parity self-test remembers the shapes it found exact."""
    return cache_dir() / "kernel_parity.json"
