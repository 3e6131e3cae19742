"""The predictive policy's arithmetic in native code (``policy.c``), built by ``pip
install`` and driven through ctypes; the policy's own arrays are passed by address, so
Python and C share one state. ``library()`` is None where the compiled library is
missing; ``Predictive`` then computes the same in numpy, to the bit (``policy.c``)."""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import numpy as np

from ..extensions import extension_path

HERE = Path(__file__).parent
_lock = threading.Lock()
_lib: ctypes.CDLL | None | bool = None

P = ctypes.c_void_p
L = ctypes.c_int64


class State(ctypes.Structure):
    """``mlxs_predictive`` (``policy.h``)."""

    _fields_ = [(n, L) for n in ("experts", "history", "nwin", "nrec", "nage")] + [
        (n, P)
        for n in ("t", "last", "resident", "trans", "row", "cum", "aged", "aged_at", "prev",
                  "nprev", "windows", "weights", "log1p_rec", "age_pow", "scores", "mark")
    ]  # fmt: skip


def library_path() -> Path | None:
    """The compiled policy inside the installed package, if it was built."""
    return extension_path(HERE, "_policy")


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    I = ctypes.c_int  # noqa: E741
    lib.mlxs_pred_access.restype = I
    lib.mlxs_pred_access.argtypes = [P, P, I]
    lib.mlxs_pred_victims.restype = I
    lib.mlxs_pred_victims.argtypes = [P, I, P, I, P, I, P]
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled policy, or None (a source tree never installed)."""
    global _lib
    with _lock:
        if _lib is None:
            path = library_path()
            try:
                _lib = _load(path) if path is not None else False
            except OSError:
                _lib = False
        return _lib or None


def use_library(path: str | Path) -> None:
    """Load the policy from ``path`` for this process (a sanitizer build under test)."""
    global _lib
    with _lock:
        _lib = _load(Path(path))


class NativeState:
    """A ``State`` over a ``Predictive``'s arrays, and the calls on it."""

    def __init__(self, lib: ctypes.CDLL, arrays: dict[str, np.ndarray], sizes: dict[str, int]):
        self.lib, self._arrays = lib, arrays  # the arrays stay alive with the state
        self.state = State(**sizes, **{k: a.ctypes.data for k, a in arrays.items()})
        self._ref = ctypes.byref(self.state)
        self._out = np.zeros(sizes["experts"], np.int64)

    def access(self, idx: np.ndarray) -> None:
        if self.lib.mlxs_pred_access(self._ref, idx.ctypes.data, len(idx)):
            raise ValueError(f"expert ids out of range: {idx.tolist()}")

    def victims(self, n: int, protect: np.ndarray, current: np.ndarray) -> list[int]:
        out = self._out
        got = self.lib.mlxs_pred_victims(
            self._ref, n, protect.ctypes.data, len(protect), current.ctypes.data,
            len(current), out.ctypes.data,
        )  # fmt: skip
        if got < 0:
            raise ValueError(f"expert ids out of range: {protect.tolist()}, {current.tolist()}")
        return out[:got].tolist()
