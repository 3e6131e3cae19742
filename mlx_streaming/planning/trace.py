"""Routing traces: record the experts a model routes to, and replay recorded routing.

Format (shared with ``../shared/traces``): a NumPy ``.npz`` holding ``experts``
(uint8/uint16, ``[T, L, k]``: token t's experts at MoE layer l, layers counted over MoE
layers only), ``offsets`` (int64 ``[S + 1]``: sequence s is tokens ``offsets[s]:
offsets[s+1]``), ``num_experts`` (int64 scalar) and ``model`` (str scalar). Loaded with
``allow_pickle=False`` only.

Random-weight checkpoints route unrealistically; replaying a real model's trace gives
them real locality. ``TraceRouting`` swaps the router's choices for the trace's, keeping
a data dependency on the real routing so that a streamed layer still waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class TraceError(ValueError):
    """A trace file is malformed or does not fit the model."""


@dataclass
class RoutingTrace:
    experts: np.ndarray  # [T, L, k]
    offsets: np.ndarray  # [S + 1]
    num_experts: int
    model: str = ""

    @property
    def tokens(self) -> int:
        return self.experts.shape[0]

    @property
    def layers(self) -> int:
        return self.experts.shape[1]

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        """Read and validate a trace (``allow_pickle=False``)."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as d:
                missing = {"experts", "offsets", "num_experts"} - set(d.files)
                if missing:
                    raise TraceError(
                        f"trace {path} lacks {sorted(missing)}; see the format "
                        "in mlx_streaming/trace.py"
                    )
                experts, offsets = d["experts"], d["offsets"]
                ne = int(d["num_experts"])
                model = str(d["model"]) if "model" in d.files else ""
        except (OSError, ValueError) as e:
            if isinstance(e, TraceError):
                raise
            raise TraceError(f"cannot read trace {path}: {e}") from e
        t = cls(experts, offsets, ne, model)
        t.validate(str(path))
        return t

    def validate(self, where: str = "trace") -> None:
        e, o = self.experts, self.offsets
        if e.ndim != 3 or e.dtype.kind not in "ui":
            raise TraceError(
                f"{where}: experts must be an integer array [T, L, k], got {e.dtype} {e.shape}"
            )
        if o.ndim != 1 or len(o) < 2 or o[0] != 0 or o[-1] != e.shape[0] or (np.diff(o) < 0).any():
            raise TraceError(f"{where}: offsets must rise from 0 to T={e.shape[0]}")
        if self.num_experts <= 0 or (e.size and (int(e.max()) >= self.num_experts or e.min() < 0)):
            raise TraceError(
                f"{where}: expert ids must be in 0..{self.num_experts - 1} (num_experts)"
            )

    def save(self, path: str | Path) -> None:
        """Write the trace (atomically)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp.npz")
        dtype = np.uint8 if self.num_experts <= 256 else np.uint16
        np.savez(
            tmp,
            experts=self.experts.astype(dtype),
            offsets=self.offsets.astype(np.int64),
            num_experts=np.int64(self.num_experts),
            model=np.str_(self.model),
        )
        tmp.replace(path)

    def split(self, fraction: float) -> tuple[RoutingTrace, RoutingTrace]:
        """(first, rest) at a sequence boundary near ``fraction`` of the tokens; within
        a sequence where no boundary leaves both parts tokens (a trace of one sequence,
        as ``generate --record-trace`` writes)."""
        o, T = self.offsets, self.tokens
        cut = min(max(int(np.searchsorted(o, fraction * T)), 1), len(o) - 2)
        at = int(o[cut]) if len(o) > 2 else 0
        if not 0 < at < T:  # cut inside a sequence
            at = min(max(round(fraction * T), 1), T - 1)
        head = np.concatenate([o[o < at], [at]])
        tail = np.concatenate([[at], o[o > at]]) - at
        a = RoutingTrace(self.experts[:at], head, self.num_experts, self.model)
        b = RoutingTrace(self.experts[at:], tail, self.num_experts, self.model)
        return a, b


class TraceRecorder:
    """Collects the routing a streamed model takes (fed by ``FileExpertStore.observers``)
    and writes it in the trace format; ``new_sequence`` starts the next sequence."""

    def __init__(self, moe_layers: list[int], num_experts: int, model: str = ""):
        self.moe_layers = list(moe_layers)
        self.pos = {li: i for i, li in enumerate(self.moe_layers)}
        self.num_experts, self.model = num_experts, model
        self._rows: dict[int, list[np.ndarray]] = {li: [] for li in self.moe_layers}
        self._seq_starts = [0]

    def __call__(self, layer: int, host_ids: np.ndarray) -> None:
        self._rows[layer].append(np.asarray(host_ids).reshape(-1, host_ids.shape[-1]))

    def new_sequence(self) -> None:
        n = self._count(self.moe_layers[0])
        if n != self._seq_starts[-1]:
            self._seq_starts.append(n)

    def _count(self, layer: int) -> int:
        return sum(len(r) for r in self._rows[layer])

    def trace(self) -> RoutingTrace:
        counts = {li: self._count(li) for li in self.moe_layers}
        if len(set(counts.values())) != 1:
            raise TraceError(f"recorded layers saw different token counts: {counts}")
        t = next(iter(counts.values()))
        experts = np.stack(
            [
                np.concatenate(self._rows[li]) if t else np.zeros((0, 1), np.int64)
                for li in self.moe_layers
            ],
            axis=1,
        )
        offsets = np.array(sorted(set(self._seq_starts + [t])), dtype=np.int64)
        return RoutingTrace(experts, offsets, self.num_experts, self.model)

    def save(self, path: str | Path) -> None:
        self.trace().save(path)


class TraceRouting:
    """Replays a trace's routing, one row per token, as a stream across calls."""

    def __init__(self, trace: RoutingTrace, start: int = 0):
        self.trace = trace
        self.cursor = start % trace.tokens

    def rows(self, pos: int, n: int) -> np.ndarray:
        idx = (self.cursor + np.arange(n)) % self.trace.tokens
        return self.trace.experts[idx, pos, :]

    def advance(self, n: int) -> None:
        self.cursor = (self.cursor + n) % self.trace.tokens


class TraceOracle:
    """A simulated next-layer predictor of known accuracy, for what-if curves.

    It reads the replayed trace ahead: for the tokens at ``routing``'s cursor it returns
    layer ``pos + 1``'s true experts, each kept with probability ``accuracy`` and
    otherwise swapped for a wrong one. No real model can do this; it measures how far a
    predictor of that accuracy would take read-ahead. Set ``routing`` (the replay's
    ``TraceRouting``) before the first call.
    """

    name = "oracle"

    def __init__(self, accuracy: float, seed: int = 0, routing: TraceRouting | None = None):
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"accuracy must be within [0, 1], got {accuracy}")
        self.accuracy, self.routing = accuracy, routing
        self._rng = np.random.default_rng(seed)

    def lazy(self, pos: int, x: mx.array) -> None:
        return None

    def predict(self, pos: int, host_ids: np.ndarray, lazy=None) -> np.ndarray:
        trace = self.routing.trace
        if pos + 1 >= trace.layers:
            return np.zeros(0, np.int64)
        true = np.unique(self.routing.rows(pos + 1, host_ids.size // host_ids.shape[-1]))
        keep = true[self._rng.random(len(true)) < self.accuracy]
        wrong = np.setdiff1d(np.arange(trace.num_experts), true)
        swap = self._rng.choice(wrong, size=min(len(true) - len(keep), len(wrong)), replace=False)
        return np.sort(np.concatenate([keep, swap]).astype(np.int64))


class TraceRouted(nn.Module):
    """Feeds an expert module the trace's expert ids instead of the router's."""

    def __init__(self, inner: nn.Module, routing: TraceRouting, pos: int, last: bool):
        super().__init__()
        self.inner = inner
        self.pos, self.last = pos, last
        self._routing = routing

    def __call__(self, x, indices):
        n = int(np.prod(indices.shape[:-1]))
        rows = mx.array(self._routing.rows(self.pos, n).reshape(indices.shape))
        # same values, but still computed after the real routing (a streamed layer waits)
        ids = rows.astype(indices.dtype) + indices * 0
        if self.last:
            self._routing.advance(n)
        return self.inner(x, ids)


def apply_trace_routing(
    model: nn.Module, trace: RoutingTrace, start: int = 0, moe_layers=None
) -> TraceRouting:
    """Make every MoE layer of ``model`` (stock or streamed) route as the trace says.

    MoE layer ``i`` of the model takes trace layer ``i``; the model may have fewer MoE
    layers than the trace, not more, and the same expert count and top-k.
    ``moe_layers``: the whole model's MoE layers, for a pipeline rank's model (which
    holds only its own).
    """
    from ..core.discovery import find_expert_sites

    sites = find_expert_sites(model)
    order = sorted(moe_layers) if moe_layers else [s.layer for s in sites]
    if len(order) > trace.layers:
        raise TraceError(f"the model has {len(order)} MoE layers, the trace {trace.layers}")
    for s in sites:
        if s.num_experts != trace.num_experts or (s.top_k and s.top_k != trace.top_k):
            raise TraceError(
                f"trace routes {trace.top_k} of {trace.num_experts} experts; layer {s.layer} "
                f"has top-{s.top_k} of {s.num_experts}: use a model of the trace's shape "
                "(e.g. the dsv2-lite presets for the DeepSeek-V2-Lite trace)"
            )
    routing = TraceRouting(trace, start)
    for i, s in enumerate(sites):
        current = s.streamed if s.streamed is not None else s.module
        last = i == len(sites) - 1  # the cursor moves on after this rank's last layer
        s.parent.update_modules({s.attr: TraceRouted(current, routing, order.index(s.layer), last)})
    return routing
