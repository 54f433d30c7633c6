#!/usr/bin/env python3
"""rolling/ on ImageNet-shaped sizes: a DALI pipeline built once over rolling/ against the same pipeline over
epoch directories, the bytes fetched, the memory the mount's cache holds, and what the twins say a reader
reads; at several RTTs through `batchfs-lab netem`, mmap and not, alternating, ROUNDS rounds; medians, ratios.

    tests/bench/rolling_bench.py OUT_DIR
    env: SAMPLES (4000), MEAN (110000 bytes; `batchfs-server gen`'s default sizes: log-normal with a heavy
         tail, 1 % of the samples 10-50x the mean), BATCH (128), PASSES (3), EPOCHS (the mounts' `epochs`,
         the span of the indexed layout's slots; default PASSES), RTTS ("0 30"), MODES ("mmap nommap"),
         ROUNDS (3), BIN_BEFORE (a target/release directory of a build whose rolling/ had the `slots`
         layout: adds `slots-before`, its mount with rolling=slots, one pass per run, at the first RTT
         only: its files are tens of times the data)

Systems, each a fresh mount with the defaults (plus epochs=EPOCHS) per run:
- `rolling`: DALI `fn.readers.tfrecord` over rolling/*.tfrecord and their twins, built once, PASSES passes;
- `epochdir`: the same pipeline over epoch-0000/, then epoch-0001/, ... (one build per epoch, as a job
  without rolling/ does), PASSES epochs.
Per run: seconds per pass (reading only: the builds are left out), the bytes the mount fetched against the
packed epochs' bytes (the manifests'), the peak memory of the mount's memory files (sampled every 20 ms:
what its cache holds with passthrough, the holes of sparse files not counted, as the kernel does not),
against the same peak of `epochdir` in the same round, and the sum of the sizes the twins list (what a
reader with `dont_use_mmap=True` reads) against an epoch's packed bytes.
Writes results.csv and report.md to OUT_DIR and prints the report. Needs root, /dev/fuse, a release build
and DALI (see .ci/run).
"""
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loaders_bench import BIN, LOADERS_PY, free_port, serve_generated, with_cleanup, write_csv  # noqa: E402

env = os.environ.get
SAMPLES, MEAN, BATCH = int(env("SAMPLES", "4000")), int(env("MEAN", "110000")), int(env("BATCH", "128"))
PASSES, ROUNDS = int(env("PASSES", "3")), int(env("ROUNDS", "3"))
EPOCHS = int(env("EPOCHS", str(PASSES)))
RTTS = [int(r) for r in env("RTTS", "0 30").split()]
MODES = env("MODES", "mmap nommap").split()


def daemon_pid(mountpoint):
    """The pid of the `batchfs mount` daemon serving `mountpoint`."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"batchfs") for a in args[:1]) and b"mount" in args and mountpoint.encode() in args:
            return int(pid)
    raise SystemExit(f"no daemon for {mountpoint}")


def memfd_bytes(pid):
    """Bytes the process's memory files hold (allocated pages; holes are not)."""
    total = 0
    fds = f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        try:
            if os.readlink(f"{fds}/{fd}").startswith("/memfd:"):
                total += os.stat(f"{fds}/{fd}").st_blocks * 512
        except OSError:
            pass
    return total


class PeakMemory:
    """Samples `memfd_bytes(pid)` every 20 ms until stopped; `peak` is the largest."""

    def __init__(self, pid):
        self.pid, self.peak, self.done = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.done.is_set():
            self.peak = max(self.peak, memfd_bytes(self.pid))
            time.sleep(0.02)

    def stop(self):
        self.done.set()
        self.thread.join()
        return self.peak


def stats(mnt):
    return json.load(open(os.path.join(mnt, ".batchfs", "stats")))


def dali(directory, mode, passes):
    args = [sys.executable, LOADERS_PY, "dali", directory]
    if mode == "nommap":
        args.append("--no-mmap")
    if passes > 1:
        args += ["--epochs", str(passes)]
    res = subprocess.run(args, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"DALI over {directory} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    with_cleanup("rolling", run)


def run(out, work, procs, mounts):
    _, port = serve_generated(work, procs, SAMPLES, MEAN)
    upstream = {}
    for rtt in RTTS:
        p = free_port()
        procs.append(subprocess.Popen([os.path.join(BIN, "batchfs-lab"), "netem", "--listen", f"127.0.0.1:{p}",
                                       "--upstream", f"127.0.0.1:{port}", "--rtt-ms", str(rtt)],
                                      stderr=subprocess.DEVNULL))
        upstream[rtt] = p
    time.sleep(1.5)
    query = f"batch_size={BATCH}&seed=0"
    packed = []
    for e in range(PASSES):
        url = f"http://127.0.0.1:{port}/v1/datasets/d/epochs/{e}?{query}"
        packed.append(json.load(urllib.request.urlopen(url))["bytes"])
    epoch_bytes = packed[0]
    systems = ["rolling", "epochdir"] + (["slots-before"] if env("BIN_BEFORE") else [])
    rows, n = [], 0
    for rnd in range(ROUNDS):
        for rtt in RTTS:
            for mode in MODES:
                for system in systems:
                    if system == "slots-before" and rtt != RTTS[0]:
                        continue
                    n += 1
                    mnt = os.path.join(work, f"mnt-{n}")
                    os.makedirs(mnt)
                    opts = f"batch_size={BATCH},epochs={EPOCHS}"
                    bindir = BIN
                    if system == "slots-before":
                        opts, bindir = opts + ",rolling=slots", env("BIN_BEFORE")
                    subprocess.run([os.path.join(bindir, "batchfs"), "mount", f"http://127.0.0.1:{upstream[rtt]}/d",
                                    mnt, "-o", opts], check=True)
                    mounts.append(mnt)
                    pid = daemon_pid(mnt)
                    passes = 1 if system == "slots-before" else PASSES
                    before = stats(mnt)
                    memory = PeakMemory(pid)
                    if system == "epochdir":
                        results = [dali(os.path.join(mnt, f"epoch-{e:04d}"), mode, 1) for e in range(passes)]
                    else:
                        results = [dali(os.path.join(mnt, "rolling"), mode, passes)]
                    peak = memory.stop()
                    after = stats(mnt)
                    read_s = sum(r["epoch_s"] - r["build_s"] for r in results)
                    samples = sum(r["samples"] for r in results)
                    if samples != SAMPLES * passes:
                        raise SystemExit(f"{system}: {samples} samples, not {SAMPLES * passes}")
                    # What the twins give a reader to read: the sum of their sizes (each record's room).
                    twins = 0
                    if system != "epochdir":
                        rolling = os.path.join(mnt, "rolling")
                        for f in (f for f in os.listdir(rolling) if f.endswith(".idx")):
                            twins += sum(int(line.split()[1]) for line in open(os.path.join(rolling, f)))
                    fetched = after["fetched_bytes"] - before["fetched_bytes"]
                    row = {"round": rnd, "rtt_ms": rtt, "mode": mode, "system": system, "passes": passes,
                           "pass_s": round(read_s / passes, 3),
                           "fetched_over_packed": round(fetched / sum(packed[:passes]), 3),
                           "peak_memfd_mb": round(peak / 1e6, 1),
                           "twins_over_epoch": round(twins / epoch_bytes, 3) if twins else "",
                           "errors": after["errors"] + after["checksum_errors"]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    subprocess.run([os.path.join(BIN, "batchfs"), "umount", mnt], check=True)
                    mounts.remove(mnt)
    write_csv(os.path.join(out, "results.csv"), rows)
    report = render(rows, epoch_bytes)
    open(os.path.join(out, "report.md"), "w").write(report)
    print(report)


def render(rows, epoch_bytes):
    med = lambda cell, k: statistics.median(r[k] for r in cell)  # noqa: E731
    lines = [f"Epoch: {SAMPLES} samples, {epoch_bytes / 1e6:.0f} MB packed, batch_size {BATCH}, {PASSES} passes, "
             f"the mounts' epochs={EPOCHS}; medians of {ROUNDS} rounds.", "",
             "| RTT | DALI | system | s per pass | / epochdir | fetched / packed | peak memory MB | / epochdir | "
             "twins / epoch |", "|---|---|---|---|---|---|---|---|---|"]
    for rtt in RTTS:
        for mode in MODES:
            cell = lambda s: [r for r in rows if r["rtt_ms"] == rtt and r["mode"] == mode and r["system"] == s]  # noqa
            base = cell("epochdir")
            for system in ("rolling", "epochdir", "slots-before"):
                c = cell(system)
                if not c:
                    continue
                twins = [r["twins_over_epoch"] for r in c if r["twins_over_epoch"] != ""]
                lines.append(
                    f"| {rtt} ms | {mode} | {system} | {med(c, 'pass_s'):.2f} | "
                    f"{med(c, 'pass_s') / med(base, 'pass_s'):.2f} | {med(c, 'fetched_over_packed'):.3f} | "
                    f"{med(c, 'peak_memfd_mb'):.0f} | {med(c, 'peak_memfd_mb') / med(base, 'peak_memfd_mb'):.2f} | "
                    f"{statistics.median(twins) if twins else '-'} |")
    for mode in MODES:
        at = {rtt: [r for r in rows if r["rtt_ms"] == rtt and r["mode"] == mode and r["system"] == "rolling"]
              for rtt in RTTS}
        for rtt in RTTS[1:]:
            lines.append("")
            lines.append(f"rolling, DALI {mode}: {rtt} ms / {RTTS[0]} ms per pass = "
                         f"{med(at[rtt], 'pass_s') / med(at[RTTS[0]], 'pass_s'):.3f}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
