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


BACKENDS = {"CPU": "cpu", "Apple GPU (Metal)": "metal", "NVIDIA GPU (CUDA)": "cuda"}


def _defaults_table() -> dict[str, dict[str, str]]:
    """The page's table of defaults: {choice: {backend: the cell's first `value`}}."""
    text = DOC.read_text().split("## Defaults", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in text.splitlines() if r.startswith("|")]
    head = [c.strip() for c in rows[0].strip("|").split("|")]
    out = {}
    for r in rows[2:]:
        cells = [c.strip() for c in r.strip("|").split("|")]
        name = cells[0].strip("`")
        out[name] = {
            BACKENDS[h]: re.match(r"`([^`]*)`", c).group(1) for h, c in zip(head[1:], cells[1:])
        }
    return out


def test_the_table_of_defaults_is_what_resolve_decides(models):
    """Each backend's defaults, as ``resolve`` makes them with nothing asked for (CUDA:
    files that fit in half the memory; the engine installed)."""
    import os

    from mlx_streaming.core.meta import load_meta
    from mlx_streaming.core.options import StreamConfig
    from mlx_streaming.core.runtime import resolve

    _, ed = models.experts("tiny-qwen3_moe")
    meta = load_meta(ed)
    table = _defaults_table()
    assert {"pool_mode", "reader", "mapped", "decode_path", "rows", "threads"} <= set(table)
    for b in BACKENDS.values():
        rt = resolve(StreamConfig(), meta, backend=b, memory=(1 << 40, 1 << 40),
                     cuda_available=True, engine_available=True)  # fmt: skip
        for choice, cells in table.items():
            want = cells[b]
            if want == "cores - 1":
                want = str(min(15, (os.cpu_count() or 2) - 1))
            assert str(getattr(rt, choice)) == want, (b, choice, getattr(rt, choice), want)
