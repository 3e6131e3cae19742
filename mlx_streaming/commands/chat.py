"""``python -m mlx_streaming chat``: mlx-lm's chat (its flags and UI), streamed experts."""

from __future__ import annotations

from ._args import add_store_args, load_kwargs


def setup_arg_parser():
    from mlx_lm.chat import setup_arg_parser as mlx_chat_parser

    p = mlx_chat_parser()
    p.prog = "mlx_streaming chat"
    # mlx-lm's default is a model to download; ours is the repository's trained model
    p.set_defaults(model=None)
    add_store_args(p)
    return p


def main(argv=None) -> None:
    import mlx.core as mx
    from mlx_lm.cli_ui import ChatUI

    from ..model_builder import load
    from ..synthetic.train import TRAINED_SAMPLING, trained_checkpoint

    p = setup_arg_parser()
    sampling = {k: p.get_default(k) for k in ("temp", "top_p")}  # mlx-lm's defaults
    p.set_defaults(temp=None, top_p=None)  # None: not given
    a = p.parse_args(argv)
    if a.model is None:  # the repository's trained model (a completion model) if present
        a.model = trained_checkpoint()
        if a.model is not None:  # its sampling, where not given
            sampling = {k: TRAINED_SAMPLING[k] for k in sampling}
    for k, v in sampling.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    for flag in ("max_tokens", "prefill_step_size"):  # mlx-lm's flags, unchecked there
        v = getattr(a, flag, None)
        if v is not None and v <= 0:
            p.error(f"--{flag.replace('_', '-')} {v} must be a positive integer")
    if a.model is None:
        p.error("--model is required: the MLX model directory or repo id to chat with")
    if a.adapter_path:
        raise ValueError("--adapter-path is not supported with streamed experts")
    if getattr(a, "pipeline", False):  # mlx-lm's chat flag: its pipeline is not ours
        raise ValueError("chat does not pipeline streamed experts: use generate or serve "
                         "with --pipeline")  # fmt: skip
    if getattr(a, "trust_remote_code", False):
        raise ValueError("--trust-remote-code: streamed models load mlx-lm's own model code "
                         "only; drop the flag")  # fmt: skip
    mx.random.seed(a.seed)
    model, tokenizer, store = load(a.model, **load_kwargs(a))
    try:
        with ChatUI(a) as ui:
            converse(a, ui, model, tokenizer, store)
    finally:
        store.close()


def converse(a, ui, model, tokenizer, store) -> None:
    """The chat loop: ends at ``q``, at the end of input (Ctrl-D, a closed pipe) and on
    Ctrl-C at the prompt; Ctrl-C during an answer stops that answer."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    cache = make_prompt_cache(model, a.max_kv_size)
    while True:
        try:
            query = ui.prompt()
        except (EOFError, KeyboardInterrupt):
            print()
            ui.say_bye()
            return
        if query == "q":
            ui.say_bye()
            return
        if query == "r":
            cache = make_prompt_cache(model, a.max_kv_size)
            ui.say_reset()
            continue
        if query == "h":
            ui.say_help()
            continue
        if not query.strip():  # an empty line asks for nothing
            continue
        messages = [{"role": "system", "content": a.system_prompt}] if a.system_prompt else []
        messages.append({"role": "user", "content": query})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        sampler = make_sampler(
            a.temp,
            a.top_p,
            xtc_threshold=a.xtc_threshold,
            xtc_probability=a.xtc_probability,
            xtc_special_tokens=(tokenizer.encode("\n") + list(tokenizer.eos_token_ids)),
        )
        last = None
        try:
            for last in stream_generate(
                model,
                tokenizer,
                prompt,
                max_tokens=a.max_tokens,
                sampler=sampler,
                prompt_cache=cache,
                prefill_step_size=a.prefill_step_size,
            ):
                ui.stream_token(last.text)
        except KeyboardInterrupt:  # the answer stops; the conversation goes on afresh
            print("\n  (stopped)")
            cache = make_prompt_cache(model, a.max_kv_size)
            continue
        ui.end_turn(last)
        print(
            f"  experts: hit rate {store.hit_rate():.3f}, "
            f"{store.totals()['bytes_read'] / 1e6:.1f} MB read"
        )


if __name__ == "__main__":
    main()
