//! `batchfs-lab bench PATH`: reads every file under PATH the way a data loader does and reports wall time,
//! throughput, per-read latency and time stalled. N reader threads share the files by `pattern`:
//! `sequential` (reader r takes the r-th contiguous slice), `interleaved` (files r, r+N, r+2N..., as DDP
//! ranks and DataLoader workers do) or `random` (a seeded shuffle, then interleaved). With
//! `--consume-mbps R` each reader feeds a consumer standing for the GPU, which takes R/N MB/s: it
//! consumes a chunk once the chunk has arrived and the previous one is consumed, while the reader reads
//! the next one (double buffering, as a loader with a prefetch queue does). A read faster than consuming a
//! chunk then costs nothing; a slower one leaves the consumer waiting, and that wait is the time
//! stalled. Without `--consume-mbps` the readers read as fast as they can. Files are read with 1 MiB
//! `read` calls, or mapped (`--mmap`) and copied out page by page, as DALI does. With `--processes` every
//! reader is a process of its own (as PyTorch DataLoader workers are), else a thread.
//! The run also reports the CPU time the whole machine spent
//! while it ran (from `/proc/stat`), from which the latency lab derives CPU seconds per GB.

use anyhow::{Context, Result};
use batchfs::plan::SplitMix64;
use clap::{Args, ValueEnum};
use serde::Serialize;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    Sequential,
    Interleaved,
    Random,
}

#[derive(Debug, Args, Clone)]
pub struct BenchArgs {
    /// Directory to read (recursively; hidden files and `*.idx` index files are skipped).
    pub path: PathBuf,
    /// Readers (threads, or processes with `--processes`).
    #[arg(long, default_value_t = 4, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub threads: usize,
    /// Run every reader as a process of its own instead of a thread.
    #[arg(long)]
    pub processes: bool,
    /// Internal: be reader R of `--threads` only and print its result as JSON (used by `--processes`).
    #[arg(long, hide = true, value_name = "R")]
    pub reader: Option<usize>,
    /// How readers share the files.
    #[arg(long, value_enum, default_value = "interleaved")]
    pub pattern: Pattern,
    /// Total consumption rate of all readers, MB/s (unpaced when absent).
    #[arg(long, value_name = "MBPS", value_parser = batchfs::units::parse_positive_number)]
    pub consume_mbps: Option<f64>,
    /// Read through mmap instead of read(2).
    #[arg(long)]
    pub mmap: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Seed of the random pattern.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// What a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    pub files: usize,
    pub bytes: u64,
    pub wall_s: f64,
    pub mb_per_s: f64,
    pub reads: usize,
    pub read_p50_us: f64,
    pub read_p99_us: f64,
    /// Paced: time the consumers waited for data (the first read included), summed over readers.
    /// Unpaced: time spent inside reads, summed over readers.
    pub stalled_s: f64,
    pub threads: usize,
    pub processes: bool,
    pub pattern: Pattern,
    pub consume_mbps: Option<f64>,
    pub mmap: bool,
    /// The sum of every byte read (wrapping): proof that the bytes were really read, mmap'd pages
    /// included, and a check on them against the files.
    pub byte_sum: u64,
    /// CPU seconds the whole machine spent (user, nice, system, irq, softirq) during the run, when
    /// `/proc/stat` is readable: readers, the mount, the server, and anything else running.
    pub machine_cpu_s: Option<f64>,
}

/// What one reader process reports to the parent.
#[derive(Debug, Serialize, serde::Deserialize)]
struct ReaderReport {
    /// Files the reader listed (all readers list the same directory).
    files: usize,
    bytes: u64,
    byte_sum: u64,
    latencies_ns: Vec<u64>,
    starved_ns: Option<u64>,
}

/// What one reader measured.
struct ReaderResult {
    bytes: u64,
    /// See [`BenchResult::byte_sum`].
    byte_sum: u64,
    /// The duration of every read.
    latencies: Vec<Duration>,
    /// Paced: the consumer's wait.
    starved: Option<Duration>,
}

/// The wrapping sum of `bytes` (vectorizes; touching every byte is the point).
pub fn byte_sum(bytes: &[u8]) -> u64 {
    bytes.chunks(1 << 16).fold(0u64, |acc, c| acc.wrapping_add(c.iter().map(|&b| u64::from(b)).sum::<u64>()))
}

/// The GPU a paced reader feeds (see the module doc).
struct Consumer {
    /// Bytes per second.
    rate: f64,
    /// When the consumer finishes the chunks it has.
    busy_until: Instant,
    /// Time it spent waiting for a chunk.
    starved: Duration,
}

impl Consumer {
    fn new(rate: f64) -> Self {
        Consumer { rate, busy_until: Instant::now(), starved: Duration::ZERO }
    }

    /// A chunk of `n` bytes has arrived: queue it, and wait until the consumer starts on it, which frees
    /// the buffer for the next read.
    fn arrived(&mut self, n: usize) {
        let now = Instant::now();
        self.starved += now.saturating_duration_since(self.busy_until);
        let start = self.busy_until.max(now);
        self.busy_until = start + Duration::from_secs_f64(n as f64 / self.rate);
        std::thread::sleep(start.saturating_duration_since(Instant::now()));
    }

    /// Waits until every chunk is consumed.
    fn finish(&self) {
        std::thread::sleep(self.busy_until.saturating_duration_since(Instant::now()));
    }
}

/// Busy CPU seconds of the whole machine since boot (`/proc/stat`, first line).
pub fn machine_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    parse_proc_stat(&stat)
}

fn parse_proc_stat(stat: &str) -> Option<f64> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<u64> = line.split_whitespace().skip(1).map(|v| v.parse().ok()).collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal: busy is all but idle, iowait and steal.
    let busy = [0, 1, 2, 5, 6].iter().map(|&i| ticks.get(i).copied()).sum::<Option<u64>>()?;
    Some(busy as f64 / batchfs_mount::sys::clock_ticks())
}

fn list(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries: Vec<_> =
        std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?.collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || name.ends_with(".idx") {
            continue;
        }
        let path = e.path();
        if e.file_type()?.is_dir() {
            list(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

/// The files reader `r` of `n` reads, in order.
pub fn assign(files: usize, n: usize, r: usize, pattern: Pattern, seed: u64) -> Vec<usize> {
    match pattern {
        Pattern::Sequential => (files * r / n..files * (r + 1) / n).collect(),
        Pattern::Interleaved => (r..files).step_by(n).collect(),
        Pattern::Random => {
            let mut order: Vec<usize> = (0..files).collect();
            let mut rng = SplitMix64::new(seed);
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            order.into_iter().skip(r).step_by(n).collect()
        }
    }
}

/// Reads one file; returns its bytes and their sum, and records the duration of every read (or chunk
/// of page faults).
fn read_file(
    path: &Path,
    mmap: bool,
    pace: &mut Option<Consumer>,
    latencies: &mut Vec<Duration>,
) -> Result<(u64, u64)> {
    let consume = |n: usize, pace: &mut Option<Consumer>| {
        if let Some(consumer) = pace {
            consumer.arrived(n);
        }
    };
    let file = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let (mut total, mut sum) = (0u64, 0u64);
    if mmap {
        let map = batchfs::mmap::MappedFile::open_file(&file).with_context(|| format!("mmap {}", path.display()))?;
        for chunk in map.bytes().chunks(1 << 20) {
            let t = Instant::now();
            // The page faults are the reads; the sum, reported, keeps the optimizer from dropping them
            // (an unused copy was dropped once, and nothing was read).
            sum = sum.wrapping_add(byte_sum(chunk));
            latencies.push(t.elapsed());
            total += chunk.len() as u64;
            consume(chunk.len(), pace);
        }
    } else {
        let mut file = file;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let t = Instant::now();
            let n = file.read(&mut buf).with_context(|| format!("read {}", path.display()))?;
            latencies.push(t.elapsed());
            if n == 0 {
                break;
            }
            sum = sum.wrapping_add(byte_sum(&buf[..n]));
            total += n as u64;
            consume(n, pace);
        }
    }
    Ok((total, sum))
}

/// Reader `r` of `n`: reads its share of `files`, paced to its share of the rate.
fn reader(args: &BenchArgs, files: &[PathBuf], n: usize, r: usize) -> Result<ReaderResult> {
    let mut pace = args.consume_mbps.map(|m| Consumer::new(m * 1e6 / n as f64));
    let mut latencies = Vec::new();
    let (mut bytes, mut sum) = (0, 0u64);
    for i in assign(files.len(), n, r, args.pattern, args.seed) {
        let (b, s) = read_file(&files[i], args.mmap, &mut pace, &mut latencies)?;
        bytes += b;
        sum = sum.wrapping_add(s);
    }
    if let Some(consumer) = &pace {
        consumer.finish();
    }
    Ok(ReaderResult { bytes, byte_sum: sum, latencies, starved: pace.map(|c| c.starved) })
}

/// Runs reader `r` of `n` in a child process of this executable and collects its report.
fn spawn_reader(args: &BenchArgs, n: usize, r: usize) -> Result<std::process::Child> {
    let exe = std::env::current_exe().context("cannot find the batchfs executable")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("bench").arg(&args.path).args(["--threads", &n.to_string(), "--reader", &r.to_string()]);
    cmd.args(["--pattern", args.pattern.to_possible_value().expect("pattern").get_name()]);
    cmd.args(["--seed", &args.seed.to_string()]);
    if let Some(m) = args.consume_mbps {
        cmd.args(["--consume-mbps", &m.to_string()]);
    }
    if args.mmap {
        cmd.arg("--mmap");
    }
    cmd.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
    cmd.spawn().with_context(|| format!("cannot start reader process {r}"))
}

/// What a reader process prints once it runs, before it waits for the start signal on stdin: the clock
/// starts when every reader is up, so process start-up is not counted.
const READY: &str = "ready";

/// Runs the benchmark.
pub fn measure(args: &BenchArgs) -> Result<BenchResult> {
    let n = args.threads.max(1);
    let mut children = Vec::new();
    if args.processes {
        use std::io::BufRead;
        for r in 0..n {
            let mut child = spawn_reader(args, n, r)?;
            let mut line = String::new();
            let stdout = child.stdout.as_mut().expect("piped");
            std::io::BufReader::new(stdout).read_line(&mut line).with_context(|| format!("reader process {r}"))?;
            anyhow::ensure!(line.trim() == READY, "reader process {r} did not start: {line:?}");
            children.push(child);
        }
    }
    let cpu_before = machine_cpu_seconds();
    let started = Instant::now();
    let mut listed = 0;
    let results: Vec<Result<ReaderResult>> = if args.processes {
        // Start them all; every child lists the directory itself, as a loader worker does.
        for child in &mut children {
            use std::io::Write;
            child.stdin.take().expect("piped").write_all(b"go")?;
        }
        let mut out = Vec::new();
        for (r, child) in children.into_iter().enumerate() {
            let done = child.wait_with_output().with_context(|| format!("reader process {r}"))?;
            if !done.status.success() {
                anyhow::bail!("reader process {r} failed ({})", done.status);
            }
            let report: ReaderReport =
                serde_json::from_slice(&done.stdout).with_context(|| format!("reader process {r}'s report"))?;
            listed = report.files;
            out.push(Ok(ReaderResult {
                bytes: report.bytes,
                byte_sum: report.byte_sum,
                latencies: report.latencies_ns.into_iter().map(Duration::from_nanos).collect(),
                starved: report.starved_ns.map(Duration::from_nanos),
            }));
        }
        out
    } else {
        let mut files = Vec::new();
        list(&args.path, &mut files)?;
        listed = files.len();
        std::thread::scope(|s| {
            let files = &files;
            let handles: Vec<_> = (0..n).map(|r| s.spawn(move || reader(args, files, n, r))).collect();
            handles.into_iter().map(|h| h.join().expect("reader thread")).collect()
        })
    };
    let wall_s = started.elapsed().as_secs_f64();
    let machine_cpu_s = cpu_before.zip(machine_cpu_seconds()).map(|(a, b)| b - a);
    let (mut bytes, mut sum, mut latencies, mut starved) = (0, 0u64, Vec::new(), Duration::ZERO);
    for r in results {
        let r = r?;
        bytes += r.bytes;
        sum = sum.wrapping_add(r.byte_sum);
        latencies.extend(r.latencies);
        starved += r.starved.unwrap_or_default();
    }
    let stalled_s = match args.consume_mbps {
        Some(_) => starved.as_secs_f64(),
        None => latencies.iter().map(Duration::as_secs_f64).sum(),
    };
    latencies.sort();
    let pct = |p: f64| {
        latencies.get(((latencies.len() as f64 - 1.0) * p).round() as usize).map_or(0.0, |d| d.as_secs_f64() * 1e6)
    };
    Ok(BenchResult {
        files: listed,
        bytes,
        wall_s,
        mb_per_s: bytes as f64 / 1e6 / wall_s.max(1e-9),
        reads: latencies.len(),
        read_p50_us: pct(0.5),
        read_p99_us: pct(0.99),
        stalled_s,
        threads: n,
        processes: args.processes,
        pattern: args.pattern,
        consume_mbps: args.consume_mbps,
        mmap: args.mmap,
        byte_sum: sum,
        machine_cpu_s,
    })
}

/// `batchfs-lab bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    if let Some(r) = args.reader {
        let n = args.threads.max(1);
        anyhow::ensure!(r < n, "--reader {r} is not below --threads {n}");
        {
            use std::io::Write;
            let mut stdout = std::io::stdout().lock();
            writeln!(stdout, "{READY}")?;
            stdout.flush()?;
            let mut go = [0u8; 2];
            std::io::Read::read_exact(&mut std::io::stdin(), &mut go).context("no start signal on stdin")?;
        }
        let mut files = Vec::new();
        list(&args.path, &mut files)?;
        let result = reader(&args, &files, n, r)?;
        let report = ReaderReport {
            files: files.len(),
            bytes: result.bytes,
            byte_sum: result.byte_sum,
            latencies_ns: result.latencies.iter().map(|d| d.as_nanos() as u64).collect(),
            starved_ns: result.starved.map(|d| d.as_nanos() as u64),
        };
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    let r = measure(&args)?;
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!(
        "batchfs-lab bench {} ({} reader {}, {:?}{}{})",
        args.path.display(),
        r.threads,
        if r.processes { "processes" } else { "threads" },
        r.pattern,
        r.consume_mbps.map(|m| format!(", paced to {m} MB/s")).unwrap_or_default(),
        if r.mmap { ", mmap" } else { "" }
    );
    for (k, v) in [
        ("files", r.files.to_string()),
        ("bytes", format!("{:.1} MB", r.bytes as f64 / 1e6)),
        ("wall time", format!("{:.3} s", r.wall_s)),
        ("throughput", format!("{:.1} MB/s", r.mb_per_s)),
        ("reads", r.reads.to_string()),
        ("read latency", format!("p50 {:.0} us, p99 {:.0} us", r.read_p50_us, r.read_p99_us)),
        ("time stalled", format!("{:.3} s (summed over readers)", r.stalled_s)),
        ("machine CPU", r.machine_cpu_s.map_or("unknown".into(), |c| format!("{c:.2} s (all processes)"))),
    ] {
        println!("{k:<14} {v}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pattern_reads_every_file_once() {
        for pattern in [Pattern::Sequential, Pattern::Interleaved, Pattern::Random] {
            for (files, n) in [(10, 3), (7, 7), (3, 5), (0, 2)] {
                let mut all: Vec<usize> = (0..n).flat_map(|r| assign(files, n, r, pattern, 9)).collect();
                all.sort();
                assert_eq!(all, (0..files).collect::<Vec<_>>(), "{pattern:?} {files} {n}");
            }
        }
        assert_eq!(assign(10, 3, 1, Pattern::Interleaved, 0), vec![1, 4, 7]);
        assert_eq!(assign(10, 2, 1, Pattern::Sequential, 0), vec![5, 6, 7, 8, 9]);
    }

    #[test]
    fn reads_all_bytes_paced_and_unpaced_with_read_and_mmap() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let (mut total, mut sum) = (0, 0);
        for i in 0..6 {
            let data = vec![i as u8 + 1; 300_000 + i * 1000];
            total += data.len() as u64;
            sum += byte_sum(&data);
            let path = if i % 2 == 0 { dir.path().join(format!("f{i}")) } else { dir.path().join(format!("sub/f{i}")) };
            std::fs::write(path, data).unwrap();
        }
        std::fs::write(dir.path().join("f0.idx"), b"0 1\n").unwrap();
        std::fs::write(dir.path().join(".hidden"), b"x").unwrap();
        let base = BenchArgs {
            path: dir.path().to_owned(),
            threads: 2,
            processes: false,
            reader: None,
            pattern: Pattern::Interleaved,
            consume_mbps: None,
            mmap: false,
            json: false,
            seed: 0,
        };
        for mmap in [false, true] {
            let r = measure(&BenchArgs { mmap, ..base.clone() }).unwrap();
            assert_eq!((r.files, r.bytes, r.byte_sum), (6, total, sum), "mmap {mmap}");
        }
        // Paced to 10 MB/s, 1.8 MB take at least ~0.18 s.
        let r = measure(&BenchArgs { consume_mbps: Some(10.0), ..base }).unwrap();
        assert!(r.wall_s >= 0.15, "{r:?}");
        assert!(r.mb_per_s <= 12.0, "{r:?}");
    }

    #[test]
    fn the_consumer_hides_reads_shorter_than_a_chunk_and_counts_longer_waits() {
        // 1 MB chunks at 100 MB/s: 10 ms to consume each.
        let mut c = Consumer::new(100e6);
        let started = Instant::now();
        c.arrived(1_000_000); // first chunk: consumed from now to +10 ms; the next read may start at once
        assert!(started.elapsed() < Duration::from_millis(5));
        std::thread::sleep(Duration::from_millis(4)); // a 4 ms read: hidden behind the consumption
        c.arrived(1_000_000); // waits until the consumer starts on it, at +10 ms
        assert!(started.elapsed() >= Duration::from_millis(10));
        std::thread::sleep(Duration::from_millis(25)); // a 25 ms read: the consumer waits ~15 ms
        c.arrived(1_000_000);
        c.finish();
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(45), "{took:?}"); // 10 + 10 + 15 idle + 10
        assert!(c.starved >= Duration::from_millis(14) && c.starved < Duration::from_millis(30), "{:?}", c.starved);
    }

    #[test]
    fn proc_stat_busy_time() {
        let stat = "cpu  100 20 30 5000 40 5 7 11 0 0\ncpu0 50 10 15 2500 20 2 3 5 0 0\nintr 1\n";
        let hz = batchfs_mount::sys::clock_ticks();
        // user + nice + system + irq + softirq; idle, iowait and steal excluded.
        assert_eq!(parse_proc_stat(stat), Some(162.0 / hz));
        assert_eq!(parse_proc_stat("intr 1\n"), None);
        assert!(machine_cpu_seconds().is_some_and(|c| c > 0.0));
    }
}
