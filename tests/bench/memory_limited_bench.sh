#!/usr/bin/env bash
# A dataset larger than the server's memory: the server in a memory cgroup (v1) limited to LIMIT, reading
# by mmap, by pread and by direct reads (`--io`; direct with part of the data held in the server's memory,
# `resident`, and without), against an unlimited server; 4 reader processes read
# whole epochs through a mount of each (`batchfs-lab bench --processes`), the systems alternating, ROUNDS
# rounds, with each server's CPU seconds per epoch. Also the device's sequential rate: `cat` of every
# shard with the page cache dropped.
#
# Each server reads its own copy of the dataset: the kernel charges a page cache page to the cgroup that
# first read it, so servers sharing files would share pages and a limited server would read for free
# what an unlimited one (or a `cat`) brought in.
#
#   tests/bench/memory_limited_bench.sh [OUT.csv]
#   env: SAMPLES (30000), MEAN (110000), SHARDS (32), LIMIT (1G), ROUNDS (3), PREAD_ARGS and DIRECT_ARGS
#        (more flags for the pread and direct servers), DATA (a directory to keep the generated dataset
#        in; generated if empty), SYSTEMS (which to run, of: unlimited limited-mmap limited-pread
#        limited-direct limited-direct-unheld; all but the last by default)
#
# Each limited server has a cgroup of its own, so each may use LIMIT.
#
# Each run reads a new epoch of its mount (nothing repeats from the mount's cache). Dropping the page
# cache (for `cat`) does not evict what the unlimited server has mapped: its epochs after the first are
# served from memory. Needs root, the cgroup v1 memory
# controller at /sys/fs/cgroup/memory, /dev/fuse and a release build.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/bench/lib.sh"
BIN=$ROOT/target/release
OUT=${1:-/dev/stdout}
SAMPLES=${SAMPLES:-30000} MEAN=${MEAN:-110000} SHARDS=${SHARDS:-32} LIMIT=${LIMIT:-1G} ROUNDS=${ROUNDS:-3}
[ -x "$BIN/batchfs" ] || cargo build --release --workspace --manifest-path "$ROOT/Cargo.toml"
work=$(mktemp -d)
DATA=${DATA:-$work/data}
SYSTEMS=${SYSTEMS:-unlimited limited-mmap limited-pread limited-direct}
CG=/sys/fs/cgroup/memory/batchfs-bench-$$
pids=()
declare -A server_pid
trap 'clean_up "$work" "$CG" "${pids[@]}"' EXIT
gen_and_index
# Direct reads leave no pages behind: the direct servers share one copy (the one `cat` reads).
for copy in limited-mmap limited-pread limited-direct; do
    case " $SYSTEMS limited-direct " in *" $copy "*) [ -e "$DATA-$copy/.batchfs-generated" ] || cp -a "$DATA" "$DATA-$copy" ;; esac
done
sync
bytes=$(cat "$DATA"/*.tfrecord | wc -c)
# The device's sequential rate now: every shard read once by `cat`, the page cache dropped before and
# after (the device is shared and its rate swings, so it is measured in every round). It reads the direct
# server's copy: pages a process maps are not dropped (the unlimited server maps "$DATA"), and direct
# reads leave none behind.
cat_cold() {
    echo 3 >/proc/sys/vm/drop_caches
    local start secs
    start=$(date +%s.%N)
    cat "$DATA-limited-direct"/*.tfrecord >/dev/null
    secs=$(echo "$(date +%s.%N) - $start" | bc)
    echo 3 >/proc/sys/vm/drop_caches
    echo "cat-cold,$1,$secs,$(echo "$bytes / $secs / 1000000" | bc),,," >>"$OUT"
}
echo 3 >/proc/sys/vm/drop_caches

# serve NAME [cgroup] ARGS...: a server, optionally inside a limited cgroup of its own, and a mount of it.
serve() {
    local name=$1 cg=$2
    shift 2
    local port
    port=$(free_port)
    if [ "$cg" = limited ]; then
        serve_limited "$CG-$name" "$LIMIT" "$port" "$work/$name.log" --dataset "d=$DATA-${name%-unheld}" "$@"
        server_pid[$name]=$limited_pid
    else
        "$BIN/batchfs-server" serve --listen "127.0.0.1:$port" --dataset "d=$DATA" "$@" 2>"$work/$name.log" &
        server_pid[$name]=$!
    fi
    pids+=("${server_pid[$name]}")
    wait_healthy "$port"
    mkdir -p "$work/mnt-$name"
    "$BIN/batchfs" mount "http://127.0.0.1:$port/d" "$work/mnt-$name" -o "epochs=1000,cache=512M"
}
for name in $SYSTEMS; do
    case $name in
        unlimited) serve unlimited free --io mmap ;;
        limited-mmap) serve limited-mmap limited --io mmap ;;
        limited-pread) serve limited-pread limited --io pread ${PREAD_ARGS:-} ;;
        limited-direct) serve limited-direct limited --io direct ${DIRECT_ARGS:-} ;;
        limited-direct-unheld) serve limited-direct-unheld limited --io direct --resident 0 ${DIRECT_ARGS:-} ;;
        *) echo "unknown system $name" >&2; exit 2 ;;
    esac
done

echo "system,round,epoch_s,mb_per_s,server_rss_mb,major_faults,server_cpu_s" >"$OUT"
# utime + stime of a process, in clock ticks.
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)

epoch=0
for round in $(seq "$ROUNDS"); do
    cat_cold "$round"
    for name in $SYSTEMS; do
        dir=$work/mnt-$name/$(printf 'epoch-%04d' "$epoch")
        pid=${server_pid[$name]}
        cpu0=$(cpu_ticks "$pid")
        json=$("$BIN/batchfs-lab" bench "$dir" --threads 4 --processes --json)
        cpu=$(echo "($(cpu_ticks "$pid") - $cpu0) / $hz" | bc -l)
        rss=$(awk '/VmRSS/ { print int($2 / 1024) }' "/proc/$pid/status")
        majflt=$(awk '{ print $12 }' "/proc/$pid/stat")
        echo "$json" | python3 -c "import json, sys; j = json.load(sys.stdin); \
print('$name,$round,%.3f,%.0f,$rss,$majflt,%.2f' % (j['wall_s'], j['bytes'] / j['wall_s'] / 1e6, $cpu))" >>"$OUT"
    done
    epoch=$((epoch + 1))
done
grep -h -m1 "storage opened" "$work"/limited-*.log >&2 || true
