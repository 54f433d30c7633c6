#!/usr/bin/env bash
# Indexing again after one shard of a TFRecord dataset is added, then removed (a stale index: only the
# files changed since are read, what it says of the others taken), against a build that reads everything
# again. Each build keeps its own index dir; the page cache is dropped before each timing; builds alternate.
#
#   tests/bench/reindex_bench.sh SERVER [SERVER_BEFORE]   env: ROUNDS (3), SAMPLES (20000), SHARDS (64),
#                                                         MEAN_BYTES (110000), WORK (a temporary dir)
#
# SERVER is a `batchfs-server` binary (target/release/batchfs-server). Needs root (drop_caches). Prints CSV
# (round, change, build, seconds) and checks that every build's index is byte-identical at the end.
set -euo pipefail
server=$(realpath "$1"); before=${2:+$(realpath "$2")}
work=${WORK:-$(mktemp -d)}; data=$work/d
trap 'rm -rf "$work"' EXIT
"$server" gen --format tfrecord --samples "${SAMPLES:-20000}" --mean-bytes "${MEAN_BYTES:-110000}" \
  --shards "${SHARDS:-64}" --out "$data" >/dev/null
builds="after"; [ -n "$before" ] && builds="before after"
bin() { if [ "$1" = before ]; then echo "$before"; else echo "$server"; fi; }
for b in $builds; do mkdir -p "$work/idx-$b"; "$(bin "$b")" index --dataset "d=$data" --index-dir "$work/idx-$b" >/dev/null 2>&1; done
first=$(find "$data" -name '*.tfrecord' | sort | head -1)
echo "round,change,build,seconds"
for round in $(seq 1 "${ROUNDS:-3}"); do
  for change in add remove; do
    if [ "$change" = add ]; then cp "$first" "$data/zz-extra.tfrecord"; else rm "$data/zz-extra.tfrecord"; fi
    order=$builds; [ $((round % 2)) = 0 ] && order=$(echo "$builds" | tr ' ' '\n' | tac | tr '\n' ' ')
    for b in $order; do
      sync; echo 3 > /proc/sys/vm/drop_caches
      s=$(date +%s.%N)
      out=$("$(bin "$b")" index --dataset "d=$data" --index-dir "$work/idx-$b" 2>&1)
      e=$(date +%s.%N)
      grep -q built <<<"$out" || { echo "$b did not index again: $out" >&2; exit 1; }
      echo "$round,$change,$b,$(echo "$e - $s" | bc)"
    done
  done
done
[ -z "$before" ] || cmp "$work/idx-before/d.batchfs-index" "$work/idx-after/d.batchfs-index"
