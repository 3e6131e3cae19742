"""The server's response generator: mlx-lm's, which runs the model on its own thread,
one request at a time; here it also publishes the store's counters after each request,
arms a pipeline's peer watch while a request runs or is shared with the peers, and can
stop the request in flight, its prompt's prefill included.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import sys
import threading

from mlx_lm import server as mlx_server

_STOP = "mlx_streaming: the server stops"  # rank 0's last share: its peers stop too


class Abandoned(Exception):
    """A request stopped during its prompt (its client gone, or the server stopping)."""


class _Heard(mlx_server.GenerationContext):
    """mlx-lm's request context whose ``stop`` also sets its ``heard`` event."""

    def stop(self):
        self.heard.set()
        super().stop()


class _Responses:
    """A request's response queue as the generation thread fills it: a progress report of
    the prompt (one per prefill chunk) raises ``Abandoned`` once the request's context
    is stopped, so that a request nobody waits for does not run its whole prompt (mlx-lm
    looks at the stop only between tokens). mlx-lm answers the exception through the
    queue, as any failure."""

    def __init__(self, queue):
        self.queue, self.stopped = queue, threading.Event()

    def put(self, item):
        if isinstance(item, mlx_server.GenerationContext):
            item.heard = self.stopped  # its stop, heard here too (no reference cycle)
            item.__class__ = _Heard
        elif isinstance(item, tuple) and self.stopped.is_set():
            raise Abandoned("the request was stopped during its prompt")
        elif isinstance(item, Abandoned):  # its frames (this one's queue, which would
            item = item.with_traceback(None)  # hold it: a cycle) and the KV cache go
        self.queue.put(item)


class StreamingResponseGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's response generator; after each request, on its own thread (the one that
    runs the model), the store publishes its counters for ``/health`` to read. It keeps
    the requests' contexts, so that a stop ends the one generating at its next token, or
    at its prompt's next prefill chunk (``Abandoned``)."""

    def __init__(self, *a, **kw):
        # the latest requests' contexts (not weak-referenceable; served one at a time,
        # and stopping a finished one does nothing): before mlx-lm's thread starts
        self._contexts = collections.deque(maxlen=64)
        self._contexts_lock = threading.Lock()
        super().__init__(*a, **kw)

    def generate(self, *a, **kw):
        ctx, tokens = super().generate(*a, **kw)
        with self._contexts_lock:
            self._contexts.append(ctx)
        return ctx, tokens

    def follow(self) -> bool:
        """A pipeline follower's main thread: wait for the generation thread, which ends
        when rank 0 stops serving (its last share says so) or the peer watch ends the
        process; returns whether it ended so. Ctrl-C reaches every rank of a terminal's
        ``mlx.launch``: here it waits for rank 0's word (stopping alone would leave the
        ranks out of step); a second one exits at once. A handler, not
        ``KeyboardInterrupt``: an interrupted ``join`` may return while the thread runs."""
        pressed = []

        def on_sigint(signum, frame):
            if pressed:
                os._exit(130)
            pressed.append(signum)
            with contextlib.suppress(OSError):  # mlx.launch, gone on Ctrl-C, held stderr
                print("mlx_streaming serve: waiting for rank 0 to stop (Ctrl-C again: now)",
                      file=sys.stderr, flush=True)  # fmt: skip

        main = threading.current_thread() is threading.main_thread()  # where handlers go
        previous = signal.signal(signal.SIGINT, on_sigint) if main else None
        try:
            self.join()
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        return self._stop

    def stop_and_join(self, timeout: float | None = None) -> bool:
        """Stop serving: requests in flight end at their next token (off a pipeline,
        whose ranks must stay in step); wait for the thread up to ``timeout`` s.
        Returns whether it ended (it cannot stop mid-load)."""
        self._stop = True
        if self.model_provider.pipeline_group is None:
            with self._contexts_lock:
                contexts = list(self._contexts)
            for ctx in contexts:
                ctx.stop()
        self._generation_thread.join(timeout)
        with self._contexts_lock:  # nothing of a request outlives the server
            self._contexts.clear()
        return not self._generation_thread.is_alive()

    def _generate(self):
        try:
            super()._generate()
            if self._is_distributed and self._rank == 0:  # the server stops (not a failure):
                with self.model_provider.watch or contextlib.nullcontext():  # its peers too
                    super()._share_object(_STOP)
        finally:  # the server stops, or the load failed
            self.model_provider.unwatch()

    def _share_object(self, obj):
        got = super()._share_object(obj)
        if self._rank != 0 and got == _STOP:  # rank 0 stopped serving: so does this rank
            self._stop = True
            return None
        return got

    def _share_request(self, request):
        # a pipeline's rank 0, idle, shares "no request" with its peers every 0.1 s: a
        # silent peer would hang it there, and every request after; each share beats
        with self.model_provider.watch or contextlib.nullcontext():
            return super()._share_request(request)

    def _serve_single(self, request, stream):
        # a pipeline's watch is armed while the model runs a request, not while a client
        # sends or reads it (a slow client is no silent peer)
        responses, req, args = request
        try:
            with self.model_provider.watch or contextlib.nullcontext():
                return super()._serve_single((_Responses(responses), req, args), stream)
        finally:
            store = self.model_provider.store
            if store is not None:
                store.publish()
            limit = self.model_provider.cli_args.prompt_cache_bytes
            if limit is not None:  # mlx-lm trims by bytes only when it batches; we never do
                self.prompt_cache.trim_to(n_bytes=limit)


class Unstoppable:
    """A request's context whose ``stop`` does nothing (a pipeline's, see
    ``server.StreamingAPIHandler.handle_completion``)."""

    def __init__(self, ctx):
        self._ctx = ctx

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def stop(self):
        pass
