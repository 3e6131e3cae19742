#!/usr/bin/env bash
# Run a command with its reads throttled to MBPS MB/s (default 100), so that reads dominate
# decode even on a slow CPU: a cgroup v1 blkio throttle (root) on the disk that holds DIR
# (default the current directory), or DEV (major:minor) given outright. Children inherit it.
#   MBPS=100 bash benchmarks/slow_disk.sh python benchmarks/speed.py --direct-io ...
set -euo pipefail
cg=/sys/fs/cgroup/blkio/mlxs-slow-disk
if [ ! -d /sys/fs/cgroup/blkio ]; then
  echo "slow_disk.sh: no cgroup v1 blkio controller here (/sys/fs/cgroup/blkio)" >&2
  exit 2
fi
dev=${DEV:-$(stat -c '%Hd:%Ld' "${DIR:-.}")}
mkdir -p "$cg"
echo "$dev $((${MBPS:-100} * 1000000))" > "$cg/blkio.throttle.read_bps_device"
echo $$ > "$cg/cgroup.procs"
echo "slow_disk.sh: reads from $dev throttled to ${MBPS:-100} MB/s" >&2
exec "$@"
