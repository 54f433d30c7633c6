#!/usr/bin/env bash
# Server benchmark: batchfs-server vs nginx serving the same batch bytes as static files, both over
# HTTP/2 cleartext (prior knowledge) on loopback, driven by h2load, alternating, several rounds.
#
#   tests/bench/server_vs_nginx.sh [SAMPLES] [MEAN_BYTES] [BATCH_SIZE] [ROUNDS]
#   SERVER_CPU=0 CLIENT_CPU=1 tests/bench/server_vs_nginx.sh ...   # each server on one core, h2load on another
#   PROFILE=/tmp/server.perf tests/bench/server_vs_nginx.sh ...    # also perf record -g the last batchfs run
#
# Needs: h2load (Debian nghttp2-client), nginx (Debian nginx), a release build of batchfs-server.
# Prints per-round figures (requests/s, MB/s, and each server's CPU seconds per GB sent: user + system
# time of its processes, from /proc, over the bytes of the run's bodies), then medians and the
# batchfs/nginx ratios.
set -euo pipefail
SAMPLES=${1:-2000}
MEAN=${2:-110000}
BATCH=${3:-64}
ROUNDS=${4:-5}
CONNS=${CONNS:-4}       # h2load clients (connections)
STREAMS=${STREAMS:-8}   # concurrent streams per connection
REPEAT=${REPEAT:-4}     # each batch requested this many times per round
SERVER_CPU=${SERVER_CPU:-}  # pin batchfs-server and nginx (master and its one worker) to this CPU
CLIENT_CPU=${CLIENT_CPU:-}  # pin h2load to this CPU
PROFILE=${PROFILE:-}        # perf record -g of batchfs-server during the last round, written here
server_pin=(); [ -n "$SERVER_CPU" ] && server_pin=(taskset -c "$SERVER_CPU")
client_pin=(); [ -n "$CLIENT_CPU" ] && client_pin=(taskset -c "$CLIENT_CPU")
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
RUST_LOG=warn ${server_pin[@]+"${server_pin[@]}"} "$bin" serve --listen "127.0.0.1:$port_b" --dataset bench="$work/data" &
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
worker_processes ${WORKERS:-$([ -n "$SERVER_CPU" ] && echo 1 || echo auto)};
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
${server_pin[@]+"${server_pin[@]}"} nginx -c "$work/nginx.conf"
for _ in $(seq 100); do curl -sf --http2-prior-knowledge "http://127.0.0.1:$port_n/epoch-0000/batch-000000.tfrecord" -o /dev/null && break; sleep 0.1; done

# Warm both (page cache, plan and manifest caches).
h2load -i "$work/urls-batchfs" -n "$((batches * REPEAT))" -c "$CONNS" -m "$STREAMS" -w 24 -W 26 >/dev/null
h2load -i "$work/urls-nginx" -n "$((batches * REPEAT))" -c "$CONNS" -m "$STREAMS" -w 24 -W 26 >/dev/null

# CPU seconds (user + system) of a system's server processes so far: batchfs-server's, or nginx's master
# and workers'.
cpu_s() {
  local pids
  if [ "$1" = batchfs ]; then pids=$server_pid; else pids="$(cat "$work/nginx.pid") $(pgrep -P "$(cat "$work/nginx.pid")" | tr '\n' ' ')"; fi
  local tck; tck=$(getconf CLK_TCK)
  for p in $pids; do awk '{ print $14 + $15 }' "/proc/$p/stat"; done | awk -v t="$tck" '{ s += $1 } END { printf "%.3f", s / t }'
}

echo "dataset: $SAMPLES samples ~$MEAN B, $batches batches of $BATCH, $bytes bytes; h2load -c $CONNS -m $STREAMS, $((batches * REPEAT)) requests per run"
echo "pinned: servers on CPU ${SERVER_CPU:-any}, h2load on CPU ${CLIENT_CPU:-any}"
printf '%-6s %-8s %12s %12s %12s\n' round system "req/s" "MB/s" "CPU s/GB"
: > "$work/results"
sent_gb=$(python3 -c "print($bytes * $REPEAT / 1e9)")
for r in $(seq "$ROUNDS"); do
  for sys in batchfs nginx; do
    if [ -n "$PROFILE" ] && [ "$sys" = batchfs ] && [ "$r" = "$ROUNDS" ]; then
      perf record -g -o "$PROFILE" -p "$server_pid" >/dev/null 2>&1 & perf_pid=$!
      sleep 0.5
    fi
    before=$(cpu_s "$sys")
    line=$(${client_pin[@]+"${client_pin[@]}"} h2load -i "$work/urls-$sys" -n "$((batches * REPEAT))" -c "$CONNS" -m "$STREAMS" -w 24 -W 26 2>&1 | grep -E '^finished in|requests: ')
    after=$(cpu_s "$sys")
    if [ -n "${perf_pid:-}" ]; then kill -INT "$perf_pid"; wait "$perf_pid" 2>/dev/null || true; perf_pid=; fi
    per_gb=$(python3 -c "print(f'{($after - $before) / $sent_gb:.3f}')")
    fails=$(echo "$line" | awk '/requests:/ { print $10 }')
    [ "$fails" = "0" ] || { echo "$sys: $fails failed requests" >&2; echo "$line" >&2; exit 1; }
    rps=$(echo "$line" | awk '/^finished in/ { gsub(",", ""); print $4 }')
    # h2load prints throughput in MB/s or GB/s; normalize to MB/s.
    mbs=$(echo "$line" | awk '/^finished in/ { gsub(",", ""); v=$6; if (v ~ /GB/) { sub("GB/s","",v); v*=1000 } else { sub("MB/s","",v) } print v }')
    printf '%-6s %-8s %12s %12s %12s\n' "$r" "$sys" "$rps" "$mbs" "$per_gb"
    echo "$sys $rps $mbs $per_gb" >> "$work/results"
  done
done
python3 - "$work/results" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
med = {s: [statistics.median(float(r[k]) for r in rows if r[0] == s) for k in (1, 2, 3)] for s in ("batchfs", "nginx")}
for s, (rps, mbs, cpu) in med.items():
    print(f"median {s:<8} {rps:10.1f} batches/s {mbs:10.1f} MB/s {cpu:8.3f} CPU s/GB")
print(f"ratio batchfs/nginx: {med['batchfs'][1] / med['nginx'][1]:.2f}x throughput")
# Per round, the two systems side by side: the CPU ratio's median.
pairs = [(float(b[3]), float(n[3])) for b, n in zip([r for r in rows if r[0] == "batchfs"], [r for r in rows if r[0] == "nginx"])]
print(f"ratio batchfs/nginx CPU per GB (median of rounds): {statistics.median(b / n for b, n in pairs if n > 0):.2f}x")
PY
