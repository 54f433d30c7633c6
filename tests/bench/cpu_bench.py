#!/usr/bin/env python3
"""Per-node cost: CPU seconds per GB of the mount's daemon, of the server and of the loader, each process
on its own core, as a GPU node and a storage node would have them. Real loaders, default settings.

    tests/bench/cpu_bench.py OUT_DIR
    env: SAMPLES (20000), MEAN (110000 bytes), BATCH (128), RTTS ("0 30"), ROUNDS (3),
         LOADERS ("dali dali-nommap torch"), TRANSPORTS ("h2c tls"),
         MOUNT_OPTS (extra -o options of every mount; default cache=1G: up to eight mounts hold their
         cache full, beside the local copy and the server's files, in this machine's memory),
         SERVER_OPTS (extra arguments of every server, e.g. "--sendfile on"),
         BIN_BEFORE (a target/release directory of another build: its server and mounts run beside this
         build's, alternating, for before/after), SERVER_CPU (0), NODE_CPU (1): the cores (taskset),
         LEAD (1): epochs each visit reads just before the counted one, back to back, as training reads
         its epochs (the first of them, `cold`, follows the other systems' runs; reported apart)

Shape: the server (and `batchfs-lab netem`, where an RTT is emulated) on SERVER_CPU; every mount and
every loader on NODE_CPU, so neither side steals the other's cycles. One server per build and
transport (h2c, or TLS with a self-signed certificate the mounts trust through ca_file), one mount per
build, transport and RTT (0 ms: straight to the server; above: through netem). Each mount first reads
one epoch that is not counted (a mount's first epoch also pays for memory the machine has not touched
lately: see docs/BENCHMARKS.md); each run reads a fresh epoch, and each visit of a system LEAD epochs
before the counted (`steady`) one, so that the counted epoch follows one of its own as in training. `local` is the same loader over
a copy of epoch 0 on local disk, page cache warm (the loader's own cost for the same bytes).

CPU: utime + stime from /proc of the server and of the mount's daemon, before and after each run, and
the loader's own over the epoch (`cpu_s` of tests/python/loaders.py: its threads and joined workers,
its imports left out). The floor is measured in every round beside them, on the loader's core: `batchfs-lab
floor` (a plain loopback TCP receive of an epoch's bytes into a 1 MiB buffer plus one CRC32C pass by the
fastest path of this CPU; the sender on SERVER_CPU, the receiver on NODE_CPU; the cheapest receive with the
CRC folded in is reported beside it, and that receive into a region no cache holds, pages already there, as
a body lands in a memory file filled again: "one copy", column `mount / one copy`; over TLS, the floor plus
AES-256-GCM decryption of the bytes by ring, the provider of the mount's rustls), so the daemon's CPU per
GB is reported as a ratio to what receiving and checking the same bytes costs this machine at the least.
Column `refilled`: of the bytes the mount fetched over the counted epoch, the share received straight
into memory files filled again (`batchfs stats`: `recycled_bytes` over `fetched_bytes`; the rest went into
fresh files or buffers). Writes
results.csv (every run), floor.csv (the floor's parts, each round) and report.md
(medians) to OUT_DIR and prints the report. Needs root, /dev/fuse, openssl, a release build, the loaders
(see .ci/run).
"""
import csv
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loaders_bench import BIN, command, cpu_of, free_port, md_table, wait_healthy, with_cleanup, write_csv  # noqa: E402

env = os.environ.get
SAMPLES, MEAN, BATCH = int(env("SAMPLES", "20000")), int(env("MEAN", "110000")), int(env("BATCH", "128"))
RTTS = [int(r) for r in env("RTTS", "0 30").split()]
ROUNDS = int(env("ROUNDS", "3"))
LOADERS = env("LOADERS", "dali dali-nommap torch").split()
TRANSPORTS = env("TRANSPORTS", "h2c tls").split()
MOUNT_OPTS = env("MOUNT_OPTS", "cache=1G")
SERVER_OPTS = env("SERVER_OPTS", "").split()
SERVER_CPU, NODE_CPU = env("SERVER_CPU", "0"), env("NODE_CPU", "1")
LEAD = int(env("LEAD", "1"))


def pinned(cpu, args):
    return ["taskset", "-c", cpu] + args


def certificate(work):
    """A CA (what the mounts trust, through ca_file) and a certificate for 127.0.0.1 it signed, with its key."""
    ca, ca_key = os.path.join(work, "ca.pem"), os.path.join(work, "ca-key.pem")
    cert, key, csr = os.path.join(work, "cert.pem"), os.path.join(work, "key.pem"), os.path.join(work, "cert.csr")
    ext = os.path.join(work, "ext.cnf")
    open(ext, "w").write("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    for args in (["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=batchfs bench CA",
                  "-keyout", ca_key, "-out", ca],
                 ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", key, "-out", csr],
                 ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "2",
                  "-extfile", ext, "-out", cert]):
        subprocess.run(["openssl"] + args, check=True, capture_output=True)
    return ca, cert, key


def wait_port(port, tries=300):
    import socket

    for _ in range(tries):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"nothing listens on {port}")


def daemon_pids(mnt):
    """The pids of the daemon serving the mount at `mnt` (their command lines name the directory): the
    supervisor and its worker (the same program, which serves; see docs/DESIGN.md, "Takeover"), or the one
    process of a mount that is not supervised."""
    out = [int(p) for p in subprocess.run(["pgrep", "-f", f" mount .* {mnt}( |$)"], capture_output=True,
                                          text=True).stdout.split()]
    parent = {p: int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) for p in out}
    workers = [p for p in out if parent[p] in out]
    if not (len(out) == 1 or (len(out) == 2 and len(workers) == 1)):
        raise SystemExit(f"cannot tell the daemon of {mnt}: {out}")
    return out


def daemon_cpu(pids):
    """CPU seconds of the daemon's processes so far."""
    return sum(cpu_of(p) for p in pids)


def mount_stats(system):
    """The mount's counters (what `batchfs stats --json` prints), read between runs."""
    with open(os.path.join(system["mnt"], ".batchfs", "stats")) as f:
        return json.load(f)


def run_loader(args):
    """Runs a loader pinned to NODE_CPU: its JSON result (`cpu_s`: its CPU over the epoch, its imports
    left out, its workers in)."""
    proc = subprocess.Popen(pinned(NODE_CPU, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def run(out, work, procs, mounts):
    data = os.path.join(work, "data")
    subprocess.run([os.path.join(BIN, "batchfs-server"), "gen", "--format", "tfrecord", "--samples", str(SAMPLES),
                    "--mean-bytes", str(MEAN), "--out", data], check=True, capture_output=True)
    ca, cert, key = certificate(work)
    builds = {"after": BIN}
    if env("BIN_BEFORE"):
        builds["before"] = env("BIN_BEFORE")
    servers, systems = {}, {}
    for build, bindir in builds.items():
        for transport in TRANSPORTS:
            port = free_port()
            args = [os.path.join(bindir, "batchfs-server"), "serve", "--listen", f"127.0.0.1:{port}", "--dataset",
                    f"d={data}"] + SERVER_OPTS
            if transport == "tls":
                args += ["--tls-cert", cert, "--tls-key", key]
            proc = subprocess.Popen(pinned(SERVER_CPU, args), stderr=subprocess.DEVNULL)
            procs.append(proc)
            if transport == "tls":
                wait_port(port)
            else:
                wait_healthy(port)
            servers[(build, transport)] = proc
            for rtt in RTTS:
                p, netem = port, None
                if rtt > 0:
                    p = free_port()
                    netem = subprocess.Popen(pinned(SERVER_CPU, [
                        os.path.join(BIN, "batchfs-lab"), "netem", "--listen", f"127.0.0.1:{p}", "--upstream",
                        f"127.0.0.1:{port}", "--rtt-ms", str(rtt)]), stderr=subprocess.DEVNULL)
                    procs.append(netem)
                    wait_port(p)
                mnt = os.path.join(work, f"mnt-{build}-{transport}-{rtt}")
                os.makedirs(mnt)
                scheme = "https" if transport == "tls" else "http"
                opts = f"batch_size={BATCH},epochs=100000" + (f",ca_file={ca}" if transport == "tls" else "")
                opts += f",{MOUNT_OPTS}" if MOUNT_OPTS else ""
                subprocess.run(pinned(NODE_CPU, [os.path.join(bindir, "batchfs"), "mount", f"{scheme}://127.0.0.1:{p}/d",
                                                 mnt, "-o", opts]), check=True)
                mounts.append(mnt)
                systems[(build, transport, rtt)] = {"mnt": mnt, "pids": daemon_pids(mnt), "epoch": 0,
                                                   "server": proc.pid, "netem": netem}
    local = os.path.join(work, "local")
    first = next(iter(systems.values()))
    subprocess.run(["cp", "-r", os.path.join(first["mnt"], "epoch-0000"), local], check=True)
    first["epoch"] = 1
    # The uncounted first epoch of every mount.
    for s in systems.values():
        run_loader(command(LOADERS[0], os.path.join(s["mnt"], f"epoch-{s['epoch']:04d}"), False))
        s["epoch"] += 1
    rows = []

    def visit(rnd, loader, key, phase):
        if key is None:
            r = run_loader(command(loader, local, False))
            gb = r["bytes"] / 1e9
            return {"round": rnd, "phase": phase, "loader": loader, "build": "-", "transport": "-", "rtt_ms": 0,
                    "system": "local", "epoch_s": r["epoch_s"], "bytes": r["bytes"], "mount_s_per_gb": 0,
                    "server_s_per_gb": 0, "netem_s_per_gb": 0, "loader_s_per_gb": round(r["cpu_s"] / gb, 3),
                    "refilled": 0}
        s = systems[key]
        directory = os.path.join(s["mnt"], f"epoch-{s['epoch']:04d}")
        s["epoch"] += 1
        netem = s["netem"].pid if s["netem"] else None
        st0 = mount_stats(s)
        m0, s0, n0 = daemon_cpu(s["pids"]), cpu_of(s["server"]), cpu_of(netem) if netem else 0.0
        r = run_loader(command(loader, directory, False))
        m1, s1, n1 = daemon_cpu(s["pids"]), cpu_of(s["server"]), cpu_of(netem) if netem else 0.0
        st1 = mount_stats(s)
        fetched = st1.get("fetched_bytes", 0) - st0.get("fetched_bytes", 0)
        refilled = st1.get("recycled_bytes", 0) - st0.get("recycled_bytes", 0)
        gb = r["bytes"] / 1e9
        build, transport, rtt = key
        return {"round": rnd, "phase": phase, "loader": loader, "build": build, "transport": transport,
                "rtt_ms": rtt, "system": f"{build}-{transport}-{rtt}ms", "epoch_s": r["epoch_s"], "bytes": r["bytes"],
                "mount_s_per_gb": round((m1 - m0) / gb, 3), "server_s_per_gb": round((s1 - s0) / gb, 3),
                "netem_s_per_gb": round((n1 - n0) / gb, 3), "loader_s_per_gb": round(r["cpu_s"] / gb, 3),
                "refilled": round(refilled / fetched, 3) if fetched else 0}

    floors = []
    # The floor receives as many bytes as an epoch holds (its batch files, twins left out).
    epoch_bytes = sum(os.path.getsize(os.path.join(local, f)) for f in os.listdir(local) if not f.endswith(".idx"))
    for rnd in range(ROUNDS):
        measured = subprocess.run([os.path.join(BIN, "batchfs-lab"), "floor", "--bytes", str(epoch_bytes), "--rounds",
                                   "1", "--json", "--receiver-cpu", NODE_CPU, "--sender-cpu", SERVER_CPU],
                                  check=True, capture_output=True, text=True)
        f = json.loads(measured.stdout)
        floor = {"round": rnd, "bytes": f["bytes"], "floor_s_per_gb": round(f["floor_cpu_s_per_gb"], 3),
                 "fold_s_per_gb": round(f["fold_cpu_s_per_gb"], 3),
                 "into_memory_s_per_gb": round(f["into_memory_cpu_s_per_gb"], 3),
                 "receive_s_per_gb": round(f["receive"]["cpu_s_per_gb"], 3),
                 "decrypt_s_per_gb": round(f["decrypt_cpu_s_per_gb"], 3),
                 "tls_floor_s_per_gb": round(f["tls_floor_cpu_s_per_gb"], 3)}
        for i, path in enumerate(f["crc"]):
            floor[f"crc{i}_path"] = path["path"]
            floor[f"crc{i}_cache_gb_per_s"] = round(path["cache"]["gb_per_s"], 2)
            floor[f"crc{i}_memory_gb_per_s"] = round(path["memory"]["gb_per_s"], 2)
            floor[f"crc{i}_folded_s_per_gb"] = round(path["folded"]["cpu_s_per_gb"], 3)
        floors.append(floor)
        print(json.dumps(floor), flush=True)
        for loader in LOADERS:
            # Builds take turns going first (the first faults in memory the second may find just freed).
            order = list(systems) if rnd % 2 == 0 else list(reversed(systems))
            for key in [None] + order:
                # LEAD epochs first, back to back with the counted one (`cold`: after the others' runs).
                for lead in range(LEAD):
                    row = visit(rnd, loader, key, "cold" if lead == 0 else "lead")
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                row = visit(rnd, loader, key, "steady" if LEAD else "cold")
                rows.append(row)
                print(json.dumps(row), flush=True)
    write_csv(os.path.join(out, "results.csv"), rows)
    write_csv(os.path.join(out, "floor.csv"), floors)
    report = render(rows, floors)
    open(os.path.join(out, "report.md"), "w").write(report)
    print(report)


def render(rows, floors):
    fields = ("epoch_s", "mount_s_per_gb", "server_s_per_gb", "netem_s_per_gb", "loader_s_per_gb", "refilled")
    cells = {}
    for r in rows:
        cells.setdefault((r["phase"], r["loader"], r["system"]), []).append(r)
    med = {k: {f: statistics.median(float(x.get(f) or 0) for x in v) for f in fields} for k, v in cells.items()}
    counted = "steady" if LEAD else "cold"
    floor = statistics.median(f["floor_s_per_gb"] for f in floors)
    one_copy = statistics.median(f["into_memory_s_per_gb"] for f in floors)
    tls_floor = statistics.median(f["tls_floor_s_per_gb"] for f in floors)
    paths = "; ".join(f"{floors[0][f'crc{i}_path']}: "
                      f"{statistics.median(f[f'crc{i}_cache_gb_per_s'] for f in floors):.1f} GB/s from cache, "
                      f"{statistics.median(f[f'crc{i}_memory_gb_per_s'] for f in floors):.1f} from memory, "
                      f"folded into the receive {statistics.median(f[f'crc{i}_folded_s_per_gb'] for f in floors):.3f}"
                      " s/GB (receive included)"
                      for i in range(sum(1 for k in floors[0] if k.endswith("_path"))))
    lines = [f"CPU seconds per GB, medians of {ROUNDS} rounds (server and netem on core {SERVER_CPU}, mount and "
             f"loader on core {NODE_CPU}); `{counted}` epochs" + (", and the `cold` one of each visit" if LEAD else ""),
             "",
             f"The floor (a loopback receive and one CRC32C pass of the same bytes by the fastest path, on core "
             f"{NODE_CPU}): {floor:.3f} s/GB, of which the receive "
             f"{statistics.median(f['receive_s_per_gb'] for f in floors):.3f}; the cheapest receive with the CRC "
             f"folded in {statistics.median(f['fold_s_per_gb'] for f in floors):.3f}, and batchfs's fold into memory no "
             f"cache holds (pages already there, as a memory file filled again has them) "
             f"{statistics.median(f['into_memory_s_per_gb'] for f in floors):.3f}. Over TLS the floor adds AES-256-GCM "
             f"decryption by ring, {statistics.median(f['decrypt_s_per_gb'] for f in floors):.3f}: {tls_floor:.3f} "
             f"(the TLS rows' `mount / floor`). CRC32C paths: {paths}.",
             ""]
    table = []
    for (phase, loader, system), m in med.items():
        if phase != counted:
            continue
        local = med.get((counted, loader, "local"), {}).get("loader_s_per_gb")
        ratio = f"{m['loader_s_per_gb'] / local:.2f}" if local else "—"
        cold = med.get(("cold", loader, system)) if LEAD else None
        cold_cells = [f"{cold['epoch_s']:.2f}", f"{cold['mount_s_per_gb']:.3f}"] if cold else ["—", "—"]
        its_floor = tls_floor if "-tls-" in system else floor
        over_floor = f"{m['mount_s_per_gb'] / its_floor:.2f}" if system != "local" and its_floor else "—"
        over_copy = f"{m['mount_s_per_gb'] / one_copy:.2f}" if system != "local" and one_copy else "—"
        refilled = f"{m['refilled']:.0%}" if system != "local" else "—"
        table.append([loader, system, f"{m['epoch_s']:.2f}", f"{m['mount_s_per_gb']:.3f}", over_floor, over_copy, refilled,
                      *(f"{m[k]:.3f}" for k in ("server_s_per_gb", "netem_s_per_gb", "loader_s_per_gb")), ratio,
                      *cold_cells])
    lines += md_table(["loader", "system", "epoch s", "mount", "mount / floor", "mount / one copy", "refilled", "server",
                       "netem",
                       "loader",
                       "loader / local", "cold epoch s", "cold mount"], table)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with_cleanup("cpu", run)
