#!/usr/bin/env python3
"""Summarizes tests/bench/latency_matrix.sh results: medians, ratios, and the EMLIO-style figure.

    matrix_report.py results.csv BYTES PACE_MBPS [READERS] [ENERGY_IDLE_JSONL]

CPU seconds per GB come from the cpu_s column (machine busy time minus the proxy and the idle background);
energy per GB from each cell's `batchfs-lab energy` log, less the idle power measured at the start.
"""
import csv
import json
import statistics
import sys
from collections import defaultdict

path, nbytes, pace = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
readers = sys.argv[4] if len(sys.argv) > 4 else "threads"
idle_log = sys.argv[5] if len(sys.argv) > 5 else None


def summary(log):
    try:
        return json.loads(open(log).read().splitlines()[-1])["summary"]
    except (OSError, ValueError, KeyError, IndexError):
        return None


idle = summary(idle_log) if idle_log else None
idle_w = {s["sensor"]: s["total_j"] / s["covered_s"] for s in (idle or {}).get("sensors", []) if s["covered_s"] > 0}


def joules_above_idle(log):
    """Energy of one cell above the idle power, all sensors together; None without a sensor."""
    s = summary(log) if log and log != "-" else None
    if not s or not s["sensors"]:
        return None
    return sum(x["total_j"] - idle_w.get(x["sensor"], 0.0) * x["covered_s"] for x in s["sensors"])


cells = defaultdict(list)
for row in csv.DictReader(open(path)):
    cpu = float(row["cpu_s"]) if row.get("cpu_s") not in (None, "") else None
    cells[row["system"], int(row["rtt_ms"]), row["mode"]].append(
        (float(row["wall_s"]), float(row["mb_per_s"]), cpu, joules_above_idle(row.get("energy_log"))))


def median_of(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


med = {k: (median_of(c[0] for c in v), median_of(c[1] for c in v), len(v)) for k, v in cells.items()}
cpu_med = {k: median_of(c[2] for c in v) for k, v in cells.items()}
joule_med = {k: median_of(c[3] for c in v) for k, v in cells.items()}
systems = [s for s in ["local", "batchfs", "batchfs-noprefetch", "sshfs", "rclone", "sshfs-samples", "rclone-samples"]
           if any(k[0] == s for k in med)]
rtts = sorted({k[1] for k in med if not k[2].startswith("capped")})
rounds = max(n for _, _, n in med.values())
print(f"Epoch of {nbytes / 1e6:.0f} MB (batch files), 4 interleaved reader {readers}, medians of {rounds} rounds; "
      f"paced = {pace:g} MB/s in total.\n")
for mode in ("paced", "unpaced"):
    print(f"**{mode}: epoch seconds**\n")
    print("| system | " + " | ".join(f"{r} ms" for r in rtts) + " |")
    print("|---|" + "---|" * len(rtts))
    for s in systems:
        print(f"| {s} | " + " | ".join(f"{med[s, r, mode][0]:.3f}" if (s, r, mode) in med else "-" for r in rtts) + " |")
    print()
gb = nbytes / 1e9
for title, table in (("CPU seconds per GB read", cpu_med), ("energy above idle, J per GB", joule_med)):
    if not any(v is not None for v in table.values()):
        if table is joule_med:
            why = "; ".join(f"{u['sensor']}: {u['reason']}" for u in (idle or {}).get("unavailable", []))
            print(f"**{title}**: not measured, no energy sensor on this machine ({why or 'no energy log'}).\n")
        continue
    for mode in ("paced", "unpaced"):
        print(f"**{mode}: {title}** (whole machine: readers, client, server; the netem proxy and the idle "
              f"background excluded)\n")
        print("| system | " + " | ".join(f"{r} ms" for r in rtts) + " |")
        print("|---|" + "---|" * len(rtts))
        for s in systems:
            vals = [table.get((s, r, mode)) for r in rtts]
            print(f"| {s} | " + " | ".join("-" if v is None else f"{v / gb:.2f}" for v in vals) + " |")
        print()
far, near = max(rtts), min(rtts)
def m(s, r, mode):
    return med[s, r, mode][0]
print("**ratios**\n")
print(f"- paced batchfs {far} ms / {near} ms: {m('batchfs', far, 'paced') / m('batchfs', near, 'paced'):.3f}x (target <= 1.03x)")
for peer in ("sshfs", "rclone"):
    for mode in ("paced", "unpaced"):
        print(f"- {mode} {peer} / batchfs at {far} ms: {m(peer, far, mode) / m('batchfs', far, mode):.1f}x (target >= 20x)")
for peer in ("sshfs-samples", "rclone-samples"):
    if (peer, far, "paced") in med:
        for mode in ("paced", "unpaced"):
            print(f"- {mode} {peer} (one file per sample) / batchfs at {far} ms: "
                  f"{m(peer, far, mode) / m('batchfs', far, mode):.1f}x (target >= 20x)")
print(f"- unpaced batchfs at {near} ms reads at {m('local', near, 'unpaced') / m('batchfs', near, 'unpaced') * 100:.0f} % "
      f"of local page-cache speed (target >= 50 %)")
print(f"- prefetch's share at {far} ms, paced: batchfs prefetch=0 / default = "
      f"{m('batchfs-noprefetch', far, 'paced') / m('batchfs', far, 'paced'):.2f}x")
capped = sorted((float(k[2][len("capped-"):]), k[0], v) for k, v in med.items() if k[2].startswith("capped"))
if capped:
    print("\n**capped links (10 ms RTT), unpaced: MB/s and share of the link rate (target >= 92 % for batchfs)**\n")
    print("| link | " + " | ".join(s for s in systems if any(c[1] == s for c in capped)) + " |")
    shown = [s for s in systems if any(c[1] == s for c in capped)]
    print("|---|" + "---|" * len(shown))
    for rate in sorted({c[0] for c in capped}):
        link = rate / 8
        cells = {c[1]: c[2][1] for c in capped if c[0] == rate}
        print(f"| {rate:g} Mbit/s ({link:.0f} MB/s) | " + " | ".join(f"{cells[s]:.1f} ({cells[s] / link * 100:.0f} %)" for s in shown) + " |")
