//! `batchfs netem`: a user-space network emulator for loopback, where the kernel has no netem qdisc. A
//! TCP proxy that delays each direction by half the RTT and caps its throughput, as a delay line (bytes
//! keep flowing while earlier ones are in flight), preserving byte order.
//!
//! Each direction of each connection has a reader thread that stamps every chunk with its release time
//! (`now + rtt/2 + jitter`, never earlier than the previous chunk's, so order holds) and a writer thread
//! that sleeps until then and, with a rate cap, until the link would have finished serializing the chunk
//! (`free_at = max(free_at, release) + len / rate`). The link is shared: all connections through one
//! emulator draw on the same `free_at` per direction, so the cap is the link's, not each connection's.
//! Threads sleep with the kernel's high-resolution timers, so delays are accurate to well under a
//! millisecond. At most `BUFFER` bytes are in flight per direction;
//! beyond that the reader waits, and TCP flow control pushes back on the sender.

use anyhow::{Context, Result};
use clap::Args;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// Bytes in flight per direction before the reader waits.
const BUFFER: usize = 64 << 20;
const CHUNK: usize = 64 << 10;

#[derive(Debug, Args, Clone)]
pub struct NetemArgs {
    /// Address to accept connections on.
    #[arg(long, value_name = "ADDR")]
    pub listen: SocketAddr,
    /// Address to forward them to.
    #[arg(long, value_name = "ADDR")]
    pub upstream: SocketAddr,
    /// Round-trip time to add (half each way), milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 0.0)]
    pub rtt_ms: f64,
    /// Throughput cap of the link per direction, shared by all connections, Mbit/s (none by default).
    #[arg(long, value_name = "MBIT")]
    pub rate_mbit: Option<f64>,
    /// Random extra one-way delay, uniform in [0, J] milliseconds (order is kept).
    #[arg(long, value_name = "MS", default_value_t = 0.0)]
    pub jitter_ms: f64,
}

/// When each direction of the shared link is next free to serialize bytes.
#[derive(Debug)]
struct Wire {
    up: Mutex<Instant>,
    down: Mutex<Instant>,
}

/// The link a direction emulates.
#[derive(Debug, Clone, Copy)]
pub struct Link {
    pub one_way: Duration,
    pub jitter: Duration,
    /// Bytes per second, if capped.
    pub rate: Option<f64>,
}

impl From<&NetemArgs> for Link {
    fn from(a: &NetemArgs) -> Self {
        Link {
            one_way: Duration::from_secs_f64(a.rtt_ms.max(0.0) / 2000.0),
            jitter: Duration::from_secs_f64(a.jitter_ms.max(0.0) / 1000.0),
            rate: a.rate_mbit.filter(|r| *r > 0.0).map(|r| r * 1e6 / 8.0),
        }
    }
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

/// Pumps `from` into `to` through the delay line, serializing on `wire` (this direction's next free
/// instant, shared by every connection); half-closes `to` at the end.
fn pump(mut from: TcpStream, mut to: TcpStream, link: Link, wire: &Mutex<Instant>) {
    let (tx, rx) = mpsc::sync_channel::<(Instant, Vec<u8>)>(BUFFER / CHUNK);
    let reader = std::thread::spawn(move || {
        let mut last = Instant::now();
        let mut seed = Instant::now().elapsed().as_nanos() as u64 | 1;
        loop {
            let mut buf = vec![0u8; CHUNK];
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            buf.truncate(n);
            let mut delay = link.one_way;
            if !link.jitter.is_zero() {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                delay += link.jitter.mul_f64((seed >> 11) as f64 / (1u64 << 53) as f64);
            }
            last = last.max(Instant::now() + delay);
            if tx.send((last, buf)).is_err() {
                return;
            }
        }
    });
    for (release, chunk) in rx {
        sleep_until(release);
        if let Some(rate) = link.rate {
            let done = {
                let mut free_at = wire.lock().expect("wire");
                *free_at = (*free_at).max(release) + Duration::from_secs_f64(chunk.len() as f64 / rate);
                *free_at
            };
            sleep_until(done);
        }
        if to.write_all(&chunk).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = reader.join();
}

/// Proxies one accepted connection.
fn proxy(client: TcpStream, upstream: SocketAddr, link: Link, wire: Arc<Wire>) -> std::io::Result<()> {
    let server = TcpStream::connect(upstream)?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (c2, s2) = (client.try_clone()?, server.try_clone()?);
    let w = wire.clone();
    let up = std::thread::spawn(move || pump(client, server, link, &w.up));
    pump(s2, c2, link, &wire.down);
    let _ = up.join();
    Ok(())
}

/// A running emulator (for tests and the latency lab); stops accepting when dropped.
pub struct Netem {
    pub addr: SocketAddr,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for Netem {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = TcpStream::connect(self.addr); // wake the accept loop
    }
}

/// Starts the emulator on `listen` (port 0 picks one) in background threads.
pub fn start(listen: SocketAddr, upstream: SocketAddr, link: Link) -> Result<Netem> {
    let listener = TcpListener::bind(listen).with_context(|| format!("cannot listen on {listen}"))?;
    let addr = listener.local_addr()?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = stop.clone();
    let wire = Arc::new(Wire { up: Mutex::new(Instant::now()), down: Mutex::new(Instant::now()) });
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            if flag.load(std::sync::atomic::Ordering::Relaxed) {
                return;
            }
            let Ok(conn) = conn else { continue };
            let wire = wire.clone();
            std::thread::spawn(move || {
                if let Err(e) = proxy(conn, upstream, link, wire) {
                    tracing::warn!(%upstream, error = %e, "netem: cannot reach the upstream");
                }
            });
        }
    });
    Ok(Netem { addr, stop })
}

/// `batchfs netem`: runs until killed.
pub fn run(args: NetemArgs) -> Result<()> {
    let link = Link::from(&args);
    let netem = start(args.listen, args.upstream, link)?;
    eprintln!(
        "batchfs netem: {} -> {} with RTT {} ms{}{}",
        netem.addr,
        args.upstream,
        args.rtt_ms,
        if args.jitter_ms > 0.0 { format!(" (+0..{} ms jitter each way)", args.jitter_ms) } else { String::new() },
        args.rate_mbit.map(|r| format!(", {r} Mbit/s per direction")).unwrap_or_default()
    );
    loop {
        std::thread::park();
    }
}
