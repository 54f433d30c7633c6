#!/usr/bin/env python3
"""The chaos benchmark: whole epochs read by 4 reader processes through a mount of two replicas, each
behind its own `batchfs-lab netem`, clean and then under faults, alternating, ROUNDS rounds.

    tests/bench/chaos_bench.py [OUT_DIR]
    env: SAMPLES (6000), MEAN (110000), BATCH (64), ROUNDS (3), EPOCHS (6 per run),
         FAULTS (netem flags for the chaos runs; default below)

Chaos runs: both links flip bits, cut connections and stall them (FAULTS); replica A's link also goes
down for 3 s every 8 s; and replica B's server is SIGKILLed 3 s into the run and restarted 3 s later on
its address. Every reader process checks every file it reads against the epoch's manifest (size and
CRC32C, fetched straight from a server): a file that differs is a wrong byte, and the run fails.

Reports per run: epoch time (median of the run's epochs), files verified, wrong files, the faults each
netem injected (its own counters), and the mount's retries, checksum errors and read errors; then the
chaos/clean epoch time ratio. Writes results.csv and report.md to OUT_DIR and prints the report. Needs
root, /dev/fuse, a release build and the `crc32c` Python package.
"""
import csv
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loaders_bench import free_port, wait_healthy  # noqa: E402

CHILDREN = []  # every server and netem started, stopped at the end whatever happens
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release")
env = os.environ.get
SAMPLES, MEAN, BATCH = int(env("SAMPLES", "6000")), int(env("MEAN", "110000")), int(env("BATCH", "64"))
ROUNDS, EPOCHS = int(env("ROUNDS", "3")), int(env("EPOCHS", "6"))
FAULTS = env("FAULTS", "--corrupt-every 64M --reset-every 256M --stall-every 64M --stall-ms 200 --fault-seed 5").split()

READER = r"""
import crc32c, json, os, sys
epoch_dir, manifest, r, n = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4])
ok = wrong = 0
for b in manifest["batches"][r::n]:
    name = os.path.join(epoch_dir, "batch-%06d.tfrecord" % b["index"])
    with open(name, "rb") as f:
        data = f.read()
    if len(data) == b["bytes"] and crc32c.crc32c(data) == b["crc32c"]:
        ok += 1
    else:
        wrong += 1
        print("WRONG", name, len(data), file=sys.stderr)
print(json.dumps({"ok": ok, "wrong": wrong}))
"""


class Replica:
    def __init__(self, work, data, name):
        self.port, self.data, self.log = free_port(), data, open(os.path.join(work, f"server-{name}.log"), "a")
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen([f"{BIN}/batchfs-server", "serve", "--listen", f"127.0.0.1:{self.port}",
                                      "--dataset", f"d={self.data}"], stderr=self.log)
        CHILDREN.append(self.proc)
        wait_healthy(self.port)

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def netem(work, name, upstream, extra):
    port = free_port()
    log = open(os.path.join(work, f"netem-{name}.log"), "w")
    proc = subprocess.Popen([f"{BIN}/batchfs-lab", "netem", "--listen", f"127.0.0.1:{port}", "--upstream",
                             f"127.0.0.1:{upstream}", "--rtt-ms", "2"] + extra, stderr=log)
    CHILDREN.append(proc)
    time.sleep(0.3)
    return port, proc, log.name


def faults_of(log):
    last = [l for l in open(log) if "faults injected" in l]
    if not last:
        return {}
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", last[-1])}


def run(work, replicas, chaos, first_epoch):
    links = [netem(work, f"{'chaos' if chaos else 'clean'}-{i}", r.port,
                   (FAULTS + (["--down-after-s", "5", "--down-ms", "3000"] if i == 0 else [])) if chaos else [])
             for i, r in enumerate(replicas)]
    mnt = tempfile.mkdtemp(dir=work)
    urls = [f"http://127.0.0.1:{p}" for p, _, _ in links]
    subprocess.run([f"{BIN}/batchfs", "mount", urls[0] + "/d", mnt, "-o",
                    f"batch_size={BATCH},epochs=100000,cache=512M,servers={urls[1]}"], check=True)
    killer = None
    if chaos:
        def chaos_monkey():
            time.sleep(3)
            replicas[1].kill()
            time.sleep(3)
            replicas[1].start()
        import threading
        killer = threading.Thread(target=chaos_monkey)
        killer.start()
    times, ok, wrong = [], 0, 0
    for e in range(first_epoch, first_epoch + EPOCHS):
        url = f"http://127.0.0.1:{replicas[0].port}/v1/datasets/d/epochs/{e}?batch_size={BATCH}"
        manifest = os.path.join(work, f"manifest-{e}.json")
        with urllib.request.urlopen(url) as r, open(manifest, "wb") as f:
            f.write(r.read())
        started = time.time()
        readers = [subprocess.Popen([sys.executable, "-c", READER, os.path.join(mnt, "epoch-%04d" % e), manifest,
                                     str(r), "4"], stdout=subprocess.PIPE) for r in range(4)]
        for p in readers:
            stdout = p.communicate()[0]
            if p.returncode != 0:
                raise SystemExit(f"a reader of epoch {e} failed (exit {p.returncode})")
            out = json.loads(stdout)
            ok, wrong = ok + out["ok"], wrong + out["wrong"]
        times.append(time.time() - started)
    if killer:
        killer.join()
    stats = json.load(open(os.path.join(mnt, ".batchfs", "stats")))
    subprocess.run([f"{BIN}/batchfs", "umount", mnt], check=True)
    injected = {}
    for _, proc, log in links:
        time.sleep(1.1)  # the last report line
        proc.terminate()
        proc.wait()
        for k, v in faults_of(log).items():
            injected[k] = injected.get(k, 0) + v
    return {"epoch_s": statistics.median(times), "files_ok": ok, "files_wrong": wrong,
            "retries": stats["retries"], "checksum_errors": stats["checksum_errors"], "read_errors": stats["errors"],
            "faults": " ".join(f"{k}={v}" for k, v in sorted(injected.items()))}


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="batchfs-chaos-")
    os.makedirs(out_dir, exist_ok=True)
    if not os.path.exists(f"{BIN}/batchfs"):
        subprocess.run(["cargo", "build", "--release", "--workspace"], cwd=ROOT, check=True)
    work = tempfile.mkdtemp(prefix="batchfs-chaos-")
    try:
        data = os.path.join(work, "data")
        subprocess.run([f"{BIN}/batchfs-server", "gen", "--format", "tfrecord", "--samples", str(SAMPLES),
                        "--mean-bytes", str(MEAN), "--out", data], check=True, stdout=subprocess.DEVNULL)
        replicas = [Replica(work, data, name) for name in "ab"]
        for r in replicas:
            r.start()
        rows, epoch = [], 0
        for rnd in range(ROUNDS):
            for chaos in (False, True):
                row = run(work, replicas, chaos, epoch)
                epoch += EPOCHS
                row.update({"round": rnd, "system": "chaos" if chaos else "clean"})
                rows.append(row)
                print(json.dumps(row), flush=True)
        for r in replicas:
            r.proc.terminate()
        with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
        med = {s: statistics.median(r["epoch_s"] for r in rows if r["system"] == s) for s in ("clean", "chaos")}
        lines = [f"Epoch: {SAMPLES} samples, batch_size {BATCH}, {EPOCHS} epochs per run, 4 reader processes, "
                 f"{ROUNDS} rounds; faults: {' '.join(FAULTS)}, replica A's link down 3 s every 8 s, replica B "
                 "killed and restarted.", "",
                 "| round | system | epoch s | files ok | files wrong | mount retries | checksum errors | "
                 "read errors | faults injected |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['round']} | {r['system']} | {r['epoch_s']:.2f} | {r['files_ok']} | {r['files_wrong']} | "
                         f"{r['retries']} | {r['checksum_errors']} | {r['read_errors']} | {r['faults']} |")
        lines += ["", f"Median epoch: clean {med['clean']:.2f} s, chaos {med['chaos']:.2f} s "
                      f"({med['chaos'] / med['clean']:.2f}x); wrong files: {sum(r['files_wrong'] for r in rows)}."]
        report = "\n".join(lines)
        open(os.path.join(out_dir, "report.md"), "w").write(report + "\n")
        print(report)
        if any(r["files_wrong"] for r in rows):
            raise SystemExit("a reader got a wrong byte")
    finally:
        for p in CHILDREN:
            if p.poll() is None:
                p.kill()
        for m in os.listdir(work):
            subprocess.run([f"{BIN}/batchfs", "umount", "--lazy", os.path.join(work, m)],
                           stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
