"""The one eviction ranking: every live policy evicts the resident experts with the lowest
score, ties to the least recently used, then the lowest id.

A policy is a weighting of the same features of each expert (``FEATURES``): its log
recency, its lookups within the latest 4, 16 and 64 lookups of the layer, its transition
score (the chance, learned online from consecutive lookups, that it follows the experts of
the call being served) and an aged count. ``lru`` weighs none of them (the ties decide:
least recently used first), ``lfu`` the aged count, ``predictive`` all of them (weights
fitted on a real trace). One state, one arithmetic: in native code (``policy.c``) on the
host, as a kernel on the device (``device_plan``), and in numpy here, the reference both
equal to the bit (the same operations in the same order, the logarithm and the powers
read from tables, no fused multiply-adds).
"""

from __future__ import annotations

import numpy as np

from .base_policy import Policy

FEATURES = ("log_recency", "window_4", "window_16", "window_64", "transitions", "aged")
WINDOWS = (4, 16, 64)
AGE = 0.9  # the aged count's decay per lookup of the layer
LOG1P_REC = np.log1p(np.arange(1 << 14, dtype=np.float64))  # recency beyond: the last
AGE_POW = AGE ** np.arange(8192, dtype=np.float64)  # 0 by the end
HISTORY = max(WINDOWS) + 1  # rows of running counts kept

# Weights of the predictive score, fitted by least squares on the first half of the
# DeepSeek-V2-Lite trace (target: discounted use over the next 8 lookups); re-fit with
# `mlx_streaming.planning.simulate.fit_predictive`.
PREDICTIVE_WEIGHTS = (0.00541, -0.01885, -0.00014, 0.0169, 0.44336, 0.11748)
WEIGHTS = {
    "lru": (0.0,) * 6,
    "lfu": (0.0, 0.0, 0.0, 0.0, 0.0, 1.0),
    "predictive": PREDICTIVE_WEIGHTS,
}


def state_arrays(num_experts: int) -> dict[str, np.ndarray]:
    """A fresh ranking state for a layer of ``num_experts`` experts: every array the
    arithmetic reads or writes, by name (the device keeps a copy of each)."""
    E = num_experts
    return {
        "t": np.zeros(1, np.int64),  # lookups so far
        "last": np.full(E, -1, np.int64),  # lookup of each expert's last use, -1: never
        "resident": np.zeros(E, np.uint8),
        "pinned": np.zeros(E, np.uint8),  # never victims
        "trans": np.zeros((E, E), np.float32),  # counts: e at t -> e' at t + 1
        "row": np.zeros(E, np.float32),  # their row sums
        "cum": np.zeros((HISTORY, E), np.float64),  # running counts, row t % HISTORY
        "aged": np.zeros(E, np.float64),  # decayed count as of aged_at
        "aged_at": np.zeros(E, np.int64),
        "prev": np.zeros(E, np.int64),  # the latest lookup's experts
        "nprev": np.zeros(1, np.int64),
    }


class Scored(Policy):
    """Evicts the resident experts with the lowest weighted score (see the module's text).

    Args:
        num_experts: Experts of the layer.
        weights: One per ``FEATURES`` entry, or a name of ``WEIGHTS``.
        native: Compute in native code where the package was built (False: numpy).
    """

    def __init__(
        self,
        num_experts: int,
        weights=PREDICTIVE_WEIGHTS,
        native: bool = True,
        name: str = "scored",
    ):
        super().__init__(num_experts)
        if isinstance(weights, str):
            name, weights = weights, WEIGHTS[weights]
        self.name = name
        self.w = np.asarray(weights, dtype=np.float64)
        if self.w.shape != (len(FEATURES),):
            raise ValueError(f"a score needs {len(FEATURES)} weights ({FEATURES}), got {weights}")
        self.state = state_arrays(num_experts)
        self.state["pinned"] = self._pinned  # the base class's mask, shared
        for k, a in self.state.items():  # the arrays as attributes (t, prev...: _t, _prev)
            setattr(self, f"_{k}" if k in ("t", "prev", "nprev", "pinned") else k, a)
        self._native = self._bind() if native else None

    def _bind(self):
        from .native_policy import NativeState, library

        lib = library()
        if lib is None:
            return None
        return NativeState(lib, self.state, self.w, LOG1P_REC, AGE_POW, WINDOWS)

    @property
    def native(self) -> bool:
        """Whether the arithmetic runs in native code."""
        return self._native is not None

    @property
    def t(self) -> int:
        return int(self._t[0])

    @property
    def prev(self) -> np.ndarray:
        """The experts of the latest lookup."""
        return self._prev[: self._nprev[0]]

    @property
    def win(self) -> list[np.ndarray]:
        """Lookups of each expert within each window of the latest lookups, a row per
        window."""
        H, last = HISTORY, self.t - 1
        if last < 0:
            return [np.zeros(self.num_experts) for _ in WINDOWS]
        now = self.cum[last % H]
        return [now - self.cum[(last - w) % H] if last >= w else now for w in WINDOWS]

    # ------------------------------------------------------------ events
    def insert(self, expert):
        self.resident[expert] = 1

    def remove(self, expert):
        self.resident[expert] = 0

    def access(self, experts):
        if self._native is not None:
            self._native.access(experts)
            return
        idx = np.asarray(experts, dtype=np.int64)
        prev = self.prev
        if len(prev):
            self.trans[prev[:, None], idx] += 1
            self.row[prev] += 1
        self._prev[: len(idx)], self._nprev[0] = idx, len(idx)
        t, H = self.t, HISTORY
        cur = self.cum[t % H]
        cur[:] = self.cum[(t - 1) % H] if t else 0
        cur[idx] += 1
        self.aged[idx] = self.aged[idx] * _age(t - self.aged_at[idx]) + 1
        self.aged_at[idx] = t
        self.last[idx] = t
        self._t[0] = t + 1

    # ------------------------------------------------------------ the ranking
    def features(self, current: np.ndarray) -> np.ndarray:
        """Per expert, the ``FEATURES`` (the transition score following ``current``)."""
        return np.stack(self._columns(np.asarray(current, np.int64)), axis=-1)

    def _columns(self, current: np.ndarray, skip=()) -> list[np.ndarray | None]:
        top = len(LOG1P_REC) - 1
        rec = np.where(self.last >= 0, np.clip(self.t - self.last, 0, top), top)
        cols: list = [LOG1P_REC[rec], *self.win, None, None]
        if 4 not in skip:
            tr = np.zeros(self.num_experts, dtype=np.float32)
            for c in current.tolist():  # row by row, in order (as policy.c adds them)
                tr = tr + self.trans[c] / np.maximum(self.row[c], np.float32(1))
            cols[4] = tr.astype(np.float64)
        cols[5] = self.aged * _age(self.t - 1 - self.aged_at)
        return cols

    def scores(self, current: np.ndarray) -> np.ndarray:
        """Every expert's score, the transition term following ``current`` (sorted)."""
        zero = {i for i, w in enumerate(self.w) if w == 0}  # terms of weight 0 add nothing
        cols = self._columns(current, skip=zero)
        s = np.zeros(self.num_experts)
        for i, (w, c) in enumerate(zip(self.w, cols)):  # in order, as policy.c sums them
            if i not in zero:
                s = s + w * c
        return s

    def victims(self, n, protect):
        """``n`` resident, unpinned experts outside ``protect`` (the call's experts,
        sorted), lowest score first; the transition score follows ``protect``, or the
        latest lookup where it is empty."""
        if self._native is not None:
            return self._native.victims(n, protect)
        protect = np.asarray(protect, np.int64)
        ok = (self.resident != 0) & (self._pinned == 0)
        ok[protect] = False
        cand = np.flatnonzero(ok)
        if len(cand) <= n:
            return cand.tolist()
        s = self.scores(protect if len(protect) else self.prev.copy())[cand]
        order = np.lexsort((cand, self.last[cand], s))  # lowest score, then oldest, then id
        return cand[order[:n]].tolist()


def _age(d: np.ndarray) -> np.ndarray:
    """``AGE ** d`` from the table."""
    return AGE_POW[np.clip(d, 0, len(AGE_POW) - 1)]
