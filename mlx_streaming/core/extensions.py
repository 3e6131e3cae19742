"""The package's compiled libraries (built by ``pip install``, loaded with ctypes)."""

from __future__ import annotations

import importlib.machinery
from pathlib import Path


def extension_path(folder: Path, stem: str) -> Path | None:
    """``folder/stem<suffix>`` for this interpreter's extension suffixes, if built."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = folder / f"{stem}{suffix}"
        if p.exists():
            return p
    return None
