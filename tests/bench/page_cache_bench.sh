#!/usr/bin/env bash
# The daemon path's page cache over many epochs: one mount with passthrough=false reads EPOCHS epochs with
# DALI (tests/python/loaders.py, defaults: mmap, 4 threads), page_cache=keep then page_cache=drop, ROUNDS
# times alternating; after every epoch it prints the epoch time and the kernel's page cache (Cached in
# /proc/meminfo). With keep, every batch file read stays in the kernel's page cache (each epoch's files
# are new files); with drop, a file's pages go at its last close.
#
#   tests/bench/page_cache_bench.sh DATA_DIR [OUT.csv]
#   env: EPOCHS (8), ROUNDS (1), BATCH (128), CACHE (512M)
#
# DATA_DIR: a TFRecord dataset (e.g. `batchfs-server gen --format tfrecord --samples 20000 --out DIR`).
# Needs root, /dev/fuse, a release build, and DALI (see .ci/run).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=$ROOT/target/release
DATA=${1:?usage: page_cache_bench.sh DATA_DIR [OUT.csv]}
OUT=${2:-/dev/stdout}
EPOCHS=${EPOCHS:-8} ROUNDS=${ROUNDS:-1} BATCH=${BATCH:-128} CACHE=${CACHE:-512M}
[ -x "$BIN/batchfs" ] || cargo build --release --workspace --manifest-path "$ROOT/Cargo.toml"
work=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$BIN/batchfs-server" serve --listen "127.0.0.1:$port" --dataset "d=$DATA" 2>"$work/server.log" &
server=$!
cleanup() {
    "$BIN/batchfs" umount --lazy "$work/mnt" 2>/dev/null || true
    kill "$server" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
for _ in $(seq 100); do curl -sf "127.0.0.1:$port/healthz" >/dev/null && break; sleep 0.1; done
cached_mb() { awk '/^Cached:/ { print int($2 / 1024) }' /proc/meminfo; }
echo "round,page_cache,epoch,epoch_s,cached_mb" >"$OUT"
for round in $(seq "$ROUNDS"); do
    for mode in keep drop; do
        mkdir -p "$work/mnt"
        "$BIN/batchfs" mount "http://127.0.0.1:$port/d" "$work/mnt" \
            -o "batch_size=$BATCH,epochs=$EPOCHS,cache=$CACHE,passthrough=false,page_cache=$mode"
        for e in $(seq 0 $((EPOCHS - 1))); do
            dir=$work/mnt/$(printf 'epoch-%04d' "$e")
            secs=$(python3 "$ROOT/tests/python/loaders.py" dali "$dir" |
                python3 -c 'import json, sys; print(json.load(sys.stdin)["epoch_s"])')
            echo "$round,$mode,$e,$secs,$(cached_mb)" >>"$OUT"
        done
        "$BIN/batchfs" umount "$work/mnt"
    done
done
