#!/usr/bin/env bash
# An ImageNet-shaped dataset, 1,281,167 small samples (a few KB, so the disk holds them), as FORMAT:
# `files` (a tree of 1,000 class folders) or `tar` (1,024 WebDataset shards). Measures, one run each: the
# index build with the page cache dropped against a cold `cat` of the same files, the index on disk,
# the indexing peak RSS, the restart with the index reused, the server's RSS, an epoch's manifest (time
# and size), the first page of the file list, and a mount's first `ls` of an epoch, of `raw/` and of one
# of its directories, and its RSS.
#
#   tests/bench/imagenet_shape.sh FORMAT [DATA_DIR]      # FORMAT: files or tar
#   env: SAMPLES (1281167), MEAN (3000), PORT (7999)
#
# Needs root (drop_caches), /dev/fuse and a release build. Prints `name value` lines.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=$ROOT/target/release
FORMAT=${1:?FORMAT: files or tar}
DATA=${2:-/tmp/imagenet-$FORMAT}
SAMPLES=${SAMPLES:-1281167} MEAN=${MEAN:-3000} PORT=${PORT:-7999}
[ -x "$BIN/batchfs" ] || cargo build --release --workspace --manifest-path "$ROOT/Cargo.toml"
mnt=$(mktemp -d)
server=
cleanup() {
    "$BIN/batchfs" umount --lazy "$mnt" 2>/dev/null || true
    [ -n "$server" ] && kill "$server" 2>/dev/null || true
    wait 2>/dev/null || true
    rmdir "$mnt" 2>/dev/null || true
}
trap cleanup EXIT
now() { date +%s.%N; }
since() { echo "$(now) - $1" | bc; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
if [ ! -d "$DATA" ]; then
    t=$(now)
    extra=(); [ "$FORMAT" = tar ] && extra=(--shards 1024)
    "$BIN/batchfs-server" gen --format "$FORMAT" --samples "$SAMPLES" --mean-bytes "$MEAN" --classes 1000 \
        "${extra[@]}" --out "$DATA" > /dev/null
    echo "generate_s $(since "$t")"
fi
rm -f "$DATA/.batchfs-index"
echo "files $(find "$DATA" -type f ! -name '.*' | wc -l) bytes $(du -sb --exclude=.batchfs-index "$DATA" | cut -f1)"
drop
t=$(now)
/usr/bin/time -f "index_peak_rss_kb %M" "$BIN/batchfs-server" index --dataset "in=$DATA" > /dev/null 2> /tmp/imagenet-index.err
echo "index_cold_s $(since "$t")"
grep index_peak_rss_kb /tmp/imagenet-index.err
echo "index_bytes $(stat -c %s "$DATA/.batchfs-index")"
drop
t=$(now)
find "$DATA" -type f ! -name '.*' -print0 | xargs -0 cat > /dev/null
echo "cat_cold_s $(since "$t")"
t=$(now)
"$BIN/batchfs-server" serve --listen "127.0.0.1:$PORT" --dataset "in=$DATA" > /dev/null 2>&1 &
server=$!
until curl -sf "http://127.0.0.1:$PORT/healthz" > /dev/null; do sleep 0.2; done
echo "restart_to_ready_s $(since "$t")"
echo "server_rss_kb $(awk '/VmRSS/ {print $2}' /proc/$server/status)"
for format in tfrecord tar; do
    curl -s -o /dev/null -w "manifest_$format %{time_total}s %{size_download}B\n" \
        "http://127.0.0.1:$PORT/v1/datasets/in/epochs/0?batch_size=256&format=$format"
done
curl -s -o /dev/null -w "files_first_page %{time_total}s %{size_download}B\n" "http://127.0.0.1:$PORT/v1/datasets/in/files"
"$BIN/batchfs" mount "http://127.0.0.1:$PORT/in" "$mnt" -o batch_size=256,format=tar 2> /dev/null
mount_pid=$(pgrep -f "batchfs mount http://127.0.0.1:$PORT/in" | head -1)
# Asking for epoch e's manifest computes e + 1's in the background: epoch 1's is under way (asked for at
# the mount), epoch 2's ready once epoch 1's was asked for and a job has read a while; epoch 5's nobody
# asked for.
t=$(now); n=$(ls "$mnt/epoch-0001" | wc -l); echo "ls_epoch_names $n s $(since "$t")"
sleep 8
t=$(now); n=$(ls "$mnt/epoch-0002" | wc -l); echo "ls_next_epoch_names $n s $(since "$t")"
t=$(now); n=$(ls "$mnt/epoch-0005" | wc -l); echo "ls_unasked_epoch_names $n s $(since "$t")"
t=$(now); n=$(ls "$mnt/raw" | wc -l); echo "ls_raw_names $n s $(since "$t")"
first=$(ls "$mnt/raw" | head -1)
if [ -d "$mnt/raw/$first" ]; then
    t=$(now); n=$(ls "$mnt/raw/$first" | wc -l); echo "ls_raw_dir_names $n s $(since "$t")"
fi
echo "mount_rss_kb $(awk '/VmRSS/ {print $2}' /proc/$mount_pid/status)"
echo "server_rss_kb_after $(awk '/VmRSS/ {print $2}' /proc/$server/status)"
