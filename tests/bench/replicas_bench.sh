#!/usr/bin/env bash
# Replicas: K = 1, 2, 3 servers of the same dataset, each behind its own capped link (`batchfs-lab netem`,
# RATE Mbit/s each), one mount of all K (`servers=`), an epoch read with `batchfs-lab bench --threads 4`; the
# K alternate, ROUNDS rounds, each run on a fresh mount. Reports MB/s per run and the median per K with
# its ratio to K = 1 (the goal: 1.9x for 2, 2.8x for 3).
#
#   tests/bench/replicas_bench.sh [OUT.csv]
#   env: SAMPLES (2000), MEAN (110000), RATE (400), ROUNDS (3)
#
# Needs root, /dev/fuse and a release build.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/bench/lib.sh"
BIN=$ROOT/target/release
OUT=${1:-/dev/stdout}
SAMPLES=${SAMPLES:-2000} MEAN=${MEAN:-110000} RATE=${RATE:-400} ROUNDS=${ROUNDS:-3}
[ -x "$BIN/batchfs" ] || cargo build --release --workspace --manifest-path "$ROOT/Cargo.toml"
work=$(mktemp -d)
pids=()
trap 'clean_up "$work" "" "${pids[@]}"' EXIT
"$BIN/batchfs-server" gen --format tfrecord --samples "$SAMPLES" --mean-bytes "$MEAN" --out "$work/data" >/dev/null
links=()
for k in 1 2 3; do
    sport=$(free_port)
    "$BIN/batchfs-server" serve --listen "127.0.0.1:$sport" --dataset "d=$work/data" 2>"$work/server-$k.log" &
    pids+=($!)
    for _ in $(seq 200); do curl -sf "127.0.0.1:$sport/healthz" >/dev/null && break; sleep 0.1; done
    nport=$(free_port)
    "$BIN/batchfs-lab" netem --listen "127.0.0.1:$nport" --upstream "127.0.0.1:$sport" --rtt-ms 2 \
        --rate-mbit "$RATE" 2>"$work/netem-$k.log" &
    pids+=($!)
    links+=("http://127.0.0.1:$nport")
done
sleep 0.3
echo "round,replicas,epoch_s,mb_per_s" >"$work/rows.csv"
for round in $(seq "$ROUNDS"); do
    for k in 1 2 3; do
        others=$(IFS=';'; echo "${links[*]:1:$((k - 1))}")
        opts="batch_size=64,cache=512M"
        [ -n "$others" ] && opts="$opts,servers=$others"
        mkdir -p "$work/mnt"
        "$BIN/batchfs" mount "${links[0]}/d" "$work/mnt" -o "$opts"
        json=$("$BIN/batchfs-lab" bench "$work/mnt/epoch-0000" --threads 4 --json)
        "$BIN/batchfs" umount "$work/mnt"
        echo "$json" | python3 -c "import json, sys; j = json.load(sys.stdin); \
print('$round,$k,%.3f,%.1f' % (j['wall_s'], j['mb_per_s']))" >>"$work/rows.csv"
    done
done
python3 - "$work/rows.csv" "$RATE" <<'PY' >&2
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
med = {k: statistics.median(float(r["mb_per_s"]) for r in rows if r["replicas"] == k) for k in "123"}
print(f"# link {sys.argv[2]} Mbit/s each ({float(sys.argv[2]) / 8:.0f} MB/s); medians: "
      + ", ".join(f"{k} replica(s) {med[k]:.1f} MB/s ({med[k] / med['1']:.2f}x)" for k in "123"))
PY
cat "$work/rows.csv" >"$OUT"
