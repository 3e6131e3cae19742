"""Compile the CUDA suite's kernels once, before its cases (``tests/test_cuda.py``'s
session fixture runs it with a bound of its own): MLX keeps compiled kernels on disk
(``MLX_PTX_CACHE_DIR``, default under the temporary directory), so each case then finds
them. Each preset runs stock and every CUDA path at every slot count, prompts in chunks
of 8 and 64, as the cases do, with fewer decode steps (the shapes are the same)."""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from mlx_lm import load

    import mlx_streaming
    from mlx_streaming.analysis.verify import greedy_trace
    from mlx_streaming.prep.split_experts import ensure_split

    jobs, text, kernel_file = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    for preset, ck, ed in jobs:
        t0 = time.time()
        ref, tok = load(ck)
        ids = tok.encode(text)
        for chunk in (8, 64):
            greedy_trace(ref, ids, 3, chunk)
        meta = ensure_split(ck, ed)
        for mode in ("device", "host", "pread", "tier", "bounded"):
            for slots in (meta.top_k, meta.num_experts // 2, meta.num_experts):
                tier = mode in ("tier", "bounded")
                if tier and (preset != "tiny-mixtral" or slots == meta.num_experts):
                    continue  # test_a_swap_tier_streams_exactly_on_cuda's runs only
                cfg = mlx_streaming.StreamConfig(
                    kernel_check=True,
                    kernel_check_file=kernel_file,
                    map_files=False if mode == "pread" or tier else None,
                    device_reads=False if mode == "host" else None,
                    swap_tier=tier,
                    swap_tier_gb=1e-6 if mode == "bounded" else None,
                )
                model, _, store = mlx_streaming.load(ck, ed, slots=slots, config=cfg)
                for chunk in (8, 64):
                    greedy_trace(model, ids, 3, chunk)
                store.close()
        print(f"{preset}: {time.time() - t0:.0f} s", flush=True)
        if preset == "thresholds-qwen3_moe":  # test_verify_on_cuda's row counts
            from mlx_streaming.cli import main as cli

            cli(["verify", "--model", ck, "--expert-dir", ed, "--slots", "16",
                 "--max-tokens-per-call", "128"])  # fmt: skip


if __name__ == "__main__":
    main()
