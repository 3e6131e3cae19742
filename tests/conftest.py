"""Shared fixtures: synthetic checkpoints and their expert directories, built once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mlx_streaming.prep.split_experts import split_model  # noqa: E402

if os.environ.get("MLX_STREAMING_TEST_ENGINE"):  # .ci/sanitize: the ASan/UBSan build
    from mlx_streaming.core.io.engine_lib import use_library

    use_library(os.environ["MLX_STREAMING_TEST_ENGINE"])
if os.environ.get("MLX_STREAMING_TEST_POLICY"):  # .ci/sanitize: the policy's ASan/UBSan build
    from mlx_streaming.core.cache import native_policy

    native_policy.use_library(os.environ["MLX_STREAMING_TEST_POLICY"])
from mlx_streaming.synthetic import make_checkpoint  # noqa: E402


class Models:
    """Builds synthetic checkpoints (and splits them) on first use in a session."""

    def __init__(self, root: Path):
        self.root = root

    def checkpoint(self, preset: str, **kw) -> Path:
        tag = preset + "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
        return make_checkpoint(self.root / "ckpt" / tag, preset, **kw)

    def experts(self, preset: str, **kw) -> tuple[Path, Path]:
        ck = self.checkpoint(preset, **kw)
        ed = self.root / "experts" / ck.name
        split_model(ck, ed)
        return ck, ed


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Models:
    return Models(tmp_path_factory.mktemp("models"))
