#!/usr/bin/env bash
# GPU benchmarks on the H200 device machine, after MLX's CUDA build is installed
# (../shared/device/mlx-cuda/README.md). Results go to $OUT (or /tmp/mlxs-out).
#   bash benchmarks/gpu_suite.sh dsv2            DeepSeek-V2-Lite shape, full width, its trace:
#                                                resident parity, 50/25/12.5% warm, prefill
#   bash benchmarks/gpu_suite.sh dsv2-cold       50/25% with a cold page cache, memory-limited
#   bash benchmarks/gpu_suite.sh dsv2-prefetch   50/25% warm with read-ahead
#   bash benchmarks/gpu_suite.sh qwen3next       Qwen3-Next-80B-A3B expert shape, own routing
# Several suites may run in one call: bash benchmarks/gpu_suite.sh dsv2 dsv2-prefetch
# TRACE names the DeepSeek-V2-Lite trace (default .gpu/deepseek-v2-lite.npz).
set -u
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
out=${OUT:-/tmp/mlxs-out}
mkdir -p "$out"
work=/tmp/mlxs
trace=${TRACE:-.gpu/deepseek-v2-lite.npz}
limit=${LIMIT:-560}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt"
run() {  # name, args...
  local name=$1; shift
  timeout "$limit" python3 benchmarks/speed.py --workdir $work --threads 8 \
    --json "$out/speed-gpu-$name.json" "$@" 2>&1 | grep -v "PyTorch was not found" \
    | tee "$out/speed-gpu-$name.log"
}
for suite in "$@"; do
case "$suite" in
  dsv2) run dsv2 --preset dsv2-lite --trace "$trace" --residency 1,0.5,0.25,0.125 \
          --cold warm --tokens 32 --repeat 3 --prefill-tokens 512 --prefill-residency 0.25 \
          --prefill-chunk 512 ;;
  dsv2-cold) run dsv2-cold --preset dsv2-lite --trace "$trace" --residency 0.5,0.25 \
          --cold cold --tokens 32 --repeat 3 --prefill-tokens 0 --limited-residency 0.25 ;;
  dsv2-prefetch) run dsv2-prefetch --preset dsv2-lite --trace "$trace" --residency 0.5,0.25 \
          --cold warm --tokens 32 --repeat 3 --prefill-tokens 0 --prefetch ;;
  qwen3next) run qwen3next --preset qwen3-next-80b-shape --num-layers 10 --trace none \
          --residency 1,0.5,0.25 --cold warm --tokens 32 --repeat 3 --prefill-tokens 0 ;;
  *) echo "unknown suite $suite" >&2; exit 2 ;;
esac
done
