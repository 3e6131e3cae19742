"""Where stock mlx-lm first gives a non-finite value on this device: every module's output
(and the gated-delta functions') is checked in call order during a greedy decode, and the
same call is shown from the CPU run beside it. Variants: as is, with ``mx.compile``
disabled, and in float32.

    python benchmarks/probes/cuda_nan.py tiny-qwen3_next [--tokens 12] [--chunk 8]
"""

from __future__ import annotations

import argparse
import importlib

import mlx.core as mx
from mlx_lm import load

from mlx_streaming.analysis.verify import greedy_trace
from mlx_streaming.synthetic import make_checkpoint

TEXT = "A mixture of experts routes each token to a few experts out of many. " * 3


def tap(model, family: str) -> list:
    """Record (name, finite, max |x|) of every module call and gated-delta function."""
    names = {id(m): n for n, m in model.named_modules()}
    events = []

    def note(name, out):
        first = out[0] if isinstance(out, tuple) else out
        if isinstance(first, mx.array):
            f = first.astype(mx.float32)
            events.append((name, bool(mx.isfinite(f).all()), float(mx.abs(f).max())))

    for cls in {type(m) for _, m in model.named_modules()}:
        if getattr(cls.__call__, "_tapped", False):
            continue
        orig = cls.__call__

        def call(self, *a, _orig=orig, **k):
            out = _orig(self, *a, **k)
            note(names.get(id(self), type(self).__name__), out)
            return out

        call._tapped = True
        cls.__call__ = call
    try:
        gd = importlib.import_module("mlx_lm.models.gated_delta")
        fam = importlib.import_module(f"mlx_lm.models.{family}")
    except ImportError:
        return events
    for mod, fn in ((gd, "compute_g"), (gd, "gated_delta_ops"), (fam, "gated_delta_update")):
        orig = getattr(mod, fn, None)
        if orig is None or getattr(orig, "_tapped", False):
            continue

        def wrapped(*a, _orig=orig, _fn=fn, **k):
            out = _orig(*a, **k)
            note(_fn, out)
            return out

        wrapped._tapped = True
        setattr(mod, fn, wrapped)
    return events


def run(ck, device, tokens, chunk, dtype=None):
    mx.set_default_device(device)
    model, tok = load(str(ck))
    if dtype is not None:
        model.set_dtype(dtype)
    events = tap(model, model.model_type if hasattr(model, "model_type") else "")
    events.clear()
    trace = greedy_trace(model, tok.encode(TEXT), tokens, chunk)
    finite = bool(mx.isfinite(mx.array(trace.logits)).all())
    return events, finite


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("preset")
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--workdir", default="/tmp/cuda_nan")
    a = p.parse_args()
    ck = make_checkpoint(f"{a.workdir}/{a.preset}", a.preset, dtype="bfloat16")
    cpu, cpu_ok = run(ck, mx.cpu, a.tokens, a.chunk)
    print(f"cpu: {len(cpu)} calls, logits finite: {cpu_ok}", flush=True)
    variants = [("as is", None, False), ("no compile", None, True), ("float32", mx.float32, False)]
    for name, dtype, no_compile in variants:
        if no_compile:
            mx.disable_compile()
        gpu, ok = run(ck, mx.gpu, a.tokens, a.chunk, dtype)
        if no_compile:
            mx.enable_compile()
        bad = next((i for i, e in enumerate(gpu) if not e[1]), None)
        print(f"gpu {name}: {len(gpu)} calls, logits finite: {ok}, first non-finite: {bad}")
        if bad is not None:
            for i in range(max(0, bad - 6), min(len(gpu), bad + 3)):
                c = cpu[i] if i < len(cpu) and dtype is None else ("-", "-", float("nan"))
                print(f"  {i:5d} {gpu[i][0]:45s} finite={gpu[i][1]!s:5s} max={gpu[i][2]:.4g}"
                      f"  | cpu {c[0]} max={c[2]:.4g}")  # fmt: skip


if __name__ == "__main__":
    main()
