#!/usr/bin/env bash
# DALI ranks with `shard_id` on one node: N reader processes share one mount, each reading its contiguous
# shard of every epoch (`fn.readers.tfrecord`, `stick_to_shard=True`, as tests/python/loaders.py
# `--shard K/N` runs it), side by side, the mount behind `batchfs-lab netem` at RTT ms. For each epoch after
# the first: the slowest rank's epoch, the reads that fetched on demand (`misses`), the time reads waited
# (`stall`), and the bytes fetched over the bytes served. Each build in turn, ROUNDS times.
#
#   tests/bench/shards_bench.sh OUT_DIR
#   env: RANKS ("2 4"), RTT (30), SAMPLES (10000), EPOCHS (4), ROUNDS (3),
#        BIN (target/release), BIN_BEFORE (a target/release directory of another build, run beside)
#
# Writes OUT_DIR/results.csv (one row per epoch) and OUT_DIR/report.md (medians of epochs 1 and on), and
# prints the report. Needs root, /dev/fuse, DALI (see .ci/run) and a release build.
set -euo pipefail
cd "$(dirname "$0")/../.."
. tests/bench/lib.sh
out=${1:-/tmp/batchfs-shards}
bench_builds
mkdir -p "$out"
bench_work_and_dataset
echo "round,build,ranks,rtt_ms,epoch,slowest_epoch_s,misses,stall_s,fetched_bytes,served_bytes" >"$out/results.csv"
# The mount's counters, as "misses stall_us fetched served".
counters() {
  "$BIN/batchfs" stats --json "$1" | python3 -c 'import json, sys
s = json.load(sys.stdin)
print(s["misses"], s["stall_us"], s["fetched_bytes"], s["bytes_served"])'
}
for round in $(seq 1 "${ROUNDS:-3}"); do
  # The builds take turns going first (on a VM that hands freed memory back to its host, the second
  # reuses pages the first just freed).
  order=("${builds[@]}")
  if [ $((round % 2)) = 0 ] && [ "${#builds[@]}" = 2 ]; then order=("${builds[1]}" "${builds[0]}"); fi
  for bin in "${order[@]}"; do
    for n in ${RANKS:-2 4}; do
      port=$(free_port)
      "$bin/batchfs-server" serve --listen "127.0.0.1:$port" --dataset "d=$work/data" 2>"$work/server.log" &
      server=$!
      pids+=("$server")
      wait_healthy "$port"
      near=$(free_port)
      "$BIN/batchfs-lab" netem --listen "127.0.0.1:$near" --upstream "127.0.0.1:$port" --rtt-ms "${RTT:-30}" \
        2>/dev/null &
      netem=$!
      pids+=("$netem")
      mkdir -p "$work/mnt"
      "$bin/batchfs" mount "http://127.0.0.1:$near/d" "$work/mnt" -o batch_size=128,epochs=100000
      read -r m0 s0 f0 b0 < <(counters "$work/mnt")
      for e in $(seq 0 $((${EPOCHS:-4} - 1))); do
        readers=()
        for k in $(seq 0 $((n - 1))); do
          python3 tests/python/loaders.py dali "$work/mnt/$(printf 'epoch-%04d' "$e")" --shard "$k/$n" \
            >"$work/out-$k" &
          readers+=($!)
        done
        wait "${readers[@]}"
        slowest=$(for k in $(seq 0 $((n - 1))); do
          tail -1 "$work/out-$k" | python3 -c 'import json, sys; print(json.load(sys.stdin)["epoch_s"])'
        done | sort -n | tail -1)
        read -r m1 s1 f1 b1 < <(counters "$work/mnt")
        echo "$round,$(build_name "$bin"),$n,${RTT:-30},$e,$slowest,$((m1 - m0))," \
          "$(python3 -c "print(($s1 - $s0) / 1e6)"),$((f1 - f0)),$((b1 - b0))" | tr -d ' ' | tee -a "$out/results.csv"
        m0=$m1 s0=$s1 f0=$f1 b0=$b1
      done
      "$BIN/batchfs" umount "$work/mnt"
      kill "$server" "$netem"
      wait "$server" "$netem" 2>/dev/null || true
    done
  done
done
python3 - "$out" <<'EOF'
import csv, statistics, sys
out = sys.argv[1]
rows = [r for r in csv.DictReader(open(f"{out}/results.csv")) if int(r["epoch"]) > 0]
keys = sorted({(r["build"], int(r["ranks"])) for r in rows}, key=lambda k: (k[1], k[0]))
lines = ["| build | ranks | slowest rank's epoch, s | misses an epoch | stall an epoch, s | fetched / served |",
         "|---|---|---|---|---|---|"]
for build, n in keys:
    rs = [r for r in rows if r["build"] == build and int(r["ranks"]) == n]
    med = lambda k: statistics.median(float(r[k]) for r in rs)
    ratio = sum(int(r["fetched_bytes"]) for r in rs) / max(1, sum(int(r["served_bytes"]) for r in rs))
    lines.append(f"| {build} | {n} | {med('slowest_epoch_s'):.3f} | {med('misses'):.0f} | {med('stall_s'):.2f} | "
                 f"{ratio:.2f} |")
report = f"DALI ranks with shard_id on one mount, epochs 1 and on (medians), {rows[0]['rtt_ms']} ms\n\n" + "\n".join(lines)
open(f"{out}/report.md", "w").write(report + "\n")
print(report)
EOF
