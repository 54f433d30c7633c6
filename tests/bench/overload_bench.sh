#!/usr/bin/env bash
# Overload: one server behind one capped link (`batchfs-lab netem`, RATE Mbit/s, shared by all connections),
# N = 1, 2, 4, 8, 16 mounts reading the same epoch at once (`batchfs-lab bench --threads 2` on each); for
# each N: the aggregate rate, each mount's share (min, median, max), the server's peak RSS, the 503s it
# answered (saturation: `--max-bodies-in-flight`) and the mounts' retries and read errors.
#
#   tests/bench/overload_bench.sh [OUT.csv]
#   env: SAMPLES (1000), MEAN (110000), RATE (800), NS ("1 2 4 8 16"), SERVER_ARGS (extra server flags)
#
# Needs root, /dev/fuse and a release build.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/bench/lib.sh"
BIN=$ROOT/target/release
OUT=${1:-/dev/stdout}
SAMPLES=${SAMPLES:-1000} MEAN=${MEAN:-110000} RATE=${RATE:-800} NS=${NS:-1 2 4 8 16}
[ -x "$BIN/batchfs" ] || cargo build --release --workspace --manifest-path "$ROOT/Cargo.toml"
work=$(mktemp -d)
pids=()
trap 'clean_up "$work" "" "${pids[@]}"' EXIT
"$BIN/batchfs-server" gen --format tfrecord --samples "$SAMPLES" --mean-bytes "$MEAN" --out "$work/data" >/dev/null
sport=$(free_port)
# shellcheck disable=SC2086
"$BIN/batchfs-server" serve --listen "127.0.0.1:$sport" --dataset "d=$work/data" ${SERVER_ARGS:-} 2>"$work/server.log" &
server=$!
pids+=("$server")
for _ in $(seq 200); do curl -sf "127.0.0.1:$sport/healthz" >/dev/null && break; sleep 0.1; done
nport=$(free_port)
"$BIN/batchfs-lab" netem --listen "127.0.0.1:$nport" --upstream "127.0.0.1:$sport" --rtt-ms 2 --rate-mbit "$RATE" \
    2>"$work/netem.log" &
pids+=($!)
sleep 0.3
errors_5xx() { curl -s "127.0.0.1:$sport/metrics" | awk '/^batchfs_errors_total\{status="5(00|03)"\}/ { n += $2 } END { print n + 0 }'; }
echo "mounts,aggregate_mb_s,min_mb_s,median_mb_s,max_mb_s,server_peak_rss_mb,server_5xx,mount_retries,read_errors" >"$OUT"
for n in $NS; do
    for i in $(seq "$n"); do
        mkdir -p "$work/mnt-$n-$i"
        "$BIN/batchfs" mount "http://127.0.0.1:$nport/d" "$work/mnt-$n-$i" -o "batch_size=64,cache=256M,epochs=2"
    done
    before=$(errors_5xx)
    ( while sleep 0.2; do awk '/VmRSS/ { print int($2 / 1024) }' "/proc/$server/status"; done ) >"$work/rss-$n" &
    sampler=$!
    start=$(date +%s.%N)
    readers=()
    for i in $(seq "$n"); do
        "$BIN/batchfs-lab" bench "$work/mnt-$n-$i/epoch-0000" --threads 2 --json >"$work/bench-$n-$i.json" &
        readers+=($!)
    done
    wait "${readers[@]}"
    secs=$(echo "$(date +%s.%N) - $start" | bc)
    kill "$sampler" 2>/dev/null || true
    peak=$(sort -n "$work/rss-$n" | tail -1)
    after=$(errors_5xx)
    retries=0
    errors=0
    for i in $(seq "$n"); do
        s=$(cat "$work/mnt-$n-$i/.batchfs/stats")
        retries=$((retries + $(echo "$s" | python3 -c 'import json,sys; print(json.load(sys.stdin)["retries"])')))
        errors=$((errors + $(echo "$s" | python3 -c 'import json,sys; print(json.load(sys.stdin)["errors"])')))
        "$BIN/batchfs" umount "$work/mnt-$n-$i"
    done
    python3 - "$work" "$n" "$secs" "${peak:-0}" "$((${after:-0} - ${before:-0}))" "$retries" "$errors" >>"$OUT" <<'PY'
import json, statistics, sys
work, n, secs, peak, fivexx, retries, errors = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:]
rates = sorted(json.load(open(f"{work}/bench-{n}-{i}.json"))["mb_per_s"] for i in range(1, n + 1))
total = sum(json.load(open(f"{work}/bench-{n}-{i}.json"))["bytes"] for i in range(1, n + 1)) / 1e6 / secs
print(f"{n},{total:.0f},{rates[0]:.0f},{statistics.median(rates):.0f},{rates[-1]:.0f},{peak},{fivexx},{retries},{errors}")
PY
done
