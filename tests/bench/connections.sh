#!/usr/bin/env bash
# The TCP connections a mount holds to its server once it has read an epoch of batch files and listed
# every view (descriptions, manifests, listings: the JSON replies; batches: the bodies), default options,
# counted by `ss` on the server's port. Each build in turn, ROUNDS times.
#
#   tests/bench/connections.sh BATCHFS [BATCHFS_BEFORE]      env: ROUNDS (3)
#
# BATCHFS is a `batchfs` binary (target/release/batchfs); the server is target/release/batchfs-server.
# Needs root and /dev/fuse. Prints a line per mount.
set -euo pipefail
cd "$(dirname "$0")/../.."
server=$(realpath target/release/batchfs-server)
work=$(mktemp -d)
mnt=$work/mnt
server_pid=
cleanup() {
  umount "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null || true
  [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
"$server" gen --format tfrecord --samples 2000 --shards 16 --out "$work/data" >/dev/null
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$server" serve --listen "127.0.0.1:$port" --dataset "d=$work/data" 2>"$work/server.log" &
server_pid=$!
for _ in $(seq 1 100); do
  curl -sf "http://127.0.0.1:$port/healthz" >/dev/null && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.log"; exit 1; }
  sleep 0.2
done
mkdir -p "$mnt"
for round in $(seq 1 "${ROUNDS:-3}"); do
  for bin in "$@"; do
    "$bin" mount "http://127.0.0.1:$port/d" "$mnt"
    ls "$mnt" "$mnt"/* >/dev/null 2>&1 || true
    ls -R "$mnt/raw" >/dev/null
    cat "$mnt"/epoch-0000/*.tfrecord >/dev/null
    sleep 1
    n=$(ss -tn state established "( dport = :$port )" | tail -n +2 | wc -l)
    echo "round=$round build=$bin connections=$n"
    umount "$mnt"
  done
done
