"""The memory budget holds, measured: with ``budget_gb`` G, peak RSS stays within
trunk + G + KV cache + the margin the README states (MLX's buffer-cache cap plus 32 MB),
over a 2,000-token generation and under ``serve`` with 8 concurrent clients."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
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
        deadline = time.time() + 120
        while True:
            try:
                call("GET", "/health")
                break
            except OSError:
                assert time.time() < deadline and proc.poll() is None, (
                    tmp_path / "err"
                ).read_text()
                time.sleep(0.3)
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
