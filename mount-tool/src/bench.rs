//! `batchfs bench PATH`: reads every file under PATH the way a data loader does and reports wall time,
//! throughput, per-read latency and time stalled. N reader threads share the files by `pattern`:
//! `sequential` (reader r takes the r-th contiguous slice), `interleaved` (files r, r+N, r+2N..., as DDP
//! ranks and DataLoader workers do) or `random` (a seeded shuffle, then interleaved). With
//! `--consume-mbps R` the readers together consume at most R MB/s, standing for the GPU; otherwise they
//! read as fast as they can. Files are read with 1 MiB `read` calls, or mapped (`--mmap`) and copied out
//! page by page, as DALI does.

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
    /// Reader threads.
    #[arg(long, default_value_t = 4)]
    pub threads: usize,
    /// How readers share the files.
    #[arg(long, value_enum, default_value = "interleaved")]
    pub pattern: Pattern,
    /// Total consumption rate of all readers, MB/s (unpaced when absent).
    #[arg(long, value_name = "MBPS")]
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
    /// Time readers spent waiting inside reads, summed over readers.
    pub stalled_s: f64,
    pub threads: usize,
    pub pattern: Pattern,
    pub consume_mbps: Option<f64>,
    pub mmap: bool,
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

/// Reads one file; returns bytes and the duration of every read (or page-copy batch).
fn read_file(path: &Path, mmap: bool, pace: &mut Option<(f64, Instant)>, latencies: &mut Vec<Duration>) -> Result<u64> {
    let consume = |n: usize, pace: &mut Option<(f64, Instant)>| {
        if let Some((rate, until)) = pace {
            *until = (*until).max(Instant::now()) + Duration::from_secs_f64(n as f64 / *rate);
            let now = Instant::now();
            if *until > now {
                std::thread::sleep(*until - now);
            }
        }
    };
    let file = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut total = 0u64;
    if mmap {
        let map = batchfs::mmap::MappedFile::open_file(&file).with_context(|| format!("mmap {}", path.display()))?;
        let mut buf = vec![0u8; 1 << 20];
        for chunk in map.bytes().chunks(1 << 20) {
            let t = Instant::now();
            buf[..chunk.len()].copy_from_slice(chunk); // page faults are the reads
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
            total += n as u64;
            consume(n, pace);
        }
    }
    Ok(total)
}

/// Runs the benchmark.
pub fn measure(args: &BenchArgs) -> Result<BenchResult> {
    let mut files = Vec::new();
    list(&args.path, &mut files)?;
    let n = args.threads.max(1);
    let started = Instant::now();
    let results: Vec<Result<(u64, Vec<Duration>)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let files = &files;
                s.spawn(move || {
                    let mut pace = args.consume_mbps.map(|m| (m * 1e6 / n as f64, Instant::now()));
                    let mut latencies = Vec::new();
                    let mut bytes = 0;
                    for i in assign(files.len(), n, r, args.pattern, args.seed) {
                        bytes += read_file(&files[i], args.mmap, &mut pace, &mut latencies)?;
                    }
                    Ok((bytes, latencies))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("reader thread")).collect()
    });
    let wall_s = started.elapsed().as_secs_f64();
    let (mut bytes, mut latencies) = (0, Vec::new());
    for r in results {
        let (b, l) = r?;
        bytes += b;
        latencies.extend(l);
    }
    latencies.sort();
    let pct = |p: f64| {
        latencies.get(((latencies.len() as f64 - 1.0) * p).round() as usize).map_or(0.0, |d| d.as_secs_f64() * 1e6)
    };
    Ok(BenchResult {
        files: files.len(),
        bytes,
        wall_s,
        mb_per_s: bytes as f64 / 1e6 / wall_s.max(1e-9),
        reads: latencies.len(),
        read_p50_us: pct(0.5),
        read_p99_us: pct(0.99),
        stalled_s: latencies.iter().map(Duration::as_secs_f64).sum(),
        threads: n,
        pattern: args.pattern,
        consume_mbps: args.consume_mbps,
        mmap: args.mmap,
    })
}

/// `batchfs bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    let r = measure(&args)?;
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!(
        "batchfs bench {} ({} readers, {:?}{}{})",
        args.path.display(),
        r.threads,
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
        let mut total = 0;
        for i in 0..6 {
            let data = vec![i as u8; 300_000 + i * 1000];
            total += data.len() as u64;
            let path = if i % 2 == 0 { dir.path().join(format!("f{i}")) } else { dir.path().join(format!("sub/f{i}")) };
            std::fs::write(path, data).unwrap();
        }
        std::fs::write(dir.path().join("f0.idx"), b"0 1\n").unwrap();
        std::fs::write(dir.path().join(".hidden"), b"x").unwrap();
        let base = BenchArgs {
            path: dir.path().to_owned(),
            threads: 2,
            pattern: Pattern::Interleaved,
            consume_mbps: None,
            mmap: false,
            json: false,
            seed: 0,
        };
        for mmap in [false, true] {
            let r = measure(&BenchArgs { mmap, ..base.clone() }).unwrap();
            assert_eq!((r.files, r.bytes), (6, total));
        }
        // Paced to 10 MB/s, 1.8 MB take at least ~0.18 s.
        let r = measure(&BenchArgs { consume_mbps: Some(10.0), ..base }).unwrap();
        assert!(r.wall_s >= 0.15, "{r:?}");
        assert!(r.mb_per_s <= 12.0, "{r:?}");
    }
}
