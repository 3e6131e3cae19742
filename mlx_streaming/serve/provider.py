"""The served model: which one (only the model the server was started with) and how it
loads, with its experts streamed from disk (mlx-lm's ``ModelProvider``, loading through
``mlx_streaming.load``), and its first split, done before the server's threads start."""

from __future__ import annotations

import contextlib
import gc
import threading

import mlx.core as mx
from mlx_lm import server as mlx_server


def _same_model(a, b) -> bool:
    """Whether two model names are one local directory (or the same name)."""
    from pathlib import Path

    if a == b:
        return True
    pa, pb = Path(str(a)), Path(str(b))
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


class StreamingModelProvider(mlx_server.ModelProvider):
    """Loads the served model with its experts streamed from disk. Only that model is
    served: its expert directory belongs to it."""

    def __init__(self, cli_args, load_kwargs: dict):
        super().__init__(cli_args)
        self.load_kwargs = load_kwargs
        self.store = None
        self.memory = None  # the loaded model's memory plan
        self.context_tokens = None  # positions the loaded model was made for
        # a pipeline's watch: the load arms it around its exchanges and beats it on
        # every layer call of the store
        self.watch = load_kwargs.get("pipeline_watch")
        self.loaded = threading.Event()  # set once the generation thread loaded the model
        self._armed = contextlib.ExitStack()  # the watch, from the load to the thread's end
        cfg = load_kwargs.get("config")
        self.cache_limit_gb = load_kwargs.get("cache_limit_gb", cfg and cfg.cache_limit_gb)
        from ..core.mem import rss_bytes

        self.baseline_rss = rss_bytes()  # before the model is loaded

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        """The served model and tokenizer (mlx-lm's server asks for them per request)."""
        if model_path in ("default_model", None) or _same_model(model_path, self.cli_args.model):
            model_path = self.cli_args.model  # e.g. the resolved path /v1/models lists
        if model_path != self.cli_args.model:
            raise ValueError(
                f"this server streams {self.cli_args.model}; it cannot load {model_path}"
            )
        if adapter_path is not None or draft_model_path not in (None, "default_model"):
            raise ValueError("adapters and draft models are not supported with streamed experts")
        if self.model is None:
            self._load_streamed(model_path)
        return self.model, self.tokenizer

    def _load_streamed(self, model_path) -> None:
        from ..model_builder import load, memory_plan

        self.loaded.clear()
        if self.store is not None:
            self.store.close()
        self.reset()
        self.store = None
        gc.collect()
        mx.clear_cache()
        # mlx-lm's provider sets pipeline_group from the launched group and --pipeline
        template = getattr(self.cli_args, "chat_template", None)  # as mlx-lm's provider:
        model, tokenizer, store = load(  # the tokenizer built with it (its tool parser too)
            model_path, **self.load_kwargs, pipeline_group=self.pipeline_group,
            tokenizer_config={"chat_template": template} if template else None,
        )  # fmt: skip
        if (
            not template
            and self.cli_args.use_default_chat_template
            and tokenizer.chat_template is None
        ):
            default = getattr(tokenizer, "default_chat_template", None)
            if default is None:  # transformers 5 dropped it
                store.close()
                raise ValueError(
                    f"--use-default-chat-template: this tokenizer ({model_path}) has no "
                    "default chat template; give one with --chat-template"
                )
            tokenizer.chat_template = default
            tokenizer.has_chat_template = True  # else mlx-lm formats chats without it
        self.model_key = (model_path, None, None)
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.memory = memory_plan(model, store, self.cache_limit_gb)
        args = model.args if isinstance(model.args, dict) else vars(model.args)
        self.context_tokens = args.get("max_position_embeddings")
        store.publish()  # what /health reports until the first request ends
        self.processor = None
        self.draft_model = None
        self.is_batchable = False  # one request at a time: they share the expert pools
        if self.watch is not None:
            # from here mlx-lm's thread shares with its peers outside any request (a seed,
            # then "no request" every 0.1 s): armed until the thread ends (``unwatch``)
            self._armed.enter_context(self.watch)
        self.loaded.set()

    def unwatch(self) -> None:
        """Disarm the watch the load armed (the generation thread is ending)."""
        self._armed.close()


def split_first(model: str, expert_dir=None) -> None:
    """Split ``model``'s experts into the directory ``load`` will read, unless done."""
    from ..model_builder import expert_dir_for
    from ..prep.hub import resolve_model_path
    from ..prep.split_experts import ensure_split

    ensure_split(resolve_model_path(model), expert_dir_for(model, expert_dir))
