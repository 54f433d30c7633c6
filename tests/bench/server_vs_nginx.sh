#!/usr/bin/env bash
# Server benchmark: batchfs-server vs nginx serving the same batch bytes as static files, both over
# HTTP/2 cleartext (prior knowledge) on loopback, driven by h2load, alternating, several rounds.
#
#   tests/bench/server_vs_nginx.sh [SAMPLES] [MEAN_BYTES] [BATCH_SIZE] [ROUNDS]
#
# Needs: h2load (Debian nghttp2-client), nginx (Debian nginx), a release build of batchfs-server.
# Prints per-round figures, then medians and the batchfs/nginx ratio.
set -euo pipefail
SAMPLES=${1:-2000}
MEAN=${2:-110000}
BATCH=${3:-64}
ROUNDS=${4:-5}
CONNS=${CONNS:-4}       # h2load clients (connections)
STREAMS=${STREAMS:-8}   # concurrent streams per connection
REPEAT=${REPEAT:-4}     # each batch requested this many times per round
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/target/release/batchfs-server
[ -x "$bin" ] || cargo build --release -p batchfs-server --manifest-path "$root/Cargo.toml"
command -v h2load >/dev/null || { echo "h2load missing: apt-get install nghttp2-client" >&2; exit 1; }
command -v nginx >/dev/null || { echo "nginx missing: apt-get install nginx" >&2; exit 1; }

work=$(mktemp -d)
chmod 755 "$work"  # nginx workers run unprivileged
cleanup() {
  [ -n "${server_pid:-}" ] && kill "$server_pid" 2>/dev/null || true
  [ -f "$work/nginx.pid" ] && kill "$(cat "$work/nginx.pid")" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

"$bin" gen --format tfrecord --samples "$SAMPLES" --mean-bytes "$MEAN" --shards 16 --out "$work/data" >/dev/null
port_b=$((20000 + RANDOM % 10000)); port_n=$((port_b + 1))
RUST_LOG=warn "$bin" serve --listen "127.0.0.1:$port_b" --dataset bench="$work/data" &
server_pid=$!
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port_b/healthz" >/dev/null && break; sleep 0.1; done

# The same bytes as static files, for nginx.
q="batch_size=$BATCH&seed=0&shuffle=global&drop_last=false&format=tfrecord"
curl -sf "http://127.0.0.1:$port_b/v1/datasets/bench/epochs/0?$q" > "$work/manifest.json"
batches=$(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))['batches']))" "$work/manifest.json")
mkdir -p "$work/static/epoch-0000"
: > "$work/urls-batchfs"; : > "$work/urls-nginx"
for i in $(seq 0 $((batches - 1))); do
  f=$(printf 'batch-%06d.tfrecord' "$i")
  curl -sf "http://127.0.0.1:$port_b/v1/datasets/bench/epochs/0/batches/$i?$q" -o "$work/static/epoch-0000/$f"
  for _ in $(seq "$REPEAT"); do
    echo "http://127.0.0.1:$port_b/v1/datasets/bench/epochs/0/batches/$i?$q" >> "$work/urls-batchfs"
    echo "http://127.0.0.1:$port_n/epoch-0000/$f" >> "$work/urls-nginx"
  done
done
bytes=$(du -sb "$work/static" | cut -f1)

cat > "$work/nginx.conf" <<CONF
worker_processes auto;
pid $work/nginx.pid;
error_log $work/nginx-error.log warn;
events { worker_connections 1024; }
http {
  access_log off;
  sendfile on;
  tcp_nopush on;
  types { application/octet-stream tfrecord; }
  http2_chunk_size 1m;
  http2_body_preread_size 16m;
  server {
    listen 127.0.0.1:$port_n http2;
    root $work/static;
  }
}
CONF
nginx -c "$work/nginx.conf"
for _ in $(seq 100); do curl -sf --http2-prior-knowledge "http://127.0.0.1:$port_n/epoch-0000/batch-000000.tfrecord" -o /dev/null && break; sleep 0.1; done

# Warm both (page cache, plan and manifest caches).
h2load -i "$work/urls-batchfs" -n "$((batches * REPEAT))" -c "$CONNS" -m "$STREAMS" -w 24 -W 26 >/dev/null
h2load -i "$work/urls-nginx" -n "$((batches * REPEAT))" -c "$CONNS" -m "$STREAMS" -w 24 -W 26 >/dev/null

echo "dataset: $SAMPLES samples ~$MEAN B, $batches batches of $BATCH, $bytes bytes; h2load -c $CONNS -m $STREAMS, $((batches * REPEAT)) requests per run"
printf '%-6s %-8s %12s %12s\n' round system "req/s" "MB/s"
: > "$work/results"
for r in $(seq "$ROUNDS"); do
  for sys in batchfs nginx; do
    line=$(h2load -i "$work/urls-$sys" -n "$((batches * REPEAT))" -c "$CONNS" -m "$STREAMS" -w 24 -W 26 2>&1 | grep -E '^finished in|requests: ')
    fails=$(echo "$line" | awk '/requests:/ { print $10 }')
    [ "$fails" = "0" ] || { echo "$sys: $fails failed requests" >&2; echo "$line" >&2; exit 1; }
    rps=$(echo "$line" | awk '/^finished in/ { gsub(",", ""); print $4 }')
    # h2load prints throughput in MB/s or GB/s; normalize to MB/s.
    mbs=$(echo "$line" | awk '/^finished in/ { gsub(",", ""); v=$6; if (v ~ /GB/) { sub("GB/s","",v); v*=1000 } else { sub("MB/s","",v) } print v }')
    printf '%-6s %-8s %12s %12s\n' "$r" "$sys" "$rps" "$mbs"
    echo "$sys $rps $mbs" >> "$work/results"
  done
done
python3 - "$work/results" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
med = {s: (statistics.median(float(r[1]) for r in rows if r[0] == s), statistics.median(float(r[2]) for r in rows if r[0] == s)) for s in ("batchfs", "nginx")}
for s, (rps, mbs) in med.items():
    print(f"median {s:<8} {rps:10.1f} batches/s {mbs:10.1f} MB/s")
print(f"ratio batchfs/nginx: {med['batchfs'][1] / med['nginx'][1]:.2f}x throughput")
PY
