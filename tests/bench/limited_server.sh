#!/usr/bin/env bash
# One server in a memory cgroup (v1) limited to LIMIT, a mount of it, and EPOCHS epochs read through the
# mount by 4 reader processes (`batchfs-lab bench --processes --threads 4`): per epoch, MB/s, the server's CPU
# seconds and the machine's idle CPU seconds. For comparing builds (BIN) or settings on one dataset, run
# after run, alternating; memory_limited_bench.sh compares the I/O modes side by side.
#
#   tests/bench/limited_server.sh DATA EPOCHS [SERVER FLAGS...]
#   env: BIN (the build's target/release; this checkout's by default), IO (direct), LIMIT (1G)
#
# Example, a build before and after a change, three rounds:
#   for r in 1 2 3; do for b in /tmp/old/target/release target/release; do
#       BIN=$b tests/bench/limited_server.sh /tmp/bigtar 2; done; done
#
# With IO=direct the server does not use the page cache, so runs may share one copy of the dataset; with
# mmap or pread, give each build its own copy (pages are charged to the cgroup that first read them).
# Needs root, the cgroup v1 memory controller at /sys/fs/cgroup/memory, /dev/fuse and a release build.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/bench/lib.sh"
BIN=${BIN:-$ROOT/target/release}
DATA=${1:?DATA: a dataset directory}
EPOCHS=${2:-2}
shift 2 || true
CG=/sys/fs/cgroup/memory/batchfs-limited-$$
work=$(mktemp -d)
port=$(free_port)
serve_limited "$CG" "${LIMIT:-1G}" "$port" "$work/server.log" --dataset "d=$DATA" --io "${IO:-direct}" "$@"
server=$limited_pid
trap 'clean_up "$work" "$CG" "$server"' EXIT
wait_healthy "$port"
mkdir -p "$work/mnt"
"$BIN/batchfs" mount "http://127.0.0.1:$port/d" "$work/mnt" -o epochs=1000,cache=512M
hz=$(getconf CLK_TCK)
for e in $(seq 0 $((EPOCHS - 1))); do
    c0=$(awk '{ print $14 + $15 }' "/proc/$server/stat")
    i0=$(awk '/^cpu / { print $5 + $6 }' /proc/stat)
    json=$("$BIN/batchfs-lab" bench "$work/mnt/$(printf 'epoch-%04d' "$e")" --threads 4 --processes --json)
    c1=$(awk '{ print $14 + $15 }' "/proc/$server/stat")
    i1=$(awk '/^cpu / { print $5 + $6 }' /proc/stat)
    echo "$json" | python3 -c "import json, sys; j = json.load(sys.stdin); \
print('epoch $e: %.0f MB/s, server CPU %.2f s, machine idle %.2f s' % (j['bytes'] / j['wall_s'] / 1e6, \
($c1 - $c0) / $hz, ($i1 - $i0) / $hz))"
done
