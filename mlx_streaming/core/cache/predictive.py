"""The ``predictive`` eviction policy: a linear score of each expert's chance of being
needed soon, its arithmetic in native code (``policy.c``) where the package was built."""

from __future__ import annotations

import numpy as np

from .base_policy import Scored

# Weights of the predictive score, fitted by least squares on the first half of the
# DeepSeek-V2-Lite trace (target: discounted use over the next 8 lookups); features in
# the order of Predictive.features. Re-fit with `mlx_streaming.planning.simulate.fit_predictive`.
PREDICTIVE_WEIGHTS = (0.00541, -0.01885, -0.00014, 0.0169, 0.44336, 0.11748)


class Predictive(Scored):
    """Evicts the experts least likely to be needed soon, by a linear score of recency,
    windowed counts (4, 16, 64 lookups), an aged count and the transition score (the
    chance, learned online from consecutive lookups of this layer, that each expert
    follows the experts of the call being served). Each lookup costs O(k) updates; the
    scores are computed only when a victim is needed.

    Its arithmetic runs in native code (``policy.c``) where the package was built, else
    in numpy (``native=False`` forces numpy); both give the same bits: the same
    operations in the same order, the logarithm and the powers read from one table."""

    name = "predictive"
    WINDOWS = (4, 16, 64)
    AGE = 0.9
    LOG1P_REC = np.log1p(np.arange(1 << 14, dtype=np.float64))  # recency beyond: the last
    AGE_POW = AGE ** np.arange(8192, dtype=np.float64)  # 0 by the end

    def __init__(
        self,
        num_experts: int,
        capacity: int | None = None,
        weights=PREDICTIVE_WEIGHTS,
        native: bool = True,
    ):
        E = num_experts
        self._t = np.zeros(1, dtype=np.int64)  # lookups so far (shared with native code)
        super().__init__(num_experts, capacity)
        self.w = np.asarray(weights, dtype=np.float64)
        self.trans = np.zeros((E, E), dtype=np.float32)  # counts: e at t -> e' at t+1
        self.row = np.zeros(E, dtype=np.float32)
        self._prev, self._nprev = np.zeros(E, dtype=np.int64), np.zeros(1, dtype=np.int64)
        # windowed counts as differences of running counts: cum[t % H] holds each
        # expert's lookups up to and including lookup t (integers, so exact)
        self.cum = np.zeros((max(self.WINDOWS) + 1, E))
        self.aged = np.zeros(E)  # decayed count as of aged_at
        self.aged_at = np.zeros(E, dtype=np.int64)
        self._now = self.prev
        self._native = self._bind() if native else None

    def _bind(self):
        from .native_policy import NativeState, library

        lib = library()
        if lib is None:
            return None
        arrays = {
            "t": self._t, "last": self.last, "resident": self.resident, "trans": self.trans,
            "row": self.row, "cum": self.cum, "aged": self.aged, "aged_at": self.aged_at,
            "prev": self._prev, "nprev": self._nprev, "windows": np.asarray(self.WINDOWS, np.int64),
            "weights": self.w, "log1p_rec": self.LOG1P_REC, "age_pow": self.AGE_POW,
            "scores": np.zeros(self.num_experts), "mark": np.zeros(self.num_experts, np.uint8),
        }  # fmt: skip
        sizes = {
            "experts": self.num_experts, "history": len(self.cum), "nwin": len(self.WINDOWS),
            "nrec": len(self.LOG1P_REC), "nage": len(self.AGE_POW),
        }  # fmt: skip
        return NativeState(lib, arrays, sizes)

    @property
    def native(self) -> bool:
        """Whether the arithmetic runs in native code."""
        return self._native is not None

    @property
    def t(self) -> int:
        return int(self._t[0])

    @t.setter
    def t(self, value: int) -> None:
        self._t[0] = value

    @property
    def prev(self) -> np.ndarray:
        """The experts of the latest lookup."""
        return self._prev[: self._nprev[0]]

    @property
    def win(self) -> list[np.ndarray]:
        """Lookups of each expert within each window of the latest lookups, a row per
        window."""
        H, last = len(self.cum), self.t - 1
        if last < 0:
            return [np.zeros(self.num_experts) for _ in self.WINDOWS]
        now = self.cum[last % H]
        return [now - self.cum[(last - w) % H] if last >= w else now for w in self.WINDOWS]

    def access(self, experts):
        if self._native is not None:
            self._native.access(experts)
        else:
            super().access(np.asarray(experts, dtype=np.int64))

    def _observe(self, idx):
        prev = self.prev
        if len(prev):
            self.trans[prev[:, None], idx] += 1
            self.row[prev] += 1
        self._prev[: len(idx)], self._nprev[0] = idx, len(idx)
        t, H = self.t, len(self.cum)
        cur = self.cum[t % H]
        cur[:] = self.cum[(t - 1) % H] if t else 0
        cur[idx] += 1
        self.aged[idx] = self.aged[idx] * self._age(t - self.aged_at[idx]) + 1
        self.aged_at[idx] = t

    def _age(self, d: np.ndarray) -> np.ndarray:
        """``AGE ** d`` from the table."""
        return self.AGE_POW[np.clip(d, 0, len(self.AGE_POW) - 1)]

    def _columns(self, current: np.ndarray) -> list[np.ndarray]:
        """The features, one array over experts each, in ``PREDICTIVE_WEIGHTS``' order:
        log recency, windowed counts, transition score, aged count."""
        top = len(self.LOG1P_REC) - 1
        rec = np.where(self.last >= 0, np.clip(self.t - self.last, 0, top), top)
        tr = np.zeros(self.num_experts, dtype=np.float32)
        for c in current.tolist():  # row by row, in order (as policy.c adds them)
            tr = tr + self.trans[c] / np.maximum(self.row[c], np.float32(1))
        aged = self.aged * self._age(self.t - 1 - self.aged_at)
        return [self.LOG1P_REC[rec], *self.win, tr.astype(np.float64), aged]

    def features(self, current: np.ndarray) -> np.ndarray:
        """Per expert: log recency, windowed counts, transition score, aged count."""
        return np.stack(self._columns(current), axis=-1)

    def scores(self):
        cols = self._columns(self._now)
        s = self.w[0] * cols[0]
        for w, c in zip(self.w[1:], cols[1:]):  # in order, as policy.c sums them
            s = s + w * c
        return s

    def victims(self, n, protect):
        # the call being served is what the next one will most likely follow
        if self._native is not None:
            return self._native.victims(n, protect)
        pro = np.fromiter(protect, dtype=np.int64, count=len(protect))
        self._now = pro if protect else self.prev.copy()  # what scores() follows
        return super().victims(n, protect)
