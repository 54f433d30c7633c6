//! `batchfs-lab floor`: what the cheapest receive of a checked body costs on this machine, the floor the
//! mount's daemon is measured against (docs/BENCHMARKS.md, "Per-node CPU"). Each part is measured on one
//! thread's CPU clock, so other load on the machine slows it down without inflating it:
//!
//! - **receive**: a plain TCP receive over loopback into a 1 MiB buffer (a sender thread writes the
//!   same buffer over and over), the receiver's CPU per GB;
//! - **CRC32C**, by every path this build has on this CPU: `crc-fast` (the path it picks here, by its
//!   own name: AVX-512 `VPCLMULQDQ` only with AVX-512VL) and the `crc32c` crate (three streams of the
//!   `crc32` instruction), each over a buffer that fits the cache and one that does not;
//! - **receive + CRC**: the receive with the CRC of each piece taken right after it lands, while its bytes
//!   are in cache (what a body's check costs when it is folded into its receive);
//! - **into memory**: the same, but each piece lands in the next MiB of a region as large as the bytes
//!   (up to 1 GiB), its pages already there and no cache holding them, as a body lands in the pages of a
//!   memory file filled again: the cheapest one copy of every byte to where a loader reads it.
//!
//! - **decryption**: what a TLS connection adds, AES-256-GCM (TLS 1.3's first suite, which the mount and
//!   the server negotiate) by `ring`, the provider their rustls uses, opening 16 KiB records in place
//!   (TLS's largest), each copied first from a sealed original in cache into the buffer it is opened in,
//!   as rustls opens a record in its own buffer; the copy alone is measured too and taken off.
//!
//! The floor is the plain receive plus one CRC32C pass from memory by the fastest path; over TLS, the
//! floor plus the decryption. The fold and the receive into memory are reported beside it. A receiver
//! slowed by its CRC reads larger pieces and wakes less often, so on loopback a receive that checks as it
//! lands can cost less than the plain one.

use anyhow::{Context, Result};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// What `batchfs-lab floor` measures.
#[derive(Debug, clap::Args)]
pub struct FloorArgs {
    /// Bytes each receive and each CRC pass from memory covers (K, M, G suffixes).
    #[arg(long, default_value = "1G", value_parser = batchfs::units::parse_size)]
    pub bytes: u64,
    /// Rounds of every measure; the medians are reported.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Print the figures as one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// The CPU the receiving (and CRC) thread runs on, as the mount's daemon would (default: as started).
    #[arg(long, value_name = "CPU")]
    pub receiver_cpu: Option<usize>,
    /// The CPU the sending thread runs on, as the server would: another core than the receiver's, so the
    /// receive copies bytes another core wrote, as the daemon's does (default: as started).
    #[arg(long, value_name = "CPU")]
    pub sender_cpu: Option<usize>,
}

/// One measure: the CPU seconds per GB of the thread that did it, and its rate over wall time.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Cost {
    pub cpu_s_per_gb: f64,
    pub gb_per_s: f64,
}

/// A CRC32C path: its name, its cost from cache and from memory, and the cost of a receive with the CRC of
/// each piece folded in by it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CrcPath {
    pub path: String,
    pub cache: Cost,
    pub memory: Cost,
    pub folded: Cost,
}

/// Every figure of a run (medians of the rounds).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Floor {
    pub bytes: u64,
    pub receive: Cost,
    pub crc: Vec<CrcPath>,
    /// The plain receive plus one pass from memory by the fastest path.
    pub floor_cpu_s_per_gb: f64,
    /// The cheapest receive with the CRC folded in, by any path.
    pub fold_cpu_s_per_gb: f64,
    /// The receive with the CRC folded in by batchfs's path, each piece into the next MiB of a region
    /// no cache holds (pages already there): one copy of every byte to where a loader reads it.
    pub into_memory_cpu_s_per_gb: f64,
    /// AES-256-GCM decryption of TLS records by `ring`, CPU s/GB (the record's copy into its buffer taken
    /// off).
    pub decrypt_cpu_s_per_gb: f64,
    /// The floor over TLS: the floor plus the decryption.
    pub tls_floor_cpu_s_per_gb: f64,
}

/// TLS's largest record's plaintext.
const RECORD: usize = 16 << 10;

/// The cost of opening `total` bytes of AES-256-GCM records of [`RECORD`] bytes by `ring`, each copied
/// first from a sealed original (a few, in cache) into the buffer it is opened in; with `open` false, the
/// copies alone. Errors if a record does not open to what was sealed.
fn decrypt_cost(total: u64, open: bool) -> Result<Cost> {
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
    let key = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &[7u8; 32]).expect("a 32-byte key"));
    let nonce = |i: usize| {
        let mut n = [0u8; 12];
        n[4..].copy_from_slice(&(i as u64).to_be_bytes());
        Nonce::assume_unique_for_key(n)
    };
    let plain = filled(RECORD);
    let sealed: Vec<Vec<u8>> = (0..4)
        .map(|i| {
            let mut record = plain.clone();
            key.seal_in_place_append_tag(nonce(i), Aad::empty(), &mut record).expect("sealed");
            record
        })
        .collect();
    let mut buffer = vec![0u8; RECORD + AES_256_GCM.tag_len()];
    let mut failed = false;
    let cost = measure(total, || {
        let mut left = total;
        let mut i = 0;
        while left > 0 {
            buffer.copy_from_slice(&sealed[i % sealed.len()]);
            if open {
                let opened = key.open_in_place(nonce(i % sealed.len()), Aad::empty(), &mut buffer);
                failed |= opened.map_or(true, |p| p.len() != RECORD);
            }
            std::hint::black_box(&buffer);
            left = left.saturating_sub(RECORD as u64);
            i += 1;
        }
    });
    anyhow::ensure!(!failed, "a record did not open");
    anyhow::ensure!(!open || buffer[..RECORD] == plain[..], "a record opened to other bytes");
    Ok(cost)
}

/// The CPU time this thread has used.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec through the pointer, which outlives the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "CLOCK_THREAD_CPUTIME_ID");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The cost of `work` over `bytes`, on this thread.
fn measure(bytes: u64, work: impl FnOnce()) -> Cost {
    let (cpu, wall) = (thread_cpu(), Instant::now());
    work();
    let (cpu, wall) = (thread_cpu() - cpu, wall.elapsed());
    let gb = bytes as f64 / 1e9;
    Cost { cpu_s_per_gb: cpu.as_secs_f64() / gb, gb_per_s: gb / wall.as_secs_f64() }
}

/// Contents that are not all one byte (so nothing along the way has it easy), from the plan's PRNG.
fn filled(len: usize) -> Vec<u8> {
    let mut rng = batchfs::plan::SplitMix64::new(1);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Pins the calling thread to `cpu`.
pub fn pin(cpu: usize) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes within it; sched_setaffinity reads it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    anyhow::ensure!(rc == 0, "cannot run on CPU {cpu}: {}", std::io::Error::last_os_error());
    Ok(())
}

/// `bytes` received over a loopback TCP connection into a 1 MiB buffer (or, with `region`, into its next
/// MiB each time, round), sent from `sender_cpu`; with `crc`, each piece's CRC32C folded in by it as the
/// piece lands. Returns the receiver's cost and the CRC (0 without).
fn receive(
    bytes: u64,
    crc: Option<Append>,
    sender_cpu: Option<usize>,
    mut region: Option<&mut [u8]>,
) -> Result<(Cost, u32)> {
    const BUFFER: usize = 1 << 20;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("cannot listen on loopback")?;
    let addr = listener.local_addr()?;
    let sender = std::thread::spawn(move || -> Result<()> {
        if let Some(cpu) = sender_cpu {
            pin(cpu)?;
        }
        let data = filled(BUFFER);
        let mut conn = std::net::TcpStream::connect(addr)?;
        let mut left = bytes;
        while left > 0 {
            let n = left.min(BUFFER as u64) as usize;
            conn.write_all(&data[..n])?;
            left -= n as u64;
        }
        Ok(())
    });
    let (mut conn, _) = listener.accept()?;
    let mut own = vec![0u8; BUFFER];
    let (mut got, mut sum, mut at) = (0u64, 0u32, 0usize);
    let mut failed = None;
    let cost = measure(bytes, || {
        while got < bytes {
            let buf = match region.as_deref_mut() {
                Some(r) if r.len() >= BUFFER => {
                    if at + BUFFER > r.len() {
                        at = 0;
                    }
                    &mut r[at..at + BUFFER]
                }
                _ => &mut own[..],
            };
            match conn.read(buf) {
                Ok(0) => break,
                Ok(n) => {
                    if let Some(append) = crc {
                        sum = append(sum, &buf[..n]);
                    }
                    got += n as u64;
                    at += n;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
    });
    // Closed first: a receive that stopped early must not leave the sender blocked in a write.
    drop(conn);
    sender.join().expect("the sender thread").context("the sender")?;
    if let Some(e) = failed {
        return Err(e).context("the receive");
    }
    anyhow::ensure!(got == bytes, "received {got} of {bytes} bytes");
    Ok((cost, sum))
}

/// A CRC32C path: (the CRC so far, bytes) to the CRC with them.
type Append = fn(u32, &[u8]) -> u32;

/// The CRC32C paths this build has, by name.
fn crc_paths() -> Vec<(String, Append)> {
    let target = crc_fast::get_calculator_target(crc_fast::CrcAlgorithm::Crc32Iscsi);
    vec![
        (format!("crc-fast ({target}), what batchfs uses"), batchfs::crc::crc32c_append),
        ("crc32c crate (SSE4.2 crc32, three streams)".to_owned(), crc32c::crc32c_append),
    ]
}

/// The cost of `path` over `total` bytes made of passes over `data`.
fn crc_cost(path: Append, data: &[u8], total: u64) -> (Cost, u32) {
    let mut sum = 0;
    let cost = measure(total, || {
        let mut left = total;
        while left > 0 {
            let n = left.min(data.len() as u64) as usize;
            sum = path(sum, &data[..n]);
            left -= n as u64;
        }
    });
    (cost, std::hint::black_box(sum))
}

fn median_cost(costs: &[Cost]) -> Cost {
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Cost {
        cpu_s_per_gb: median(costs.iter().map(|c| c.cpu_s_per_gb).collect()),
        gb_per_s: median(costs.iter().map(|c| c.gb_per_s).collect()),
    }
}

/// Measures every part `rounds` times, alternating, and returns the medians; the sender of each receive
/// runs on `sender_cpu`, the rest on the calling thread.
pub fn measure_floor(bytes: u64, rounds: usize, sender_cpu: Option<usize>) -> Result<Floor> {
    anyhow::ensure!(bytes > 0 && rounds > 0, "--bytes and --rounds must be above 0");
    let paths = crc_paths();
    // From cache: 64 KiB passed over again and again; from memory: a buffer larger than any cache here.
    let in_cache = filled(64 << 10);
    let mut in_memory = filled(bytes.clamp(128 << 20, 1 << 30) as usize);
    // As the daemon checks a body: by batchfs's own path (`crc-fast`'s choice for this CPU).
    let ours = paths[0].1;
    let (mut plain, mut into_memory, mut decrypt) = (Vec::new(), Vec::new(), Vec::new());
    let mut per_path: Vec<[Vec<Cost>; 3]> = vec![Default::default(); paths.len()];
    for _ in 0..rounds {
        plain.push(receive(bytes, None, sender_cpu, None)?.0);
        for ((_, path), [cache, memory, folded]) in paths.iter().zip(per_path.iter_mut()) {
            cache.push(crc_cost(*path, &in_cache, bytes).0);
            memory.push(crc_cost(*path, &in_memory, bytes).0);
            folded.push(receive(bytes, Some(*path), sender_cpu, None)?.0);
        }
        into_memory.push(receive(bytes, Some(ours), sender_cpu, Some(&mut in_memory))?.0);
        let (opened, copied) = (decrypt_cost(bytes, true)?, decrypt_cost(bytes, false)?);
        decrypt.push(Cost {
            cpu_s_per_gb: (opened.cpu_s_per_gb - copied.cpu_s_per_gb).max(0.0),
            gb_per_s: opened.gb_per_s,
        });
    }
    // Every path computes the same CRC32C.
    let sums: Vec<u32> = paths.iter().map(|(_, p)| p(0, &in_cache)).collect();
    anyhow::ensure!(sums.windows(2).all(|w| w[0] == w[1]), "the CRC32C paths disagree: {sums:x?}");
    let crc: Vec<CrcPath> = paths
        .iter()
        .zip(&per_path)
        .map(|((name, _), [cache, memory, folded])| CrcPath {
            path: name.clone(),
            cache: median_cost(cache),
            memory: median_cost(memory),
            folded: median_cost(folded),
        })
        .collect();
    let receive = median_cost(&plain);
    let best_pass = crc.iter().map(|p| p.memory.cpu_s_per_gb).fold(f64::INFINITY, f64::min);
    let best_fold = crc.iter().map(|p| p.folded.cpu_s_per_gb).fold(f64::INFINITY, f64::min);
    let floor_cpu_s_per_gb = receive.cpu_s_per_gb + best_pass;
    let into_memory_cpu_s_per_gb = median_cost(&into_memory).cpu_s_per_gb;
    let decrypt_cpu_s_per_gb = median_cost(&decrypt).cpu_s_per_gb;
    Ok(Floor {
        bytes,
        receive,
        crc,
        floor_cpu_s_per_gb,
        fold_cpu_s_per_gb: best_fold,
        into_memory_cpu_s_per_gb,
        decrypt_cpu_s_per_gb,
        tls_floor_cpu_s_per_gb: floor_cpu_s_per_gb + decrypt_cpu_s_per_gb,
    })
}

/// The report as a table.
pub fn render(f: &Floor) -> String {
    let row = |name: &str, c: &Cost| format!("{name:<56}{:>14.3}{:>14.2}\n", c.cpu_s_per_gb, c.gb_per_s);
    let mut out = format!("the floor of a checked receive, {} MB a measure (medians)\n", f.bytes / 1_000_000);
    out += &format!("{:-<84}\n", "");
    out += &format!("{:<56}{:>14}{:>14}\n", "measure", "CPU s/GB", "GB/s");
    out += &row("TCP receive over loopback into 1 MiB", &f.receive);
    for p in &f.crc {
        out += &format!("CRC32C by {}\n", p.path);
        out += &row("  from cache", &p.cache);
        out += &row("  from memory", &p.memory);
        out += &row("  folded into the receive (receive included)", &p.folded);
    }
    out += &format!("{:<56}{:>14.3}\n", "floor: the receive + one pass by the fastest path", f.floor_cpu_s_per_gb);
    out += &format!("{:<56}{:>14.3}\n", "the cheapest receive with the CRC folded in", f.fold_cpu_s_per_gb);
    out += &format!("{:<56}{:>14.3}\n", "batchfs's fold into memory no cache holds", f.into_memory_cpu_s_per_gb);
    out += &format!("{:<56}{:>14.3}\n", "AES-256-GCM decryption of TLS records (ring)", f.decrypt_cpu_s_per_gb);
    out += &format!("{:<56}{:>14.3}\n", "the floor over TLS: the floor + the decryption", f.tls_floor_cpu_s_per_gb);
    out
}

/// Runs `batchfs-lab floor`.
pub fn run(args: FloorArgs) -> Result<()> {
    if let Some(cpu) = args.receiver_cpu {
        pin(cpu)?;
    }
    let floor = measure_floor(args.bytes, args.rounds, args.sender_cpu)?;
    match args.json {
        true => println!("{}", serde_json::to_string(&floor)?),
        false => print!("{}", render(&floor)),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_floor_receives_every_byte_and_its_paths_agree() {
        let (_, sum) = receive(3 << 20, Some(batchfs::crc::crc32c_append), None, None).unwrap();
        let data = filled(1 << 20);
        let expected = (0..3).fold(0, |s, _| crc32c::crc32c_append(s, &data));
        assert_eq!(sum, expected, "the fold's CRC is the CRC of every byte sent");
        // Into a region smaller than the bytes: round it, every byte checked as it lands.
        let mut region = vec![0u8; (2 << 20) + 4096];
        let (_, sum) = receive(3 << 20, Some(batchfs::crc::crc32c_append), None, Some(&mut region)).unwrap();
        assert_eq!(sum, expected, "into memory");
        let floor = measure_floor(1 << 20, 1, Some(0)).unwrap();
        assert_eq!(floor.crc.len(), 2);
        assert!(floor.crc[0].path.starts_with("crc-fast (") && floor.floor_cpu_s_per_gb > 0.0, "{floor:?}");
        assert!(floor.into_memory_cpu_s_per_gb > 0.0, "{floor:?}");
        assert!(floor.tls_floor_cpu_s_per_gb >= floor.floor_cpu_s_per_gb, "{floor:?}");
        assert!(decrypt_cost(1 << 20, true).is_ok(), "every record opens to what was sealed");
        let table = render(&floor);
        assert!(table.contains("TCP receive") && table.contains("floor"), "{table}");
    }
}
