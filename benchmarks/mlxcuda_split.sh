#!/usr/bin/env bash
# After ../shared/device/mlx-cuda/prepare.sh (two halves of MLX's CUDA wheel), split the
# wheel in three so that each device call, with this repository (22 MiB), stays under the
# 64 MiB a call may carry: .mlxcuda1 and .mlxcuda1b park a part each in /tmp
# (`bash .mlxcuda1/stage1.sh`, `bash .mlxcuda1b/stage1.sh`), then
# `source .mlxcuda2/stage2.sh` installs; three calls within 30 s of each other.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
w=$(cat .mlxcuda2/WHEEL_NAME)
tmp=$(mktemp -d)
cat .mlxcuda1/cudapart.00 .mlxcuda2/cudapart.01 > "$tmp/$w"
rm -rf .mlxcuda1 .mlxcuda1b .mlxcuda2/cudapart.01
mkdir -p .mlxcuda1 .mlxcuda1b
split -n 3 -d "$tmp/$w" "$tmp/cudapart."
mv "$tmp/cudapart.00" .mlxcuda1/ && mv "$tmp/cudapart.01" .mlxcuda1b/
mv "$tmp/cudapart.02" .mlxcuda2/
cat > .mlxcuda1/stage1.sh <<'S1'
#!/usr/bin/env bash
# Device side, calls 1 and 1b: park a part of the MLX CUDA wheel in /tmp until stage 2.
set -e
mkdir -p /tmp/mlxcuda && cp "$(dirname "$0")"/cudapart.* /tmp/mlxcuda/
echo "parked: $(ls /tmp/mlxcuda)"
S1
cp .mlxcuda1/stage1.sh .mlxcuda1b/stage1.sh
cat > .mlxcuda2/stage2.sh <<'S2'
# Device side, call 3 and later (source it): install MLX CUDA + mlx-lm into /tmp/site once.
_d=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -f /tmp/site/.mlx-ok ]; then
  if [ ! -f /tmp/mlxcuda/cudapart.00 ] || [ ! -f /tmp/mlxcuda/cudapart.01 ]; then
    echo "stage2: a part is missing: a fresh machine; run stages 1 and 1b again" >&2
    return 3 2>/dev/null || exit 3
  fi
  _w=/tmp/mlxcuda/$(cat "$_d/WHEEL_NAME")
  cat /tmp/mlxcuda/cudapart.00 /tmp/mlxcuda/cudapart.01 "$_d/cudapart.02" > "$_w"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$_w" "$_d"/mlx-*.whl "$_d"/mlx_lm-*.whl && touch /tmp/site/.mlx-ok
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
S2
grep -qxF "/.mlxcuda1b/" .git/info/exclude || echo "/.mlxcuda1b/" >> .git/info/exclude
rm -rf "$tmp"
du -sh .mlxcuda1 .mlxcuda1b .mlxcuda2
