"""docs/ARCHITECTURE.md stays true: every file and ``file::name`` it names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mlx_streaming"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
REF = re.compile(r"`((?:[a-z_]+/)*[a-z_]+\.(?:py|c))(?:::([A-Za-z_][\w.]*))?`")


def _names(path: Path) -> set[str]:
    """Top-level functions, classes and constants, and ``Class.member`` for their
    methods, properties and class attributes."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        if isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        if isinstance(node, ast.ClassDef):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    out.add(f"{node.name}.{sub.name}")
                elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                    out.add(f"{node.name}.{sub.attr}")  # self.x = ...
                elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                    out.add(f"{node.name}.{sub.target.id}")
    return out


def test_every_file_and_name_in_the_architecture_page_exists():
    refs = REF.findall(DOC.read_text())
    assert len(refs) > 30, "the page names the code it describes"
    missing = []
    for file, name in refs:
        path = PKG / file if (PKG / file).exists() else ROOT / file
        if not path.exists():
            missing.append(file)
        elif name and name not in _names(path):
            missing.append(f"{file}::{name}")
    assert not missing, f"docs/ARCHITECTURE.md names what does not exist: {missing}"
