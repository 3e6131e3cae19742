"""The package's layout: imports run down the layers, modules stay small, and no module
reaches into another's private members (ruff's SLF001, beside the seed's
``store._resident``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "mlx_streaming"

# Lower layers never import higher ones. Within a rank, modules may import each other.
RANKS = {
    "core": 0,
    "prep": 1,
    "planning": 2,
    "config": 3,
    "model_builder": 3,
    "parallel": 3,
    "peers": 3,
    "analysis": 4,
    "synthetic": 4,
    "bench": 5,
    "serve": 5,
    "commands": 6,
    "cli": 6,
    "__main__": 6,
    "__init__": 6,
}
MAX_LINES = 400


def _modules():
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG).with_suffix("").parts
        yield f, rel


def _rank(parts) -> int:
    return RANKS[parts[0]]


def _imports(f: Path, parts: tuple) -> list[tuple[str, ...]]:
    """The mlx_streaming modules ``f`` imports, as package-relative parts."""
    pkg = list(parts[:-1]) if parts[-1] != "__init__" else list(parts[:-1])
    out = []
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                mod = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.startswith("mlx_streaming"):
                mod = node.module.split(".")[1:]
            else:
                continue
            if node.module is None:  # from . import x: the names are modules
                out += [tuple(mod + [a.name]) for a in node.names]
            else:
                out.append(tuple(mod) if mod else ("__init__",))
        elif isinstance(node, ast.Import):
            out += [
                tuple(a.name.split(".")[1:])
                for a in node.names
                if a.name.startswith("mlx_streaming.")
            ]
    return [m for m in out if m]


@pytest.mark.parametrize("f,parts", list(_modules()), ids=lambda v: str(v))
def test_imports_run_down_the_layers(f, parts):
    for target in _imports(f, parts):
        assert _rank(target) <= _rank(parts), (
            f"{'/'.join(parts)} imports {'.'.join(target)}, a higher layer"
        )


def test_core_reads_no_environment():
    for f in (PKG / "core").rglob("*.py"):
        assert "os.environ" not in f.read_text(), f


def test_modules_stay_small():
    big = {
        str(f.relative_to(PKG)): n
        for f in [*(m for m, _ in _modules()), *PKG.rglob("*.c")]  # C is held to it too
        if (n := len(f.read_text().splitlines())) > MAX_LINES
    }
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_no_private_reach_through():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--select",
            "SLF001",
            "--output-format",
            "concise",
            str(PKG),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode in (0, 1) and "No module named" not in r.stderr, r.stderr  # ruff ran
    hits = [line for line in r.stdout.splitlines() if "SLF001" in line]
    allowed = [h for h in hits if "`_resident`" in h and "bench/" in h]
    # the standard library's one way to read another thread's stack (PeerWatch.stuck_at)
    allowed += [h for h in hits if "`_current_frames`" in h and "peers.py" in h]
    assert hits == allowed, "\n".join(hits)


# Within the expert cache, the order a layer call runs down (a module imports only
# those after it): no call runs back up, no part is wired to one above it.
CACHE_ORDER = [
    "expert_store", "counts", "host_path", "device_path", "loads", "readers", "plan_kernel",
    "device_tier", "device_plan",
    "calls", "slots", "pool", "recording", "policy", "scored", "native_policy",
    "base_policy", "stats", "driver",
]  # fmt: skip


def test_the_expert_cache_calls_only_down():
    rank = {m: i for i, m in enumerate(CACHE_ORDER)}
    found = {f.stem for f in (PKG / "core" / "cache").glob("*.py") if f.stem != "__init__"}
    assert found == set(CACHE_ORDER), (
        f"place new modules in CACHE_ORDER: {found ^ set(CACHE_ORDER)}"
    )
    for f in (PKG / "core" / "cache").glob("*.py"):
        if f.stem == "__init__":
            continue
        for target in _imports(f, ("core", "cache", f.stem)):
            if target[:2] == ("core", "cache") and len(target) > 2:
                assert rank[target[2]] > rank[f.stem], f"{f.stem} imports {target[2]}, above it"
