"""mlx_streaming: run Mixture-of-Experts LLMs larger than memory on MLX.

Experts are split to disk once, the trunk stays resident, each MoE layer holds a bounded
pool of expert slots and loads misses from the files; outputs are bit-identical to stock
mlx-lm.
"""

__version__ = "0.1.0"

from .core.cache.expert_store import FileExpertStore  # noqa: E402
from .core.options import PoolMode, Reader, Rows, StreamConfig  # noqa: E402
from .core.prefetch.patch import patch_model_filebacked  # noqa: E402
from .model_builder import load, load_pool_profile, memory_plan  # noqa: E402
from .prep.split_experts import split_model  # noqa: E402

__all__ = [
    "FileExpertStore",
    "PoolMode",
    "Reader",
    "Rows",
    "StreamConfig",
    "load",
    "load_pool_profile",
    "memory_plan",
    "patch_model_filebacked",
    "split_model",
    "__version__",
]
