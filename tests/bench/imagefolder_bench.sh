#!/usr/bin/env bash
# ImageFolder's pattern, unmodified: torchvision.datasets.ImageFolder over a class-folder tree of the
# heavy-tailed generator, read by a DataLoader (shuffle=True, 4 worker processes, one file per item), from
# the local tree and through each remote system behind the same user-space link (`batchfs-lab netem`) at
# each RTT, systems alternating, ROUNDS rounds. Prints medians and ratios; writes results.csv and
# report.md to OUT.
#
#   tests/bench/imagefolder_bench.sh [OUT_DIR]
#   env: SAMPLES (20000), MEAN (110000), RTTS ("0 30 100"), ROUNDS (3), SYSTEMS ("local shuffled raw
#        raw-cached sshfs rclone"; shuffled-cached on request), LIMIT (400: the items a slow path reads, per run, at an RTT above 0; its
#        epoch time is scaled from them), RATE (1000 Mbit/s: raw-cached's link, to compare warming with),
#        MOUNT_OPTS (extra -o options of batchfs mounts), BIN_BEFORE (a directory with another build's
#        `batchfs`: each batchfs system S also runs as S-before, mounted by that build, in the same round
#        beside it, behind the same server), MOUNT_OPTS_BEFORE (the S-before mounts' options instead of
#        MOUNT_OPTS; set alone, this build runs both: `MOUNT_OPTS=supervise=false
#        MOUNT_OPTS_BEFORE=supervise=false,fuse_uring=on` measures FUSE over io_uring against /dev/fuse),
#        TLS (1: the server serves TLS, the mounts trust its CA through ca_file; else h2c)
#
# Systems: local (the tree on local disk, page cache warm), shuffled (a batchfs mount's shuffled/), raw (the
# same mount's raw/: the files under their own names), raw-cached (raw/ of a mount with a fresh cache_dir
# and warm=raw over a link capped at RATE: `warm_s` the warming's time, then the epoch read timed),
# shuffled-cached (the same, reading shuffled/), sshfs (Debian sshfs of the tree to a loopback sshd),
# rclone (rclone mount of the tree as an :http: remote served by nginx). Every run reads through a fresh
# mount. shuffled/ and local read every item of an epoch; raw, sshfs and rclone at an RTT above 0 read LIMIT
# items (an epoch of them would take minutes per run) and their epoch is scaled: the walk (ImageFolder's
# build, `build_s`) plus SAMPLES × the per-item time after it.
# `mount_mb`: the peak RSS of the batchfs mount's daemon in the run (shuffled and raw); `daemon_cpu_s`: its
# CPU time (user and system) during the loader's run, warming excluded.
# Needs root, /dev/fuse, a release build, torchvision for /usr/bin/python3 (python3-torchvision), and:
# apt-get install sshfs openssh-server rclone nginx fuse3
set -euo pipefail
OUT=${1:-/tmp/batchfs-imagefolder}
SAMPLES=${SAMPLES:-20000}; MEAN=${MEAN:-110000}; RTTS=${RTTS:-"0 30 100"}; ROUNDS=${ROUNDS:-3}
SYSTEMS=${SYSTEMS:-"local shuffled raw raw-cached sshfs rclone"}; LIMIT=${LIMIT:-400}; RATE=${RATE:-1000}
MOUNT_OPTS=${MOUNT_OPTS:-}
root=$(cd "$(dirname "$0")/../.." && pwd)
BIN=$root/target/release
. "$root/tests/bench/lib.sh"
[ -x "$BIN/batchfs" ] && [ -x "$BIN/batchfs-server" ] && [ -x "$BIN/batchfs-lab" ] ||
  cargo build --release --workspace --manifest-path "$root/Cargo.toml"
mkdir -p "$OUT"
work=$(mktemp -d); chmod 755 "$work"
pids=()
trap 'umount -l "$work"/mnt-sshfs "$work"/mnt-rclone 2>/dev/null || true; peers_stop "$work"; clean_up "$work" "" "${pids[@]}" ${NETEM_PID:-}' EXIT

"$BIN/batchfs-server" gen --format files --samples "$SAMPLES" --mean-bytes "$MEAN" --out "$work/tree" >/dev/null
chmod -R a+rX "$work/tree"
p_server=$(free_port)
SCHEME=http; tls_args=()
if [ "${TLS:-0}" = 1 ]; then
  tls_certificate "$work"
  SCHEME=https; tls_args=(--tls-cert "$work/cert.pem" --tls-key "$work/key.pem")
  MOUNT_OPTS="ca_file=$work/ca.pem${MOUNT_OPTS:+,$MOUNT_OPTS}"
  [ -z "${MOUNT_OPTS_BEFORE+set}" ] || MOUNT_OPTS_BEFORE="ca_file=$work/ca.pem${MOUNT_OPTS_BEFORE:+,$MOUNT_OPTS_BEFORE}"
fi
RUST_LOG=warn "$BIN/batchfs-server" serve --listen "127.0.0.1:$p_server" --dataset d="$work/tree" "${tls_args[@]}" &
pids+=($!)
wait_healthy "$p_server"
# The peers' servers only where a peer is measured (sshd and nginx need not be installed otherwise).
case " $SYSTEMS " in *" sshfs "* | *" rclone "*) peers_start "$work" ;; esac
mkdir -p "$work/mnt-batchfs" "$work/mnt-sshfs" "$work/mnt-rclone"

mount_system() { # system rtt: sets DIR
  local sys=$1 rtt=$2 bin=$BIN opts=$MOUNT_OPTS
  case $sys in *-before) bin=${BIN_BEFORE:-$BIN}; opts=${MOUNT_OPTS_BEFORE-$MOUNT_OPTS}; sys=${sys%-before} ;; esac
  NETEM_PID=
  case $sys in
    local) DIR=$work/tree ;;
    shuffled|raw)
      start_netem "$BIN" "$p_server" "$rtt"
      "$bin/batchfs" mount "$SCHEME://127.0.0.1:$NETEM_PORT/d" "$work/mnt-batchfs" ${opts:+-o "$opts"}
      DIR=$work/mnt-batchfs/$sys ;;
    raw-cached|shuffled-cached)
      start_netem "$BIN" "$p_server" "$rtt" "$RATE"
      rm -rf "$work/node-cache"
      local o="cache_dir=$work/node-cache,warm=raw${opts:+,$opts}"
      local t0; t0=$(date +%s.%N)
      "$bin/batchfs" mount "$SCHEME://127.0.0.1:$NETEM_PORT/d" "$work/mnt-batchfs" -o "$o"
      until "$BIN/batchfs" stats --json "$work/mnt-batchfs" | python3 -c 'import json,sys; w=json.load(sys.stdin).get("warm") or {}; sys.exit(0 if w and w["files"] >= w["files_total"] else 1)'; do
        sleep 0.2
      done
      WARM_S=$(python3 -c "import time; print(round(time.time() - $t0, 3))")
      DIR=$work/mnt-batchfs/${sys%-cached} ;;
    sshfs)
      start_netem "$BIN" "$P_SSHD" "$rtt"
      mount_sshfs "$work" "$NETEM_PORT" "$work/tree" "$work/mnt-sshfs"
      DIR=$work/mnt-sshfs ;;
    rclone)
      start_netem "$BIN" "$P_NGINX" "$rtt"
      mount_rclone "$NETEM_PORT" tree "$work/mnt-rclone"
      DIR=$work/mnt-rclone ;;
  esac
}
unmount_system() {
  case ${1%-before} in
    local) ;;
    shuffled|raw|raw-cached|shuffled-cached) "$BIN/batchfs" umount "$work/mnt-batchfs" ;;
    sshfs) umount "$work/mnt-sshfs" ;;
    rclone) umount "$work/mnt-rclone" ;;
  esac
  if [ -n "$NETEM_PID" ]; then kill "$NETEM_PID" 2>/dev/null || true; wait "$NETEM_PID" 2>/dev/null || true; fi
}
# The process serving the mount: its worker (the supervisor only holds the connection).
daemon_pid() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["worker_pid"])' "$work/mnt-batchfs/.batchfs/stats"; }
# Its CPU time so far (user + system, clock ticks).
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }

if [ -n "${BIN_BEFORE:-}" ] || [ -n "${MOUNT_OPTS_BEFORE+set}" ]; then
  with=""
  for sys in $SYSTEMS; do
    with="$with $sys"
    case $sys in shuffled|raw|raw-cached|shuffled-cached) with="$with $sys-before" ;; esac
  done
  SYSTEMS=$with
fi
echo "round,system,rtt_ms,items,seconds,bytes,epoch_s,mount_mb,warm_s,daemon_cpu_s" > "$OUT/results.csv"
for round in $(seq "$ROUNDS"); do
  # Each system and its -before twin take turns going first: on a VM that hands freed memory back to
  # its host, the second mount of a pair reuses the pages the first one freed just before (the first
  # faults fresh ones in), which biased every pair toward its second.
  order=$SYSTEMS
  [ $((round % 2)) = 0 ] && order=$(echo $SYSTEMS | sed -E 's/([a-z-]+) \1-before/\1-before \1/g')
  for rtt in $RTTS; do
    for sys in $order; do
      [ "$sys" = local ] && [ "$rtt" != "$(echo $RTTS | cut -d' ' -f1)" ] && continue
      WARM_S=0
      mount_system "$sys" "$rtt"
      limit=()
      case ${sys%-before} in raw|sshfs|rclone) [ "$rtt" != 0 ] && limit=(--limit "$LIMIT") ;; esac
      pid=
      case ${sys%-before} in shuffled|raw|raw-cached|shuffled-cached) pid=$(daemon_pid); t0=$(cpu_ticks "$pid") ;; esac
      json=$(/usr/bin/python3 -W ignore "$root/tests/python/loaders.py" imagefolder "$DIR" "${limit[@]}")
      mb=0 cpu=0
      if [ -n "$pid" ]; then
        mb=$(awk '/VmHWM/ { print int($2 / 1024) }' "/proc/$pid/status")
        cpu=$(python3 -c "import os, sys; print(round((int(sys.argv[1]) - int(sys.argv[2])) / os.sysconf('SC_CLK_TCK'), 2))" "$(cpu_ticks "$pid")" "$t0")
      fi
      unmount_system "$sys"
      row=$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); n=int(sys.argv[2])
e = r["build_s"] + (r["epoch_s"] - r["build_s"]) * n / r["samples"]
print(",".join(str(v) for v in [r["samples"], r["epoch_s"], r["bytes"], round(e, 3)]))' \
        "$json" "$SAMPLES")
      echo "$round,$sys,$rtt,$row,$mb,$WARM_S,$cpu" | tee -a "$OUT/results.csv"
    done
  done
done

python3 - "$OUT" "$SAMPLES" "$RATE" <<'PY' | tee "$OUT/report.md"
import csv, statistics, sys
from collections import defaultdict
out, samples, rate = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
rows = list(csv.DictReader(open(f"{out}/results.csv")))
cells = defaultdict(list)
mem = defaultdict(list)
for r in rows:
    cells[(r["system"], int(r["rtt_ms"]))].append(float(r["epoch_s"]))
    mem[(r["system"], int(r["rtt_ms"]))].append(int(r["mount_mb"]))
med = {k: statistics.median(v) for k, v in cells.items()}
rtts = sorted({k[1] for k in med})
names = ["local", "shuffled", "shuffled-before", "raw", "raw-before", "raw-cached", "raw-cached-before",
         "shuffled-cached", "shuffled-cached-before", "sshfs", "rclone"]
systems = [s for s in names if any(k[0] == s for k in med)]
warm = defaultdict(list)
for r in rows:
    if r["system"] == "raw-cached":
        warm[int(r["rtt_ms"])].append(int(r["bytes"]) / 1e6 / float(r["warm_s"]))
print(f"ImageFolder, DataLoader(shuffle=True, num_workers=4), {samples} files; epoch seconds, medians of "
      f"{max(len(v) for v in cells.values())} rounds (scaled from the items read where fewer than an epoch)\n")
print("| system | " + " | ".join(f"{r} ms" for r in rtts) + " |")
print("|---|" + "---|" * len(rtts))
for s in systems:
    print(f"| {s} | " + " | ".join(f"{med[(s, r)]:.2f}" if (s, r) in med else "—" for r in rtts) + " |")
print()
def ratio(a, b):
    return f"{med[a] / med[b]:.2f}x" if a in med and b in med else "—"
for r in rtts[1:]:
    print(f"- shuffled {r} ms / shuffled {rtts[0]} ms: {ratio(('shuffled', r), ('shuffled', rtts[0]))}")
    for peer in ["raw", "sshfs", "rclone"]:
        print(f"- {peer} {r} ms / shuffled {r} ms: {ratio((peer, r), ('shuffled', r))}")
for r in rtts:
    if ("raw-cached", r) in med and ("raw", rtts[0]) in med:
        print(f"- raw-cached {r} ms (an epoch after warming) / raw {rtts[0]} ms: {ratio(('raw-cached', r), ('raw', rtts[0]))}")
    if warm.get(r):
        mbs = statistics.median(warm[r])
        print(f"- warm=raw at {r} ms over a {rate:.0f} Mbit/s link: {mbs:.0f} MB/s, {mbs / (rate / 8):.2f} of the link "
              "(mount to warm, the mount's start included)")
if ("local", rtts[0]) in med:
    print(f"- shuffled {rtts[0]} ms / local: {ratio(('shuffled', rtts[0]), ('local', rtts[0]))}")
for s in ["shuffled", "raw", "raw-cached", "shuffled-cached"]:
    for r in rtts:
        if (s + "-before", r) in med:
            print(f"- {s} / {s}-before (this build / BIN_BEFORE's or MOUNT_OPTS_BEFORE's), {r} ms: {ratio((s, r), (s + '-before', r))}")
    if ("local", rtts[0]) in med and (s, rtts[0]) in med:
        print(f"- {s} {rtts[0]} ms / local: {ratio((s, rtts[0]), ('local', rtts[0]))}")
    c = [float(r["daemon_cpu_s"]) for r in rows if r["system"] == s and r.get("daemon_cpu_s")]
    cb = [float(r["daemon_cpu_s"]) for r in rows if r["system"] == s + "-before" and r.get("daemon_cpu_s")]
    if c:
        print(f"- the daemon's CPU in the epoch, {s}: median {statistics.median(c):.2f} s"
              + (f" (before: {statistics.median(cb):.2f} s)" if cb else ""))
    m = [v for k, vs in mem.items() if k[0] == s for v in vs]
    if m:
        print(f"- peak RSS of the mount, {s}: median {statistics.median(m)} MB, max {max(m)} MB")
PY
