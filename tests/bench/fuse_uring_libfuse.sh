#!/usr/bin/env bash
# FUSE over io_uring against /dev/fuse, the kernel's mechanism alone: libfuse's own example server,
# passthrough_hp (reads through the daemon: --nopassthrough), over a tmpfs copy of the ImageFolder bench's
# tree (3,000 heavy-tailed files), read whole by 4 processes in a shuffled order after a walk, caches dropped
# before each run, the two modes alternating. Prints one line per run: epoch seconds and the daemon's CPU.
#
#   PASSTHROUGH_HP=/path/to/passthrough_hp tests/bench/fuse_uring_libfuse.sh [ROUNDS]
#   env: EXTRA (passthrough_hp's flags, default --nopassthrough), SAMPLES (3000), MEAN (110000)
#
# passthrough_hp comes from libfuse 3.18 or later built with io_uring (liburing-dev; meson setup build
# -Denable-io-uring=true -Dexamples=true; ninja -C build). Needs root and the fuse module's enable_uring
# (echo Y > /sys/module/fuse/parameters/enable_uring), which this script sets for the run and puts back.
set -euo pipefail
ROUNDS=${1:-5}; EXTRA=${EXTRA:---nopassthrough}; SAMPLES=${SAMPLES:-3000}; MEAN=${MEAN:-110000}
HP=${PASSTHROUGH_HP:?set PASSTHROUGH_HP to the passthrough_hp example of libfuse}
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d /dev/shm/fuse-uring.XXXXXX); mkdir -p "$work/mnt"
param=/sys/module/fuse/parameters/enable_uring; before=$(cat "$param")
trap 'umount "$work/mnt" 2>/dev/null || true; echo "$before" > "$param"; rm -rf "$work"' EXIT
echo Y > "$param"
"$root/target/release/batchfs-server" gen --format files --samples "$SAMPLES" --mean-bytes "$MEAN" --out "$work/tree" >/dev/null
cat > "$work/read.py" <<'PY'
import os, sys, time, random, multiprocessing as mp
def work(paths):
    n = 0
    for p in paths:
        with open(p, 'rb') as f:
            n += len(f.read())
    return n
if __name__ == '__main__':
    t0 = time.perf_counter()
    files = [f.path for d in sorted(os.scandir(sys.argv[1]), key=lambda e: e.name) if d.is_dir()
             for f in sorted(os.scandir(d.path), key=lambda e: e.name)]
    random.Random(1).shuffle(files)
    with mp.get_context('fork').Pool(4) as pool:
        total = sum(pool.map(work, [files[i::4] for i in range(4)]))
    print(f"files={len(files)} bytes={total} epoch_s={time.perf_counter() - t0:.3f}")
PY
for r in $(seq 1 "$ROUNDS"); do
  for mode in dev uring; do
    opt=(); [ "$mode" = uring ] && opt=(-o io_uring)
    "$HP" --foreground $EXTRA "${opt[@]}" "$work/tree" "$work/mnt" 2>"$work/hp.log" &
    pid=$!
    for _ in $(seq 50); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
    sync; echo 3 > /proc/sys/vm/drop_caches
    c0=$(awk '{print $14 + $15}' "/proc/$pid/stat")
    out=$(python3 "$work/read.py" "$work/mnt")
    c1=$(awk '{print $14 + $15}' "/proc/$pid/stat")
    echo "round=$r mode=$mode $out daemon_cpu_s=$(python3 -c "print(($c1 - $c0) / 100)")"
    umount "$work/mnt"; wait "$pid" 2>/dev/null || true
  done
done
