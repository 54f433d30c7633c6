#!/usr/bin/env python3
"""The loaders table: real data loaders, default settings, reading epochs from a local copy and through
batchfs mounts at several RTTs, paced and unpaced, alternating, ROUNDS rounds; medians, ratios, CPU/GB.

    tests/bench/loaders_bench.py OUT_DIR
    env: SAMPLES (20000), MEAN (110000 bytes), BATCH (128), RTTS ("0 30 100"), PACE (MB/s, 400),
         ROUNDS (3), LOADERS ("dali dali-nommap torch wds"), MODES ("unpaced paced"),
         MOUNT_OPTS (extra -o options for every mount; default cache=512M: twelve mounts, each holding
         its cache full after an epoch, beside the local copies and the server's files, must fit in this
         machine's memory, or kswapd evicts the local copies and every figure turns to noise),
         BIN_BEFORE (a target/release directory of another build: adds `direct-before` and
         `daemon-before`, its mounts, to compare builds side by side)

Systems: `local` (the same batch files copied to a local directory, page cache warm), `direct` (a mount
of the server on loopback), `daemon` (the same with passthrough=false: every read through the daemon) and `netem-RTT` (a mount through `batchfs-lab netem` at each RTT, 0 included: the
user-space proxy costs CPU on these 2 cores, so the latency's own cost is netem-RTT / netem-0ms). Each run on a mount reads a fresh epoch
(epoch 1, 2, ... of that mount), so nothing is served from the mount's cache of an earlier run except
what the previous epoch's window warmed, as in training. Loaders: tests/python/loaders.py (DALI with and
without mmap, PyTorch DataLoader with 4 workers under Debian's python3, WebDataset over tar batches).

CPU seconds: the whole machine's busy time during the run (/proc/stat), minus the netem proxy's own CPU.
Writes results.csv (every run) and report.md (medians, ratios) to OUT_DIR and prints the report.
Needs root, /dev/fuse, a release build (built if missing), and the loaders installed (see .ci/run).
"""
import csv
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release")
LOADERS_PY = os.path.join(ROOT, "tests", "python", "loaders.py")
env = os.environ.get
SAMPLES, MEAN, BATCH = int(env("SAMPLES", "20000")), int(env("MEAN", "110000")), int(env("BATCH", "128"))
RTTS = [int(r) for r in env("RTTS", "0 30 100").split()]
PACE, ROUNDS = float(env("PACE", "400")), int(env("ROUNDS", "3"))
LOADERS = env("LOADERS", "dali dali-nommap torch wds").split()
MODES = env("MODES", "unpaced paced").split()
MOUNT_OPTS = env("MOUNT_OPTS", "cache=512M")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port, tries=300):
    """Waits until the server on `port` answers /healthz (at most `tries` x 0.1 s)."""
    import urllib.request

    for _ in range(tries):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"server on {port} did not come up")


def busy_seconds():
    fields = open("/proc/stat").readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def cpu_of(pid):
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def run_measured(args, what, netem_proc, idle_rate):
    """Runs loaders.py with `args`: its JSON result and the machine's CPU seconds per GB it read (idle
    background and the netem proxy's own CPU subtracted)."""
    netem_before = cpu_of(netem_proc.pid) if netem_proc else 0.0
    busy = busy_seconds()
    started = time.monotonic()
    res = subprocess.run(args, capture_output=True, text=True)
    wall = time.monotonic() - started
    if res.returncode != 0:
        raise SystemExit(f"{what} failed:\n{res.stderr[-3000:]}")
    r = json.loads(res.stdout.strip().splitlines()[-1])
    cpu = busy_seconds() - busy - (cpu_of(netem_proc.pid) - netem_before if netem_proc else 0.0)
    cpu -= idle_rate * wall
    return r, round(max(cpu, 0.0) / (r["bytes"] / 1e9), 3)


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def md_table(header, rows):
    """A Markdown table's lines: the header's cells, the rule under them, and a line for each row of cells."""
    def line(cells):
        return "| " + " | ".join(str(c) for c in cells) + " |"
    return [line(header), "|---" * len(header) + "|"] + [line(r) for r in rows]


def command(loader, directory, paced):
    python = "/usr/bin/python3" if loader == "torch" else sys.executable
    name = {"dali-nommap": "dali"}.get(loader, loader)
    args = [python, LOADERS_PY, name, directory]
    if loader == "dali-nommap":
        args.append("--no-mmap")
    if paced:
        args += ["--consume-mbps", str(PACE)]
    return args


def with_cleanup(name, run):
    """Runs `run(out, work, procs, mounts)`: OUT_DIR from the command line (default /tmp/batchfs-NAME),
    a fresh work directory, and lists `run` appends the processes it starts and the mounts it makes to;
    all are unmounted, killed and removed afterwards, also on SIGTERM."""
    out = sys.argv[1] if len(sys.argv) > 1 else f"/tmp/batchfs-{name}"
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f"batchfs-{name}-")
    procs, mounts = [], []

    def cleanup(*_):
        for m in mounts:
            subprocess.run([os.path.join(BIN, "batchfs"), "umount", "--lazy", m], capture_output=True)
        for p in procs:
            p.kill()
        shutil.rmtree(work, ignore_errors=True)

    signal.signal(signal.SIGTERM, lambda *a: (cleanup(), sys.exit(1)))
    try:
        run(out, work, procs, mounts)
    finally:
        cleanup()


def main():
    if not (os.path.exists(os.path.join(BIN, "batchfs")) and os.path.exists(os.path.join(BIN, "batchfs-server"))):
        subprocess.run(["cargo", "build", "--release", "--workspace"], cwd=ROOT, check=True)
    with_cleanup("loaders", run)


def serve_generated(work, procs, samples, mean):
    """Generates a TFRecord dataset of `samples` (ImageNet-shaped sizes around `mean` bytes) under `work`
    and serves it as `d` on a free loopback port (the server joins `procs`); returns (data dir, port)."""
    data = os.path.join(work, "data")
    subprocess.run([os.path.join(BIN, "batchfs-server"), "gen", "--format", "tfrecord", "--samples", str(samples),
                    "--mean-bytes", str(mean), "--out", data], check=True, capture_output=True)
    port = free_port()
    procs.append(subprocess.Popen([os.path.join(BIN, "batchfs-server"), "serve", "--listen", f"127.0.0.1:{port}",
                                   "--dataset", f"d={data}"], stderr=subprocess.DEVNULL))
    return data, port


def run(out, work, procs, mounts):
    _, port = serve_generated(work, procs, SAMPLES, MEAN)
    netem = {"direct": (port, None), "daemon": (port, None)}
    if env("BIN_BEFORE"):
        netem["direct-before"] = (port, None)
        netem["daemon-before"] = (port, None)
    for rtt in RTTS:
        p = free_port()
        proc = subprocess.Popen([os.path.join(BIN, "batchfs-lab"), "netem", "--listen", f"127.0.0.1:{p}",
                                 "--upstream", f"127.0.0.1:{port}", "--rtt-ms", str(rtt)], stderr=subprocess.DEVNULL)
        procs.append(proc)
        netem[f"netem-{rtt}ms"] = (p, proc)
    time.sleep(1.0)
    # One mount per RTT and format (WebDataset reads tar batches).
    dirs = {}
    for system, (p, _) in netem.items():
        for fmt in ("tfrecord", "tar"):
            mnt = os.path.join(work, f"mnt-{system}-{fmt}")
            os.makedirs(mnt)
            opts = f"batch_size={BATCH},format={fmt},epochs=100000" + (f",{MOUNT_OPTS}" if MOUNT_OPTS else "")
            if system.startswith("daemon"):
                opts += ",passthrough=false"
            bindir = env("BIN_BEFORE") if system.endswith("-before") else BIN
            subprocess.run([os.path.join(bindir, "batchfs"), "mount", f"http://127.0.0.1:{p}/d", mnt, "-o", opts],
                           check=True)
            mounts.append(mnt)
            dirs[(system, fmt)] = mnt
    # The local copies: epoch 0 of each format, read from the page cache.
    local = {}
    for fmt in ("tfrecord", "tar"):
        dst = os.path.join(work, f"local-{fmt}")
        shutil.copytree(os.path.join(dirs[("direct", fmt)], "epoch-0000"), dst)
        local[fmt] = dst
    next_epoch = {key: 1 for key in dirs}
    systems = ["local"] + list(netem)
    rows = []
    idle_rate = measure_idle()
    for rnd in range(ROUNDS):
        for mode in MODES:
            for loader in LOADERS:
                fmt = "tar" if loader == "wds" else "tfrecord"
                for system in systems:
                    if system == "local":
                        directory, netem_proc = local[fmt], None
                    else:
                        key = (system, fmt)
                        directory = os.path.join(dirs[key], f"epoch-{next_epoch[key]:04d}")
                        next_epoch[key] += 1
                        netem_proc = netem[system][1]
                    args = command(loader, directory, mode == "paced")
                    r, cpu_per_gb = run_measured(args, f"{loader} on {system}", netem_proc, idle_rate)
                    row = {"round": rnd, "mode": mode, "loader": loader, "system": system, "epoch_s": r["epoch_s"],
                           "build_s": r["build_s"], "bytes": r["bytes"], "samples": r["samples"],
                           "cpu_s_per_gb": cpu_per_gb}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    write_csv(os.path.join(out, "results.csv"), rows)
    report = render(rows, systems)
    open(os.path.join(out, "report.md"), "w").write(report)
    print(report)


def measure_idle():
    busy, started = busy_seconds(), time.monotonic()
    time.sleep(2.0)
    return (busy_seconds() - busy) / (time.monotonic() - started)


def render(rows, systems):
    gb = rows[0]["bytes"] / 1e9
    lines = [f"Epoch: {SAMPLES} samples, {gb:.2f} GB of sample bytes, batch_size {BATCH}, medians of {ROUNDS} "
             f"rounds; paced = a consumer at {PACE:.0f} MB/s overlapping with loading.", ""]
    slow = [s for s in systems if s.startswith("netem-") and s != "netem-0ms"]
    columns = [f"{s} s" for s in systems] + ["direct / local", "daemon / local"]
    columns += ["direct / direct-before", "daemon / daemon-before"] if "daemon-before" in systems else []
    columns += [f"{s} / netem-0ms" for s in slow] + ["CPU s/GB local", "CPU s/GB direct"]
    header = "| loader | mode | " + " | ".join(columns) + " |"
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for mode in MODES:
        for loader in LOADERS:
            med = {}
            cpu = {}
            for s in systems:
                cell = [r for r in rows if r["mode"] == mode and r["loader"] == loader and r["system"] == s]
                med[s] = statistics.median(r["epoch_s"] for r in cell)
                cpu[s] = statistics.median(r["cpu_s_per_gb"] for r in cell)
            cells = [f"{med[s]:.2f}" for s in systems]
            cells += [f"{med['direct'] / med['local']:.2f}x", f"{med['daemon'] / med['local']:.2f}x"]
            if "daemon-before" in systems:
                cells += [f"{med['direct'] / med['direct-before']:.3f}", f"{med['daemon'] / med['daemon-before']:.3f}"]
            cells += [f"{med[s] / med['netem-0ms']:.3f}" for s in slow]
            cells += [f"{cpu['local']:.2f}", f"{cpu['direct']:.2f}"]
            lines.append(f"| {loader} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
