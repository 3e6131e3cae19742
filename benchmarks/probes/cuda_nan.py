"""Where stock mlx-lm first gives a non-finite value on this device: every module's output
(and the gated-delta functions') is checked in call order during a greedy decode, and the
same call is shown from the CPU run beside it. Variants: as is, with ``mx.compile``
disabled, and in float32.

    python benchmarks/probes/cuda_nan.py tiny-qwen3_next [--tokens 12] [--chunk 8]
"""

from __future__ import annotations

import argparse
import importlib
import json

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load

from mlx_streaming.analysis.verify import compare_traces, greedy_trace
from mlx_streaming.synthetic import make_checkpoint

TEXT = "A mixture of experts routes each token to a few experts out of many. " * 3


LEVEL = "leaf"  # which calls are checked: layer, block (a layer's children) or leaf (all)
EVENTS: list = []  # the current run's (name, finite, max |x|), in call order
NAMES: dict = {}  # id(module) -> its name in the current model


def tap(model, family: str) -> None:
    """Record (name, finite, max |x|) of every module call and gated-delta function in
    ``EVENTS``. Each check evaluates its array, which changes how MLX fuses kernels."""
    NAMES.clear()
    NAMES.update({id(m): n for n, m in model.named_modules()})
    events = EVENTS

    def note(name, out):
        first = out[0] if isinstance(out, tuple) else out
        if isinstance(first, mx.array):
            f = first.astype(mx.float32)
            events.append((name, bool(mx.isfinite(f).all()), float(mx.abs(f).max())))

    layers = model.model.layers if hasattr(model, "model") else []
    if LEVEL == "layer":
        kinds = {type(m) for m in layers}
    elif LEVEL == "block":
        kinds = {type(c) for m in layers for c in m.children().values() if isinstance(c, nn.Module)}
    else:
        kinds = {type(m) for _, m in model.named_modules()}
    for cls in kinds:
        if getattr(cls.__call__, "_tapped", False):
            continue
        orig = cls.__call__

        def call(self, *a, _orig=orig, **k):
            out = _orig(self, *a, **k)
            note(NAMES.get(id(self), type(self).__name__), out)
            return out

        call._tapped = True
        cls.__call__ = call
    try:
        gd = importlib.import_module("mlx_lm.models.gated_delta")
        fam = importlib.import_module(f"mlx_lm.models.{family}")
    except ImportError:
        return
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


def run(ck, device, tokens, chunk, dtype=None, taps=True):
    mx.set_default_device(device)
    model, tok = load(str(ck))
    if dtype is not None:
        model.set_dtype(dtype)
    if taps:
        tap(model, getattr(model, "model_type", ""))
    EVENTS.clear()
    trace = greedy_trace(model, tok.encode(TEXT), tokens, chunk)
    finite = bool(mx.isfinite(mx.array(trace.logits)).all())
    return list(EVENTS), finite, trace


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("preset")
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--workdir", default="/tmp/cuda_nan")
    p.add_argument("--level", default="leaf", choices=["layer", "block", "leaf"])
    a = p.parse_args()
    global LEVEL
    LEVEL = a.level
    ck = make_checkpoint(f"{a.workdir}/{a.preset}", a.preset, dtype="bfloat16")
    for c in (8,):  # untouched stock first: the taps change kernel fusion
        _, ok, t1 = run(ck, mx.gpu, a.tokens, c, taps=False)
        _, ok2, t2 = run(ck, mx.gpu, a.tokens, c, taps=False)
        print(
            f"gpu untapped chunk {c}: logits finite {ok}, {ok2}; tokens {t1.tokens}; "
            f"stock vs stock {json.dumps(compare_traces(t1, t2).to_json())}",
            flush=True,
        )
    mx.disable_compile()
    _, ok, _ = run(ck, mx.gpu, a.tokens, a.chunk, taps=False)
    mx.enable_compile()
    print(f"gpu untapped, mx.compile disabled: logits finite {ok}", flush=True)
    cpu, cpu_ok, _ = run(ck, mx.cpu, a.tokens, a.chunk)
    print(f"cpu: {len(cpu)} calls, logits finite: {cpu_ok}", flush=True)
    variants = [("as is", None, False), ("no compile", None, True), ("float32", mx.float32, False)]
    for name, dtype, no_compile in variants:
        if no_compile:
            mx.disable_compile()
        gpu, ok, _ = run(ck, mx.gpu, a.tokens, a.chunk, dtype)
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
