"""``python -m mlx_streaming serve``: mlx-lm's OpenAI-compatible server, streamed experts."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from ..config import PREFILL_CHUNK
from ._args import (
    add_pipeline_args,
    add_store_args,
    load_kwargs,
    nonneg_int,
    pipeline_kwargs,
    port_number,
    positive_int,
)

SERVER_ARENAS = 2  # glibc malloc arenas in a server process (core.mem.limit_malloc_arenas)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_streaming serve",
        description=(
            "Serve /v1/chat/completions, /v1/completions and /v1/models (mlx-lm's server) with "
            "the model's experts streamed from disk. Requests run one at a time; /health "
            "reports the queue depth."
        ),
    )
    p.add_argument("--model", required=True, help="MLX model directory or repo id")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: local only)")
    p.add_argument("--port", type=port_number, default=8080)
    p.add_argument("--allowed-origins", type=lambda s: s.split(","), default=["*"])
    p.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    )
    p.add_argument("--chat-template", default="")
    p.add_argument("--use-default-chat-template", action="store_true")
    p.add_argument("--chat-template-args", type=json.loads, default={})
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--max-tokens", type=positive_int, default=512)
    p.add_argument(
        "--max-queue", type=positive_int, default=32,
        help="requests that may wait for the model; more get HTTP 503 (default 32)",
    )  # fmt: skip
    p.add_argument("--prefill-step-size", type=positive_int, default=PREFILL_CHUNK)
    p.add_argument("--prompt-cache-size", type=nonneg_int, default=10)
    p.add_argument("--prompt-cache-bytes", type=positive_int, default=None)
    p.add_argument("--kv-bits", type=int, default=None)
    p.add_argument("--kv-group-size", type=int, default=64)
    p.add_argument("--quantized-kv-start", type=int, default=5000)
    add_store_args(p)
    add_pipeline_args(p)
    return p


def cli_args_for_mlx_lm(a: argparse.Namespace) -> argparse.Namespace:
    """The namespace mlx-lm's server reads, from our flags (fixed values where streaming
    rules them: no adapters, no draft model, no batching; distribution only as a
    pipeline)."""
    return argparse.Namespace(
        model=a.model,
        adapter_path=None,
        draft_model=None,
        num_draft_tokens=3,
        trust_remote_code=False,
        allowed_origins=a.allowed_origins,
        chat_template=a.chat_template,
        use_default_chat_template=a.use_default_chat_template,
        chat_template_args=a.chat_template_args,
        temp=a.temp,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        max_tokens=a.max_tokens,
        decode_concurrency=1,
        prompt_concurrency=1,
        prefill_step_size=a.prefill_step_size,
        prompt_cache_size=a.prompt_cache_size,
        prompt_cache_bytes=a.prompt_cache_bytes,
        kv_bits=a.kv_bits,
        kv_group_size=a.kv_group_size,
        quantized_kv_start=a.quantized_kv_start,
        pipeline=a.pipeline,
        max_queue=a.max_queue,
    )


def main(argv=None) -> None:
    from ..core.mem import limit_malloc_arenas

    # first, before the model's threads allocate: one request runs at a time, and a
    # thread per connection would otherwise leave an arena of freed blocks behind each
    limit_malloc_arenas(SERVER_ARENAS)
    from ..prep.hub import local_model_dir
    from ..serve.server import ServerStopped, StreamingAPIHandler, serve

    a = setup_arg_parser().parse_args(argv)
    local_model_dir(a.model)  # a local model's errors before any thread starts
    logging.basicConfig(level=getattr(logging, a.log_level), format="%(asctime)s %(message)s")
    # joins the group first (mlx-lm's server then finds it); a silent peer fails the
    # requests in flight before this rank exits
    pipe = pipeline_kwargs(a, StreamingAPIHandler.fail_inflight)
    pipe.pop("pipeline_group", None)  # the provider takes it from mlx-lm's own lookup
    try:
        serve(a.host, a.port, cli_args_for_mlx_lm(a), {**load_kwargs(a), **pipe})
    except ServerStopped as e:  # the log above has the cause: one message, no traceback
        raise SystemExit(f"mlx_streaming serve: error: {e}") from None
    # stopped (Ctrl-C), the server and its generation thread ended: exit now, without
    # the interpreter's teardown, which after a served request aborted 3 times in 4 in
    # MLX's C++ (std::terminate: "terminate called without an active exception", MLX
    # 0.32 on Linux, status -6 where 0 is meant)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
