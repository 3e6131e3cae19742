"""The OpenAI-compatible server (mlx-lm's, over a streamed model), driven by the openai
client, streaming and not: its text equals offline generation with the same settings."""

from __future__ import annotations

import pytest
from mlx_lm import generate, load
from serving import get, health_under_load, running_server

from mlx_streaming.synthetic.build import CHAT_TEMPLATE

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Why do experts stream from disk?"}]
PROMPT = "The expert pool holds"
MAX_TOKENS = 24
# the test model's own template, with each tool's JSON before the messages (its own
# renders no tools): the same prompt as the model's when a request has no tools
TOOLS_TEMPLATE = (
    "{% for t in tools or [] %}<|im_start|>tool\n{{ t | tojson }}<|im_end|>\n{% endfor %}"
    + CHAT_TEMPLATE
)


@pytest.fixture(scope="module")
def server(models):
    ck, ed = models.experts("tiny-qwen3_next")
    with running_server(ck, ed, 6, extra=["--chat-template", TOOLS_TEMPLATE]) as (base, port):
        yield ck, base, port


def post_chat(base: str, body: dict) -> tuple[int, bytes]:
    """A /v1/chat/completions request's status and body, an HTTP error's included."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        base + "/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def offline(ck, prompt):
    model, tok = load(str(ck))
    return generate(model, tok, prompt, max_tokens=MAX_TOKENS)


def test_chat_completions(server):
    ck, base, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    _, tok = load(str(ck))
    want = offline(
        ck, tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    )
    r = client.chat.completions.create(
        model="default_model", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0
    )
    assert r.choices[0].message.content == want
    chunks = client.chat.completions.create(
        model="default_model",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_completions(server):
    ck, base, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    want = offline(ck, PROMPT)
    r = client.completions.create(
        model="default_model", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0
    )
    assert r.choices[0].text == want
    chunks = client.completions.create(
        model="default_model", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want


def test_models_health_and_queue(server):
    ck, base, port = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    assert any(m.id == str(ck.resolve()) for m in client.models.list().data)
    r = client.completions.create(  # the id it lists is one it serves
        model=str(ck.resolve()), prompt=PROMPT, max_tokens=2, temperature=0.0
    )
    assert r.choices[0].text is not None
    status, headers, body = get(base + "/health")
    assert status == 200 and body["status"] == "ok"
    assert body["queue_depth"] == 0 and body["concurrency"] == 1
    assert 0 <= body["experts"]["hit_rate"] <= 1 and body["experts"]["bytes_read"] > 0
    assert headers["X-Queue-Depth"] == "0"


def test_failing_request_gets_an_error_and_the_server_keeps_serving(models, tmp_path):
    import shutil

    from mlx_streaming.core.meta import load_meta

    ck, src = models.experts("tiny-qwen3_moe")
    ed = tmp_path / "experts"
    shutil.copytree(src, ed)
    meta = load_meta(ed)
    with running_server(ck, ed, 4) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        originals = {li: meta.file(li).read_bytes() for li in meta.layers}
        for li, lay in meta.layers.items():  # every record fails its checksum
            data = bytearray(originals[li])
            for e in range(lay.num_experts):
                data[e * lay.stride + 5] ^= 0xFF
            meta.file(li).write_bytes(bytes(data))
        # answered with the error, not a dropped connection (an APIConnectionError)
        with pytest.raises(openai.InternalServerError, match="ExpertChecksumError"):
            client.completions.create(model="default_model", prompt=PROMPT, max_tokens=8)
        assert get(base + "/health")[2]["status"] == "ok"
        with pytest.raises(openai.APIError, match="ExpertChecksumError"):  # a stream: an
            for _ in client.completions.create(  # error event, after its headers
                model="default_model", prompt=PROMPT, max_tokens=8, stream=True
            ):
                pass
        assert get(base + "/health")[2]["status"] == "ok"
        for li in meta.layers:  # repaired: the next request is served normally
            meta.file(li).write_bytes(originals[li])
        r = client.completions.create(
            model="default_model", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0
        )
        assert r.choices[0].text == offline(ck, PROMPT)


def test_health_polled_while_eight_clients_stream():
    """The trained model served to 8 concurrent streaming clients, 200 requests, while
    another client polls /health every 50 ms: every output equals stock mlx-lm's, no
    request fails, every poll answers (from the counters the generation thread publishes:
    it never touches MLX or the slot tables). ``tests/test_cuda.py`` runs it on CUDA."""
    health_under_load(200)


def test_serve_exits_when_the_model_cannot_load_or_the_port_is_taken(models, tmp_path):
    """Startup failures end the process with the reason (before: a model that failed to
    load left a server answering 404s, and a taken port a process that never exited)."""
    import socket
    import subprocess
    import sys

    from serving import free_port

    ck, ed = models.experts("tiny-qwen3_moe")
    serve = [sys.executable, "-m", "mlx_streaming", "serve", "--log-level", "WARNING"]
    r = subprocess.run(
        [*serve, "--model", str(tmp_path / "missing"), "--port", str(free_port())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "missing not found" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr  # checked before any thread starts
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # a model directory mlx-lm cannot load
    r = subprocess.run(
        [*serve, "--model", str(broken), "--port", str(free_port())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode != 0 and "could not be loaded" in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("Traceback") <= 1  # the loading thread's log only, no second
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [*serve, "--model", str(ck), "--expert-dir", str(ed), "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert r.returncode != 0 and "Address already in use" in r.stderr, r.stderr[-2000:]


def test_a_relative_model_name_and_its_listed_path_are_one_model(tmp_path, monkeypatch):
    """``serve --model qm`` lists ``/abs/path/qm`` in /v1/models; a request naming that
    id is the served model (before: refused as another model)."""
    from mlx_streaming.serve.provider import _same_model

    (tmp_path / "qm").mkdir()
    monkeypatch.chdir(tmp_path)
    assert _same_model(str((tmp_path / "qm").resolve()), "qm")
    assert not _same_model(str(tmp_path), "qm") and not _same_model("other", "qm")


def test_a_non_stream_request_whose_client_left_stops_generating(server):
    """A client asks for many tokens without streaming and leaves: the next request is
    not held behind the abandoned one's max_tokens (before: it waited for all of them)."""
    import json
    import socket
    import time
    import urllib.request

    _, base, port = server

    def post(body):
        req = urllib.request.Request(
            base + "/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        return urllib.request.urlopen(req, timeout=300).read()

    t0 = time.time()
    post({"prompt": PROMPT, "max_tokens": 100, "temperature": 0.0})
    per_100 = time.time() - t0
    s = socket.create_connection(("127.0.0.1", port))
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1500, "temperature": 0.0}).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    s.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    time.sleep(min(1.0, per_100))  # under way
    s.close()
    t1 = time.time()
    post({"prompt": PROMPT, "max_tokens": 3, "temperature": 0.0})
    assert time.time() - t1 < 5 * per_100  # the abandoned 1,500 tokens take ~15x that


def test_requests_past_max_queue_get_503(models):
    """``--max-queue N``: with the model busy and N requests waiting, the next gets an
    HTTP 503 at once (before: the queue grew without bound, a thread per request)."""
    import json
    import threading
    import time
    import urllib.error
    import urllib.request

    from serving import running_server

    ck, ed = models.experts("tiny-qwen3_moe")

    with running_server(ck, ed, 8, extra=["--max-queue", "1"]) as (base, _):

        def post(max_tokens):
            req = urllib.request.Request(
                base + "/v1/completions",
                json.dumps({"prompt": PROMPT, "max_tokens": max_tokens}).encode(),
                {"Content-Type": "application/json"},
            )
            return urllib.request.urlopen(req, timeout=300)

        def long_request():
            try:
                post(2000).read()  # seconds: the second waits meanwhile
            except OSError:  # the server stops at the end of the test
                pass

        busy = [threading.Thread(target=long_request, daemon=True) for _ in range(2)]
        busy[0].start()
        time.sleep(1)  # the first is taken by the model
        busy[1].start()
        t0 = time.time()  # the second waits
        while get(base + "/health")[2]["queue_depth"] < 1 and time.time() - t0 < 30:
            time.sleep(0.1)
        with pytest.raises(urllib.error.HTTPError) as e:
            post(3)
        assert e.value.code == 503 and "--max-queue 1" in e.value.read().decode()


def test_a_taken_port_is_refused_before_the_model_loads(tmp_path):
    """``serve`` binds its port first: a port in use ends the command at once with one
    clear message (before: after the whole load, a first split included)."""
    import socket
    import subprocess
    import sys
    import time

    from mlx_streaming.synthetic.train import trained_checkpoint

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    cmd = [sys.executable, "-m", "mlx_streaming", "serve", "--model", str(trained_checkpoint())]
    cmd += ["--expert-dir", str(tmp_path / "ed"), "--port", str(port)]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert r.returncode == 2 and "Address already in use" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "ed").exists()
    print(f"refused in {time.perf_counter() - t0:.1f} s")


def test_a_chat_past_the_context_is_refused_with_tools_and_template_kwargs(server):
    """A chat request (with tools and template arguments, which the check passes to the
    template as mlx-lm does) whose prompt and ``max_tokens`` run past the model's
    positions gets a 400 naming the counts; a short one with the same fields is served."""
    _, base, _ = server
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

    def post(content: str):
        body = {"messages": [{"role": "user", "content": content}], "tools": tools}
        body.update(max_tokens=4, chat_template_kwargs={"enable_thinking": False})
        return post_chat(base, body)

    status, data = post("word " * 40_000)
    assert status == 400 and b"exceed the model's context" in data, data[:300]
    status, data = post("Why do experts stream from disk?")
    assert status == 200, data[:300]


def test_a_chat_whose_tools_run_past_the_context_is_refused(server):
    """The context check counts the tools as the template renders them (the server's
    --chat-template writes each tool's JSON into the prompt): a chat whose messages fit
    the model's 8,192 positions but whose tools run past them gets a 400; the same
    request without tools is served."""
    import re

    _, base, _ = server
    long_doc = "word " * 3_000  # about 9,000 tokens once rendered
    tools = [{"type": "function", "function": {
        "name": "f", "description": long_doc, "parameters": {"type": "object"}}}]  # fmt: skip
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0.0}
    status, data = post_chat(base, {**body, "tools": tools})
    assert status == 400 and b"exceed the model's context of 8192" in data, data[:300]
    assert int(re.search(rb"the prompt \((\d+) tokens\)", data)[1]) > 8192
    status, data = post_chat(base, body)
    assert status == 200, data[:300]


def test_ctrl_c_during_the_first_split_ends_serve_and_the_next_run_completes_it(models, tmp_path):
    """Ctrl-C while ``serve`` splits a model's experts for the first time ends it at once
    (status 130, no traceback), leaving only whole layer files; the next run completes
    the split and serves. Before, the split ran on mlx-lm's generation thread, which is
    no daemon and takes no Ctrl-C: the process waited for the split to end. The split is
    held on layer 2 by that layer's lock, as while another process splits that layer into
    the same directory (``writer.LayerLocks``), so Ctrl-C lands mid-split every time.
    Meanwhile ``/health`` and a POST are answered 503 "loading" (before: left waiting)."""
    import fcntl
    import filecmp
    import json
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import time
    import urllib.error
    import urllib.request

    from serving import free_port

    from mlx_streaming.core.format import META_NAME
    from mlx_streaming.core.meta import load_meta

    ck, ref = models.experts("tiny-qwen3_moe")  # MoE layers 1-3
    ed = tmp_path / "experts"
    ed.mkdir()
    lock = os.open(ed / ".split.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.lockf(lock, fcntl.LOCK_EX, 1, 2)  # layer 2's byte, as LayerLocks.hold takes it
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_streaming", "serve", "--model", str(ck)]
    cmd += ["--expert-dir", str(ed), "--port", str(port), "--log-level", "WARNING"]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 120
            while not (ed / "layer_001.json").exists():  # layer 1 done: now waits on 2
                assert proc.poll() is None and time.time() < deadline, "no split under way"
                time.sleep(0.05)
            time.sleep(0.5)
            for url, data in (
                (f"http://127.0.0.1:{port}/health", None),
                (f"http://127.0.0.1:{port}/v1/completions", b'{"prompt": "x"}'),
            ):
                with pytest.raises(urllib.error.HTTPError) as e:  # fmt: skip
                    urllib.request.urlopen(url, data, timeout=5)  # answered, not left waiting
                assert e.value.code == 503 and e.value.headers["Retry-After"] == "5"
                assert json.loads(e.value.read())["status"] == "loading"
            proc.send_signal(signal.SIGINT)
            t0 = time.time()
            rc = proc.wait(timeout=15)
            took = time.time() - t0
        finally:
            os.close(lock)  # releases layer 2
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log.seek(0)
        out = log.read()
    assert rc == 130 and "mlx_streaming serve: interrupted" in out, out[-3000:]
    assert "Traceback" not in out and took < 5, (took, out[-3000:])
    assert not (ed / META_NAME).exists()  # never taken for a complete directory
    assert sorted(p.name for p in ed.glob("layer_*.bin")) == ["layer_001.bin"]
    assert filecmp.cmp(ed / "layer_001.bin", ref / "layer_001.bin", shallow=False)
    with running_server(ck, ed, 4) as (base, _):
        r = openai.OpenAI(base_url=base + "/v1", api_key="none").completions.create(
            model="default_model", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0
        )
        assert r.choices[0].text == offline(ck, PROMPT)
    assert load_meta(ed).complete and not list(ed.glob("*.partial"))
    for f in sorted(p.name for p in ref.glob("layer_*.bin")):
        assert filecmp.cmp(ref / f, ed / f, shallow=False)


def test_a_chat_template_given_to_a_model_without_one_is_used(models, tmp_path):
    """``--chat-template`` on a model that ships none: chats are formatted with it (the
    tokenizer is built with it, as mlx-lm's provider does), not with mlx-lm's plain
    fallback for template-less tokenizers (before: it was set after the tokenizer was
    built, which had already decided it had no template)."""
    import json
    import shutil

    from transformers import AutoTokenizer

    ck, ed = models.experts("tiny-qwen3_moe")
    bare = tmp_path / "bare"
    shutil.copytree(ck, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = AutoTokenizer.from_pretrained(bare)
    assert tok.chat_template is None
    want = tok.apply_chat_template(
        MESSAGES, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    with running_server(bare, ed, 4, extra=["--chat-template", CHAT_TEMPLATE]) as (base, _):
        status, data = post_chat(base, {"messages": MESSAGES, "max_tokens": 2})
    assert status == 200, data[:300]
    assert json.loads(data)["usage"]["prompt_tokens"] == len(want)


def test_ctrl_c_while_a_long_request_generates_ends_serve_at_once(models):
    """Ctrl-C while a request generates: the request stops at its next token and
    ``serve`` ends, status 0, not once the request reaches its ``max_tokens`` (before:
    mlx-lm checks its stop flag only between requests), nor aborted in MLX's teardown
    (before: status -6 after a served request, 3 times in 4)."""
    import json
    import signal
    import subprocess
    import sys
    import tempfile
    import threading
    import time
    import urllib.request

    from serving import free_port, wait_healthy

    ck, ed = models.experts("tiny-qwen3_moe")
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_streaming", "serve", "--model", str(ck)]
    cmd += ["--expert-dir", str(ed), "--port", str(port), "--log-level", "WARNING"]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

        def output():
            log.seek(0)
            return log.read()

        def long_request():  # 8,000 tokens (its context: 8,192): about a minute here
            body = {"model": "default_model", "prompt": PROMPT, "max_tokens": 8_000}
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                json.dumps({**body, "stream": True}).encode(),
                {"Content-Type": "application/json"},
            )  # fmt: skip
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    for _ in r:
                        streaming.set()
            except OSError as e:
                errors.append(e)

        streaming, errors = threading.Event(), []
        try:
            wait_healthy(port, proc, output, 120)
            threading.Thread(target=long_request, daemon=True).start()
            assert streaming.wait(60), f"the request never started streaming: {errors}"
            time.sleep(1)  # generating
            proc.send_signal(signal.SIGINT)
            t0 = time.time()
            rc = proc.wait(timeout=30)
            took = time.time() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out = output()
    assert rc == 0 and "Traceback" not in out, (rc, out[-3000:])
    assert took < 10, (took, out[-3000:])


def test_a_request_whose_client_left_during_its_prompt_stops_prefilling(models):
    """A client sends a long prompt without streaming and leaves during its prefill: the
    prefill stops at its next chunk, and the next request is not held behind the rest of
    it (before: mlx-lm looked at the stop only between tokens, after the whole prompt)."""
    import json
    import socket
    import time
    import urllib.request

    from mlx_lm.utils import load_tokenizer

    ck, ed = models.experts("tiny-qwen3_moe")
    filler = " experts stream from disk when the pool is small."
    n = len(load_tokenizer(ck).encode(filler))
    prompts = [f"{w}{filler * (2000 // n)}" for w in ("One", "Two")]  # ~2,000 tokens each,
    # different from the first: no prompt-cache hit

    with running_server(ck, ed, 4, extra=["--prefill-step-size", "8"]) as (base, port):

        def post(prompt):
            req = urllib.request.Request(
                base + "/v1/completions",
                json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0.0}).encode(),
                {"Content-Type": "application/json"},
            )  # fmt: skip
            return urllib.request.urlopen(req, timeout=300).read()

        t0 = time.time()
        post(prompts[0])
        whole = time.time() - t0  # the whole prefill, in chunks of 8
        s = socket.create_connection(("127.0.0.1", port))
        body = json.dumps({"prompt": prompts[1], "max_tokens": 1}).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        s.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(whole / 5)  # its prefill under way
        s.close()
        t1 = time.time()
        post("Hi")
        assert time.time() - t1 < whole / 2, (time.time() - t1, whole)


def test_a_client_that_half_closes_gets_no_answer_cut_short(server):
    """A client that sends its request and shuts its sending side (a half-close, which to
    the server looks like a client that left) is told its request stopped (a 503, or no
    answer if it is seen gone between tokens), rather than a 200 whose text was cut at
    the first token (before)."""
    import json
    import socket

    _, _, port = server
    body = json.dumps({"prompt": PROMPT, "max_tokens": 200, "temperature": 0.0}).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data == b"" or (data.startswith(b"HTTP/1.0 503") and b'"stopped"' in data), data
