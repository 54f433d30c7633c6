#!/usr/bin/env bash
# Writes the seed corpora of every fuzz target into fuzz/seeds/TARGET/ from data the project's own
# generator makes: TFRecord shards (tfrecord), tar shards (tar), persisted indexes of all four source
# formats (index), the tf.train.Example payloads of TFRecord records (proto), request lines (query:
# PATH, QUERY, RANGE and LEN, one per line, as the target reads them), a server's connection (frames)
# and its response heads (hpack).
#
#   fuzz/seed.sh        (needs target/release/batchfs-server: cargo build --release --workspace)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SERVER=$ROOT/target/release/batchfs-server
SEEDS=$ROOT/fuzz/seeds
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$SEEDS"
mkdir -p "$SEEDS"/{tfrecord,tar,index,proto,query,frames,hpack}
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
# frames: what the server really sends a mount (its SETTINGS, WINDOW_UPDATE, a response head in HPACK with
# Huffman coding and its dynamic table, DATA), captured from two requests on one h2c connection, and a
# synthetic connection with padding, CONTINUATION, PING and GOAWAY. Each seed starts with the target's
# one byte that picks the largest frame allowed.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$SERVER" serve --listen "127.0.0.1:$port" --dataset "d=$work/tfrecord" >"$work/server.log" 2>&1 &
server_pid=$!
trap 'kill $server_pid 2>/dev/null; rm -rf "$work"' EXIT
python3 - "$port" "$SEEDS/frames" <<'PY'
import socket, struct, sys, time
port, out = int(sys.argv[1]), sys.argv[2]
def frame(kind, flags, stream, payload):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload
def literal(index, value):
    return bytes([index]) + bytes([len(value)]) + value
def request(stream, path):
    block = b"\x82\x86" + literal(1, b"127.0.0.1:%d" % port) + literal(4, path)
    return frame(1, 0x5, stream, block)
for attempt in range(100):
    try:
        s = socket.create_connection(("127.0.0.1", port))
        break
    except OSError:
        time.sleep(0.1)
s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, struct.pack(">HI", 5, 131072)))
s.sendall(request(1, b"/v1/datasets/d/epochs/0/batches/0?batch_size=4&format=tfrecord"))
s.sendall(request(3, b"/v1/datasets/d/epochs/0/batches/9?batch_size=4&format=tfrecord"))
s.settimeout(1.0)
got = b""
try:
    while True:
        piece = s.recv(65536)
        if not piece:
            break
        got += piece
except socket.timeout:
    pass
open(out + "/server-capture", "wb").write(b"\x01" + got)
# hpack: the server's response heads from that capture (HEADERS frames' blocks, in order, over one
# table), and RFC 7541 C.4's three requests; each block after its length in two bytes.
heads, at = b"", 0
while at + 9 <= len(got):
    length, kind = int.from_bytes(got[at:at + 3], "big"), got[at + 3]
    if kind == 1:
        heads += struct.pack(">H", length) + got[at + 9:at + 9 + length]
    at += 9 + length
hpack = out.replace("/frames", "/hpack")
open(hpack + "/server-heads", "wb").write(heads)
rfc = [bytes.fromhex(h) for h in ("828684418cf1e3c2e5f23a6ba0ab90f4ff", "828684be5886a8eb10649cbf",
                                  "828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf")]
open(hpack + "/rfc7541-c4", "wb").write(b"".join(struct.pack(">H", len(b)) + b for b in rfc))
synthetic = (frame(4, 0, 0, struct.pack(">HIHI", 3, 100, 5, 16384)) + frame(6, 0, 0, b"12345678")
    + frame(1, 0x8, 1, b"\x02\x88" + b"\0\0") + frame(9, 0x4, 1, b"")
    + frame(0, 0x8, 1, b"\x03abc\0\0\0") + frame(0, 0x1, 1, b"end")
    + frame(8, 0, 0, struct.pack(">I", 1000)) + frame(7, 0, 0, struct.pack(">II", 1, 0) + b"bye"))
open(out + "/synthetic", "wb").write(b"\x00" + synthetic)
PY
find "$SEEDS" -type f | wc -l | xargs echo "seed files:"
du -sh "$SEEDS"
