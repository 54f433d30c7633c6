#!/usr/bin/env python3
"""The transparent views with real loaders: DALI (mmap and not) reading the original TFRecord shards
with their `.idx` files from a local copy and through a mount's `raw/` at several RTTs, alternating,
ROUNDS rounds; medians and ratios. Also the cost of `rolling=slots` for this dataset (slot / mean record).

    tests/bench/views_bench.py OUT_DIR
    env: SAMPLES (20000), MEAN (110000 bytes), SHARDS (32), RTTS ("0 30"), ROUNDS (3),
         LOADERS ("dali dali-nommap"), MOUNT_OPTS (default cache=512M)

Systems: `local` (the shards and the mount's `.idx` twins copied to a local directory, page cache warm)
and `raw-RTT` (a mount's `raw/` through `batchfs-lab netem` at each RTT). Shards are read in 4 MiB verified
chunks through the daemon (larger than a chunk: no passthrough). Writes results.csv and report.md to
OUT_DIR. Needs root, /dev/fuse, a release build and DALI (see .ci/run).
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loaders_bench import (  # noqa: E402
    BIN, LOADERS_PY, free_port, measure_idle, run_measured, with_cleanup, write_csv)

env = os.environ.get
SAMPLES, MEAN, SHARDS = int(env("SAMPLES", "20000")), int(env("MEAN", "110000")), int(env("SHARDS", "32"))
RTTS = [int(r) for r in env("RTTS", "0 30").split()]
ROUNDS = int(env("ROUNDS", "3"))
LOADERS = env("LOADERS", "dali dali-nommap").split()
MOUNT_OPTS = env("MOUNT_OPTS", "cache=512M")


def main():
    with_cleanup("views", run)


def run(out, work, procs, mounts):
    data = os.path.join(work, "data")
    subprocess.run([os.path.join(BIN, "batchfs-server"), "gen", "--format", "tfrecord", "--samples", str(SAMPLES),
                    "--mean-bytes", str(MEAN), "--shards", str(SHARDS), "--out", data], check=True,
                   capture_output=True)
    port = free_port()
    procs.append(subprocess.Popen([os.path.join(BIN, "batchfs-server"), "serve", "--listen", f"127.0.0.1:{port}",
                                   "--dataset", f"d={data}"], stderr=subprocess.DEVNULL))
    time.sleep(1.0)
    dirs, netem = {}, {}
    for rtt in RTTS:
        p = free_port()
        proc = subprocess.Popen([os.path.join(BIN, "batchfs-lab"), "netem", "--listen", f"127.0.0.1:{p}",
                                 "--upstream", f"127.0.0.1:{port}", "--rtt-ms", str(rtt)], stderr=subprocess.DEVNULL)
        procs.append(proc)
        time.sleep(0.5)
        mnt = os.path.join(work, f"mnt-{rtt}ms")
        os.makedirs(mnt)
        opts = "batch_size=128" + (f",{MOUNT_OPTS}" if MOUNT_OPTS else "")
        subprocess.run([os.path.join(BIN, "batchfs"), "mount", f"http://127.0.0.1:{p}/d", mnt, "-o", opts], check=True)
        mounts.append(mnt)
        dirs[f"raw-{rtt}ms"] = os.path.join(mnt, "raw")
        netem[f"raw-{rtt}ms"] = proc
    info = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/datasets/d"))
    # The local copy: the shards and the twins the mount shows, read from the page cache.
    local = os.path.join(work, "local")
    os.makedirs(local)
    first = dirs[f"raw-{RTTS[0]}ms"]
    for name in os.listdir(first):
        if name.endswith(".tfrecord") or name.endswith(".tfrecord.idx"):
            src = os.path.join(data, name) if name.endswith(".tfrecord") else os.path.join(first, name)
            shutil.copy(src, os.path.join(local, name))
    dirs["local"] = local
    systems = ["local"] + [f"raw-{rtt}ms" for rtt in RTTS]
    rows = []
    idle_rate = measure_idle()
    for rnd in range(ROUNDS):
        for loader in LOADERS:
            for system in systems:
                args = [sys.executable, LOADERS_PY, "dali", dirs[system]] + (["--no-mmap"] if "nommap" in loader else [])
                r, cpu_per_gb = run_measured(args, f"{loader} on {system}", netem.get(system), idle_rate)
                row = {"round": rnd, "loader": loader, "system": system, "epoch_s": r["epoch_s"],
                       "build_s": r["build_s"], "bytes": r["bytes"], "samples": r["samples"],
                       "cpu_s_per_gb": cpu_per_gb}
                rows.append(row)
                print(json.dumps(row), flush=True)
    write_csv(os.path.join(out, "results.csv"), rows)
    report = render(rows, systems, info)
    open(os.path.join(out, "report.md"), "w").write(report)
    print(report)


def render(rows, systems, info):
    gb = rows[0]["bytes"] / 1e9
    lines = [f"DALI over the original shards: {SAMPLES} samples in {SHARDS} shards, {gb:.2f} GB of sample bytes, "
             f"medians of {ROUNDS} rounds.", ""]
    slow = [s for s in systems if s.startswith("raw-") and s != f"raw-{RTTS[0]}ms"]
    columns = [f"{s} s" for s in systems] + [f"raw-{RTTS[0]}ms / local"] + [f"{s} / raw-{RTTS[0]}ms" for s in slow]
    columns += ["build s local", f"build s raw-{RTTS[-1]}ms", "CPU s/GB local", f"CPU s/GB raw-{RTTS[0]}ms"]
    header = "| loader | " + " | ".join(columns) + " |"
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for loader in LOADERS:
        cell = lambda s, k: statistics.median(r[k] for r in rows if r["loader"] == loader and r["system"] == s)
        med = {s: cell(s, "epoch_s") for s in systems}
        cells = [f"{med[s]:.2f}" for s in systems] + [f"{med[f'raw-{RTTS[0]}ms'] / med['local']:.2f}x"]
        cells += [f"{med[s] / med[f'raw-{RTTS[0]}ms']:.3f}" for s in slow]
        cells += [f"{cell('local', 'build_s'):.2f}", f"{cell(f'raw-{RTTS[-1]}ms', 'build_s'):.2f}"]
        cells += [f"{cell('local', 'cpu_s_per_gb'):.2f}", f"{cell(f'raw-{RTTS[0]}ms', 'cpu_s_per_gb'):.2f}"]
        lines.append(f"| {loader} | " + " | ".join(cells) + " |")
    ratio = info["slot_bytes"] / max(info["mean_frame_bytes"], 1)
    lines += ["", f"`rolling=slots` for this dataset: slot {info['slot_bytes']} bytes against a mean record of "
              f"{info['mean_frame_bytes']} bytes: {ratio:.1f}x the bytes of the packed files "
              f"(`rolling=auto` picks {'slots' if ratio <= 2 else 'packed'})."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
