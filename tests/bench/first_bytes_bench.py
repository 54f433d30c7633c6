#!/usr/bin/env python3
"""A batch read on demand: how long until its first bytes, and until its last, through the daemon with
reads released at the body's verified checkpoints (this build, `after`) against a build whose reads wait
for the whole body (BIN_BEFORE, `before`), and with passthrough, whose open waits for the whole verified
batch (this build, `passthrough`): the choice the kernel leaves for a batch still arriving at its open.

    python3 tests/bench/first_bytes_bench.py [OUT_DIR]
    env: BIN_BEFORE (a target/release directory of the build to compare with; required),
         SAMPLES (4000), MEAN (90000 bytes), BATCH (512: ~46 MB batch files), ROUNDS (7),
         RATE_MBIT (800: the netem link's cap), RTT_MS (2)

One server (this build) on loopback; each system mounts it twice, directly and through its own
`batchfs-lab netem` link (RATE_MBIT, RTT_MS), with `prefetch=0`, so each read is a miss fetched on demand
(`passthrough=false` but for `passthrough`). Each round, every mount opens batch ROUND of epoch 0
(a file it has never read) and reads it from the start in 1 MiB reads, as a streaming reader does; the
systems alternate, in an order reversed every other round. `first_ms`: from the open to the first MiB;
`all_ms`: to the last byte. Writes results.csv and report.md to OUT_DIR and prints the report.
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
from loaders_bench import BIN, free_port, write_csv  # noqa: E402

env = os.environ.get
BEFORE = env("BIN_BEFORE") or sys.exit("set BIN_BEFORE to the target/release directory of the build to compare")
SAMPLES, MEAN, BATCH = int(env("SAMPLES", "4000")), int(env("MEAN", "90000")), int(env("BATCH", "512"))
ROUNDS, RATE, RTT = int(env("ROUNDS", "7")), env("RATE_MBIT", "800"), env("RTT_MS", "2")


def read_timed(path):
    """(ms to the first MiB, ms to the end, bytes) of reading `path` from its open in 1 MiB reads."""
    start = time.perf_counter()
    first, size = None, 0
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = f.read(1 << 20)
            if first is None:
                first = time.perf_counter()
            if not chunk:
                break
            size += len(chunk)
    end = time.perf_counter()
    return (first - start) * 1e3, (end - start) * 1e3, size


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/batchfs-first-bytes"
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="batchfs-first-bytes-")
    procs, mounts = [], []
    try:
        data = os.path.join(work, "data")
        subprocess.run([os.path.join(BIN, "batchfs-server"), "gen", "--format", "tfrecord", "--samples",
                        str(SAMPLES), "--mean-bytes", str(MEAN), "--out", data], check=True, capture_output=True)
        port = free_port()
        procs.append(subprocess.Popen([os.path.join(BIN, "batchfs-server"), "serve", "--listen",
                                       f"127.0.0.1:{port}", "--dataset", f"d={data}"], stderr=subprocess.DEVNULL))
        systems = {}
        for build, bindir in (("before", BEFORE), ("after", BIN), ("passthrough", BIN)):
            for link in ("loopback", f"{RATE}mbit-{RTT}ms"):
                p = port
                if link != "loopback":
                    p = free_port()
                    procs.append(subprocess.Popen([os.path.join(BIN, "batchfs-lab"), "netem", "--listen",
                                                   f"127.0.0.1:{p}", "--upstream", f"127.0.0.1:{port}", "--rtt-ms",
                                                   RTT, "--rate-mbit", RATE], stderr=subprocess.DEVNULL))
                systems[(build, link)] = (bindir, p, "true" if build == "passthrough" else "false")
        time.sleep(1.5)
        for (build, link), (bindir, p, passthrough) in systems.items():
            mnt = os.path.join(work, f"mnt-{build}-{link}")
            os.makedirs(mnt)
            subprocess.run([os.path.join(bindir, "batchfs"), "mount", f"http://127.0.0.1:{p}/d", mnt, "-o",
                            f"batch_size={BATCH},prefetch=0,passthrough={passthrough},cache=1G"], check=True)
            mounts.append((bindir, mnt))
            systems[(build, link)] = mnt
        rows = []
        order = list(systems)
        for rnd in range(ROUNDS):
            for build, link in order if rnd % 2 == 0 else order[::-1]:
                path = os.path.join(systems[(build, link)], "epoch-0000", f"batch-{rnd:06d}.tfrecord")
                first, total, size = read_timed(path)
                row = {"round": rnd, "build": build, "link": link, "batch": rnd, "bytes": size,
                       "first_ms": round(first, 2), "all_ms": round(total, 2)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        write_csv(os.path.join(out, "results.csv"), rows)
        med = lambda b, l, k: statistics.median(r[k] for r in rows if r["build"] == b and r["link"] == l)
        report = (f"{rows[0]['bytes'] / 1e6:.0f} MB batch files read on demand (prefetch=0), 1 MiB reads, "
                  f"medians of {ROUNDS} rounds; ms from the open\n\n"
                  "| link | system | first MiB ms | whole file ms | first MiB / before | whole / before |\n"
                  "|---|---|---|---|---|---|\n")
        for link in dict.fromkeys(l for _, l in systems):
            fb, ab = med("before", link, "first_ms"), med("before", link, "all_ms")
            for build in ("before", "after", "passthrough"):
                f, a = med(build, link, "first_ms"), med(build, link, "all_ms")
                report += f"| {link} | {build} | {f:.1f} | {a:.1f} | {f / fb:.3f} | {a / ab:.3f} |\n"
        open(os.path.join(out, "report.md"), "w").write(report)
        print(report)
    finally:
        for bindir, m in mounts:
            subprocess.run([os.path.join(bindir, "batchfs"), "umount", "--lazy", m], capture_output=True)
        for p in procs:
            p.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
