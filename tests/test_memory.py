"""The memory budget holds, measured: with ``budget_gb`` G, peak RSS stays within
trunk + G + KV cache + the margin the README states (MLX's buffer-cache cap plus 32 MB),
over a 2,000-token generation and under ``serve`` with 8 concurrent clients."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import pytest
from serving import wait_healthy
from test_pipeline import free_ports

HERE = Path(__file__).parent
SLACK = 32 << 20  # staging rows, reader buffers, thread stacks, allocator slack
BUDGET_GB = 0.015  # about 40% of the experts


@pytest.fixture(scope="module")
def model(models):
    return models.experts("dsv2-lite-cpu", num_layers=2)  # one MoE layer, 35 MB of experts


def within_budget(m: dict, kv: int) -> None:
    allowed = m["trunk"] + int(BUDGET_GB * 1e9) + kv + m["cache_cap"] + SLACK
    assert m["pools"] <= BUDGET_GB * 1e9
    assert m["peak_rss"] <= allowed, (m, allowed)
    assert m["mlx_peak"] <= m["trunk"] + int(BUDGET_GB * 1e9) + kv + SLACK, m


def test_budget_holds_over_a_long_generation(model):
    ck, ed = model
    r = subprocess.run(
        [sys.executable, str(HERE / "memory_run.py"), "--model", str(ck), "--expert-dir",
         str(ed), "--budget-gb", str(BUDGET_GB), "--tokens", "2000"],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["generated"] == 2000
    within_budget(m, m["kv"])


def test_budget_holds_under_concurrent_serving(model, tmp_path):
    ck, ed = model
    port = free_ports(1)
    cmd = [sys.executable, "-m", "mlx_streaming", "serve", "--model", str(ck)]
    cmd += ["--expert-dir", str(ed), "--budget-gb", str(BUDGET_GB), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err", "w"))

    def call(method, path, body=None):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.request(method, path, body and json.dumps(body), {"Content-Type": "application/json"})
        resp = c.getresponse()
        return resp.status, json.loads(resp.read())

    try:
        wait_healthy(port, proc, (tmp_path / "err").read_text)
        codes = []

        def client(i):
            for j in range(2):
                prompt = f"Client {i} asks question {j} about experts on a disk."
                codes.append(
                    call("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 48})[0]
                )

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        assert codes == [200] * 16
        status, health = call("GET", "/health")
        assert status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    m = health["memory"]
    # the KV cache: the prompt cache's entries, and the request in flight's (< 4 MB here)
    within_budget(m, m["prompt_cache_kv"] + (4 << 20))


def test_auto_budget_fits_a_simulated_small_machine(model, capsys):
    from mlx_lm import load

    from mlx_streaming.model_builder import auto_budget_for
    from mlx_streaming.planning.budget import MARGIN_BYTES

    ck, _ = model
    lazy, _ = load(str(ck), lazy=True)
    for total, available in ((2 << 30, 1 << 30), (1 << 30, 3 << 30), (64 << 30, 48 << 30)):
        p = auto_budget_for(lazy, 4096, machine=(total, available))
        peak = p.trunk + p.budget_bytes + p.kv + p.cache_cap + MARGIN_BYTES
        assert 0 < p.budget_bytes and peak + p.headroom <= min(total, available)
        assert p.kv == 4096 * 5120  # as measured: mlx-lm's cache after 2,048 tokens holds 10.5 MB
        assert "--budget-gb auto:" in capsys.readouterr().err
    with pytest.raises(ValueError, match="nothing is left for expert pools.*--context"):
        auto_budget_for(lazy, 4096, machine=(300 << 20, 300 << 20))


def test_what_the_trunk_takes_beside_a_swap_tier(model):
    """``trunk_host_bytes`` of a lazily loaded model, which it leaves unread: off CUDA
    the whole trunk (it stays in the memory a swap tier takes from; ``auto_budget``'s
    count), on CUDA the largest block ``load_trunk`` reads at once (MLX stages each array
    in a host buffer it frees once copied to the GPU): no less than the embeddings or any
    decoder layer outside its experts, and less than the whole."""
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from mlx_streaming.core.discovery import find_expert_sites
    from mlx_streaming.model_builder import auto_budget_for, trunk_blocks, trunk_host_bytes

    ck, _ = model
    lazy, _ = load(str(ck), lazy=True)
    whole = trunk_host_bytes(lazy, "cpu")
    assert whole == auto_budget_for(lazy, 16, machine=(64 << 30, 48 << 30)).trunk
    largest = trunk_host_bytes(lazy, "cuda")
    experts = {
        id(v) for s in find_expert_sites(lazy) for _, v in tree_flatten(s.module.parameters())
    }
    for layer in lazy.model.layers:
        own = sum(v.nbytes for _, v in tree_flatten(layer.parameters()) if id(v) not in experts)
        assert 0 < own <= largest
    assert lazy.model.embed_tokens.weight.nbytes <= largest < whole
    arrays = [v for b in trunk_blocks(lazy) for v in b]
    assert len(arrays) == len(tree_flatten(lazy.parameters())) - len(experts)
    assert not any(id(v) in experts for v in arrays)


@pytest.mark.parametrize("preset", ["tiny-deepseek_v3", "tiny-deepseek_v2", "tiny-qwen3_next",
                                    "tiny-gpt_oss", "tiny-mixtral"])  # fmt: skip
def test_kv_bytes_per_token_as_a_real_prompt_grows_the_cache(models, preset):
    """``budget_gb="auto"``'s KV figure, traced lazily (nothing evaluated), equals what a
    real prompt adds to mlx-lm's cache per token on each cache layout: DeepSeek-V3's
    latent (the config formula counted every head: 71x too much on the real model), hybrid
    and sliding-window models."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_streaming.planning.budget import kv_bytes_measured, kv_bytes_per_token

    lazy, _ = load(str(models.checkpoint(preset)), lazy=True)
    before = mx.get_active_memory()
    per_layer = kv_bytes_measured(lazy)
    assert len(per_layer) == len(lazy.layers)
    kv = sum(per_layer)
    assert mx.get_active_memory() - before < 1 << 10  # nothing loaded or allocated
    grown = []
    for n in (300, 556):  # past one 256-position allocation, and past the next
        cache = make_prompt_cache(lazy)
        lazy(mx.array([list(range(1, n + 1))]), cache=cache)
        mx.eval([c.state for c in cache])
        grown.append(sum(c.nbytes for c in cache))
    truth = (grown[1] - grown[0]) // 256
    assert truth * 0.95 <= kv <= truth  # a sliding window fills before 257 tokens
    if preset in ("tiny-qwen3_next", "tiny-mixtral", "tiny-deepseek_v2"):
        # the config's formula, the fallback, gives the same per layer (hybrid layers too;
        # it counted ceil(layers / interval) attention layers, not the layers that attend)
        args = lazy.args if isinstance(lazy.args, dict) else dataclasses.asdict(lazy.args)
        assert kv_bytes_per_token(args, lazy.model.embed_tokens.weight.dtype.size) == per_layer


def test_auto_budget_from_this_machine(model, capsys):
    import mlx_streaming
    from mlx_streaming.core.mem import machine_memory

    ck, ed = model
    _, _, store = mlx_streaming.load(ck, ed, budget_gb="auto", context=512, progress=False)
    err = capsys.readouterr().err
    assert "--budget-gb auto:" in err and "KV cache for 512 tokens" in err
    assert store.pool_bytes() <= machine_memory()[0]
    store.close()
    with pytest.raises(ValueError, match="budget_gb must be a number of GB or 'auto'"):
        mlx_streaming.StreamConfig(budget_gb="lots")


LIMIT_CHILD = """
import os, sys
from mlx_streaming.bench.measure import drop_page_cache, enter_memory_limit
from mlx_streaming.core.mem import cgroup_memory, machine_memory
try:
    group = enter_memory_limit(256 << 20, "mlxs-test")
except OSError as e:
    print("NO CGROUP", e)
    sys.exit(0)
path = sys.argv[1]
drop_page_cache([path])
with open(path, "rb") as f:
    while f.read(8 << 20):
        pass
import mmap
shared = mmap.mmap(-1, 64 << 20)  # shared memory (as CUDA's page-locked): not page cache
shared.write(b"x" * (64 << 20))
limit, used, cache = cgroup_memory()
print("LIMIT", limit, used, cache, machine_memory()[0])
"""


def test_a_memory_limit_keeps_the_page_cache_within_it(tmp_path):
    """``enter_memory_limit`` (bench --memory-limit-gb, speed.py --beyond-ram memlimit):
    reading a file larger than the limit leaves at most the limit charged, and the
    process sees the limit as its machine's memory, shared memory (CUDA's page-locked
    swap tier) not counted as reclaimable page cache. Skipped without a writable memory
    cgroup (it needs root)."""
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        for _ in range(48):
            f.write(os.urandom(8 << 20))  # 384 MB
    r = subprocess.run([sys.executable, "-c", LIMIT_CHILD, str(path)], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    if r.stdout.startswith("NO CGROUP"):
        pytest.skip(r.stdout.strip())
    limit, used, cache, total = map(int, r.stdout.split("LIMIT")[1].split())
    assert limit == 256 << 20 and used <= limit and 0 < cache <= limit and total == limit
    assert cache + (64 << 20) <= used  # the shared mapping is in use, not reclaimable


KILLED_CHILD = """
import os, signal, sys
from mlx_streaming.bench.measure import enter_memory_limit
try:
    print(enter_memory_limit(256 << 20, "mlxs-test-killed"), flush=True)
except OSError as e:
    print("NO CGROUP", e, flush=True)
    sys.exit(0)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)  # no atexit: the group stays behind
"""


def test_a_group_left_by_a_killed_process_is_removed_by_the_next():
    """A run killed outright (SIGKILL, the OOM killer) leaves its memory cgroup behind;
    the next ``enter_memory_limit`` of the same name removes it (and its own at exit).
    Skipped without a writable memory cgroup."""
    from pathlib import Path

    def child(how):
        return subprocess.run([sys.executable, "-c", KILLED_CHILD, how], capture_output=True,
                              text=True, timeout=120)  # fmt: skip

    r = child("kill")
    if r.stdout.startswith("NO CGROUP"):
        pytest.skip(r.stdout.strip())
    left = Path(r.stdout.strip())
    assert r.returncode == -9 and left.is_dir()
    r = child("exit")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not left.exists() and not Path(r.stdout.strip()).exists()


def test_bench_refuses_stock_within_a_memory_limit(models):
    from mlx_streaming.bench.run import BenchConfig, run_bench

    ck, ed = models.experts("tiny-qwen3_moe")
    cfg = BenchConfig(model=str(ck), expert_dir=str(ed), memory_limit_gb=0.5, compare_stock=True)
    with pytest.raises(ValueError, match="--compare-stock loads every expert"):
        run_bench(cfg)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(x for x in f if x.startswith("VmRSS:")).split()[1]) * 1024


def test_a_thousand_requests_leak_nothing(tmp_path):
    """``serve`` (the trained model) over 1,000 requests: plain and streamed ones, clients
    that hang up mid-stream, prompts longer than the context, malformed JSON. Every bad
    request gets a 4xx naming what is wrong, every good one a 200, and the server's RSS
    after the run is within 5% of its RSS after the first 100."""
    import socket

    from mlx_streaming.synthetic.train import trained_checkpoint

    ck = trained_checkpoint()
    port = free_ports(1)
    cmd = [sys.executable, "-m", "mlx_streaming", "serve", "--model", str(ck), "--slots", "32"]
    cmd += ["--expert-dir", str(tmp_path / "ed"), "--port", str(port), "--max-tokens", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err", "w"))
    long_prompt = "def f(x):\n    return x\n" * 800  # past the model's 4,096 positions

    def call(body: bytes):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        status, data = r.status, r.read()
        c.close()
        return status, data

    def hang_up():  # a streamed request whose client leaves after the first bytes
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        body = json.dumps({"prompt": "import ", "max_tokens": 32, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
        assert s.recv(64)
        s.close()

    try:
        wait_healthy(port, proc, (tmp_path / "err").read_text)
        after_100, series = None, []
        for i in range(1000):
            kind = i % 10
            if kind == 7:
                hang_up()
            elif kind == 8:
                status, data = call(json.dumps({"prompt": long_prompt}).encode())
                assert status == 400 and b"exceed the model's context" in data, data
            elif kind == 9:
                status, data = call(
                    b'{"prompt": "def f(',
                )
                assert status == 400 and b"Invalid JSON" in data, data
            else:
                body = {"prompt": f"def f{i % 13}(", "stream": kind % 2 == 1}
                status, data = call(json.dumps(body).encode())
                assert status == 200, data
            if i % 100 == 99:  # every 100: a failure shows a trend or a plateau
                series.append(round(_rss(proc.pid) / 1e6, 1))
                if i == 99:
                    after_100 = _rss(proc.pid)
        end = _rss(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"RSS after 100 requests {after_100 / 1e6:.1f} MB, after 1,000 {end / 1e6:.1f} MB")
    assert end <= 1.05 * after_100, f"RSS (MB) every 100 requests: {series}"


def test_the_bounds_of_decode_and_the_step_bound_of_bursty_reads():
    """``bounds``: compute 10 ms a token, 10 MB a token at 1 GB/s: 100 tok/s overlapped,
    50 serial. The same bytes in one burst every third step: the quiet steps cannot lend
    the disk to the burst, so each step's own reads under its compute give 60."""
    from mlx_streaming.bench.measure import bounds

    b = bounds(0.01, 10e6, 1.0, 40.0, step_bytes=[0, 0, 30e6])
    assert (b["bound_tok_per_s"], b["serial_bound_tok_per_s"]) == (100.0, 50.0)
    assert b["step_bound_tok_per_s"] == 60.0 and b["efficiency_vs_step"] == round(40 / 60, 4)
    assert "step_bound_tok_per_s" not in bounds(0.01, 10e6, 1.0, 40.0)
