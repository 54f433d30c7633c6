#!/usr/bin/env bash
# One server whose memory is smaller than its dataset (a cgroup v1 limited to LIMIT, page cache included,
# `io=IO`) serving MOUNTS mounts at once, each read by `batchfs-lab bench` (4 threads) at the same time:
# the server's peak RSS and the cgroup's peak usage against the documented bound, the aggregate rate, and
# what the dataset's block device read meanwhile (machine-wide: run nothing else).
#
#   tests/bench/limited_fanout.sh
#   env: SAMPLES (30000), MEAN (110000), SHARDS (32), LIMIT (1G), MOUNTS (8), ROUNDS (2), IO (direct, or
#        pread), DATA (kept between runs if given), SERVER_ARGS (more server flags: `--resident 0`)
#
# Needs root, the cgroup v1 memory controller at /sys/fs/cgroup/memory, /dev/fuse and a release build.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/bench/lib.sh"
BIN=$ROOT/target/release
SAMPLES=${SAMPLES:-30000} MEAN=${MEAN:-110000} SHARDS=${SHARDS:-32} LIMIT=${LIMIT:-1G}
MOUNTS=${MOUNTS:-8} ROUNDS=${ROUNDS:-2} IO=${IO:-direct}
[ -x "$BIN/batchfs" ] || cargo build --release --workspace --manifest-path "$ROOT/Cargo.toml"
work=$(mktemp -d)
DATA=${DATA:-$work/data}
CG=/sys/fs/cgroup/memory/batchfs-fanout-$$
server=
trap 'clean_up "$work" "$CG" $server' EXIT
gen_and_index
sync
echo 3 >/proc/sys/vm/drop_caches
port=$(free_port)
# SERVER_ARGS is split into words on purpose (several flags).
# shellcheck disable=SC2086
serve_limited "$CG" "$LIMIT" "$port" "$work/server.log" --dataset "d=$DATA" --io "$IO" ${SERVER_ARGS:-}
server=$limited_pid
wait_healthy "$port"
for m in $(seq "$MOUNTS"); do
    mkdir -p "$work/mnt-$m"
    "$BIN/batchfs" mount "http://127.0.0.1:$port/d" "$work/mnt-$m" -o "epochs=1000,cache=256M"
done
peak_rss=0
# Sectors (512 bytes) read by the device holding the dataset.
device=$(basename "$(df --output=source "$DATA" | tail -1)")
sectors() { awk '{ print $3 }' "/sys/class/block/$device/stat"; }
echo "round,mounts,wall_s,aggregate_mb_per_s,server_peak_rss_mb,cgroup_peak_mb,device_read_mb"
for round in $(seq "$ROUNDS"); do
    epoch=$(printf 'epoch-%04d' "$round")
    start=$(date +%s.%N)
    read0=$(sectors)
    jobs_pids=()
    for m in $(seq "$MOUNTS"); do
        "$BIN/batchfs-lab" bench "$work/mnt-$m/$epoch" --threads 4 --json >"$work/bench-$m.json" &
        jobs_pids+=($!)
    done
    while kill -0 "${jobs_pids[0]}" 2>/dev/null || [ "$(jobs -pr | wc -l)" -gt 1 ]; do
        rss=$(awk '/VmRSS/ { print int($2 / 1024) }' "/proc/$server/status")
        [ "$rss" -gt "$peak_rss" ] && peak_rss=$rss
        sleep 0.2
        [ "$(jobs -pr | grep -vc "^$server\$")" -eq 0 ] && break
    done
    wait "${jobs_pids[@]}"
    wall=$(echo "$(date +%s.%N) - $start" | bc)
    bytes=$(cat "$work"/bench-*.json | python3 -c "import json, sys; print(sum(json.loads(l)['bytes'] for l in sys.stdin))")
    cg_peak=$(($(cat "$CG/memory.max_usage_in_bytes") / 1048576))
    device_mb=$((($(sectors) - read0) * 512 / 1000000))
    echo "$round,$MOUNTS,$wall,$(echo "$bytes / $wall / 1000000" | bc),$peak_rss,$cg_peak,$device_mb"
done
grep -m1 "storage opened" "$work/server.log" >&2 || true
