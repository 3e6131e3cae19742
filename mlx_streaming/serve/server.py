"""mlx-lm's OpenAI-compatible server over a streamed model.

No HTTP server of our own: ``StreamingModelProvider`` (``provider.py``) is mlx-lm's
``ModelProvider`` that loads through ``mlx_streaming.load``, and ``StreamingAPIHandler``
is mlx-lm's handler that also reports the request queue (``/health`` and an
``X-Queue-Depth`` header on every response) and the expert pools' counters. Requests run
one at a time (no batching) since they share one pool of expert slots.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import sys
import threading
import traceback

import mlx.core as mx
from mlx_lm import server as mlx_server

from .generator import Abandoned, StreamingResponseGenerator, Unstoppable
from .loading import MAX_DISCARD, LoadingHandler
from .provider import StreamingModelProvider, split_first


class ServerStopped(RuntimeError):
    """The server stopped on its own: the message, or its threads' log, says why."""


class ClientGone(Exception):
    """A non-stream request's client closed its end (or half-closed it: the two look
    alike) while its tokens were generated."""


STOP_S = 10  # on Ctrl-C, how long the generation thread is given to stop


class StreamingAPIHandler(mlx_server.APIHandler):
    """mlx-lm's API handler, plus the queue depth and the pools' counters; in a pipeline,
    a request in flight when a peer stops answering gets an HTTP 503 (``fail_inflight``)
    before the server exits."""

    inflight: set = set()  # handlers of POST requests being served
    lock = threading.Lock()

    def do_POST(self):
        self._headers_sent = self._status_sent = False
        limit = getattr(self.response_generator.model_provider.cli_args, "max_queue", None)
        with self.lock:  # admitted under the lock: requests arriving together count
            # every POST in flight: the one generating, those queued, and those still
            # reading their body or waiting for the model's load (mlx-lm's queue has
            # only the second)
            waiting = max(0, len(self.inflight) - 1)
            full = limit is not None and waiting >= limit
            if not full:
                self.inflight.add(self)
        if full:  # back-pressure, not a pile; the body read first (unread, the close
            # would reset the connection before the client reads the 503)
            n = int(self.headers.get("Content-Length") or 0)
            if n <= MAX_DISCARD:
                self.rfile.read(n)
            self.answer_error(
                503, f"{waiting} requests wait already (--max-queue {limit}); retry later",
                "overloaded",
            )  # fmt: skip
            return
        try:
            super().do_POST()
        finally:
            with self.lock:
                self.inflight.discard(self)

    def handle_completion(self, request, stop_words):
        """mlx-lm's (``_completion``); a generation that fails (an expert that cannot be
        read, an MLX error) is answered: a 500 naming the error, or on a stream already
        started an error event and its end. mlx-lm re-raises it in the handler, which
        dropped the connection."""
        try:
            return self._completion(request, stop_words)
        except OSError:
            raise  # the client has gone: there is no one to answer
        except ClientGone:  # or it half-closed: it gets no answer rather than a cut one
            self.discard_unsent_headers()
            self.close_connection = True
        except Abandoned as e:  # stopped during its prompt: the client left, or we stop
            with contextlib.suppress(OSError):
                self.answer_error(503, f"{e} (the client left, or the server stops)", "stopped")
        except Exception as e:  # noqa: BLE001 - answered, and shown to the operator
            traceback.print_exc()
            message = f"generation failed: {type(e).__name__}: {e}"
            self.answer_error(500, message, "server_error")

    def _completion(self, request, stop_words):
        """mlx-lm's; a non-stream request whose client has gone stops generating at the
        next token, or during its prompt at the next prefill chunk (it ran to max_tokens,
        holding the one generation slot). A stream finds out by itself: its next write
        (a token, or the prompt's keep-alive) fails. In a pipeline nothing stops a
        request (mlx-lm raises there, in its generation thread, which ended rank 0's
        server): the ranks stay in step, and the tokens left run to ``max_tokens``."""
        gen, handler = self.response_generator, self
        pipeline = mx.distributed.init().size() > 1  # as mlx-lm tells (its _is_distributed)
        if self.stream and not pipeline:
            return super().handle_completion(request, stop_words)

        def until_gone(ctx, tokens):  # the token stream, ended when the client has gone
            for t in tokens:
                if handler._client_gone():
                    ctx.stop()
                    raise ClientGone  # no 200 with the text cut short
                yield t

        class Wrapped:  # the generator, its context or its token stream wrapped
            def __getattr__(self, name):
                return getattr(gen, name)

            def generate(self, *a, **kw):
                if pipeline:
                    ctx, tokens = gen.generate(*a, **kw)
                    return Unstoppable(ctx), tokens
                seen, given = [], kw.get("progress_callback")

                def progress(done, total):  # each prefill chunk: has the client gone?
                    if given is not None:
                        given(done, total)
                    if seen and handler._client_gone():
                        seen[0].stop()  # the prompt stops at its next chunk

                ctx, tokens = gen.generate(*a, **{**kw, "progress_callback": progress})
                seen.append(ctx)
                return ctx, until_gone(ctx, tokens)

        self.response_generator = Wrapped()
        try:
            return super().handle_completion(request, stop_words)
        finally:
            self.response_generator = gen

    def _client_gone(self) -> bool:
        """Whether the client closed its end (readable, and nothing to read; by
        ``poll``: ``select`` fails on descriptors past 1023)."""
        try:
            p = select.poll()
            p.register(self.connection, select.POLLIN)
            readable = bool(p.poll(0))
            return readable and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def answer_error(self, status: int, message: str, kind: str) -> None:
        """Answer with an error: ``status`` and an OpenAI error body, or on a stream
        whose headers are out an error event, then its end."""
        body = {"error": {"message": message, "type": kind}}
        if getattr(self, "_headers_sent", False):
            self.wfile.write(f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode())
            self.wfile.flush()
        else:  # a status line still buffered (not sent) gives way
            self.discard_unsent_headers()
            self.reply(status, body)

    def discard_unsent_headers(self) -> None:
        """Drop a status line and headers buffered but not yet sent."""
        if self._status_sent and not self._headers_sent:
            self._headers_buffer = []

    def send_response(self, *a, **kw):
        self._status_sent = True  # buffered until end_headers
        super().send_response(*a, **kw)

    @classmethod
    def fail_inflight(cls, message: str) -> None:
        """Answer every request in flight with the error (a 503, or an error event on a
        stream already started)."""
        with cls.lock:
            handlers = list(cls.inflight)
        for h in handlers:
            try:
                h.connection.settimeout(5)
                h.answer_error(503, message, "peer_silent")
            except OSError:
                pass

    def _queue_depth(self) -> int:
        return self.response_generator.requests.qsize()

    def validate_model_parameters(self) -> None:
        """mlx-lm's checks, and the context: a prompt that with ``max_tokens`` would run
        past the model's positions is refused with a 400 naming the counts (mlx-lm would
        compute it, for long, past what the model was made for)."""
        super().validate_model_parameters()
        gen = self.response_generator
        provider = gen.model_provider
        # /health answers while the generation thread loads the model: a request then
        # waits for the tokenizer and context (else it went unchecked)
        while not provider.loaded.wait(0.5):
            if not gen.generation_available():
                return  # the load failed: the server stops
        limit, tok = provider.context_tokens, provider.tokenizer
        if not limit or tok is None:
            return
        try:
            if "messages" in self.body:  # the template as mlx-lm applies it: its tools
                kwargs = {**provider.cli_args.chat_template_args}  # and template arguments
                kwargs.update(self.body.get("chat_template_kwargs") or {})
                ids = tok.apply_chat_template(
                    self.body["messages"],
                    add_generation_prompt=True,
                    tools=self.body.get("tools"),
                    **{**kwargs, "tokenize": True},
                )
                n = len(ids)
            elif isinstance(self.body.get("prompt"), str):
                n = len(tok.encode(self.body["prompt"]))
            else:
                return  # mlx-lm words the error of a malformed request
        except Exception:  # noqa: BLE001 - likewise
            return
        if n + int(self.max_tokens) > limit:
            raise ValueError(
                f"the prompt ({n} tokens) and max_tokens ({self.max_tokens}) exceed the "
                f"model's context of {limit} tokens: shorten the prompt or lower max_tokens"
            )

    def end_headers(self):
        """Every response reports the request queue's depth."""
        self.send_header("X-Queue-Depth", str(self._queue_depth()))
        super().end_headers()
        self._headers_sent = True

    def handle_models_request(self):
        """The served model (mlx-lm's version also scans the Hugging Face cache, and
        fails where there is none)."""
        from pathlib import Path

        model = self.response_generator.cli_args.model
        p = Path(model)
        ids = [str(p.resolve()) if p.exists() else model, "default_model"]
        body = {
            "object": "list",
            "data": [{"id": i, "object": "model", "created": self.created} for i in ids],
        }
        self.reply(200, body)

    def handle_health_check(self):
        healthy = self.response_generator.is_healthy
        provider = self.response_generator.model_provider
        loading = healthy and not provider.loaded.is_set()  # requests wait meanwhile
        body = {
            "status": "loading" if loading else "ok" if healthy else "unavailable",
            "queue_depth": self._queue_depth(),
            "concurrency": 1,
        }
        store = getattr(provider, "store", None)
        if store is not None and provider.loaded.is_set():  # as published after the last
            # request (no MLX, no tables); not while a load sets the store, then its plan
            t = store.snapshot()
            body["experts"] = {
                "hit_rate": round(t.get("hit_rate", 0.0), 4),
                "bytes_read": t.get("bytes_read", 0),
                "pool_gb": round(t.get("pool_bytes", 0) / 1e9, 3),
            }
            body["memory"] = self._memory(provider)
        self.reply(200 if healthy and not loading else 503, body)

    def _memory(self, provider) -> dict:
        """Bytes: the process's peak RSS over its RSS before the model was loaded, MLX's
        peak, and what the budget accounts for (trunk, pools, MLX's buffer-cache cap, the
        prompt cache's KV)."""
        from ..core.mem import peak_rss_bytes, rss_bytes

        plan = provider.memory
        return {
            "rss": rss_bytes() - provider.baseline_rss,
            "peak_rss": peak_rss_bytes() - provider.baseline_rss,
            "mlx_peak": mx.get_peak_memory(),
            "trunk": plan.trunk_bytes,
            "pools": plan.pool_bytes,
            "cache_cap": plan.cache_limit_bytes,
            "prompt_cache_kv": self.response_generator.prompt_cache.nbytes,
        }

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        # mlx-lm's own JSON response start (status, content type, CORS): the one place
        # this module leans on the handler's internals
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()


def serve(host: str, port: int, cli_args, load_kwargs: dict) -> None:
    """Run mlx-lm's server with the streamed model until interrupted.

    As in ``mlx_lm.server.run``: its response generator loads the model on its own
    thread (MLX streams are per thread) and serves one request at a time; the HTTP side
    is the standard library's threading server with mlx-lm's handler, extended. In a
    pipeline (``cli_args.pipeline`` under ``mlx.launch``) only rank 0 serves HTTP; the
    generator shares each request with the other ranks, which run their layers. There,
    with ``load_kwargs["pipeline_watch"]`` (a ``peers.PeerWatch`` of the group), every
    rank is bounded from its load's exchanges until its generation thread ends: one whose
    peer stops answering for the watch's time exits (code ``peers.EXIT_PEER_SILENT``),
    naming it, rank 0 after answering the requests in flight with an HTTP 503 (the
    watch's ``on_silence``).

    Off a pipeline, a model not yet split is split here, on the calling thread, before
    the generator starts: Ctrl-C stops it there (mlx-lm's generation thread, which loads
    the model, is no daemon and takes no KeyboardInterrupt). A pipeline's ranks split
    their own layers as they load. Until the model is loaded, ``/health`` answers 503
    ``{"status": "loading"}``; during the split every request does (``LoadingHandler``),
    during the load POSTs wait for it.
    """
    from http.server import ThreadingHTTPServer

    provider = StreamingModelProvider(cli_args, load_kwargs)
    follower = provider.pipeline_group is not None and provider.pipeline_group.rank() != 0
    httpd = http = None
    made = []  # the generator, once made: until then every request is told to wait

    def handler(*a, **kw):
        if not made:
            return LoadingHandler(*a, **kw)
        return StreamingAPIHandler(made[0], *a, system_fingerprint=fingerprint, **kw)

    if not follower:  # bind first: a taken port is refused before the model loads
        fingerprint = mlx_server.get_system_fingerprint()
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        server_class = type("Server", (ThreadingHTTPServer,), {"address_family": info[0][0]})
        httpd = server_class(info[0][4][:2], handler)  # IPv4 or IPv6, as the host resolves
        http = threading.Thread(target=httpd.serve_forever, name="http", daemon=True)
        http.start()  # answers "loading" during the split
    try:
        if provider.pipeline_group is None:
            try:
                split_first(cli_args.model, load_kwargs.get("expert_dir"))
            except Exception as e:  # as a load on the generation thread would end (not ^C)
                msg = f"the model could not be loaded ({cli_args.model}): {e}"
                raise ServerStopped(msg) from e
        generator = StreamingResponseGenerator(
            provider, mlx_server.LRUPromptCache(cli_args.prompt_cache_size)
        )
        made.append(generator)
    except BaseException:
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        raise
    if follower:  # runs rank 0's requests on its own layers until rank 0 stops serving
        if not generator.follow():  # its thread ended otherwise: the load failed, or it died
            raise ServerStopped("this rank's generation thread stopped: see the log above")
        return
    try:  # the generator's thread loads the model, then serves: if it dies, so do we
        while generator.generation_available() and http.is_alive():
            http.join(timeout=0.5)
        if http.is_alive():
            raise ServerStopped(
                f"the model could not be loaded, or its generation thread died "
                f"({cli_args.model}): see the log above; the server stops"
            )
        raise ServerStopped("the HTTP server's thread stopped: see the log above")
    except KeyboardInterrupt:  # the server's way to stop: a clean exit
        pass
    finally:
        httpd.shutdown()
        httpd.server_close()
        if not generator.stop_and_join(timeout=STOP_S):  # a load under way: no waiting
            print(  # for it (mlx-lm's thread is no daemon: the interpreter would)
                f"mlx_streaming serve: the generation thread did not stop within {STOP_S} "
                "s (a model load, or a pipeline's request, under way); exiting", file=sys.stderr, flush=True,
            )  # fmt: skip
            os._exit(130)
