"""macOS portability, checked on Linux: with ``sys.platform`` set to ``darwin`` and the
Linux-only ``os`` functions removed, every module imports and the commands run (or, for
cold runs, stop with a clear error), with ``--direct-io`` going through F_NOCACHE."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import fcntl, importlib, json, os, pkgutil, sys
    # third-party modules import as they would on Linux; ours see macOS
    import mlx.core, mlx_lm, mlx_lm.server, mlx_lm.chat, urllib.request, numpy, tqdm
    import transformers, huggingface_hub, xxhash
    sys.platform = "darwin"
    for name in ("posix_fadvise", "POSIX_FADV_DONTNEED", "O_DIRECT"):
        if hasattr(os, name):
            delattr(os, name)
    nocache = []
    real_fcntl = fcntl.fcntl
    fcntl.F_NOCACHE = 48  # the value in macOS's <fcntl.h>
    def fake_fcntl(fd, cmd, arg=0):
        if cmd == fcntl.F_NOCACHE:
            nocache.append(fd)
            return 0
        return real_fcntl(fd, cmd, arg)
    fcntl.fcntl = fake_fcntl
    real_open = open
    def no_proc(path, *a, **kw):
        if str(path).startswith("/proc"):
            raise FileNotFoundError(path)
        return real_open(path, *a, **kw)
    import builtins
    builtins.open = no_proc

    import mlx_streaming
    for m in pkgutil.walk_packages(mlx_streaming.__path__, "mlx_streaming."):
        if not m.name.endswith(("__main__", "._engine", "._policy")):  # ctypes libraries
            importlib.import_module(m.name)
    from mlx_streaming.cli import main
    ck, ed, out = sys.argv[1:4]
    store = ["--model", ck, "--expert-dir", ed, "--slots", "5"]
    main(["bench", *store, "--max-tokens", "4", "--repeat", "1", "--direct-io",
          "--json", out])
    main(["generate", *store, "--max-tokens", "3", "--direct-io", "--no-verbose"])
    main(["verify", *store, "--max-tokens-per-call", "16", "--direct-io"])
    try:
        main(["bench", *store, "--max-tokens", "2", "--repeat", "1", "--cold"])
        print("COLD RAN")
    except SystemExit as e:
        print("cold exit", e.code)
    print("F_NOCACHE", len(nocache))
""")


def test_darwin_paths(models, tmp_path):
    ck, ed = models.experts("tiny-qwen3_moe")
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ck), str(ed), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cold exit 2" in r.stdout
    assert "posix_fadvise, which darwin lacks" in r.stderr
    assert int(r.stdout.split("F_NOCACHE")[-1]) > 0
    assert "exact" in r.stdout
    res = json.loads(out.read_text())
    assert res["direct_io"] and res["mlx_peak_gb"] > 0 and "rss_*" in res["memory_sources"]
