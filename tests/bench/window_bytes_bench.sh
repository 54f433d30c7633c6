#!/usr/bin/env bash
# The window in bytes for small batches: DALI (default settings, unpaced) reading fresh epochs through two
# mounts of one server behind `batchfs-lab netem`, one with the window in batches only (prefetch_bytes=0, as
# before) and one with the default prefetch_bytes, alternating, ROUNDS rounds per batch size.
#
#   tests/bench/window_bytes_bench.sh [OUT_CSV]
#   env: BATCHES ("16 32 128"), RTT_MS (30), ROUNDS (5), SAMPLES (12000), MEAN (110000 bytes)
#
# Prints one CSV row per epoch read (batch_size, round, window, epoch_s, stalls and stall seconds of that
# mount so far) and the medians per batch size. Needs a release build and DALI (see .ci/run).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/bench/lib.sh"
B=$ROOT/target/release
OUT=${1:-/tmp/batchfs-window-bytes.csv}
BATCHES=${BATCHES:-16 32 128} RTT_MS=${RTT_MS:-30} ROUNDS=${ROUNDS:-5}
SAMPLES=${SAMPLES:-12000} MEAN=${MEAN:-110000}
WORK=$(mktemp -d /tmp/batchfs-window-bytes-XXXXXX)
PIDS=()
BIN=$B
trap 'clean_up "$WORK" "" "${PIDS[@]}"' EXIT
"$B/batchfs-server" gen --format tfrecord --samples "$SAMPLES" --mean-bytes "$MEAN" --out "$WORK/data" >/dev/null
SP=$(free_port); NP=$(free_port)
"$B/batchfs-server" serve --listen "127.0.0.1:$SP" --dataset "d=$WORK/data" 2>/dev/null & PIDS+=($!)
"$B/batchfs-lab" netem --listen "127.0.0.1:$NP" --upstream "127.0.0.1:$SP" --rtt-ms "$RTT_MS" 2>/dev/null & PIDS+=($!)
sleep 1.5
echo "batch_size,round,window,epoch_s,stalls,stall_s" >"$OUT"
stat_of() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["stalls"], d["stall_us"] / 1e6)' "$1"; }
for bs in $BATCHES; do
    for w in batches bytes; do
        opt=$([ "$w" = batches ] && echo prefetch_bytes=0 || echo prefetch_bytes=128M)
        mkdir -p "$WORK/m-$bs-$w"
        "$B/batchfs" mount "http://127.0.0.1:$NP/d" "$WORK/m-$bs-$w" -o "batch_size=$bs,epochs=100000,cache=512M,$opt"
    done
    for r in $(seq 1 "$ROUNDS"); do
        order="batches bytes"; [ $((r % 2)) -eq 0 ] && order="bytes batches"
        for w in $order; do
            m=$WORK/m-$bs-$w
            s=$(python3 "$ROOT/tests/python/loaders.py" dali "$m/epoch-$(printf %04d "$r")" |
                python3 -c 'import json,sys; print(json.load(sys.stdin)["epoch_s"])')
            read -r stalls stall_s < <(stat_of "$m/.batchfs/stats")
            echo "$bs,$r,$w,$s,$stalls,$stall_s" | tee -a "$OUT"
        done
    done
    for w in batches bytes; do "$B/batchfs" umount --lazy "$WORK/m-$bs-$w"; done
done
python3 - "$OUT" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print("| batch_size | window in batches s | window in bytes s | bytes / batches |")
print("|---|---|---|---|")
for bs in dict.fromkeys(r["batch_size"] for r in rows):
    med = {w: statistics.median(float(r["epoch_s"]) for r in rows if r["batch_size"] == bs and r["window"] == w)
           for w in ("batches", "bytes")}
    print(f"| {bs} | {med['batches']:.2f} | {med['bytes']:.2f} | {med['bytes'] / med['batches']:.3f} |")
PY
