#!/usr/bin/env bash
# The mount's daemon CPU over one ImageFolder epoch of shuffled/ (3,000 heavy-tailed files), each run a
# fresh mount of the same server, through a `batchfs-lab netem` at 0 ms, over TLS: for builds in the order
# given, so that each build's place in the series can be varied (a series' first mount pays more,
# whichever build it is). Prints, per run, the build and the daemon's CPU ticks.
#
#   BUILDS="/path/a /path/b /path/a /path/b" tests/bench/fresh_mounts_bench.sh
#   env: BUILDS (directories holding `batchfs`), SAMPLES (3000), TLS (1; 0 for h2c)
# Needs root, /dev/fuse, a release build (the server and netem come from target/release), openssl, and
# torchvision for /usr/bin/python3.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
BIN=$root/target/release
. "$root/tests/bench/lib.sh"
SAMPLES=${SAMPLES:-3000}
W=$(mktemp -d); mkdir -p "$W/mnt"
pids=()
trap 'clean_up "$W" "" "${pids[@]}" ${NETEM_PID:-}' EXIT
"$BIN/batchfs-server" gen --format files --samples "$SAMPLES" --mean-bytes 110000 --out "$W/tree" >/dev/null
P=$(free_port); SCHEME=http; tls=(); opts=""
if [ "${TLS:-1}" = 1 ]; then
  tls_certificate "$W"; SCHEME=https; tls=(--tls-cert "$W/cert.pem" --tls-key "$W/key.pem"); opts="-o ca_file=$W/ca.pem"
fi
taskset -c 0 "$BIN/batchfs-server" serve --listen "127.0.0.1:$P" --dataset d="$W/tree" "${tls[@]}" 2>/dev/null &
pids+=($!)
wait_healthy "$P"
start_netem "$BIN" "$P" 0
Q=$NETEM_PORT
ticks() { for p in $1; do awk '{print $14 + $15}' "/proc/$p/stat"; done | paste -sd+ | bc; }
for b in $BUILDS; do
  # shellcheck disable=SC2086
  taskset -c 1 "$b/batchfs" mount "$SCHEME://127.0.0.1:$Q/d" "$W/mnt" $opts
  daemon=$(pgrep -f "batchfs mount $SCHEME://127.0.0.1:$Q/d" | tr '\n' ' ')
  c0=$(ticks "$daemon")
  taskset -c 1 /usr/bin/python3 -W ignore "$root/tests/python/loaders.py" imagefolder "$W/mnt/shuffled" >/dev/null
  c1=$(ticks "$daemon")
  echo "$b $((c1 - c0))"
  umount -l "$W/mnt"; sleep 0.5
done
