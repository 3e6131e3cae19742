#!/usr/bin/env bash
# Stage MLX's CUDA build and the routing trace for the device machine, in a fresh checkout
# (the staged files are git-ignored, so a new checkout has none). The repository is ~27 MiB
# and a device call carries at most 64 MiB, so the CUDA wheel travels in three parts:
#   call 1: carry [".mlxcuda1"]   command: bash .mlxcuda1/stage1.sh
#   call 2: carry [".mlxcuda1b"]  command: bash .mlxcuda1b/stage1.sh
#     with a former call's kernel cache ($OUT/ptx.tgz, kept as .gpu/ptx.tgz, ~5 MB) beside
#     it: carry [".mlxcuda1b", ".gpu/ptx.tgz"], command
#     bash .mlxcuda1b/stage1.sh; cp .gpu/ptx.tgz /tmp/ptx-seed.tgz
#     (gpu_suite.sh seeds an empty cache from it: 450 s of compiling saved, 2026-12-07f)
#   call 3 (where a former call's driver cache is kept: its $OUT/nv.tgz.part-*, saved as
#     .gpu/nv.tgz.part-*, 18.5 MB in two parts on 2026-12-07h): carry [".gpu/nv.tgz.part-aa",
#     ".gpu/nv.tgz.part-ab"], command cp .gpu/nv.tgz.part-* /tmp/ (beside .mlxcuda1 it
#     passed the 64 MiB, the repository being 27 MiB, 2026-12-07h; with both seeds warmup
#     took 148 s against 176-178 s with the PTX seed alone)
#   call 4: carry [".mlxcuda2", ".gpu/deepseek-v2-lite.npz"]: source .mlxcuda2/stage2.sh && ...
# The last part is the smallest (~22 MB): it travels beside the 9 MB trace,
# each within 30 s of the one before (benchmarks/gpu_suite.sh says what runs next).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
bash ../shared/device/mlx-cuda/prepare.sh > /dev/null  # .mlxcuda1 and .mlxcuda2: two halves
wheel=$(mktemp)
cat .mlxcuda1/cudapart.00 .mlxcuda2/cudapart.01 > "$wheel"
rm -rf .mlxcuda1b && mkdir .mlxcuda1b && rm .mlxcuda1/cudapart.00 .mlxcuda2/cudapart.01
parts=$(mktemp -d)
split -b 34000000 -d "$wheel" "$parts/cudapart."
[ ! -e "$parts/cudapart.03" ] || { echo "the wheel needs a fourth part: adjust this script" >&2; exit 1; }
mv "$parts/cudapart.00" .mlxcuda1/ && mv "$parts/cudapart.01" .mlxcuda1b/
mv "$parts/cudapart.02" .mlxcuda2/
rm -rf "$wheel" "$parts"
for d in .mlxcuda1 .mlxcuda1b; do  # park this part in /tmp until stage 2
  printf '%s\n' '#!/usr/bin/env bash' 'set -e' \
    'mkdir -p /tmp/mlxcuda && cp "$(dirname "$0")"/cudapart.0* /tmp/mlxcuda/' \
    'echo "stage1: $(ls /tmp/mlxcuda | tr "\n" " ")parked"' > $d/stage1.sh
done
chmod u+w .mlxcuda2/stage2.sh
sed -i 's|cat /tmp/mlxcuda/cudapart.00 "$_d/cudapart.01"|cat /tmp/mlxcuda/cudapart.00 /tmp/mlxcuda/cudapart.01 "$_d/cudapart.02"|' \
  .mlxcuda2/stage2.sh
grep -q 'cudapart.02' .mlxcuda2/stage2.sh  # the shared stage2.sh changed: fix the line above
mkdir -p .gpu && cp ../shared/traces/deepseek-v2-lite.npz .gpu/
du -sh .mlxcuda1 .mlxcuda1b .mlxcuda2 .gpu
