"""Server under load: concurrent OpenAI clients against one streamed model.

Starts ``python -m mlx_streaming serve`` on a synthetic model, then ``--clients`` threads
each send ``--requests`` chat or completion requests (half streaming). Checks that all
complete, that every output equals the same request run alone, and samples the server's
RSS and queue depth throughout.

    python benchmarks/load.py --json benchmarks/results/load-cpu.json
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

from harness import build, finish, parser

from mlx_streaming.core.mem import rss_bytes as rss


def main():
    p = parser(__doc__, preset="demo", trace=False, workdir="scratch/load")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--slots", type=int, default=16)
    a = p.parse_args()
    import openai

    ck, ed, _ = build(a)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlx_streaming",
            "serve",
            "--model",
            str(ck),
            "--expert-dir",
            str(ed),
            "--slots",
            str(a.slots),
            "--port",
            str(port),
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"

    def health():
        with urllib.request.urlopen(base + "/health", timeout=10) as r:
            return json.loads(r.read())

    for _ in range(240):
        try:
            health()
            break
        except OSError:
            time.sleep(0.5)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=600)

    def request(i: int) -> str:
        stream = i % 2 == 1
        if i % 4 < 2:
            kw = dict(
                model="default_model",
                max_tokens=a.max_tokens,
                temperature=0.0,
                messages=[{"role": "user", "content": f"Question {i % 7}: what is an expert?"}],
            )
            r = client.chat.completions.create(stream=stream, **kw)
            if stream:
                return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
            return r.choices[0].message.content
        kw = dict(
            model="default_model",
            max_tokens=a.max_tokens,
            temperature=0.0,
            prompt=f"Prompt {i % 5}: the pool holds",
        )
        r = client.completions.create(stream=stream, **kw)
        if stream:
            return "".join(c.choices[0].text for c in r if c.choices)
        return r.choices[0].text

    kinds = sorted({(i % 4, i % 7, i % 5) for i in range(a.clients * a.requests)})
    alone = {}
    t0 = time.perf_counter()
    for i in range(a.clients * a.requests):  # each distinct request run alone first
        key = (i % 4, i % 7, i % 5)
        if key not in alone:
            alone[key] = request(i)
    sequential_s = time.perf_counter() - t0
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((time.perf_counter(), rss(proc.pid), health()["queue_depth"]))
            time.sleep(0.5)

    samples.append((time.perf_counter(), rss(proc.pid), health()["queue_depth"]))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    results, latencies, errors = {}, [], []

    def client_thread(c):
        for r in range(a.requests):
            i = c * a.requests + r
            t = time.perf_counter()
            try:
                results[i] = request(i)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_thread, args=(c,)) for c in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=1800)
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    proc.terminate()
    proc.wait(timeout=60)
    mism = sum(
        results.get(i) != alone[(i % 4, i % 7, i % 5)] for i in range(a.clients * a.requests)
    )
    rs = [s[1] for s in samples]
    q = len(rs) // 4 or 1
    finish(
        a,
        "load",
        {
            "model": a.preset,
            "slots": a.slots,
            "clients": a.clients,
            "requests_per_client": a.requests,
            "distinct_requests": len(kinds),
            "completed": len(results),
            "errors": errors[:5],
            "error_count": len(errors),
            "outputs_equal_sequential": mism == 0,
            "mismatches": mism,
            "deadlock": any(t.is_alive() for t in threads),
            "wall_s": round(wall, 1),
            "requests_per_s": round(len(results) / wall, 3),
            "sequential_distinct_s": round(sequential_s, 1),
            "latency_median_s": round(statistics.median(latencies), 2),
            "latency_max_s": round(max(latencies), 2),
            "max_queue_depth": max(s[2] for s in samples),
            "server_rss_mb_first_quarter": round(statistics.mean(rs[:q]) / 1e6, 1),
            "server_rss_mb_last_quarter": round(statistics.mean(rs[-q:]) / 1e6, 1),
            "server_rss_drift": round(statistics.mean(rs[-q:]) / statistics.mean(rs[:q]) - 1, 4),
        },
    )


if __name__ == "__main__":
    main()
