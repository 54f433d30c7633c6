#!/usr/bin/env bash
# One point of the latency lab: the same epoch read from local disk (page cache warm), through batchfs
# mounted directly (RTT ~0) and through batchfs behind `batchfs-lab netem` at RTT X ms, paced and unpaced,
# the systems alternating, ROUNDS rounds; prints medians and ratios.
#
#   tests/bench/latency_point.sh [RTT_MS] [PACE_MBPS] [ROUNDS]
#
# Needs root and /dev/fuse (it mounts under a temporary directory) and a release build.
set -euo pipefail
RTT=${1:-30}
PACE=${2:-200}
ROUNDS=${3:-3}
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/target/release
[ -x "$bin/batchfs" ] && [ -x "$bin/batchfs-server" ] || cargo build --release --workspace --manifest-path "$root/Cargo.toml"
work=$(mktemp -d)
cleanup() {
  "$bin/batchfs" umount --lazy "$work/mnt" 2>/dev/null || true
  kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
pids=()
trap cleanup EXIT
mkdir -p "$work/mnt"
"$bin/batchfs-server" gen --format tfrecord --samples 2000 --mean-bytes 110000 --shards 16 --out "$work/data" >/dev/null
pa=$((20000 + RANDOM % 10000)); pb=$((pa + 1))
RUST_LOG=warn "$bin/batchfs-server" serve --listen "127.0.0.1:$pa" --dataset d="$work/data" & pids+=($!)
"$bin/batchfs-lab" netem --listen "127.0.0.1:$pb" --upstream "127.0.0.1:$pa" --rtt-ms "$RTT" 2>/dev/null & pids+=($!)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$pa/healthz" >/dev/null && break; sleep 0.1; done
opts="batch_size=64,epochs=1"

# Local disk: the same batch files copied out of a mount.
"$bin/batchfs" mount "http://127.0.0.1:$pa/d" "$work/mnt" -o "$opts"
cp -r "$work/mnt/epoch-0000" "$work/local"
"$bin/batchfs" umount "$work/mnt"

bench() { # dir paced? -> wall seconds
  local extra=()
  [ "$2" = paced ] && extra=(--consume-mbps "$PACE")
  "$bin/batchfs-lab" bench "$1" --threads 4 --pattern interleaved --json "${extra[@]}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["wall_s"])'
}
: > "$work/results"
for round in $(seq "$ROUNDS"); do
  for mode in unpaced paced; do
    echo "local $mode $(bench "$work/local" $mode)" >> "$work/results"
    for sys in "batchfs-0ms:$pa" "batchfs-${RTT}ms:$pb"; do
      name=${sys%%:*}; port=${sys##*:}
      "$bin/batchfs" mount "http://127.0.0.1:$port/d" "$work/mnt" -o "$opts"
      echo "$name $mode $(bench "$work/mnt/epoch-0000" $mode)" >> "$work/results"
      "$bin/batchfs" umount "$work/mnt"
    done
  done
done
python3 - "$work/results" "$RTT" "$PACE" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
rtt, pace = sys.argv[2], sys.argv[3]
systems = ["local", "batchfs-0ms", f"batchfs-{rtt}ms"]
print(f"epoch of 219 MB, 4 interleaved readers; paced = {pace} MB/s total; medians of {len(rows) // 6} rounds")
print(f"{'system':<16} {'unpaced s':>10} {'paced s':>10}")
med = {}
for s in systems:
    for m in ("unpaced", "paced"):
        med[s, m] = statistics.median(float(r[2]) for r in rows if r[0] == s and r[1] == m)
    print(f"{s:<16} {med[s, 'unpaced']:>10.3f} {med[s, 'paced']:>10.3f}")
far = f"batchfs-{rtt}ms"
print(f"paced: {rtt} ms / 0 ms = {med[far, 'paced'] / med['batchfs-0ms', 'paced']:.3f}x; "
      f"{rtt} ms / local = {med[far, 'paced'] / med['local', 'paced']:.3f}x")
print(f"unpaced: batchfs 0 ms reads at {med['local', 'unpaced'] / med['batchfs-0ms', 'unpaced'] * 100:.0f} % of local page-cache speed")
PY
