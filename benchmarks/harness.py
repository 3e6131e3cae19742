"""The set-up every benchmark shares: flags, a synthetic checkpoint and its experts, the
real routing trace, stock and streamed models side by side, timed generations, and the
result record (machine, command, date) printed and written as JSON.

Benchmarks are scripts, not tests: they print figures measured side by side in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "deepseek-v2-lite.npz"  # DeepSeek-V2-Lite routing
PROMPT = "Explain how a mixture of experts model routes tokens, briefly."


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def recorded_trace(s: str) -> str:
    """``--trace`` of a benchmark that replays a recorded trace: a file, not ``none``."""
    if s == "none":
        raise argparse.ArgumentTypeError("this benchmark replays a recorded trace: give a .npz")
    return s


def numbers(kind=float, lo: float | None = None, hi: float | None = None):
    """An argparse type: a comma-separated list of ``kind`` (at least one, each within
    ``[lo, hi]``), checked as the flags are read, before any build: ``--pieces 1,4,8``."""

    def parse(s: str) -> list:
        try:
            out = [kind(x) for x in s.replace(" ", ",").split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r}: give {kind.__name__}s, e.g. 1,2") from None
        bad = [v for v in out if (lo is not None and v < lo) or (hi is not None and v > hi)]
        if not out or bad:
            span = f"within [{lo}, {hi}]" if hi is not None else f"of at least {lo}"
            raise argparse.ArgumentTypeError(f"{s!r}: give one or more {kind.__name__}s {span}")
        return out

    return parse


RESIDENCIES = numbers(float, 0, 1)  # shares of each layer's experts resident


def parser(
    doc: str,
    preset: str | None = "dsv2-lite-cpu",
    trace: bool | str = True,
    workdir: str | None = "scratch/bench",
) -> argparse.ArgumentParser:
    """Flags every benchmark has: the checkpoint (--preset, --num-layers, --workdir; no
    --workdir where ``workdir`` is None), the routing trace (--trace, 'none' for the
    model's own routing; ``trace="required"``: a recorded trace only) and --json."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if preset is not None:
        p.add_argument("--preset", default=preset, help="synthetic checkpoint preset")
        p.add_argument("--num-layers", type=int, help="override the preset's layer count")
        p.add_argument(
            "--checkpoint",
            help="an MLX model directory to measure instead of a preset (e.g. the trained "
            "checkpoints/tiny-stdlib-moe" + (", with --trace none)" if trace is True else ")"),
        )
    if workdir is not None:
        p.add_argument("--workdir", default=workdir, help="checkpoints and expert directories")
    if trace == "required":
        p.add_argument("--trace", type=recorded_trace, default=str(TRACE),
                       help="routing trace to replay (.npz)")  # fmt: skip
    elif trace:
        p.add_argument("--trace", default=str(TRACE), help="routing trace to replay, or none")
    p.add_argument("--json", dest="json_out", help="write the result here")
    return p


def build(a, **make_kw):
    """The preset's checkpoint and its expert directory (built once, reused):
    ``(checkpoint, expert_dir, meta)``."""
    from mlx_streaming.prep.split_experts import ensure_split
    from mlx_streaming.synthetic import make_checkpoint

    root = Path(a.workdir)
    if getattr(a, "checkpoint", None):
        ck = Path(a.checkpoint)
        ed = root / f"{ck.name}-experts"
        return ck, ed, ensure_split(ck, ed)
    tag = a.preset + (f"-{a.num_layers}l" if getattr(a, "num_layers", None) else "")
    tag += "".join(f"-{k}{v}" for k, v in sorted(make_kw.items()))
    ck = make_checkpoint(root / tag, a.preset, num_layers=getattr(a, "num_layers", None), **make_kw)
    ed = root / f"{tag}-experts"
    return ck, ed, ensure_split(ck, ed)


def add_trace_start(p: argparse.ArgumentParser) -> None:
    """``--trace-start``: the trace token the runs' routing starts at, as ``bench``'s."""
    p.add_argument(
        "--trace-start",
        type=int,
        help="the trace token the replayed routing starts at, within its held-out half "
        "(default: that half's first). A short run reads what its stretch of text asks, "
        "which ranges widely: each row says how its stretch compares (stretch_vs_typical; "
        "probes/stretches.py finds typical starts)",
    )


def held_out_span(trace, run_tokens: int = 0) -> tuple[int, int]:
    """The first and last tokens runs replaying ``run_tokens`` tokens of routing may
    start at: the held-out half's first (the first half trains predictors), and room
    before the trace's end for them and at least 4096 (a typical stretch's)."""
    return trace.split(0.5)[0].tokens, trace.tokens - max(4096, run_tokens)


def routing_trace(a):
    """``(trace, start)``: the trace and the token its runs start at (``--trace-start``
    where the benchmark has it, else the held-out half's first), or (None, 0)."""
    start = getattr(a, "trace_start", None)
    if getattr(a, "trace", "none") in (None, "none"):
        if start is not None:
            raise SystemExit("--trace-start is a position in --trace: give a trace")
        return None, 0
    from mlx_streaming.planning.trace import RoutingTrace

    trace = RoutingTrace.load(a.trace)
    prompt = getattr(a, "prompt_tokens", None) or 64  # (the default prompt: 28 tokens)
    runs = (getattr(a, "repeat", 3) + 1) * (prompt + getattr(a, "tokens", 32))
    first, last = held_out_span(trace, runs)
    if start is not None and not first <= start <= last:
        raise SystemExit(f"--trace-start {start}: give {first} to {last} (the held-out half "
                         f"of {a.trace}, less the {trace.tokens - last} tokens the runs may "
                         "replay)")  # fmt: skip
    return trace, first if start is None else start


def stock(ck, trace=None, start: int = 0):
    """Stock mlx-lm, every expert resident: ``(model, tokenizer, routing)``."""
    from mlx_lm import load

    model, tok = load(str(ck))
    return model, tok, _route(model, trace, start)


def streamed(ck, ed, trace=None, start: int = 0, **load_kw):
    """``mlx_streaming.load`` with ``load_kw``: ``(model, tokenizer, store, routing)``."""
    import mlx_streaming

    model, tok, store = mlx_streaming.load(ck, ed, progress=False, **load_kw)
    return model, tok, store, _route(model, trace, start)


def _route(model, trace, start):
    if trace is None:
        return None
    from mlx_streaming.planning.trace import apply_trace_routing

    return apply_trace_routing(model, trace, start)


_ON_HOST = {"read": False, "launch": False, "transfers": None}  # routing_on_host's state


def routing_read_through() -> str:
    """How ``routing_on_host`` reads the ids (installing it once, for the rest of the
    process): through page-locked memory on CUDA (``IdTransfers``), else ``np.array``."""
    from mlx_streaming.planning.trace import TraceRouted

    if not hasattr(TraceRouted, "_replay"):
        from mlx_streaming.core.io.transfers import id_transfers

        gpu = mx.default_device() == mx.gpu
        _ON_HOST["transfers"] = id_transfers()[0] if gpu else None
        TraceRouted._replay = TraceRouted.__call__

        def call(self, x, indices):
            tr = _ON_HOST["transfers"]
            if _ON_HOST["launch"]:
                mx.async_eval(indices)
            elif _ON_HOST["read"]:  # as HostPath.call and _plan read it
                done = tr.start(indices) if tr is not None else None
                mx.eval(indices if done is None else done)
                _ = np.array(indices) if done is None else tr.read(indices)
            return TraceRouted._replay(self, x, indices)

        TraceRouted.__call__ = call
    return "page-locked memory (IdTransfers)" if _ON_HOST["transfers"] else "np.array"


@contextlib.contextmanager
def routing_on_host(launch_only: bool = False):
    """While open, a trace-routed stock model reads each MoE layer's routing on the host
    as the streamed host path does before it plans (``mx.eval``, then the ids:
    ``routing_read_through``), or with ``launch_only`` only launches it apart
    (``mx.async_eval``): the host path's floor, measured on stock. Not for streamed
    models (they read it already)."""
    routing_read_through()
    before = {k: _ON_HOST[k] for k in ("read", "launch")}
    _ON_HOST.update(read=not launch_only, launch=launch_only)
    try:
        yield
    finally:
        _ON_HOST.update(before)


def slots_at(meta, residency: float) -> int:
    """Slots per MoE layer holding ``residency`` of its experts (the package's rule)."""
    from mlx_streaming.planning.budget import slots_for_share

    return slots_for_share(residency, meta.num_experts, meta.top_k)


def oracle_accuracies(text: str | None) -> list[str]:
    """``--oracle``'s accuracies, checked before anything runs.

    Raises:
        SystemExit: a value that is not a number within [0, 1] (argparse's error)."""
    out = [x.strip() for x in text.split(",")] if text else []
    for x in out:
        try:
            ok = 0.0 <= float(x) <= 1.0
        except ValueError:
            ok = False
        if not ok:
            raise SystemExit(f"--oracle {text}: {x!r} is not an accuracy; give values in [0, 1]")
    return out


def read_ahead(cfg, how: str, trace, meta):
    """``cfg`` reading ahead by ``how``: ``"transition"`` (the experts that followed in
    the trace's first half: a replay's model routes by the trace, its own random routers
    know nothing of it) or an accuracy, a simulated ``TraceOracle`` (``follow`` it)."""
    from mlx_streaming.core.prefetch.predictor import TransitionPredictor
    from mlx_streaming.planning.trace import TraceOracle

    if how == "transition":
        guess = TransitionPredictor.from_trace(trace.split(0.5)[0], meta.top_k)
    else:
        guess = TraceOracle(float(how))
    return cfg.replace(prefetch=True, predictor=guess)


def follow(cfg, routing) -> None:
    """Point a simulated oracle at the replay it reads ahead of, once the model loaded."""
    if hasattr(cfg.predictor, "routing"):
        cfg.predictor.routing = routing


def ahead_label(how: str | None) -> str | None:
    """How a row read ahead, as results name it."""
    if how is None or how == "transition":
        return how
    return f"oracle {how} (simulation)"


def rewind(start: int, *routings) -> None:
    """Make trace-routed models replay from the same token."""
    for r in routings:
        if r is not None:
            r.cursor = start


def decode_run(model, tok, ids, tokens: int, prefill: int = 2048, first_only: bool = False):
    """One ``stream_generate``: (decode tok/s, prefill tok/s, generated tokens);
    ``first_only``: return at the first token (a time to first token)."""
    from mlx_lm import stream_generate

    out = stream_generate(model, tok, ids, max_tokens=tokens, prefill_step_size=prefill)
    for last in out:  # noqa: B007 - the last response is kept
        if first_only:
            break
    return last.generation_tps, last.prompt_tps, last.generation_tokens


def median_us(f, repeat: int, skip: int = 1) -> float:
    """Median µs of ``repeat`` calls of ``f``, the first ``skip`` left out (warm-up)."""
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return round(1e6 * statistics.median(ts[skip:]), 1)


def machine() -> str:
    u = os.uname()
    dev = mx.device_info().get("device_name", str(mx.default_device()))
    return (
        f"{u.sysname} {u.machine}, {os.cpu_count()} cores, MLX {mx.__version__} on "
        f"{mx.default_device()} ({dev})"
    )


def stamped(a, name: str, result: dict, t0: float | None = None) -> dict:
    """``result`` with the benchmark, date, machine, command and wall time."""
    out = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        **result,
    }
    if t0 is not None:
        out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def save(a, out: dict) -> None:
    """Write ``out`` to ``--json`` (if given), whole or not at all."""
    if a.json_out:
        path = Path(a.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
        tmp.replace(path)


def finish(a, name: str, result: dict, t0: float | None = None, quiet=()) -> dict:
    """Stamp ``result`` (``stamped``), print it (without the ``quiet`` keys) and write it
    to ``--json``."""
    out = stamped(a, name, result, t0)
    print(
        json.dumps({k: v for k, v in out.items() if k not in quiet}, indent=1, ensure_ascii=False)
    )
    save(a, out)
    return out


def held_out_gap(trace, tokens: int, others) -> dict:
    """Demand misses per token over six layers across the model, on the trace's held-out
    second half (``tokens`` of it), at 8, 16 and 32 slots: ``lru``, ``predictive`` and
    Belady beside ``others(slots, layers, start, n)`` ({name: misses per token}), each
    with the share of the LRU-to-Belady gap it closes."""
    from mlx_streaming.planning.simulate import simulate

    half = trace.tokens // 2
    n = min(trace.tokens - half, tokens)
    layers = [int(x) for x in np.linspace(1, trace.layers - 1, 6)]
    rows = []
    for slots in (8, 16, 32):
        per = {
            pol: sum(
                simulate(trace, pol, slots, layers=layers, start=half, tokens=n).misses.values()
            )
            / n
            for pol in ("lru", "predictive", "belady")
        }
        per.update(others(slots, layers, half, n))
        lru, bel = per["lru"], per["belady"]
        row = {"slots": slots, "misses_per_token": {k: round(v, 3) for k, v in per.items()}}
        row["gap_closed"] = {k: round((lru - v) / (lru - bel), 3) for k, v in per.items()}
        rows.append(row)
        log(row)
    return {"layers": layers, "tokens": n, "rows": rows}
