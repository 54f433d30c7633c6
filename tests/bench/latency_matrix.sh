#!/usr/bin/env bash
# The latency-lab matrix: one generated dataset's epoch-0 batch files read by five systems through the
# same user-space link (`batchfs-lab netem`), at several RTTs, paced and unpaced, systems alternating,
# ROUNDS rounds; then bandwidth-capped links. Prints medians and ratios; writes results.csv, report.md
# and the figures (epoch-vs-rtt.png, throughput-vs-link.png) to OUT.
#
#   tests/bench/latency_matrix.sh [OUT_DIR]
#   env: SAMPLES (2000), MEAN (110000), RTTS ("0 1 10 30"), PACE (200 MB/s), ROUNDS (3), RATES ("250 500 1000" Mbit/s),
#        SAMPLE_PEERS (0; 1 adds sshfs-samples and rclone-samples: the peers reading the same samples as one
#        file each, an ImageFolder tree, the way a loader without batchfs reads them), RATES="" skips the caps,
#        READERS (processes; or threads), ENERGY (auto: an energy column when `batchfs-lab energy` finds a sensor)
#
# Every cell also records CPU seconds: the whole machine's busy time during the read (`batchfs-lab bench`
# reads /proc/stat), minus the netem proxy's own CPU and the idle machine's background rate measured at
# the start; the report divides it by the GB read.
#
# Systems: local (plain directory, page cache warm), batchfs (defaults), batchfs-noprefetch (prefetch=0),
# sshfs (Debian sshfs to a loopback sshd), rclone (rclone mount of an :http: remote served by nginx).
# Needs root, /dev/fuse, a release build, and: apt-get install sshfs openssh-server rclone nginx fuse3
set -euo pipefail
OUT=${1:-/tmp/batchfs-matrix}
SAMPLES=${SAMPLES:-2000}; MEAN=${MEAN:-110000}; RTTS=${RTTS:-"0 1 10 30"}
PACE=${PACE:-200}; ROUNDS=${ROUNDS:-3}; RATES=${RATES-"250 500 1000"}; SAMPLE_PEERS=${SAMPLE_PEERS:-0}
READERS=${READERS:-processes}; ENERGY=${ENERGY:-auto}
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/target/release
BIN=$bin
. "$root/tests/bench/lib.sh"
[ -x "$bin/batchfs" ] && [ -x "$bin/batchfs-server" ] || cargo build --release --workspace --manifest-path "$root/Cargo.toml"
for tool in sshfs sshd rclone nginx; do command -v $tool >/dev/null || [ -x /usr/sbin/$tool ] || { echo "missing $tool" >&2; exit 1; }; done
mkdir -p "$OUT"
work=$(mktemp -d); chmod 755 "$work"
pids=()
cleanup() {
  for m in "$work"/mnt-*; do umount -l "$m" 2>/dev/null || true; done
  kill "${pids[@]}" ${NETEM_PID:-} 2>/dev/null || true
  peers_stop "$work"
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
port() { free_port; }

# The dataset, the server, and the batch files as plain files (for local, sshfs and rclone).
"$bin/batchfs-server" gen --format tfrecord --samples "$SAMPLES" --mean-bytes "$MEAN" --shards 16 --out "$work/data" >/dev/null
# The same samples (same seed) as one file each, for the per-sample peers.
[ "$SAMPLE_PEERS" = 1 ] && "$bin/batchfs-server" gen --format files --samples "$SAMPLES" --mean-bytes "$MEAN" --out "$work/tree" >/dev/null
p_server=$(port)
RUST_LOG=warn "$bin/batchfs-server" serve --listen "127.0.0.1:$p_server" --dataset d="$work/data" & pids+=($!)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$p_server/healthz" >/dev/null && break; sleep 0.1; done
opts="batch_size=64,epochs=1"
mkdir -p "$work/mnt-batchfs" "$work/mnt-sshfs" "$work/mnt-rclone" "$work/files"
"$bin/batchfs" mount "http://127.0.0.1:$p_server/d" "$work/mnt-batchfs" -o "$opts"
cp "$work"/mnt-batchfs/epoch-0000/*.tfrecord "$work/files/"
"$bin/batchfs" umount "$work/mnt-batchfs"
chmod -R a+rX "$work/files"; [ -d "$work/tree" ] && chmod -R a+rX "$work/tree"
bytes=$(du -sb "$work/files" | cut -f1)

# Peers' servers: sshd and nginx on loopback.
peers_start "$work"
p_sshd=$P_SSHD; p_nginx=$P_NGINX

mount_system() { # system rtt [rate]: sets DIR (and starts a netem for remote systems)
  local sys=$1 rtt=$2 rate=${3:-}
  NETEM_PID=
  case $sys in
    local) DIR=$work/files ;;
    batchfs|batchfs-noprefetch)
      start_netem "$bin" "$p_server" "$rtt" "$rate"
      local o=$opts; [ "$sys" = batchfs-noprefetch ] && o="$o,prefetch=0"
      "$bin/batchfs" mount "http://127.0.0.1:$NETEM_PORT/d" "$work/mnt-batchfs" -o "$o"
      DIR=$work/mnt-batchfs/epoch-0000 ;;
    sshfs|sshfs-samples)
      local src=files; [ "$sys" = sshfs-samples ] && src=tree
      start_netem "$bin" "$p_sshd" "$rtt" "$rate"
      mount_sshfs "$work" "$NETEM_PORT" "$work/$src" "$work/mnt-sshfs"
      DIR=$work/mnt-sshfs ;;
    rclone|rclone-samples)
      local src=files; [ "$sys" = rclone-samples ] && src=tree
      start_netem "$bin" "$p_nginx" "$rtt" "$rate"
      mount_rclone "$NETEM_PORT" "$src" "$work/mnt-rclone"
      DIR=$work/mnt-rclone ;;
  esac
}
unmount_system() {
  case $1 in
    local) ;;
    batchfs|batchfs-noprefetch) "$bin/batchfs" umount "$work/mnt-batchfs" ;;
    sshfs|sshfs-samples) umount "$work/mnt-sshfs" ;;
    rclone|rclone-samples) umount "$work/mnt-rclone" ;;
  esac
  if [ -n "$NETEM_PID" ]; then kill "$NETEM_PID" 2>/dev/null || true; wait "$NETEM_PID" 2>/dev/null || true; fi
}
proc_cpu() { # pid -> CPU seconds so far (0 when there is no such process)
  [ -n "$1" ] && [ -r "/proc/$1/stat" ] || { echo 0; return; }
  awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); print ($12 + $13) / hz }' "/proc/$1/stat"
}
machine_cpu() { awk -v hz="$(getconf CLK_TCK)" '/^cpu / { print ($2 + $3 + $4 + $7 + $8) / hz }' /proc/stat; }
# The idle machine's background CPU rate (daemons, the idle mounts of the other systems), per second.
c0=$(machine_cpu); sleep 5; IDLE_CPU=$(python3 -c "print(max(0.0, ($(machine_cpu) - $c0) / 5))")
echo "idle machine: $IDLE_CPU CPU s/s" >&2
# Energy: a column only where `batchfs-lab energy` finds a sensor (it says which are unavailable, and why).
if [ "$ENERGY" = auto ]; then
  "$bin/batchfs-lab" energy --idle 0s --out "$OUT/energy-idle.jsonl" -- sleep 5 2> "$OUT/energy-probe.txt" || true
  if python3 -c 'import json,sys; s=json.loads(open(sys.argv[1]).read().splitlines()[-1])["summary"]; sys.exit(0 if s["sensors"] else 1)' "$OUT/energy-idle.jsonl"; then
    ENERGY=1
  else
    ENERGY=0; echo "energy: no sensor on this machine, no energy column (see $OUT/energy-probe.txt)" >&2
  fi
fi
CELL=0
bench() { # dir mode -> "wall_s mb_per_s cpu_s energy_file"
  local extra=(); [ "$2" = paced ] && extra=(--consume-mbps "$PACE")
  [ "$READERS" = processes ] && extra+=(--processes)
  local wrap=() efile=-
  CELL=$((CELL + 1))
  if [ "$ENERGY" = 1 ]; then efile=$OUT/energy/cell-$CELL.jsonl; mkdir -p "$OUT/energy"; wrap=("$bin/batchfs-lab" energy --idle 0s --out "$efile" --); fi
  local n0; n0=$(proc_cpu "${NETEM_PID:-}")
  "${wrap[@]}" "$bin/batchfs-lab" bench "$1" --threads 4 --pattern interleaved --json "${extra[@]}" 2>/dev/null |
    python3 -c 'import json,sys; r=json.load(sys.stdin); n0, n1, idle, e = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
cpu = r["machine_cpu_s"] - (n1 - n0) - idle * r["wall_s"]
print(r["wall_s"], r["mb_per_s"], round(max(cpu, 0.0), 3), e)' "$n0" "$(proc_cpu "${NETEM_PID:-}")" "$IDLE_CPU" "$efile"
}

echo "system,rtt_ms,mode,round,wall_s,mb_per_s,cpu_s,energy_log" > "$OUT/results.csv"
systems="local batchfs batchfs-noprefetch sshfs rclone"
[ "$SAMPLE_PEERS" = 1 ] && systems="$systems sshfs-samples rclone-samples"
for round in $(seq "$ROUNDS"); do
  for rtt in $RTTS; do
    for mode in unpaced paced; do
      for sys in $systems; do
        mount_system "$sys" "$rtt"
        read -r wall mbs cpu efile < <(bench "$DIR" "$mode")
        unmount_system "$sys"
        echo "$sys,$rtt,$mode,$round,$wall,$mbs,$cpu,$efile" >> "$OUT/results.csv"
        echo "round $round rtt $rtt $mode $sys: $wall s ($mbs MB/s, $cpu CPU s)" >&2
      done
    done
  done
done
# Bandwidth-capped links: 10 ms RTT, each of RATES Mbit/s, unpaced.
for round in $(seq "$ROUNDS"); do
  for rate in $RATES; do
    for sys in batchfs sshfs rclone; do
      mount_system "$sys" 10 "$rate"
      read -r wall mbs cpu efile < <(bench "$DIR" unpaced)
      unmount_system "$sys"
      echo "$sys,10,capped-$rate,$round,$wall,$mbs,$cpu,$efile" >> "$OUT/results.csv"
      echo "round $round capped $rate $sys: $wall s ($mbs MB/s)" >&2
    done
  done
done
python3 "$root/tests/bench/matrix_report.py" "$OUT/results.csv" "$bytes" "$PACE" "$READERS" "$OUT/energy-idle.jsonl" | tee "$OUT/report.md"
cargo run --release -q -p batchfs-plot --manifest-path "$root/Cargo.toml" -- "$OUT/results.csv" "$OUT"
