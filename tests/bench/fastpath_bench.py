#!/usr/bin/env python3
"""The fast path: reading batches that are already complete in the mount's cache, through FUSE
passthrough and through the daemon, against the same bytes in a local tmpfs file; the daemon's CPU per GB.

    tests/bench/fastpath_bench.py [OUT_DIR]
    env: SAMPLES (6000), MEAN (90000 bytes), BATCH (128), ROUNDS (5), THREADS (4), MMAP (0; 1 reads by mmap),
         DROP_CACHES (0; 1 drops the kernel's clean page cache before every read: the batches stay in the
         mount's cache and tmpfs, but the daemon path's page cache copy is gone, as for a batch read the
         first time)

Both mounts read the epoch once first (fetched, verified, cached: the cache holds it whole), then each
round reads it again with `batchfs-lab bench` (THREADS reader threads, 1 MiB reads), the three systems
alternating. The daemon's CPU is its /proc/PID/stat user+system time over the read. Writes results.csv
and report.md to OUT_DIR and prints the report.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loaders_bench import BIN, cpu_of, free_port, write_csv  # noqa: E402

env = os.environ.get
SAMPLES, MEAN, BATCH = int(env("SAMPLES", "6000")), int(env("MEAN", "90000")), int(env("BATCH", "128"))
ROUNDS, THREADS, MMAP = int(env("ROUNDS", "5")), int(env("THREADS", "4")), env("MMAP", "0") == "1"
DROP = env("DROP_CACHES", "0") == "1"


def mount_pid(mnt):
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if len(cmd) > 3 and cmd[1] == b"mount" and os.path.abspath(cmd[3].decode()) == mnt:
                return int(pid)
    raise SystemExit(f"no daemon for {mnt}")


def bench(directory):
    args = [os.path.join(BIN, "batchfs-lab"), "bench", directory, "--threads", str(THREADS), "--json"]
    if MMAP:
        args.append("--mmap")
    return json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/batchfs-fastpath"
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="batchfs-fastpath-")
    shm = tempfile.mkdtemp(prefix="batchfs-fastpath-", dir="/dev/shm")
    server, mounts = None, []
    try:
        data = os.path.join(work, "data")
        subprocess.run([os.path.join(BIN, "batchfs-server"), "gen", "--format", "tfrecord", "--samples",
                        str(SAMPLES), "--mean-bytes", str(MEAN), "--out", data], check=True, capture_output=True)
        port = free_port()
        server = subprocess.Popen([os.path.join(BIN, "batchfs-server"), "serve", "--listen", f"127.0.0.1:{port}",
                                   "--dataset", f"d={data}"], stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        systems = {}
        for name, opt in (("passthrough", "true"), ("daemon", "false")):
            mnt = os.path.join(work, name)
            os.makedirs(mnt)
            subprocess.run([os.path.join(BIN, "batchfs"), "mount", f"http://127.0.0.1:{port}/d", mnt, "-o",
                            f"batch_size={BATCH},passthrough={opt},cache=4G"], check=True)
            mounts.append(mnt)
            epoch = os.path.join(mnt, "epoch-0000")
            bench(epoch)  # fetch and cache the whole epoch
            systems[name] = (epoch, mount_pid(mnt))
        local = os.path.join(shm, "epoch")
        shutil.copytree(systems["daemon"][0], local)
        systems["tmpfs"] = (local, None)
        rows = []
        for rnd in range(ROUNDS):
            for name, (directory, pid) in systems.items():
                if DROP:
                    os.sync()
                    open("/proc/sys/vm/drop_caches", "w").write("1\n")
                before = cpu_of(pid) if pid else 0.0
                r = bench(directory)
                cpu = cpu_of(pid) - before if pid else 0.0
                row = {"round": rnd, "system": name, "mb_per_s": round(r["mb_per_s"], 1), "bytes": r["bytes"],
                       "daemon_cpu_s_per_gb": round(cpu / (r["bytes"] / 1e9), 4)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        write_csv(os.path.join(out, "results.csv"), rows)
        med = {s: statistics.median(r["mb_per_s"] for r in rows if r["system"] == s) for s in systems}
        cpu = {s: statistics.median(r["daemon_cpu_s_per_gb"] for r in rows if r["system"] == s) for s in systems}
        report = (f"{rows[0]['bytes'] / 1e9:.2f} GB epoch already cached, {THREADS} reader threads, "
                  f"{'mmap' if MMAP else '1 MiB reads'}, {'page cache dropped before each read, ' if DROP else ''}"
                  f"medians of {ROUNDS} rounds\n\n"
                  "| system | MB/s | vs tmpfs | daemon CPU s/GB |\n|---|---|---|---|\n")
        for s in systems:
            report += f"| {s} | {med[s]:.0f} | {med[s] / med['tmpfs']:.2f} | {cpu[s]:.3f} |\n"
        open(os.path.join(out, "report.md"), "w").write(report)
        print(report)
    finally:
        for m in mounts:
            subprocess.run([os.path.join(BIN, "batchfs"), "umount", "--lazy", m], capture_output=True)
        if server:
            server.kill()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
