#!/usr/bin/env bash
# The real loaders (DALI, PyTorch DataLoader, WebDataset; tests/python/loaders.py, default settings,
# unpaced) reading whole epochs through mounts of one server in a memory cgroup (v1) limited to LIMIT
# (`io=direct`), behind `batchfs-lab netem` at 0 and 30 ms RTT, alternating; ROUNDS rounds. One line per
# epoch: loader, RTT, samples, GB, seconds, MB/s.
#
#   tests/bench/limited_loaders.sh DATA [SERVER FLAGS...]
#   env: BIN (the build's target/release; this checkout's by default), LIMIT (1G), ROUNDS (2)
#
# Example, a build before and after a change, alternating:
#   for r in 1 2; do for b in /tmp/old/target/release target/release; do
#       BIN=$b ROUNDS=1 tests/bench/limited_loaders.sh /tmp/bigdata; done; done
#
# Needs root, the cgroup v1 memory controller at /sys/fs/cgroup/memory, /dev/fuse, a release build and the
# loaders (see .ci/run; PyTorch runs under Debian's /usr/bin/python3).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/bench/lib.sh"
BIN=${BIN:-$ROOT/target/release}
DATA=${1:?DATA: a TFRecord dataset directory}
shift
ROUNDS=${ROUNDS:-2}
work=$(mktemp -d)
CG=/sys/fs/cgroup/memory/batchfs-loaders-$$
port=$(free_port)
serve_limited "$CG" "${LIMIT:-1G}" "$port" "$work/server.log" --dataset "d=$DATA" --io direct "$@"
pids=("$limited_pid")
declare -A proxy
for rtt in 0 30; do
    proxy[$rtt]=$(free_port)
    "$BIN/batchfs-lab" netem --listen "127.0.0.1:${proxy[$rtt]}" --upstream "127.0.0.1:$port" --rtt-ms "$rtt" \
        2>/dev/null &
    pids+=($!)
done
trap 'clean_up "$work" "$CG" "${pids[@]}"' EXIT
wait_healthy "$port"
for rtt in 0 30; do
    for fmt in tfrecord tar; do
        mkdir -p "$work/mnt-$rtt-$fmt"
        "$BIN/batchfs" mount "http://127.0.0.1:${proxy[$rtt]}/d" "$work/mnt-$rtt-$fmt" \
            -o "batch_size=128,format=$fmt,epochs=100000,cache=512M"
    done
done
epoch=1
for round in $(seq "$ROUNDS"); do
    for loader in dali torch wds; do
        for rtt in 0 30; do
            fmt=tfrecord py=python3
            [ "$loader" = wds ] && fmt=tar
            [ "$loader" = torch ] && py=/usr/bin/python3
            dir=$work/mnt-$rtt-$fmt/$(printf 'epoch-%04d' "$epoch")
            "$py" "$ROOT/tests/python/loaders.py" "$loader" "$dir" 2>/dev/null | python3 -c "import json, sys; \
j = json.load(sys.stdin); print('round $round $loader ${rtt}ms: %d samples %.2f GB %.2f s %.0f MB/s' % \
(j['samples'], j['bytes'] / 1e9, j['epoch_s'], j['bytes'] / j['epoch_s'] / 1e6))"
        done
        epoch=$((epoch + 1))
    done
done
