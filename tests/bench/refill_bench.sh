#!/usr/bin/env bash
# The daemon's CPU over steady epochs of one long-lived mount, and where the bodies went: a loader (DALI's
# `fn.readers.tfrecord` by default) reads EPOCHS epoch folders one after another, each a new pipeline as in
# training, the server pinned to SERVER_CPU and the mount and the loader to NODE_CPU, straight to the
# server (0 ms). After a lead epoch: the daemon's CPU ticks (utime + stime of its process, 10 ms each),
# the bytes it fetched and the share of them received into memory files filled again (`batchfs stats`:
# `recycled_bytes` over `fetched_bytes`). Several epochs to one figure, so that a tick is a small part of
# it (cpu_bench.py counts one epoch at a time). Each build in turn, ROUNDS times, each with a fresh mount.
#
#   tests/bench/refill_bench.sh OUT_DIR
#   env: LOADER (dali; torch: as tests/python/loaders.py names them), LOADER_ARGS (more of its arguments,
#        e.g. --no-mmap), SAMPLES (10000), EPOCHS (3 counted),
#        ROUNDS (3), MOUNT_OPTS (extra -o options), SERVER_CPU (0), NODE_CPU (1),
#        BIN (target/release), BIN_BEFORE (a target/release directory of another build, run beside)
#
# Writes OUT_DIR/results.csv (one row per build and round) and OUT_DIR/report.md (medians), and prints
# the report. Needs root, /dev/fuse, the loader (see .ci/run) and a release build.
set -euo pipefail
cd "$(dirname "$0")/../.."
. tests/bench/lib.sh
out=${1:-/tmp/batchfs-refill}
bench_builds
loader=${LOADER:-dali}
python=python3
[ "$loader" = torch ] && python=/usr/bin/python3
server_cpu=${SERVER_CPU:-0} node_cpu=${NODE_CPU:-1}
mkdir -p "$out"
bench_work_and_dataset
port=$(free_port)
taskset -c "$server_cpu" "$BIN/batchfs-server" serve --listen "127.0.0.1:$port" --dataset "d=$work/data" \
  2>"$work/server.log" &
pids+=($!)
wait_healthy "$port"
echo "round,build,loader,epochs,daemon_ticks,fetched_bytes,recycled_bytes,epoch_s" >"$out/results.csv"
# The mount's counters, as "fetched recycled".
counters() {
  "$1/batchfs" stats --json "$2" | python3 -c 'import json, sys
s = json.load(sys.stdin)
print(s["fetched_bytes"], s.get("recycled_bytes", 0))'
}
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
epoch() {
  # shellcheck disable=SC2086 # LOADER_ARGS: several arguments
  taskset -c "$node_cpu" "$python" tests/python/loaders.py "$loader" "$work/mnt/$(printf 'epoch-%04d' "$1")" \
    ${LOADER_ARGS:-} |
    tail -1 | python3 -c 'import json, sys; print(json.load(sys.stdin)["epoch_s"])'
}
for round in $(seq 1 "${ROUNDS:-3}"); do
  # The builds take turns going first (on a VM that hands freed memory back to its host, the second
  # reuses pages the first just freed).
  order=("${builds[@]}")
  if [ $((round % 2)) = 0 ] && [ "${#builds[@]}" = 2 ]; then order=("${builds[1]}" "${builds[0]}"); fi
  for bin in "${order[@]}"; do
    mkdir -p "$work/mnt"
    taskset -c "$node_cpu" "$bin/batchfs" mount "http://127.0.0.1:$port/d" "$work/mnt" \
      -o "batch_size=128,epochs=100000,supervise=false${MOUNT_OPTS:+,$MOUNT_OPTS}"
    daemon=$(pgrep -f "batchfs mount .* $work/mnt" | head -1)
    epoch 0 >/dev/null
    read -r f0 r0 < <(counters "$bin" "$work/mnt")
    t0=$(ticks "$daemon")
    times=()
    for e in $(seq 1 "${EPOCHS:-3}"); do
      times+=("$(epoch "$e")")
    done
    t1=$(ticks "$daemon")
    read -r f1 r1 < <(counters "$bin" "$work/mnt")
    median=$(printf '%s\n' "${times[@]}" | sort -n | sed -n "$(((${#times[@]} + 1) / 2))p")
    echo "$round,$(build_name "$bin"),$loader,${EPOCHS:-3},$((t1 - t0))," \
      "$((f1 - f0)),$((r1 - r0)),$median" | tr -d ' ' | tee -a "$out/results.csv"
    "$BIN/batchfs" umount "$work/mnt"
  done
done
python3 - "$out" <<'EOF'
import csv, statistics, sys
out = sys.argv[1]
rows = list(csv.DictReader(open(f"{out}/results.csv")))
lines = ["| build | daemon ticks (10 ms) | fetched, MB | into files filled again | epoch, s |", "|---|---|---|---|---|"]
for build in dict.fromkeys(r["build"] for r in rows):
    rs = [r for r in rows if r["build"] == build]
    med = lambda f: statistics.median(f(r) for r in rs)
    lines.append(f"| {build} | {med(lambda r: int(r['daemon_ticks'])):.0f} | "
                 f"{med(lambda r: int(r['fetched_bytes'])) / 1e6:,.0f} | "
                 f"{med(lambda r: int(r['recycled_bytes']) / max(1, int(r['fetched_bytes']))):.0%} | "
                 f"{med(lambda r: float(r['epoch_s'])):.3f} |")
report = (f"{rows[0]['loader']}, {rows[0]['epochs']} epochs after a lead one, one mount a round (medians of "
          f"{len(rows) // max(1, len({r['build'] for r in rows}))} rounds)\n\n" + "\n".join(lines))
open(f"{out}/report.md", "w").write(report + "\n")
print(report)
EOF
