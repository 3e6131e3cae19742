"""A streamed model pipelined over local ``ring`` ranks (``mlx.launch``, 127.0.0.1 only)
gives the tokens and logits of one stock mlx-lm process; a lost or absent peer and
mismatched models or expert directories end every rank with a clear error, in bounded
time."""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from serving import wait_healthy

from mlx_streaming.analysis.verify import greedy_trace

RANK_SCRIPT = Path(__file__).with_name("pipeline_rank.py")
STOP_SCRIPT = Path(__file__).with_name("stop_rank.py")  # rank 1 held up in its load
LAUNCH = Path(sys.executable).with_name("mlx.launch")
PROMPT = (
    "A mixture of experts model routes each token to a few experts out of many; "
    "the rest stay on disk until they are needed."
)
TOKENS, PREFILL = 8, 4  # the prompt spans several prefill chunks


def free_ports(n: int) -> int:
    """A base port with ``n`` free ports after it on 127.0.0.1."""
    for _ in range(50):
        base = random.randrange(20000, 60000)
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def run_session(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own; when it ends, fails or times out, whatever it
    started (mlx.launch's ranks) is killed with it, so no rank outlives its test."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        _killpg(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)  # SIGKILL: ends stopped and hung processes too
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def launch(n: int, out: Path, *args: str, timeout: float = 240) -> float:
    """Run ``n`` ranks of the rank script; returns the wall time."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(LAUNCH), "--backend", "ring", "-n", str(n), "-p", str(free_ports(n))]
    cmd += ["--", sys.executable, str(RANK_SCRIPT), "--out", str(out), *args]
    t0 = time.perf_counter()
    r = run_session(cmd, timeout)
    (out / "launch.log").write_text(r.stdout + r.stderr)
    return time.perf_counter() - t0


def spawn(n: int, out: Path, *args: str, timeout: float = 120) -> tuple[float, list[int]]:
    """Start ``n`` ranks as mlx.launch does on one host, but without its habit of killing
    the other ranks when one fails (hosts apart have no such launcher): each rank must
    end on its own. Returns the wall time and the exit codes."""
    out.mkdir(parents=True, exist_ok=True)
    base = free_ports(n)
    hostfile = out / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(n)]))
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), "--out", str(out), *args],
            env={**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(r)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for r in range(n)
    ]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        _kill(procs)
    return time.perf_counter() - t0, codes


@functools.cache
def reference(ck: Path):
    model, tok = load(str(ck))
    ids = tok.encode(PROMPT)
    assert len(ids) > 2 * PREFILL
    return ids, greedy_trace(model, ids, TOKENS, PREFILL)


CASES = [
    ("tiny-qwen3_moe", 2, None),
    ("tiny-qwen3_moe", 3, "1,1,2"),
    ("tiny-qwen3_next", 2, None),
    ("tiny-qwen3_next", 3, "1,1,2"),
    ("tiny-deepseek_v3", 2, "1,3"),
    ("tiny-deepseek_v3", 3, "1,1,2"),
]


@pytest.mark.parametrize("preset,ranks,split", CASES)
def test_pipelined_stream_equals_stock(models, tmp_path, preset, ranks, split):
    ck = models.checkpoint(preset)
    ids, ref = reference(ck)
    meta = json.loads((models.experts(preset)[1] / "_split_meta.json").read_text())
    slots = meta["top_k"] + 1  # a pool smaller than the experts
    ed = tmp_path / "experts"  # one directory the ranks split into at once
    args = ["--model", str(ck), "--expert-dir", str(ed), "--slots", str(slots)]
    args += ["--prompt", ",".join(map(str, ids)), "--tokens", str(TOKENS)]
    args += ["--prefill", str(PREFILL)] + (["--split", split] if split else [])
    launch(ranks, tmp_path / "out", *args)
    log = (tmp_path / "out" / "launch.log").read_text()
    owned = []
    for r in range(ranks):
        f = tmp_path / "out" / f"rank{r}.npz"
        assert f.exists(), log
        d = np.load(f)
        assert d["tokens"].tolist() == ref.tokens, f"rank {r} tokens differ"
        assert np.array_equal(d["logits"], ref.logits), (
            f"rank {r} logits differ by {np.abs(d['logits'] - ref.logits).max()}"
        )
        assert d["layers"].tolist() == d["report_layers"].tolist()
        owned += d["layers"].tolist()
    # each rank streamed only its own layers; together, every MoE layer once
    assert sorted(owned) == meta["moe_layers"]
    done = json.loads((ed / "_split_meta.json").read_text())
    assert done["moe_layers"] == meta["moe_layers"] and "model_moe_layers" not in done
    assert not list(ed.glob("*.partial")) and not list(ed.glob("layer_*.json"))


@pytest.mark.skipif(mx.cuda.is_available(), reason="on CUDA the pools live in the GPU's own memory")
def test_ranks_on_one_host_split_its_memory(models, tmp_path):
    """Two ranks on this host with ``--budget-gb auto``: each plans its pools with half of
    the memory available (they count each other at load: ``parallel.ranks_on_this_host``),
    says so, and the pipeline streams exactly as stock."""
    import re

    from mlx_streaming.core.mem import machine_memory

    ck = models.checkpoint("tiny-qwen3_moe")
    ids, ref = reference(ck)
    alone = machine_memory()[1]
    args = ["--model", str(ck), "--expert-dir", str(tmp_path / "ed"), "--budget-gb", "auto"]
    launch(2, tmp_path / "out", *args, "--prompt", ",".join(map(str, ids)), "--tokens", "4")
    log = (tmp_path / "out" / "launch.log").read_text()
    lines = [x for x in log.splitlines() if "--budget-gb auto:" in x]
    assert len(lines) == 2 and all("(a share: 2 ranks on this host)" in x for x in lines), log
    for x in lines:
        available = float(re.search(r"= ([0-9.]+) GB available", x)[1]) * 1e9
        assert available < 0.6 * alone, (x, alone)
    for r in range(2):
        assert np.load(tmp_path / "out" / f"rank{r}.npz")["tokens"].tolist() == ref.tokens[:4]


def _args(ck, ed, ids):
    return ["--model", str(ck), "--expert-dir", str(ed), "--slots", "5"] + [
        "--prompt",
        ",".join(map(str, ids)),
        "--tokens",
        "4",
    ]


def test_dead_rank_ends_the_others(models, tmp_path):
    ck = models.checkpoint("tiny-qwen3_moe")
    ids, _ = reference(ck)
    wall, codes = spawn(2, tmp_path, *_args(ck, tmp_path / "ed", ids), "--die-after-load", "1")
    assert codes == [4, 5]
    assert "pipeline peer is gone" in (tmp_path / "rank0.err").read_text()
    assert not (tmp_path / "rank0.npz").exists()
    assert wall < 60


def test_absent_peer_ends_in_bounded_time(tmp_path):
    hostfile = tmp_path / "hosts.json"
    base = free_ports(2)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": "0"}
    # through the commands' own flags: the connect is bounded by --connect-timeout, apart
    # from the step's --pipeline-timeout (a short step bound no longer shortens the connect)
    code = (
        "import argparse; from mlx_streaming.commands._args import add_pipeline_args, "
        "pipeline_kwargs; p = argparse.ArgumentParser(); add_pipeline_args(p); "
        "pipeline_kwargs(p.parse_args(['--pipeline', '--connect-timeout', '3', "
        "'--pipeline-timeout', '1']))"
    )
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0
    assert "could not connect to its pipeline peers within 3 s" in r.stderr
    assert "--connect-timeout" in r.stderr
    assert 2.5 < time.perf_counter() - t0 < 30


def test_different_models_are_refused(models, tmp_path):
    a = models.checkpoint("tiny-qwen3_moe")
    b = models.checkpoint("tiny-qwen3_moe", seed=1)
    ids, _ = reference(a)
    (tmp_path / "m0").symlink_to(a)
    (tmp_path / "m1").symlink_to(b)
    _, codes = spawn(2, tmp_path, *_args(tmp_path / "m{rank}", tmp_path / "ed{rank}", ids))
    assert codes == [4, 4]
    for r in (0, 1):
        text = (tmp_path / f"rank{r}.err").read_text()
        assert "ranks [1] differ from rank 0 in model" in text


def test_different_expert_dirs_are_refused(models, tmp_path):
    a = models.checkpoint("tiny-qwen3_moe")
    _, other = models.experts("tiny-qwen3_moe", seed=1)
    ids, _ = reference(a)
    (tmp_path / "ed0").mkdir()
    (tmp_path / "ed1").symlink_to(other)
    _, codes = spawn(2, tmp_path, *_args(a, tmp_path / "ed{rank}", ids))
    assert codes == [4, 4]
    for r in (0, 1):
        text = (tmp_path / f"rank{r}.err").read_text()
        assert "ranks [1] differ from rank 0 in experts" in text


def test_a_rank_without_experts_is_refused(models, tmp_path):
    ck = models.checkpoint("tiny-qwen3_moe")  # layer 0 is dense
    ids, _ = reference(ck)
    _, codes = spawn(2, tmp_path, *_args(ck, tmp_path / "ed", ids), "--split", "3,1")
    assert codes == [4, 4]
    text = (tmp_path / "rank1.err").read_text()
    assert "hold no experts" in text and "--pipeline-split" in text
    assert "pipeline peer is gone" in (tmp_path / "rank0.err").read_text()


def _stock_text(ck: Path, prompt: str, tokens: int, chat: bool) -> str:
    from mlx_lm import generate

    model, tok = load(str(ck))
    if chat:
        msgs = [{"role": "user", "content": prompt}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return generate(model, tok, prompt, max_tokens=tokens, verbose=False)


def test_generate_command_under_launch(models, tmp_path):
    """The README's command: rank 0 prints stock mlx-lm's text; the other rank nothing."""
    ck = models.checkpoint("tiny-qwen3_moe")
    cmd = [str(LAUNCH), "--backend", "ring", "-n", "2", "-p", str(free_ports(2)), "--"]
    cmd += [sys.executable, "-m", "mlx_streaming", "generate", "--model", str(ck)]
    cmd += ["--expert-dir", str(tmp_path / "ed"), "--slots", "5", "--pipeline"]
    cmd += ["--prompt", PROMPT, "--max-tokens", "12", "--no-verbose"]
    r = run_session(cmd, timeout=240)
    assert r.stdout.strip() == _stock_text(ck, PROMPT, 12, chat=True).strip(), r.stderr


def _first_completion(port: int, tokens: int, proc, log: Path):
    """``(request, text)``: a greedy completion of ``PROMPT`` from the pipelined server on
    ``port``, asked again until it answers (it loads first); fails with its log if it
    does not within 120 s or its launcher exits."""
    import urllib.request

    body = json.dumps({"prompt": PROMPT, "max_tokens": tokens, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return req, json.loads(resp.read())["choices"][0]["text"]
        except OSError as e:
            if time.time() > deadline or proc.poll() is not None:
                raise AssertionError(f"no server ({e}): {log.read_text()[-3000:]}") from e
            time.sleep(0.5)


def _pipelined_server(ck, tmp_path, port: int, log: Path, rank: list[str], *extra: str):
    """``mlx.launch`` of 2 ranks of ``rank serve`` (``rank``: the command before
    ``serve``) on ``ck``, serving on ``port``, writing ``log``; in its own session."""
    cmd = [str(LAUNCH), "--backend", "ring", "-n", "2", "-p", str(free_ports(2)), "--", *rank]
    cmd += ["serve", "--model", str(ck), "--expert-dir", str(tmp_path / "ed"), "--slots", "5"]
    cmd += ["--pipeline", *extra, "--port", str(port)]
    return subprocess.Popen(
        cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def test_serve_under_launch(models, tmp_path):
    """Rank 0 serves HTTP; rank 1 runs its layers of every request."""
    import urllib.request

    ck = models.checkpoint("tiny-qwen3_moe")
    port, log = free_ports(1), tmp_path / "serve.log"
    proc = _pipelined_server(ck, tmp_path, port, log, [sys.executable, "-m", "mlx_streaming"])
    try:
        req, got = _first_completion(port, 12, proc, log)
        assert got == _stock_text(ck, PROMPT, 12, chat=False)
        # a streamed request whose client hangs up: the ranks finish it in step, and the
        # server serves on (before: mlx-lm's stop raised on rank 0, which ended the server)
        import socket

        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        hang = json.dumps({"prompt": PROMPT, "max_tokens": 24, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n" % len(hang) + hang)  # fmt: skip
        assert s.recv(64)
        s.close()
        with urllib.request.urlopen(req, timeout=120) as resp:
            again = json.loads(resp.read())["choices"][0]["text"]
        assert again == got and proc.poll() is None, log.read_text()[-3000:]
    finally:
        _killpg(proc)


def test_ctrl_c_stops_every_rank_of_a_pipelined_server(models, tmp_path):
    """A terminal's Ctrl-C (SIGINT to the launcher and every rank) stops the server:
    rank 0 tells its peers, which wait for its word, and every rank exits 0 (before:
    rank 1, left waiting in mlx-lm's share of the next request, aborted with -6)."""

    ck = models.checkpoint("tiny-qwen3_moe")
    port, codes, log = free_ports(1), tmp_path / "codes", tmp_path / "serve.log"
    rank = [sys.executable, str(Path(__file__).with_name("rank_code.py")), "--codes", str(codes)]
    proc = _pipelined_server(ck, tmp_path, port, log, rank, "--pipeline-timeout", "10")
    try:
        _, got = _first_completion(port, 6, proc, log)
        assert got == _stock_text(ck, PROMPT, 6, chat=False)
        os.killpg(proc.pid, signal.SIGINT)
        deadline = time.time() + 60
        while time.time() < deadline:
            lines = codes.read_text().splitlines() if codes.exists() else []
            if len(lines) == 2:
                break
            time.sleep(0.5)
        text = log.read_text()
        assert sorted(lines) == ["rank 0 rc 0", "rank 1 rc 0"], text[-3000:]
        assert "no answer within" not in text
    finally:
        _killpg(proc)


def test_plan_suggests_a_split(models):
    from mlx_lm import load as mlx_load

    from mlx_streaming.planning.pipeline import ModelBytes, suggest_split

    ck = models.checkpoint("dsv2-lite-cpu", num_layers=8)
    mb = ModelBytes.from_model(mlx_load(str(ck), lazy=True)[0])
    assert len(mb.kv) == 8 and all(b > 0 for b in mb.kv)
    total = mb.rank_bytes(range(8), 1.0, 0) + mb.rank_bytes([], 1.0, 0)  # two ranks
    even = suggest_split(mb, [total * 0.6 / 1e9] * 2, 0)
    assert even.share == 1.0 and sum(even.split) == 8 and abs(even.split[0] - 4) <= 1
    # a host with twice the memory takes about twice the layers
    big = suggest_split(mb, [total * 2 / 3e9, total / 3e9], 0)
    assert big.split[0] > big.split[1]
    for r in big.ranks:  # every rank's trunk and pools fit its host
        host = [total * 2 / 3e9, total / 3e9][r["rank"]]
        assert r["trunk_gb"] + r["pool_budget_gb"] <= host + 1e-3  # rounded to MB
    # half the memory: pools hold a smaller share, still within every host
    half = suggest_split(mb, [total / 4e9, total / 4e9], 0)
    assert 0 < half.share < 1
    with pytest.raises(ValueError, match="cannot hold this model"):
        suggest_split(mb, [mb.shared / 1e9, mb.shared / 1e9], 0)
    # a host with room for the dense layer 0 only, or for nothing: no split that load
    # would take (before: a rank of the dense layer alone, or of no layer at all)
    dense_only = (mb.shared + mb.trunk[0] + 1) / 1e9
    for small in (dense_only, mb.shared / 2e9):
        with pytest.raises(ValueError, match="every rank a MoE layer|cannot hold"):
            suggest_split(mb, [total / 1e9, small], 0)
    with pytest.raises(ValueError, match="positive size"):
        suggest_split(mb, [-1, 1], 0)


def test_a_split_keeps_room_for_what_load_adds_and_the_kv_cache(models):
    """The share a split promises fits each rank's pool budget once the margin, MLX's
    buffer-cache cap and the context's KV cache are taken (before: the packing counted
    trunk and pools only, so the printed share did not fit the printed budgets, and the
    KV cache was left out)."""
    import dataclasses
    import math

    from mlx_lm import load as mlx_load

    from mlx_streaming.planning.budget import MARGIN_BYTES, PoolShape, plan_budget
    from mlx_streaming.planning.pipeline import ModelBytes, suggest_split

    ck = models.checkpoint("dsv2-lite-cpu", num_layers=8)
    lazy = mlx_load(str(ck), lazy=True)[0]
    mb = ModelBytes.from_model(lazy)
    assert len(mb.kv) == len(lazy.layers) and all(b > 0 for b in mb.kv)
    experts = sum(mb.experts)
    shares = []
    for context, zero in ((0, False), (0, True), (2048, True)):
        mb = dataclasses.replace(mb, zero_slot=zero)  # the GPU backends' pools have one
        hosts = [(mb.shared + sum(mb.trunk) / 2 + experts / 4 + 2 * MARGIN_BYTES) / 1e9] * 2
        sp = suggest_split(mb, hosts, context)
        assert 0 < sp.share < 1 and sp.to_json()["context"] == context
        for r, n in zip(sp.ranks, sp.split):
            assert r["layers"][1] - r["layers"][0] + 1 == n
            moe = [i for i in range(r["layers"][0], r["layers"][1] + 1) if mb.experts[i]]
            # load, given the printed budget, plans at least the promised slots per layer
            shape = PoolShape(
                [mb.experts[i] // mb.num_experts[i] for i in moe],
                [mb.num_experts[i] for i in moe], mb.top_k, moe,
            )  # fmt: skip
            got = plan_budget(shape, r["pool_budget_gb"], zero_slot=zero).slots
            want = math.ceil(sp.share * mb.num_experts[moe[0]])
            assert min(got.values()) >= want, (context, zero, got, want)
        shares.append(sp.share)
    assert shares[2] < shares[1] < shares[0]  # the KV cache and the zero slots take room
    # a host that fits only once a layer is moved to it: the packing checks the taker
    # (before: the split was refused although a lower share fits)
    mb = dataclasses.replace(mb, zero_slot=False)
    small = mb.rank_bytes(range(7, 8), 0.0, 0) / 1e9 + 0.001
    sp = suggest_split(mb, [small, 1.0], 0)
    assert sp.split[0] >= 1 and sp.ranks[0]["moe_layers"] >= 1
    with pytest.raises(ValueError, match="cannot hold even one MoE layer.*give the small"):
        suggest_split(mb, [small - 0.002, 1.0], 0)  # before: "add memory or hosts"


def _start_ranks(
    n: int, out: Path, argv: list[str], script: Path | None = None
) -> list[subprocess.Popen]:
    """``n`` ranks of ``python -m mlx_streaming ARGV`` (or ``python SCRIPT ARGV``) on
    127.0.0.1, each in its own session (the caller kills them), output to
    OUT/rank<r>.out and .err."""
    base = free_ports(n)
    hostfile = out / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(n)]))
    return [
        subprocess.Popen(
            [sys.executable, *([str(script)] if script else ["-m", "mlx_streaming"]), *argv],
            env={**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(r)},
            stdout=open(out / f"rank{r}.out", "w"),
            stderr=open(out / f"rank{r}.err", "w"),
            start_new_session=True,
        )
        for r in range(n)
    ]


def _serving_ranks(models, tmp_path) -> tuple[list, int]:
    """``serve`` on two ranks (tiny-qwen3_moe, --pipeline-timeout 5), healthy: the
    processes and rank 0's port."""
    ck = models.checkpoint("tiny-qwen3_moe")
    port = free_ports(1)
    argv = ["serve", "--model", str(ck), "--expert-dir", str(tmp_path / "ed"), "--slots", "5"]
    argv += ["--pipeline", "--pipeline-timeout", "5", "--port", str(port)]
    procs = _start_ranks(2, tmp_path, argv)
    try:
        wait_healthy(port, procs[0], (tmp_path / "rank0.err").read_text)
    except BaseException:
        _kill(procs)
        raise
    return procs, port


def _kill(procs) -> None:
    for p in procs:
        _killpg(p)


LONG = 600  # tokens: the stock generation of this prompt runs them all (no end token)


def _stop_rank_1(procs, out: Path, started) -> tuple[int, float]:
    """Once ``started(rank 0's stdout, stderr)`` (within 120 s), SIGSTOP rank 1; rank 0's
    exit code and the seconds it took to exit."""
    deadline = time.time() + 120
    while not started((out / "rank0.out").read_text(), (out / "rank0.err").read_text()):
        assert time.time() < deadline and procs[0].poll() is None, (out / "rank0.err").read_text()
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGSTOP)
    t0 = time.time()
    code = procs[0].wait(timeout=60)
    waited = time.time() - t0
    print(f"the silent rank was detected in {waited:.1f} s")  # with -s
    return code, waited


def test_a_stopped_rank_ends_generate_in_bounded_time(models, tmp_path):
    """SIGSTOP one rank mid-generation: the other exits within --pipeline-timeout,
    naming it, instead of waiting forever."""
    ck = models.checkpoint("tiny-qwen3_moe")
    assert len(load(str(ck))[1].encode(_stock_text(ck, PROMPT, LONG, chat=True))) > LONG // 2
    argv = ["generate", "--model", str(ck), "--expert-dir", str(tmp_path / "ed")]
    argv += ["--slots", "5", "--pipeline", "--pipeline-timeout", "5", "--prompt", PROMPT]
    argv += ["--max-tokens", str(LONG)]
    procs = _start_ranks(2, tmp_path, argv)
    try:  # the header, then tokens
        code, waited = _stop_rank_1(procs, tmp_path, lambda o, e: len(o) >= 40)
    finally:
        _kill(procs)
    err = (tmp_path / "rank0.err").read_text()
    assert code == 6, err
    assert "rank 0: no answer within 5 s: rank 1" in err
    assert waited < 5 + 5  # the bound, plus the watch's polling and the exit


@pytest.mark.parametrize(
    "command,where",
    [("generate", "ensure_split"), ("generate", "load_trunk"), ("serve", "load_trunk")],
)
def test_a_rank_stopped_while_loading_ends_the_others(models, tmp_path, command, where):
    """SIGSTOP rank 1 as its load enters WHERE (before its split: rank 0 waits to check
    models and experts with it; before its trunk: rank 0 waits for every rank to have
    loaded): rank 0 exits within --pipeline-timeout, naming it (before: it waited for
    ever, generate silent, serve's /health "loading")."""
    ck = models.checkpoint("tiny-qwen3_moe")
    argv = [command, "--model", str(ck), "--expert-dir", str(tmp_path / "ed"), "--slots", "5"]
    argv += ["--pipeline", "--pipeline-timeout", "5"]
    argv += ["--port", str(free_ports(1))] if command == "serve" else ["--prompt", PROMPT]
    stopped = tmp_path / "stopped_at"
    held = ["--in", where, "--stop-file", str(stopped)]
    procs = _start_ranks(2, tmp_path, held + argv, script=STOP_SCRIPT)
    try:
        code = procs[0].wait(timeout=120)
        waited = time.time() - float(stopped.read_text())
        assert procs[1].poll() is None  # stopped, not dead: rank 0 heard nothing
    finally:
        _kill(procs)
    err = (tmp_path / "rank0.err").read_text()
    assert code == 6, err[-2000:]
    assert "rank 0: no answer within 5 s: rank 1" in err, err[-2000:]
    assert waited < 5 + 5


def test_a_rank_slower_to_load_is_waited_for(models, tmp_path):
    """Rank 1's load takes 10 s longer than rank 0's, working all along (its trunk in
    pieces of 0.25 s): with --pipeline-timeout 5, rank 0 waits for it (the ranks hear
    from each other between pieces), and the text is stock's."""
    ck = models.checkpoint("tiny-qwen3_moe")
    argv = ["generate", "--model", str(ck), "--expert-dir", str(tmp_path / "ed"), "--slots"]
    argv += ["5", "--pipeline", "--pipeline-timeout", "5", "--prompt", PROMPT]
    argv += ["--max-tokens", "12", "--no-verbose"]
    procs = _start_ranks(2, tmp_path, ["--in", "load_trunk", "--slow", "10"] + argv, STOP_SCRIPT)
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        _kill(procs)
    assert codes == [0, 0], (tmp_path / "rank0.err").read_text()[-2000:]
    text = (tmp_path / "rank0.out").read_text()
    assert text.strip() == _stock_text(ck, PROMPT, 12, chat=True).strip()


@pytest.mark.parametrize(
    "where,each,pieces,flags",
    [
        ("mlx_streaming.core.cache.readers:forget_pages", 4.5, 2,
         ["--swap-tier", "--pipeline-split", "1,3"]),  # rank 1: MoE layers 1 and 2
        ("mlx_streaming.core.selftest:check_case", 3, 3, ["--kernel-check"]),
    ],
    ids=["tier", "kernel"],
)  # fmt: skip
def test_a_rank_slower_to_open_its_store_is_waited_for(
    models, tmp_path, monkeypatch, where, each, pieces, flags
):
    """Rank 1 takes EACH s longer per layer of its swap tier's fill (2 layers), or per case
    of its kernel check (3: gate, up, down), 9 s in all but less than --pipeline-timeout 6
    per piece: rank 0 waits for it (the store's opening and the kernel check tick after
    each piece) and the text is stock's (before: these steps did not tick, and rank 0's
    watch ended it as "rank 1 stopped answering")."""
    monkeypatch.setenv("MLX_STREAMING_HOME", str(tmp_path / "home"))  # no kernel verdicts
    ck = models.checkpoint("tiny-qwen3_moe")
    argv = ["generate", "--model", str(ck), "--expert-dir", str(tmp_path / "ed"), "--slots"]
    argv += ["5", "--pipeline", "--pipeline-timeout", "6", "--prompt", PROMPT]
    argv += ["--max-tokens", "12", "--no-verbose"]
    held = ["--in", where, "--each", str(each)]
    procs = _start_ranks(2, tmp_path, held + argv + flags, STOP_SCRIPT)
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        _kill(procs)
    assert codes == [0, 0], (tmp_path / "rank0.err").read_text()[-2000:]
    assert (tmp_path / "rank1.err").read_text().count(f"{where} held") == pieces
    text = (tmp_path / "rank0.out").read_text()
    assert text.strip() == _stock_text(ck, PROMPT, 12, chat=True).strip()


@pytest.mark.parametrize("stream", [True, False])
def test_a_stopped_rank_fails_the_request_in_flight(models, tmp_path, stream):
    """serve under a pipeline: SIGSTOP the other rank while a completion is running; the
    client gets an error naming it (an error event on a stream; else a 503, where a 200
    once came with the 503 after it), and rank 0 exits."""
    import http.client

    procs, port = _serving_ranks(models, tmp_path)
    try:
        body = {"prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": stream}
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        if stream:
            resp = c.getresponse()
            assert resp.status == 200
            while not resp.readline().startswith(b"data: "):  # keepalives while prefilling
                pass  # the first token's event: generation is under way
        else:
            time.sleep(1)  # under way (no event to wait for; 600 tokens take longer)
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.time()
        if not stream:
            resp = c.getresponse()
            assert resp.status == 503
        rest = resp.read().decode()  # ends when rank 0 answers with the error and exits
        code = procs[0].wait(timeout=60)
        waited = time.time() - t0
        print(f"the silent rank was detected in {waited:.1f} s")  # with -s
    finally:
        _kill(procs)
    assert '"peer_silent"' in rest and "rank 1" in rest, rest[-500:]
    assert code == 6 and waited < 5 + 5


@pytest.mark.parametrize("stopped", [1, 0])
def test_a_rank_stopped_while_serve_is_idle_ends_it(models, tmp_path, stopped):
    """serve under a pipeline, idle (rank 0 shares "no request" with its peers every
    0.1 s): SIGSTOP one rank; the other exits within --pipeline-timeout, naming it
    (before: rank 0 hung in the share, /health still "ok", every request after it queued
    for ever; rank 1, whose rank 0 stopped, waited for ever)."""
    procs, port = _serving_ranks(models, tmp_path)
    other = 1 - stopped
    try:
        procs[stopped].send_signal(signal.SIGSTOP)
        t0 = time.time()
        code = procs[other].wait(timeout=60)
        waited = time.time() - t0
    finally:
        _kill(procs)
    err = (tmp_path / f"rank{other}.err").read_text()
    assert code == 6, err[-2000:]
    assert f"rank {other}: no answer within 5 s: rank {stopped}" in err, err[-2000:]
    assert waited < 5 + 5


def test_bench_under_ranks_then_a_stopped_rank(models, tmp_path):
    """bench over 2 ranks: both exit cleanly after their timed runs (each run ends at a
    step boundary on every rank), rank 0 reports for both; then, with one rank stopped
    mid-run, the other exits within --pipeline-timeout, naming it."""
    ck = models.checkpoint("tiny-qwen3_moe")
    argv = ["bench", "--model", str(ck), "--expert-dir", str(tmp_path / "ed"), "--slots", "5"]
    argv += ["--pipeline", "--pipeline-timeout", "5", "--prompt", PROMPT]
    procs = _start_ranks(2, tmp_path, argv + ["--max-tokens", "8", "--repeat", "2"])
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        _kill(procs)
    assert codes == [0, 0], (tmp_path / "rank0.err").read_text()[-2000:]
    result = json.loads((tmp_path / "rank0.out").read_text())
    assert result["generated_tokens"] == 8 and result["tok_per_s"] > 0
    assert (tmp_path / "rank1.out").read_text().strip() == ""

    run = tmp_path / "stopped"
    run.mkdir()
    procs = _start_ranks(2, run, argv + ["--max-tokens", str(LONG), "--repeat", "3"])
    try:  # once the timed runs began
        code, waited = _stop_rank_1(procs, run, lambda o, e: "run 1/3" in e)
    finally:
        _kill(procs)
    err = (run / "rank0.err").read_text()
    assert code == 6, err[-2000:]
    assert "no answer within 5 s: rank 1" in err and waited < 5 + 5


def test_a_hung_rank_ends_the_whole_job(models, tmp_path):
    """Under ``mlx.launch``, rank 1 hangs mid-generation (blocked for good, alive): within
    --pipeline-timeout a rank exits naming it, on stderr apart from the text (rank 0,
    waiting on it, or rank 1 itself, stuck on an event of its own: the first watch to fire;
    rank 1 hangs before its step's first beat, so its own often is); mlx.launch then ends
    the other, and the user's command returns within the timeout plus 30 s of the hang."""
    ck = models.checkpoint("tiny-qwen3_moe")
    hang = tmp_path / "hung_at"
    cmd = [str(LAUNCH), "--backend", "ring", "-n", "2", "-p", str(free_ports(2)), "--",
           sys.executable, str(Path(__file__).with_name("hang_rank.py")),
           "--hang-after", "60", "--hang-file", str(hang),
           "generate", "--model", str(ck), "--expert-dir", str(tmp_path / "ed"),
           "--slots", "5", "--pipeline", "--pipeline-timeout", "5", "--prompt", PROMPT,
           "--max-tokens", str(LONG)]  # fmt: skip
    r = run_session(cmd, 180)
    returned = time.time()
    assert hang.exists(), r.stderr[-3000:]
    assert returned - float(hang.read_text()) < 5 + 30, r.stderr[-3000:]
    print(f"returned {returned - float(hang.read_text()):.1f} s after the hang")  # with -s
    # mlx.launch (0.32) itself exits 0 whatever its ranks did; it says which failed
    by_peer = "rank 0: no answer within 5 s: rank 1 " in r.stderr
    by_itself = (
        "rank 1: no progress within 5 s: this rank is stuck in its own work "
        "(request (hang_rank.py:" in r.stderr
    )
    assert by_peer or by_itself, r.stderr[-3000:]  # a witness, naming rank 1
    assert f"rank {1 if by_itself else 0} exited with code 6" in r.stderr, r.stderr[-3000:]
    assert "within 5 s" not in r.stdout  # the error is not mixed into the text


def test_the_watch_tells_a_stuck_rank_from_one_that_waits():
    """``PeerWatch.stuck_at``: the thread that beat, blocked on an event of its own process, is
    named (function, file:line), and the message blames this rank; blocked in a call that
    may wait on a peer (here a sleep in C), it is None and the message names the peer."""
    from mlx_streaming.peers import PeerWatch

    watch = PeerWatch(mx.distributed.init(), timeout_s=3600)
    go, armed = threading.Event(), threading.Event()

    def on_event():
        with watch:
            watch.beat()
            armed.set()
            go.wait()

    def in_c_call():
        with watch:
            watch.beat()
            armed.set()
            time.sleep(1.0)

    t = threading.Thread(target=on_event, daemon=True)
    t.start()
    armed.wait(10)
    time.sleep(0.1)  # into the wait
    where = watch.stuck_at()
    assert where is not None and where.startswith("on_event (test_pipeline.py:"), where
    assert "rank 0: no progress within 3600 s: this rank is stuck" in watch.message()
    go.set()
    t.join(10)
    armed.clear()
    t = threading.Thread(target=in_c_call, daemon=True)
    t.start()
    armed.wait(10)
    time.sleep(0.1)
    assert watch.stuck_at() is None
    assert "rank 0: no answer within 3600 s: rank 0 (or a rank it waits on)" in watch.message()
    t.join(10)


def _fits(mb, hosts, counts) -> bool:
    """Whether layers per rank ``counts`` (rank order; the last rank takes layer 0 on)
    fit every host with a MoE layer each."""
    end = 0
    for r in reversed(range(len(hosts))):
        layers = range(end, end + counts[r])
        if not any(mb.experts[i] for i in layers) or mb.rank_bytes(layers, 0.0, 0) > hosts[r]:
            return False
        end += counts[r]
    return True


def test_a_split_is_found_whenever_one_fits():
    """The packing searches every split point: on random layer sizes and hosts it finds
    a split exactly when one exists (brute force over every contiguous split), and the
    split it gives fits (before: a greedy packing refused 417 of 3,000 such cases)."""
    import itertools
    import random

    from mlx_streaming.planning.pipeline import ModelBytes, _pack, suggest_split

    rng = random.Random(0)
    found = 0
    for case in range(400):
        n, size = rng.randint(2, 7), rng.randint(2, 3)
        if size > n:
            continue
        experts = [rng.choice([0, 1]) * rng.randint(10**6, 9 * 10**6) for _ in range(n)]
        experts[rng.randrange(n)] = 4 * 10**6  # at least one MoE layer
        mb = ModelBytes(
            shared=rng.randint(10**6, 5 * 10**6),
            trunk=[rng.randint(10**5, 4 * 10**6) for _ in range(n)],
            experts=experts,
            num_experts=[8] * n,
            top_k=2,
            kv=[0] * n,
        )
        hosts = [rng.randint(2 * 10**8, 4 * 10**8) for _ in range(size)]

        cuts = itertools.combinations(range(1, n), size - 1)
        splits = [[b - a for a, b in zip((0, *c), (*c, n))][::-1] for c in cuts]
        exists = any(_fits(mb, hosts, s) for s in splits)
        got = _pack(mb, hosts, 0.0, 0)
        assert (got is not None) == exists, (case, hosts, got)
        if got is not None:
            found += 1
            assert _fits(mb, hosts, got), (case, got)
            sp = suggest_split(mb, [h / 1e9 for h in hosts], 0)
            assert _fits(mb, hosts, sp.split) and sum(sp.split) == n
    assert found > 50  # the cases exercise both outcomes


def test_one_rule_from_a_share_to_slots():
    """The pipeline's planner and the benchmarks turn a residency into slots alike:
    rounded up, within [top-k, every expert], without float noise adding a slot."""
    from mlx_streaming.planning.budget import slots_for_share

    assert [slots_for_share(r, 64, 6) for r in (1, 0.5, 0.25, 0.125, 0.05, 0)] == [
        64,
        32,
        16,
        8,
        6,
        6,
    ]
    assert slots_for_share(0.3, 64, 2) == 20  # 19.2 rounded up: at least the share
    assert slots_for_share(0.1, 70, 2) == 7  # 0.1 * 70 is 7.000000000000001 in floats
    for bad in (-0.5, 1.5):
        with pytest.raises(ValueError, match="within \\[0, 1\\]"):
            slots_for_share(bad, 64, 6)
