"""Where models come from: a local MLX model directory or a Hugging Face repo id."""

from __future__ import annotations

from pathlib import Path


def local_model_dir(path_or_repo: str | Path) -> Path | None:
    """The local model directory ``path_or_repo`` names, checked, or None for a Hugging
    Face repo id (nothing is downloaded).

    Raises:
        FileNotFoundError: a local path that is not there, or not an MLX model directory.
    """
    p = Path(path_or_repo).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} has no config.json; is it an MLX model directory?")
        return p
    if str(path_or_repo).count("/") != 1 or str(path_or_repo).startswith((".", "/", "~")):
        raise FileNotFoundError(
            f"model {path_or_repo} not found: give a local MLX model "
            "directory or a Hugging Face repo id (org/name)"
        )
    return None


def resolve_model_path(path_or_repo: str | Path) -> Path:
    """A local model directory, or a Hugging Face repo id downloaded to its cache."""
    local = local_model_dir(path_or_repo)
    if local is not None:
        return local
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            str(path_or_repo),
            allow_patterns=[
                "*.json",
                "*.safetensors",
                "*.py",
                "tokenizer.model",
                "*.tiktoken",
                "*.txt",
                "*.jinja",
            ],
        )
    )


def load_lazy(model_dir: Path):
    """The mlx-lm model with lazily loaded weights (nothing read yet), and its config."""
    from mlx_lm.utils import load_model

    return load_model(model_dir, lazy=True)
