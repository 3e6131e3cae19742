"""``python -m mlx_streaming generate``: mlx-lm's generate on a streamed model."""

from __future__ import annotations

import argparse
import contextlib

from ..config import PREFILL_CHUNK
from ._args import (
    add_pipeline_args,
    add_store_args,
    load_kwargs,
    nonneg_int,
    pipeline_kwargs,
    positive_int,
)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_streaming generate",
        description=(
            "Generate text with a MoE model whose experts stream from disk. Flags as in "
            "mlx_lm.generate, plus the streaming ones."
        ),
    )
    p.add_argument("--model", required=True, help="MLX model directory or repo id")
    add_store_args(p)
    add_pipeline_args(p)
    p.add_argument("--prompt", "-p", default="Hello", help="prompt ('-' reads stdin)")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--max-tokens", "-m", type=positive_int, default=100)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-chat-template", action="store_true")
    p.add_argument(
        "--prefill-step-size",
        type=nonneg_int,
        default=PREFILL_CHUNK,
        help=f"prompt tokens per prefill step (default {PREFILL_CHUNK}; 0: the same)",
    )
    p.add_argument(
        "--record-trace",
        help="write the routing taken to this .npz (in a pipeline each rank its own layers, to NAME.rankR.npz)",
    )
    p.add_argument("--verbose", action=argparse.BooleanOptionalAction, default=True)
    return p


def main(argv=None) -> None:
    import sys

    import mlx.core as mx
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    from ..model_builder import load, memory_plan

    a = setup_arg_parser().parse_args(argv)
    if a.seed is not None:
        mx.random.seed(a.seed)
    pipe = pipeline_kwargs(a)
    group = pipe.get("pipeline_group")
    primary = group is None or group.rank() == 0  # the rank that prints
    model, tok, store = load(a.model, **{**load_kwargs(a), **pipe})
    watch = pipe.get("pipeline_watch")  # armed: a peer that stops answering ends this rank
    recorder = None
    if a.record_trace:
        from ..planning.trace import TraceRecorder

        recorder = TraceRecorder(store.layers, store.meta.num_experts, a.model)
        store.observers.append(recorder)
    prompt = sys.stdin.read() if a.prompt == "-" and primary else a.prompt
    with watch or contextlib.nullcontext():
        if group is not None and a.prompt == "-":
            from ..parallel import gather_lines

            prompt = gather_lines(group, prompt)[0]  # rank 0 read stdin
        if not a.ignore_chat_template and tok.chat_template is not None:
            msgs = [{"role": "system", "content": a.system_prompt}] if a.system_prompt else []
            msgs.append({"role": "user", "content": prompt})
            prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        text = generate(
            model,
            tok,
            prompt,
            max_tokens=a.max_tokens,
            verbose=a.verbose and primary,
            sampler=make_sampler(a.temp, a.top_p),
            prefill_step_size=a.prefill_step_size or PREFILL_CHUNK,
        )
        if recorder is not None:
            from ..parallel import rank_path

            recorder.save(rank_path(a.record_trace, group))
        if group is not None:  # the last step's forward pass is still in flight
            from ..parallel import finish_step

            finish_step(group)
    if a.verbose:
        if primary:
            print("Memory plan:", memory_plan(model, store, a.cache_limit_gb).to_json())
        print(expert_line(store, group), flush=True)
    elif primary:
        print(text)
    store.close()


def expert_line(store, group=None) -> str:
    """One line of expert counters (and, in a pipeline, whose layers they are)."""
    import mlx.core as mx

    t = store.totals()
    who = "" if group is None else f" of rank {group.rank()}"
    span = f"MoE layers {store.layers[0]}-{store.layers[-1]}"
    tier, files = t["swap_tier_bytes"], t["file_bytes_read"]  # its trades count as reads
    return (
        f"Experts{who} ({span}): hit rate {store.hit_rate():.3f}, {t['bytes_read'] / 1e6:.1f} MB "
        f"{f'read or traded ({files / 1e6:.1f} MB from the files)' if tier else 'read'} in "
        f"{t['read_s']:.2f} s, pools "
        f"{store.pool_bytes() / 1e9:.3f} GB{f', swap tier {tier / 1e9:.3f} GB' if tier else ''}, "
        f"peak memory {mx.get_peak_memory() / 1e9:.3f} GB"
    )


if __name__ == "__main__":
    main()
