#!/usr/bin/env python3
"""Takeover benchmark (issue 20): a supervised `batchfs mount` (release build, default options but
`worker_settle=100ms`) over a real server behind `batchfs-lab netem` (30 ms RTT), four reader threads
(one through mmap).

1. Time without service per takeover: the worker killed with SIGKILL 20 times under the four readers,
   the supervisor's measure of each (death to the new worker serving, `last_takeover_us`), and the
   longest single read the readers saw meanwhile.
2. The supervisor's memory (VmRSS).
3. An epoch's time with the worker killed every 2 s against one without, alternating, ROUNDS rounds, a
   new epoch each time (nothing cached); each reader "trains" STEP_MS per batch file, as a job does.

Usage: ROUNDS=3 tests/bench/takeover_bench.py WORKDIR   (needs target/release/{batchfs,batchfs-server,batchfs-lab})
"""
import json, mmap, os, signal, statistics, subprocess, sys, threading, time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release")
ROUNDS = int(os.environ.get("ROUNDS", "3"))
STEP_MS = float(os.environ.get("STEP_MS", "60"))
work = sys.argv[1]
os.makedirs(work, exist_ok=True)
data, mnt = os.path.join(work, "ds"), os.path.join(work, "mnt")
os.makedirs(mnt, exist_ok=True)
if not os.path.exists(data):
    subprocess.run([f"{BIN}/batchfs-server", "gen", "--format", "tfrecord", "--samples", "8000",
                    "--mean-bytes", "110000", "--out", data], check=True, stdout=subprocess.DEVNULL)
procs = []
server = subprocess.Popen([f"{BIN}/batchfs-server", "serve", "--listen", "127.0.0.1:7990", "--dataset",
                           f"d={data}"], stdout=subprocess.DEVNULL, stderr=open(f"{work}/server.log", "w"))
netem = subprocess.Popen([f"{BIN}/batchfs-lab", "netem", "--listen", "127.0.0.1:7991", "--upstream",
                          "127.0.0.1:7990", "--rtt-ms", "30"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
procs += [server, netem]
time.sleep(2)
# Workers killed every 2 s are takeovers, not workers that fail to reach service (`worker_settle`, 10 s
# by default, would count each kill within it and give the mount up after five).
sup = subprocess.Popen([f"{BIN}/batchfs", "mount", "http://127.0.0.1:7991/d", mnt, "--foreground", "-o",
                        "batch_size=32,worker_settle=100ms"],
                       stdout=subprocess.DEVNULL, stderr=open(f"{work}/mount.log", "w"))
procs.append(sup)


def stats():
    with open(f"{mnt}/.batchfs/stats") as f:
        return json.load(f)


def cleanup():
    os.kill(sup.pid, signal.SIGTERM)
    sup.wait()
    for p in (netem, server):
        p.kill()
        p.wait()


try:
    for _ in range(200):
        try:
            stats()
            break
        except OSError:
            time.sleep(0.1)
    batches = sorted(n for n in os.listdir(f"{mnt}/epoch-0000") if n.endswith(".tfrecord"))

    def readers(epoch, stop, step_ms, longest):
        """Four readers over `epoch` (whole, or passes over it until `stop`); the longest read seen."""
        def run(r):
            while True:
                for name in batches[r::4]:
                    path = f"{mnt}/epoch-{epoch:04d}/{name}"
                    t = time.monotonic()
                    with open(path, "rb") as f:
                        if r == 3:
                            with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                                sum(m[i] for i in range(0, len(m), 4096))
                        else:
                            while f.read(1 << 20):
                                pass
                    longest[0] = max(longest[0], time.monotonic() - t)
                    if step_ms:
                        time.sleep(step_ms / 1e3)
                if stop is None or stop.is_set():
                    return
        threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
        for t in threads:
            t.start()
        return threads

    def kill_worker():
        before = stats()
        os.kill(before["worker_pid"], signal.SIGKILL)
        while True:
            try:
                s = stats()
                if s["worker_restarts"] > before["worker_restarts"]:
                    return s["last_takeover_us"] / 1e3
            except OSError:
                pass
            time.sleep(0.005)

    # 1. Twenty takeovers under four readers.
    stop, longest = threading.Event(), [0.0]
    threads = readers(1, stop, 0, longest)
    time.sleep(1)
    took = []
    for _ in range(20):
        took.append(kill_worker())
        time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join()
    rss = next(l.split()[1] for l in open(f"/proc/{sup.pid}/status") if l.startswith("VmRSS"))
    print(json.dumps({"takeovers": len(took), "median_ms": statistics.median(took), "worst_ms": max(took),
                      "longest_read_s": round(longest[0], 3), "supervisor_rss_kb": int(rss)}))

    # 3. Epochs with a kill every 2 s against epochs without, alternating.
    times = {"none": [], "kill every 2 s": []}
    epoch = 2
    for r in range(ROUNDS):
        for mode in ("none", "kill every 2 s"):
            epoch += 1
            t0 = time.monotonic()
            threads = readers(epoch, None, STEP_MS, [0.0])
            kills = 0
            while any(t.is_alive() for t in threads):
                if mode != "none" and time.monotonic() - t0 > 2 * (kills + 1):
                    kill_worker()
                    kills += 1
                time.sleep(0.02)
            for t in threads:
                t.join()
            times[mode].append(time.monotonic() - t0)
            print(json.dumps({"round": r, "mode": mode, "epoch": epoch, "seconds": round(times[mode][-1], 2),
                              "kills": kills}), flush=True)
    med = {m: statistics.median(v) for m, v in times.items()}
    print(json.dumps({"median_s": med, "ratio": med["kill every 2 s"] / med["none"]}))
finally:
    cleanup()
