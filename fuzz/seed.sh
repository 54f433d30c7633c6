#!/usr/bin/env bash
# Writes the seed corpora of every fuzz target into fuzz/seeds/TARGET/ from data the project's own
# generator makes: TFRecord shards (tfrecord), tar shards (tar), persisted indexes of all four source
# formats (index), the tf.train.Example payloads of TFRecord records (proto), and request lines (query:
# PATH, QUERY, RANGE and LEN, one per line, as the target reads them).
#
#   fuzz/seed.sh        (needs target/release/batchfs-server: cargo build --release --workspace)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SERVER=$ROOT/target/release/batchfs-server
SEEDS=$ROOT/fuzz/seeds
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$SEEDS"
mkdir -p "$SEEDS"/{tfrecord,tar,index,proto,query}
for format in tfrecord tar lmdb files; do
    "$SERVER" gen --format "$format" --samples 6 --mean-bytes 300 --shards 2 --classes 3 --seed 1 \
        --out "$work/$format" >/dev/null
    "$SERVER" index --dataset "d=$work/$format" >/dev/null 2>&1
    cp "$work/$format/.batchfs-index" "$SEEDS/index/$format.batchfs-index"
done
cp "$work"/tfrecord/*.tfrecord "$SEEDS/tfrecord/"
cp "$work"/tar/*.tar "$SEEDS/tar/"
# Each record's payload (a tf.train.Example): length u64, length CRC u32, data, data CRC u32.
python3 - "$work/tfrecord" "$SEEDS/proto" <<'PY'
import os, struct, sys
src, out = sys.argv[1], sys.argv[2]
n = 0
for name in sorted(os.listdir(src)):
    if not name.endswith(".tfrecord"):
        continue
    data = open(os.path.join(src, name), "rb").read()
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        open(os.path.join(out, "example-%02d" % n), "wb").write(data[pos + 12:pos + 12 + length])
        pos += 12 + length + 4
        n += 1
PY
i=0
while IFS= read -r line; do
    printf '%b' "$line" >"$SEEDS/query/request-$i"
    i=$((i + 1))
done <<'QUERIES'
/v1/datasets/imagenet/epochs/3/batches/17\nbatch_size=256&seed=42&shuffle=global&drop_last=true&format=tfrecord\nbytes=0-1048575\n28000000
/v1/datasets/d/epochs/0/batches/1\nformat=tar\nbytes=0-\n900000\n40000:1a2b3c4d,80000:00000001,dbba0:ffffffff
/v1/datasets/d/epochs/0/batches/2\n\n\n10\n10:1,10:2,:,ffffffffffffffff:0, 20 :123456789
/v1/datasets/d/epochs/0\nbatch_size=64&format=tar\nbytes=-4096\n1000
/v1/datasets/d/epochs/0/batches/0\nformat=tfrecord.idx&shuffle=none\nbytes=100-\n4096
/v1/datasets/d/files/class-0001/sample-000001.jpg\n\nbytes=0-0\n1
/v1/datasets/d%2Fx/files/..%2Fetc%2Fpasswd\nbatch_size=0\nbytes=5-2\n10
/healthz\nseed=18446744073709551615\nbytes=0-1,4-5\n0
/v1/datasets\ndrop_last=maybe&batch_size=99999999999\nbytes=abc\n4294967295
QUERIES
find "$SEEDS" -type f | wc -l | xargs echo "seed files:"
du -sh "$SEEDS"
