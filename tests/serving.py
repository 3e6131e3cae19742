"""A served model for the tests, over plain HTTP (no client package, so that the CUDA
suite runs these cases on a machine without one): ``serve`` in a subprocess, a streaming
completion read as server-sent events, and the /health-under-load case."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
from mlx_lm import generate, load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, dict(r.headers), json.loads(r.read())


@contextlib.contextmanager
def running_server(ck, ed, slots: int, extra=()):
    """``serve`` in a subprocess (``extra``: more flags), healthy: yields ``(base url,
    port)``."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_streaming", "serve", "--model", str(ck)]
    cmd += ["--expert-dir", str(ed), "--slots", str(slots), "--port", str(port), *extra]
    log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would block it
    proc = subprocess.Popen(
        [*cmd, "--log-level", "WARNING"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    base = f"http://127.0.0.1:{port}"

    def output():
        log.seek(0)
        return log.read()

    try:
        wait_healthy(port, proc, output, 60)
        yield base, port
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def wait_healthy(port: int, proc, output, timeout: float = 120) -> None:
    """Wait until the server on ``port`` answers /health with 200; fail with its
    ``output()`` if ``proc`` (its process, or rank 0's) exits first or ``timeout`` s pass."""
    deadline = time.time() + timeout
    while True:
        try:
            if get(f"http://127.0.0.1:{port}/health")[0] == 200:
                return
        except OSError:
            pass
        if proc.poll() is not None:
            pytest.fail(f"the server exited before it was healthy:\n{output()[-3000:]}")
        if time.time() > deadline:
            pytest.fail(f"the server was not healthy within {timeout} s:\n{output()[-3000:]}")
        time.sleep(0.3)


def stream_completion(base: str, prompt: str, max_tokens: int) -> str:
    """A greedy streaming /v1/completions request's text, read event by event."""
    body = {"model": "default_model", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True}  # fmt: skip
    req = urllib.request.Request(
        base + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    text, done = "", False
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200, r.status
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                done = True
                break
            text += json.loads(data)["choices"][0]["text"]
    assert done, f"the stream for {prompt!r} ended without [DONE]"
    return text


def health_under_load(requests: int) -> None:
    """The body of ``test_health_polled_while_eight_clients_stream``."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from mlx_streaming.synthetic.train import trained_checkpoint

    ck = trained_checkpoint()
    prompts = ["def parse(args):\n", "import os\n\n\nclass ", "    for key, value in ",
               "# Copyright", "def test_", "    return self.", "try:\n    import "]  # fmt: skip
    model, tok = load(str(ck))
    want = {p: generate(model, tok, p, max_tokens=8) for p in prompts}
    with tempfile.TemporaryDirectory() as ed, running_server(ck, ed, 32) as (base, _):
        stop, polls, bad = threading.Event(), [], []

        def poll():
            while not stop.is_set():
                status, _, body = get(base + "/health")
                polls.append(body)
                if status != 200 or body["status"] != "ok":
                    bad.append(body)
                time.sleep(0.05)

        def ask(i):
            p = prompts[i % len(prompts)]
            return p, stream_completion(base, p, 8)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(ask, range(requests)))
        finally:
            stop.set()
            poller.join()
    assert len(got) == requests and all(text == want[p] for p, text in got)
    assert not bad and len(polls) > 20
    assert polls[-1]["experts"]["bytes_read"] > 0  # published by the generation thread
