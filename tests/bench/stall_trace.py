#!/usr/bin/env python3
"""Stalls on short epochs: DALI over short epochs through `batchfs-lab netem` at 0 and 30 ms, rounds
alternating, with a trace of the prefetcher around every epoch (docs/BENCHMARKS.md, "Per-node CPU",
issue 25's item 4).

    tests/bench/stall_trace.py OUT_DIR
    env: SAMPLES (5000: 545 MB epochs of the heavy-tailed generator), MEAN (110000), BATCH (128),
         RTTS ("0 30"), ROUNDS (5), LOADER (dali), INTERVAL_MS (20), MOUNT_OPTS (extra -o options),
         DIRECT ("1": also a mount straight to the server, `direct`, beside the netem ones)

One server, one `batchfs-lab netem` per RTT (0 included: every RTT then pays netem's CPU, about 0.6 s/GB
on this machine's two shared cores, so that only the latency differs between them), one mount per RTT
and one straight to the server, default options. After an uncounted first epoch
through each, each round reads a new epoch through each mount in turn with the loader (its default settings, as in loaders_bench.py).
While an epoch is read, `.batchfs/stats` is sampled every INTERVAL_MS: the stall time so far, the prefetch
bytes in flight, their cap and the delivery rate the cap is computed from, the batches in flight and the
cache's bytes. Writes results.csv (one row per epoch: its time and the stall time, from the deltas of the
mount's counters), trace.csv (every sample of every epoch) and report.md, which gives, for the epoch with
the most stall time at each RTT, the samples around the sharpest rise of its stall time: what the window
held while a reader waited.
"""
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loaders_bench import BIN, command, free_port, md_table, serve_generated, with_cleanup, write_csv  # noqa: E402

env = os.environ.get
SAMPLES, MEAN, BATCH = int(env("SAMPLES", "5000")), int(env("MEAN", "110000")), int(env("BATCH", "128"))
RTTS = [int(r) for r in env("RTTS", "0 30").split()]
DIRECT = env("DIRECT", "1") == "1"
ROUNDS = int(env("ROUNDS", "5"))
LOADER = env("LOADER", "dali")
INTERVAL = int(env("INTERVAL_MS", "20")) / 1000
MOUNT_OPTS = env("MOUNT_OPTS", "")
FIELDS = ("stall_us", "stalls", "prefetch_bytes_in_flight", "prefetch_cap", "delivery_rate", "in_flight",
          "cache_bytes", "fetched_bytes")


def stats(mnt):
    # The mount serves it with direct I/O: each read is fresh (docs/SEMANTICS.md).
    with open(os.path.join(mnt, ".batchfs", "stats")) as f:
        return json.load(f)


class Tracer(threading.Thread):
    """Samples a mount's stats every INTERVAL until stopped."""

    def __init__(self, mnt):
        super().__init__(daemon=True)
        self.mnt, self.samples, self.done = mnt, [], threading.Event()
        self.start_time = time.monotonic()

    def run(self):
        while not self.done.is_set():
            s = stats(self.mnt)
            self.samples.append({"t_ms": round((time.monotonic() - self.start_time) * 1000, 1),
                                 **{k: s.get(k, 0) for k in FIELDS}})
            self.done.wait(INTERVAL)


def run(out, work, procs, mounts):
    _, port = serve_generated(work, procs, SAMPLES, MEAN)
    mnts = {}
    for rtt in (["direct"] if DIRECT else []) + RTTS:
        p = port
        if rtt != "direct":
            p = free_port()
            procs.append(subprocess.Popen([os.path.join(BIN, "batchfs-lab"), "netem", "--listen", f"127.0.0.1:{p}",
                                           "--upstream", f"127.0.0.1:{port}", "--rtt-ms", str(rtt)],
                                          stderr=subprocess.DEVNULL))
        time.sleep(0.5)
        mnt = os.path.join(work, f"mnt-{rtt}")
        os.makedirs(mnt)
        opts = f"batch_size={BATCH},epochs=100000" + (f",{MOUNT_OPTS}" if MOUNT_OPTS else "")
        subprocess.run([os.path.join(BIN, "batchfs"), "mount", f"http://127.0.0.1:{p}/d", mnt, "-o", opts], check=True)
        mounts.append(mnt)
        mnts[rtt] = {"mnt": mnt, "epoch": 0}
    # The uncounted first epoch of every mount (a mount's first epoch fills memory it has not touched).
    for m in mnts.values():
        subprocess.run(command(LOADER, os.path.join(m["mnt"], "epoch-0000"), False), check=True, capture_output=True)
        m["epoch"] = 1
    rows, traces = [], []
    for rnd in range(ROUNDS):
        for rtt, m in mnts.items():
            directory = os.path.join(m["mnt"], f"epoch-{m['epoch']:04d}")
            before = stats(m["mnt"])
            tracer = Tracer(m["mnt"])
            tracer.start()
            proc = subprocess.run(command(LOADER, directory, False), capture_output=True, text=True)
            tracer.done.set()
            tracer.join()
            if proc.returncode != 0:
                raise SystemExit(f"{LOADER} over {directory} failed:\n{proc.stderr[-3000:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            after = stats(m["mnt"])
            row = {"round": rnd, "link": rtt, "epoch": m["epoch"], "epoch_s": result["epoch_s"],
                   "samples": result["samples"], "bytes": result["bytes"],
                   "stall_s": round((after["stall_us"] - before["stall_us"]) / 1e6, 3),
                   "stalls": after["stalls"] - before["stalls"],
                   "cap_min_mb": round(min(s["prefetch_cap"] for s in tracer.samples) / 1e6, 1),
                   "in_flight_max_mb": round(max(s["prefetch_bytes_in_flight"] for s in tracer.samples) / 1e6, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            for s in tracer.samples:
                traces.append({"round": rnd, "link": rtt, "epoch": m["epoch"], **s})
            m["epoch"] += 1
    write_csv(os.path.join(out, "results.csv"), rows)
    write_csv(os.path.join(out, "trace.csv"), traces)
    report = render(rows, traces, list(mnts))
    open(os.path.join(out, "report.md"), "w").write(report)
    print(report)


def render(rows, traces, systems):
    name = lambda r: r if r == "direct" else f"{r} ms"  # noqa: E731
    lines = [f"{LOADER}, {SAMPLES} samples per epoch, {ROUNDS} rounds, the systems in turn: "
             + ", ".join(name(r) for r in systems), "",
             "| round | " + " | ".join(f"{name(r)} epoch s | {name(r)} stall s" for r in systems) + " |",
             "|---|" + "---|---|" * len(systems)]
    for rnd in range(ROUNDS):
        cells = []
        for rtt in systems:
            r = next(x for x in rows if x["round"] == rnd and x["link"] == rtt)
            cells.append(f"{r['epoch_s']:.2f} | {r['stall_s']:.2f}")
        lines.append(f"| {rnd} | " + " | ".join(cells) + " |")
    for rtt in systems:
        mine = [r for r in rows if r["link"] == rtt]
        lines.append(f"\n{name(rtt)}: median epoch {statistics.median(r['epoch_s'] for r in mine):.2f} s, "
                     f"median stall {statistics.median(r['stall_s'] for r in mine):.2f} s, cap at least "
                     f"{min(r['cap_min_mb'] for r in mine)} MB")
    if len(RTTS) > 1:
        base = [r["epoch_s"] for r in rows if r["link"] == RTTS[0]]
        for rtt in RTTS[1:]:
            ratios = [r["epoch_s"] / b for r, b in zip((r for r in rows if r["link"] == rtt), base)]
            lines.append(f"{rtt} ms / {RTTS[0]} ms per round: " + ", ".join(f"{x:.2f}" for x in ratios))
    for rtt in systems:
        worst = max((r for r in rows if r["link"] == rtt), key=lambda r: r["stall_s"])
        trace = [t for t in traces if t["link"] == rtt and t["epoch"] == worst["epoch"]]
        if len(trace) < 2:
            continue
        rise = max(range(1, len(trace)), key=lambda i: trace[i]["stall_us"] - trace[i - 1]["stall_us"])
        lines += ["", f"{name(rtt)}, epoch {worst['epoch']} ({worst['stall_s']} s stalled): around its sharpest rise",
                  ""]
        lines += md_table(["t ms", "stalled ms, this epoch", "in flight MB", "cap MB", "rate MB/s", "batches in flight",
                           "cache MB"],
                          [[t["t_ms"], f"{(t['stall_us'] - trace[0]['stall_us']) / 1000:.0f}",
                            f"{t['prefetch_bytes_in_flight'] / 1e6:.1f}", f"{t['prefetch_cap'] / 1e6:.1f}",
                            f"{t['delivery_rate'] / 1e6:.0f}", t["in_flight"], f"{t['cache_bytes'] / 1e6:.0f}"]
                           for t in trace[max(0, rise - 5):rise + 5]])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with_cleanup("stall", run)
