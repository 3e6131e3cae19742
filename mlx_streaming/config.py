"""Every environment variable mlx_streaming reads, read here and nowhere else.

Library functions take explicit arguments. The edges (the commands, ``load`` and the
seed-facing helpers below) read the environment once into ``Settings`` and pass values
on.

  PREFILL_CHUNK         prompt tokens per prefill step for the seed script (default 2;
                        0 = mlx-lm's default of 2048)
  EXPERT_POOL_PROFILE   pool profile to use instead of EXPERT_DIR/pool_profile.json,
                        or "none" to use none
  MLX_STREAMING_HOME    where expert directories of downloaded models and the kernel
                        self-test's results go (default ~/.cache/mlx_streaming)
  MLX_RANK, MLX_HOSTFILE  set by ``mlx.launch``: named in a pipeline's error messages
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# The seed script prefills two tokens per step (its documented default): prefill
# activations then stay at decode size, which its memory measurements rely on. The
# commands prefill as mlx-lm does, 2048 tokens per step, which is far faster.
SEED_PREFILL_CHUNK = 2
PREFILL_CHUNK = 2048


@dataclass(frozen=True)
class Settings:
    """What the environment says."""

    prefill_chunk: int = SEED_PREFILL_CHUNK
    pool_profile: str | None = None  # a path, "none", or None (use EXPERT_DIR's)
    home_dir: Path = Path("~/.cache/mlx_streaming").expanduser()
    launch_rank: str = "?"  # what mlx.launch set: this rank and its hostfile (for errors)
    launch_hostfile: str = "unset"

    @property
    def kernel_check_file(self) -> Path:
        """Where the kernel-parity self-test remembers the shapes it found exact."""
        return self.home_dir / "kernel_parity.json"


def settings() -> Settings:
    """Read the environment into ``Settings``.

    Raises:
        ValueError: a variable holds a bad value (names it).
    """
    return Settings(
        prefill_chunk=_int_env("PREFILL_CHUNK", SEED_PREFILL_CHUNK),
        pool_profile=os.environ.get("EXPERT_POOL_PROFILE") or None,
        home_dir=Path(os.environ.get("MLX_STREAMING_HOME", "~/.cache/mlx_streaming")).expanduser(),
        launch_rank=os.environ.get("MLX_RANK", "?"),
        launch_hostfile=os.environ.get("MLX_HOSTFILE", "unset"),
    )


def prefill_chunk() -> int:
    """Prompt tokens per prefill step for the seed (env ``PREFILL_CHUNK``, default 2;
    0 = mlx-lm's)."""
    return settings().prefill_chunk


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
