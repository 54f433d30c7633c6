#!/usr/bin/env bash
# A batch of many small samples asked of the server: the memory its layout takes (tar framing is 1 KB a
# member), for one request alone and for several at once, against a build before `framing_memory`.
#
#   tests/bench/framing_bench.sh SERVER [SERVER_BEFORE]   env: SAMPLES (1000000), BATCH (1048576),
#                                                         CONCURRENT (4), WORK (a temporary dir)
#
# SERVER is a `batchfs-server` binary (target/release/batchfs-server). Prints CSV: build, what was asked,
# the HTTP statuses, seconds, and the server's anonymous memory (RssAnon, kB) before and after, and its peak
# resident set (VmHWM, kB; the shards' mapped pages count in it).
set -euo pipefail
server=$(realpath "$1"); before=${2:+$(realpath "$2")}
work=${WORK:-$(mktemp -d)}; data=$work/d
port=17931
pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT
"$server" gen --format tar --samples "${SAMPLES:-1000000}" --mean-bytes 16 --sizes lognormal --out "$data" >/dev/null
batch=${BATCH:-1048576}; n=${CONCURRENT:-4}
url="http://127.0.0.1:$port/v1/datasets/w/epochs/0/batches/0?format=tar"
status() { grep -E "^$1:" "/proc/$pid/status" | awk '{print $2}'; }
echo "build,asked,statuses,seconds,anon_kb_before,anon_kb_after,peak_rss_kb"
builds="after"; [ -n "$before" ] && builds="before after"
for b in $builds; do
  bin=$server; [ "$b" = before ] && bin=$before
  mkdir -p "$work/idx-$b"
  "$bin" serve --listen "127.0.0.1:$port" --dataset "w=$data" --index-dir "$work/idx-$b" >"$work/$b.log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/healthz" >/dev/null && break; sleep 1; done
  for asked in one concurrent; do
    anon=$(status RssAnon)
    s=$(date +%s.%N)
    if [ "$asked" = one ]; then
      codes=$(curl -s -o /dev/null -w "%{http_code}" "$url&batch_size=$batch&seed=1")
    else
      codes=$(for i in $(seq 2 $((n + 1))); do
        curl -s -o /dev/null -w "%{http_code}\n" "$url&batch_size=$((batch / n))&seed=$i" &
      done; wait)
      codes=$(echo "$codes" | sort | tr '\n' ' ' | sed 's/ $//')
    fi
    e=$(date +%s.%N)
    echo "$b,$asked,$codes,$(echo "$e - $s" | bc),$anon,$(status RssAnon),$(status VmHWM)"
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
done
