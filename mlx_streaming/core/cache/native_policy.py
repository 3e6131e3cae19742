"""The eviction ranking's arithmetic in native code (``policy.c``), built by ``pip
install`` and driven through ctypes; the policy's own arrays are passed by address, so
Python and C share one state. ``library()`` is None where the compiled library is
missing; ``Scored`` then computes the same in numpy, to the bit."""

from __future__ import annotations

import ctypes
import threading
import warnings
from pathlib import Path

import numpy as np

from ..extensions import extension_path

HERE = Path(__file__).parent
_lock = threading.Lock()
_lib: ctypes.CDLL | None | bool = None

P = ctypes.c_void_p
L = ctypes.c_int64
ARRAYS = ("t", "last", "resident", "pinned", "trans", "row", "cum", "aged", "aged_at", "prev",
          "nprev", "windows", "weights", "log1p_rec", "age_pow", "scores", "mark")  # fmt: skip


class State(ctypes.Structure):
    """``mlxs_scored`` (``policy.h``)."""

    _fields_ = [(n, L) for n in ("experts", "history", "nwin", "nrec", "nage")] + [
        (n, P) for n in ARRAYS
    ]


def library_path() -> Path | None:
    """The compiled policy inside the installed package, if it was built."""
    return extension_path(HERE, "_policy")


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    I = ctypes.c_int  # noqa: E741
    lib.mlxs_scored_access.restype = I
    lib.mlxs_scored_access.argtypes = [P, P, I]
    lib.mlxs_scored_victims.restype = I
    lib.mlxs_scored_victims.argtypes = [P, I, P, I, P]
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled policy, or None (a source tree never installed)."""
    global _lib
    with _lock:
        if _lib is None:
            path = library_path()
            why = "not built"
            try:
                _lib = _load(path) if path is not None else False
            except OSError as e:
                _lib, why = False, str(e)
            if _lib is False:  # once per process: the same victims, ranked slower
                warnings.warn(
                    f"the compiled policy is unavailable ({why}): victims are ranked in "
                    "numpy, slower; pip install the package to build it",
                    stacklevel=2,
                )
        return _lib or None


def use_library(path: str | Path) -> None:
    """Load the policy from ``path`` for this process (a sanitizer build under test)."""
    global _lib
    with _lock:
        _lib = _load(Path(path))


class NativeState:
    """A ``State`` over a ``Scored`` policy's arrays (``state``: shared, not copied), and
    the calls on it. Ids pass through buffers of its own, whose addresses are taken once."""

    def __init__(self, lib, state: dict, weights, log1p_rec, age_pow, windows):
        E = len(state["last"])
        arrays = dict(state)
        arrays.update(
            windows=np.asarray(windows, np.int64), weights=np.asarray(weights, np.float64),
            log1p_rec=log1p_rec, age_pow=age_pow, scores=np.zeros(E), mark=np.zeros(E, np.uint8),
        )  # fmt: skip
        sizes = dict(
            experts=E, history=len(state["cum"]), nwin=len(windows), nrec=len(log1p_rec),
            nage=len(age_pow),
        )  # fmt: skip
        self.lib, self._arrays = lib, arrays  # the arrays stay alive with the state
        self.state = State(**sizes, **{k: arrays[k].ctypes.data for k in ARRAYS})
        self._ref = ctypes.byref(self.state)
        self._ids = np.zeros((2, E), np.int64)  # a lookup's or protected ids; victims out
        self._in, self._out = (r.ctypes.data for r in self._ids)

    def _load(self, ids) -> int:
        """Copy distinct expert ids into the input buffer; their count."""
        n = len(ids)
        if n > self._ids.shape[1]:
            raise ValueError(f"expert ids out of range: {sorted(ids)} (more than the layer has)")
        if n:
            self._ids[0, :n] = ids
        return n

    def access(self, experts) -> None:
        """One lookup of distinct ``experts``."""
        n = self._load(experts)
        if self.lib.mlxs_scored_access(self._ref, self._in, n):
            raise ValueError(f"expert ids out of range: {list(experts)}")

    def victims(self, n: int, protect) -> list[int]:
        """``n`` victims outside ``protect`` (sorted); the transition score follows
        ``protect``, or the latest lookup where it is empty (as ``Scored.victims``)."""
        k = self._load(protect)
        got = self.lib.mlxs_scored_victims(self._ref, n, self._in, k, self._out)
        if got < 0:
            raise ValueError(f"expert ids out of range: {list(protect)}")
        return self._ids[1, :got].tolist()
