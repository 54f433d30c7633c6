//! `batchfs-lab netem`: a user-space network emulator for loopback, where the kernel has no netem qdisc. A
//! TCP proxy that delays each direction by half the RTT and caps its throughput, as a delay line (bytes
//! keep flowing while earlier ones are in flight), preserving byte order.
//!
//! Each direction of each connection has a reader thread that stamps every chunk with its release time
//! (`now + rtt/2 + jitter`, never earlier than the previous chunk's, so order holds) and a writer thread
//! that sleeps until then and, with a rate cap, until the link would have finished serializing the chunk
//! (`free_at = max(free_at, release) + len / rate`). The link is shared: all connections through one
//! emulator draw on the same `free_at` per direction, so the cap is the link's, not each connection's.
//! Threads sleep with the kernel's high-resolution timers, so delays are accurate to well under a
//! millisecond. A capped link serializes a packet's worth at a time (`Link::packet`), each connection's
//! in turn. At most `BUFFER` bytes are in flight per direction of a connection, and with a rate
//! cap at most what the link holds: the bytes on the wire (the rate times the one-way delay) and a
//! bottleneck queue of `--queue-ms` at the rate ([`Link::held`]); beyond that the reader waits, and TCP
//! flow control pushes back on the sender, as a router's bounded buffer does. (An unbounded queue is
//! no link: a capped direction took 64 MB in at once, so whatever the sender wrote first reached the
//! client first, however the sender interleaved its streams afterwards.)
//!
//! **Faults** (all off by default; each counted in [`FaultCounts`] and reported on stderr): a connection
//! cut after about `--reset-every` bytes sent toward the client, one bit flipped in about every
//! `--corrupt-every` bytes toward the client, a connection held still for `--stall-ms` after about every
//! `--stall-every` bytes, and the whole link down for `--down-ms` every `--down-after-s` seconds (live
//! connections cut, new ones closed at once). "About N" is drawn uniformly from [N/2, 3N/2] for each next
//! fault of each connection, from a generator seeded by `--fault-seed` and the connection's number, so a
//! seed replays the same faults for the same traffic.

use anyhow::{Context, Result};
use batchfs::plan::SplitMix64;
use clap::Args;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Bytes in flight per direction before the reader waits.
const BUFFER: usize = 64 << 20;
const CHUNK: usize = 64 << 10;
/// The bottleneck's queue of a capped link, in time at its rate, unless `--queue-ms` says otherwise.
pub const QUEUE: Duration = Duration::from_millis(100);
/// The least a capped direction of a connection holds (a few packets).
const MIN_HELD: usize = 16 << 10;
/// A packet: the least a capped link serializes at once.
const PACKET: usize = 1500;
/// How long a capped link serializes one connection's bytes before another's may go.
const PACKET_TIME: Duration = Duration::from_millis(2);

#[derive(Debug, Args, Clone)]
pub struct NetemArgs {
    /// Address to accept connections on.
    #[arg(long, value_name = "ADDR")]
    pub listen: SocketAddr,
    /// Address to forward them to: IP:PORT, or HOST:PORT (resolved once, at start; its first address).
    #[arg(long, value_name = "HOST:PORT", value_parser = resolve)]
    pub upstream: SocketAddr,
    /// Round-trip time to add (half each way), milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 0.0)]
    pub rtt_ms: f64,
    /// Throughput cap of the link per direction, shared by all connections, Mbit/s (none by default).
    #[arg(long, value_name = "MBIT", value_parser = batchfs::units::parse_positive_number)]
    pub rate_mbit: Option<f64>,
    /// Random extra one-way delay, uniform in [0, J] milliseconds (order is kept).
    #[arg(long, value_name = "MS", default_value_t = 0.0)]
    pub jitter_ms: f64,
    /// With --rate-mbit: the bottleneck's queue per direction of each connection, in milliseconds at the
    /// rate; the sender is held back (TCP flow control) beyond it and what is on the wire.
    #[arg(long, value_name = "MS", default_value_t = QUEUE.as_millis() as u64, requires = "rate_mbit")]
    pub queue_ms: u64,
    /// Cut each connection after about this many bytes toward the client (above 0).
    #[arg(long, value_name = "BYTES", value_parser = positive_size, help_heading = "Faults")]
    pub reset_every: Option<u64>,
    /// Flip one bit in about every this many bytes toward the client (above 0).
    #[arg(long, value_name = "BYTES", value_parser = positive_size, help_heading = "Faults")]
    pub corrupt_every: Option<u64>,
    /// Hold a connection still for --stall-ms after about every this many bytes toward the client.
    #[arg(long, value_name = "BYTES", value_parser = positive_size, requires = "stall_ms", help_heading = "Faults")]
    pub stall_every: Option<u64>,
    /// How long a stall lasts, milliseconds (with --stall-every).
    #[arg(long, value_name = "MS", requires = "stall_every", help_heading = "Faults")]
    pub stall_ms: Option<u64>,
    /// Take the whole link down every this many seconds (first after this long), for --down-ms.
    #[arg(long, value_name = "S", value_parser = batchfs::units::parse_positive_number, requires = "down_ms",
          help_heading = "Faults")]
    pub down_after_s: Option<f64>,
    /// How long the link stays down: live connections are cut, new ones closed at once (with --down-after-s).
    #[arg(long, value_name = "MS", requires = "down_after_s", help_heading = "Faults")]
    pub down_ms: Option<u64>,
    /// Seed of the fault choices: the same seed and traffic inject the same faults.
    #[arg(long, value_name = "N", default_value_t = 1, help_heading = "Faults")]
    pub fault_seed: u64,
}

/// `HOST:PORT` or `IP:PORT` as the first address the resolver gives for it.
fn resolve(text: &str) -> std::io::Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    let context = |e: std::io::Error| std::io::Error::new(e.kind(), format!("cannot resolve {text} (HOST:PORT): {e}"));
    let mut addrs = text.to_socket_addrs().map_err(context)?;
    let none = || std::io::Error::new(std::io::ErrorKind::NotFound, format!("{text} resolves to no address"));
    addrs.next().ok_or_else(none)
}

/// A fault's spacing in bytes: above 0 (0 turned the fault off without a word; leave the flag out for that).
fn positive_size(text: &str) -> Result<u64, batchfs::units::UnitError> {
    match batchfs::units::parse_size(text)? {
        0 => Err(batchfs::units::UnitError::NotPositive(text.to_owned())),
        n => Ok(n),
    }
}

/// The faults to inject (see the module note); `None` turns one off.
#[derive(Debug, Clone, Copy, Default)]
pub struct Faults {
    pub reset_every: Option<u64>,
    pub corrupt_every: Option<u64>,
    pub stall_every: Option<u64>,
    pub stall: Duration,
    /// (up for, down for), repeating from the start.
    pub down: Option<(Duration, Duration)>,
    pub seed: u64,
}

impl From<&NetemArgs> for Faults {
    fn from(a: &NetemArgs) -> Self {
        let positive = |v: Option<u64>| v.filter(|&n| n > 0);
        Faults {
            reset_every: positive(a.reset_every),
            corrupt_every: positive(a.corrupt_every),
            stall_every: positive(a.stall_every),
            stall: Duration::from_millis(a.stall_ms.unwrap_or(0)),
            down: a
                .down_after_s
                .filter(|s| *s > 0.0)
                .map(|s| (Duration::from_secs_f64(s), Duration::from_millis(a.down_ms.unwrap_or(0)))),
            seed: a.fault_seed,
        }
    }
}

/// Faults injected so far.
#[derive(Debug, Default)]
pub struct FaultCounts {
    /// Connections cut by `reset_every`.
    pub resets: AtomicU64,
    /// Bits flipped.
    pub corruptions: AtomicU64,
    pub stalls: AtomicU64,
    /// Times the link went down.
    pub downs: AtomicU64,
    /// Live connections cut, and new ones closed, while the link was down.
    pub cut_by_down: AtomicU64,
}

impl FaultCounts {
    /// `resets=R corruptions=C stalls=S downs=D cut_by_down=X`.
    pub fn summary(&self) -> String {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        format!(
            "resets={} corruptions={} stalls={} downs={} cut_by_down={}",
            g(&self.resets),
            g(&self.corruptions),
            g(&self.stalls),
            g(&self.downs),
            g(&self.cut_by_down)
        )
    }
}

/// The connection's generator: the plan's SplitMix64, one stream per connection.
fn rng(seed: u64, connection: u64) -> SplitMix64 {
    SplitMix64::new(seed ^ connection.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// About `n`: uniform in [n/2, 3n/2].
fn about(rng: &mut SplitMix64, n: u64) -> u64 {
    n / 2 + rng.next_u64() % n.max(1) + 1
}

/// The next byte offset (toward the client) of each fault of one connection.
struct Schedule {
    rng: SplitMix64,
    reset: Option<u64>,
    corrupt: Option<u64>,
    stall: Option<u64>,
}

impl Schedule {
    fn new(faults: &Faults, connection: u64) -> Self {
        let mut rng = rng(faults.seed, connection);
        let mut first = |every: Option<u64>| every.map(|n| about(&mut rng, n));
        let (reset, corrupt, stall) =
            (first(faults.reset_every), first(faults.corrupt_every), first(faults.stall_every));
        Schedule { rng, reset, corrupt, stall }
    }
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
    /// With a rate: the bottleneck's queue, in time at the rate ([`QUEUE`] unless told).
    pub queue: Duration,
}

impl Link {
    /// Bytes one direction of a connection holds at most: with a rate, those on the wire and in the
    /// bottleneck's queue (two chunks at least); without, `BUFFER`.
    pub fn held(&self) -> usize {
        match self.rate {
            Some(rate) => ((rate * (self.one_way + self.queue).as_secs_f64()) as usize).clamp(MIN_HELD, BUFFER),
            None => BUFFER,
        }
    }

    /// The bytes a capped link serializes at once, each connection's in turn: what it sends in
    /// [`PACKET_TIME`] (a packet at least, a chunk at most). Whole chunks at a time left each of N
    /// connections silent for N chunks' time: 20 s at 0.1 Mbit/s with 4 connections.
    fn packet(&self) -> usize {
        self.rate.map_or(CHUNK, |rate| ((rate * PACKET_TIME.as_secs_f64()) as usize).clamp(PACKET, CHUNK))
    }
}

impl From<&NetemArgs> for Link {
    fn from(a: &NetemArgs) -> Self {
        Link {
            one_way: Duration::from_secs_f64(a.rtt_ms.max(0.0) / 2000.0),
            jitter: Duration::from_secs_f64(a.jitter_ms.max(0.0) / 1000.0),
            rate: a.rate_mbit.filter(|r| *r > 0.0).map(|r| r * 1e6 / 8.0),
            queue: Duration::from_millis(a.queue_ms),
        }
    }
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

/// What the direction toward the client injects: its connection's schedule, the emulator's settings
/// and counters.
struct Injector {
    schedule: Schedule,
    faults: Faults,
    counts: Arc<FaultCounts>,
    /// Bytes passed toward the client so far.
    passed: u64,
}

impl Injector {
    /// Applies the faults due in `buf` (the bytes after `passed`): flips bits, and returns the stall to
    /// add before `buf` goes out, and whether the connection is cut after it (`buf` then keeps only the
    /// bytes before the cut point).
    fn apply(&mut self, buf: &mut Vec<u8>) -> (Duration, bool) {
        let (start, end) = (self.passed, self.passed + buf.len() as u64);
        self.passed = end;
        while let Some(at) = self.schedule.corrupt.filter(|&at| at < end) {
            let bit = self.schedule.rng.next_u64() % 8;
            buf[(at - start) as usize] ^= 1 << bit;
            self.counts.corruptions.fetch_add(1, Ordering::Relaxed);
            let every = self.faults.corrupt_every.expect("scheduled");
            self.schedule.corrupt = Some(at + about(&mut self.schedule.rng, every));
        }
        let mut stall = Duration::ZERO;
        while let Some(at) = self.schedule.stall.filter(|&at| at < end) {
            stall += self.faults.stall;
            self.counts.stalls.fetch_add(1, Ordering::Relaxed);
            let every = self.faults.stall_every.expect("scheduled");
            self.schedule.stall = Some(at + about(&mut self.schedule.rng, every));
        }
        if let Some(at) = self.schedule.reset.filter(|&at| at < end) {
            buf.truncate((at - start) as usize);
            self.counts.resets.fetch_add(1, Ordering::Relaxed);
            return (stall, true);
        }
        (stall, false)
    }
}

/// The bytes one direction of a connection holds (read from the sender, not yet written to the
/// receiver), bounded by [`Link::held`]: the reader waits for room before it reads more.
struct Held {
    bytes: Mutex<(usize, bool)>,
    room: Condvar,
    limit: usize,
}

impl Held {
    fn new(limit: usize) -> Self {
        Held { bytes: Mutex::new((0, false)), room: Condvar::new(), limit }
    }

    /// Waits until the direction holds less than its limit; false once the writer has ended.
    /// Waits until the direction holds less than its limit: the room left (`None` once the writer has
    /// ended).
    fn wait_for_room(&self) -> Option<usize> {
        let mut held = self.bytes.lock().expect("held");
        while held.0 >= self.limit && !held.1 {
            held = self.room.wait(held).expect("held");
        }
        (!held.1).then(|| self.limit - held.0)
    }

    fn add(&self, n: usize) {
        self.bytes.lock().expect("held").0 += n;
    }

    fn gone(&self, n: usize) {
        self.bytes.lock().expect("held").0 -= n;
        self.room.notify_one();
    }

    /// The writer has ended: the reader stops waiting.
    fn end(&self) {
        self.bytes.lock().expect("held").1 = true;
        self.room.notify_one();
    }
}

/// Pumps `from` into `to` through the delay line, serializing on `wire` (this direction's next free
/// instant, shared by every connection), holding at most [`Link::held`] bytes, injecting faults when
/// given; half-closes `to` at the end, or cuts both sockets where a fault says so.
fn pump(mut from: TcpStream, mut to: TcpStream, link: Link, wire: &Mutex<Instant>, mut faults: Option<Injector>) {
    let (tx, rx) = mpsc::sync_channel::<(Instant, Vec<u8>, bool)>(BUFFER / CHUNK);
    let Ok(from_handle) = from.try_clone() else { return };
    let held = Arc::new(Held::new(link.held()));
    if link.rate.is_some() {
        // The socket's own receive buffer is held bytes too (a loopback connection's grows to megabytes):
        // kept to the link's, so that the sender, not this side of the bottleneck, holds what waits.
        let _ = socket2::SockRef::from(&from).set_recv_buffer_size(link.held() / 2);
    }
    let reading = held.clone();
    let reader = std::thread::spawn(move || {
        let mut last = Instant::now();
        let mut seed = Instant::now().elapsed().as_nanos() as u64 | 1;
        while let Some(room) = reading.wait_for_room() {
            let mut buf = vec![0u8; room.min(CHUNK)];
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            buf.truncate(n);
            let (stall, cut) = faults.as_mut().map_or((Duration::ZERO, false), |f| f.apply(&mut buf));
            let mut delay = link.one_way;
            if !link.jitter.is_zero() {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                delay += link.jitter.mul_f64((seed >> 11) as f64 / (1u64 << 53) as f64);
            }
            last = last.max(Instant::now() + delay) + stall;
            reading.add(buf.len());
            if tx.send((last, buf, cut)).is_err() || cut {
                return;
            }
        }
    });
    let packet = link.packet();
    'pumping: for (release, chunk, cut) in rx {
        sleep_until(release);
        // A capped link serializes a packet's worth at a time, every connection's in turn.
        for piece in chunk.chunks(if link.rate.is_some() { packet } else { chunk.len().max(1) }) {
            if let Some(rate) = link.rate {
                let done = {
                    let mut free_at = wire.lock().expect("wire");
                    *free_at = (*free_at).max(release) + Duration::from_secs_f64(piece.len() as f64 / rate);
                    *free_at
                };
                sleep_until(done);
            }
            if to.write_all(piece).is_err() {
                break 'pumping;
            }
            held.gone(piece.len());
        }
        if cut {
            // Both ends see the connection die mid-stream; the other direction's pump ends with it.
            let _ = to.shutdown(Shutdown::Both);
            let _ = from_handle.shutdown(Shutdown::Both);
            break;
        }
    }
    held.end();
    let _ = to.shutdown(Shutdown::Write);
    let _ = reader.join();
}

/// The emulator's shared state: the wire, the faults and their counts, and the live connections (to
/// cut them when the link goes down).
struct Shared {
    wire: Wire,
    faults: Faults,
    counts: Arc<FaultCounts>,
    live: Mutex<std::collections::HashMap<u64, TcpStream>>,
    started: Instant,
}

impl Shared {
    /// Whether the link is down at `now` (`down`: up for A, then down for B, repeating).
    fn is_down(&self, now: Instant) -> bool {
        let Some((up, down)) = self.faults.down else { return false };
        let cycle = (up + down).as_secs_f64();
        cycle > 0.0 && (now - self.started).as_secs_f64() % cycle >= up.as_secs_f64()
    }
}

/// Proxies one accepted connection, number `id`.
fn proxy(client: TcpStream, upstream: SocketAddr, link: Link, shared: Arc<Shared>, id: u64) -> std::io::Result<()> {
    let server = TcpStream::connect(upstream)?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    shared.live.lock().expect("live").insert(id, client.try_clone()?);
    let (c2, s2) = (client.try_clone()?, server.try_clone()?);
    let injector = Injector {
        schedule: Schedule::new(&shared.faults, id),
        faults: shared.faults,
        counts: shared.counts.clone(),
        passed: 0,
    };
    let up_shared = shared.clone();
    let up = std::thread::spawn(move || pump(client, server, link, &up_shared.wire.up, None));
    pump(s2, c2, link, &shared.wire.down, Some(injector));
    let _ = up.join();
    shared.live.lock().expect("live").remove(&id);
    Ok(())
}

/// A running emulator (for tests and the latency lab); when dropped it stops accepting and cuts its
/// live connections, as a link (or a peer) gone for good.
pub struct Netem {
    pub addr: SocketAddr,
    /// The faults injected so far.
    pub faults: Arc<FaultCounts>,
    stop: Arc<AtomicBool>,
    shared: Arc<Shared>,
}

impl Drop for Netem {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(self.addr); // wake the accept loop
        for (_, conn) in self.shared.live.lock().expect("live").drain() {
            let _ = conn.shutdown(Shutdown::Both);
        }
    }
}

/// Starts the emulator on `listen` (port 0 picks one) in background threads, with no faults.
pub fn start(listen: SocketAddr, upstream: SocketAddr, link: Link) -> Result<Netem> {
    start_with_faults(listen, upstream, link, Faults::default())
}

/// Starts the emulator injecting `faults`.
pub fn start_with_faults(listen: SocketAddr, upstream: SocketAddr, link: Link, faults: Faults) -> Result<Netem> {
    let listener = TcpListener::bind(listen).with_context(|| format!("cannot listen on {listen}"))?;
    let addr = listener.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(FaultCounts::default());
    let shared = Arc::new(Shared {
        wire: Wire { up: Mutex::new(Instant::now()), down: Mutex::new(Instant::now()) },
        faults,
        counts: counts.clone(),
        live: Mutex::new(Default::default()),
        started: Instant::now(),
    });
    if faults.down.is_some() {
        // Cuts every live connection as each down period begins.
        let (shared, stop) = (shared.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut was_down = false;
            while !stop.load(Ordering::Relaxed) {
                let down = shared.is_down(Instant::now());
                if down && !was_down {
                    shared.counts.downs.fetch_add(1, Ordering::Relaxed);
                    for (_, conn) in shared.live.lock().expect("live").drain() {
                        let _ = conn.shutdown(Shutdown::Both);
                        shared.counts.cut_by_down.fetch_add(1, Ordering::Relaxed);
                    }
                }
                was_down = down;
                std::thread::sleep(Duration::from_millis(5));
            }
        });
    }
    let (flag, kept) = (stop.clone(), shared.clone());
    std::thread::spawn(move || {
        for (id, conn) in listener.incoming().enumerate() {
            if flag.load(Ordering::Relaxed) {
                return;
            }
            let Ok(conn) = conn else { continue };
            if shared.is_down(Instant::now()) {
                // Down: the connection is closed at once (a refused connect, as the client sees it).
                let _ = conn.shutdown(Shutdown::Both);
                shared.counts.cut_by_down.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let shared = shared.clone();
            std::thread::spawn(move || {
                if let Err(e) = proxy(conn, upstream, link, shared, id as u64) {
                    tracing::warn!(%upstream, error = %e, "netem: cannot reach the upstream");
                }
            });
        }
    });
    Ok(Netem { addr, faults: counts, stop, shared: kept })
}

/// `batchfs-lab netem`: runs until killed.
pub fn run(args: NetemArgs) -> Result<()> {
    let link = Link::from(&args);
    let faults = Faults::from(&args);
    let netem = start_with_faults(args.listen, args.upstream, link, faults)?;
    eprintln!(
        "batchfs-lab netem: {} -> {} with RTT {} ms{}{}",
        netem.addr,
        args.upstream,
        args.rtt_ms,
        if args.jitter_ms > 0.0 { format!(" (+0..{} ms jitter each way)", args.jitter_ms) } else { String::new() },
        args.rate_mbit.map(|r| format!(", {r} Mbit/s per direction")).unwrap_or_default()
    );
    let injecting = faults.reset_every.is_some()
        || faults.corrupt_every.is_some()
        || faults.stall_every.is_some()
        || faults.down.is_some();
    if injecting {
        eprintln!("batchfs-lab netem: injecting faults ({faults:?}); totals follow whenever they change");
    }
    // The report: the fault totals, every second in which they changed.
    let mut last = String::new();
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let now = netem.faults.summary();
        if injecting && now != last {
            eprintln!("batchfs-lab netem: faults injected: {now}");
            last = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Netem {
        #[command(flatten)]
        args: NetemArgs,
    }

    fn upstream(text: &str) -> Result<SocketAddr, clap::Error> {
        Netem::try_parse_from(["netem", "--listen", "127.0.0.1:0", "--upstream", text]).map(|n| n.args.upstream)
    }

    #[test]
    fn the_upstream_is_an_address_or_a_host_name_with_a_port() {
        assert_eq!(upstream("127.0.0.1:7878").unwrap(), "127.0.0.1:7878".parse().unwrap());
        assert_eq!(upstream("[::1]:7878").unwrap(), "[::1]:7878".parse().unwrap());
        // A name, through the resolver (`localhost` is in every hosts file).
        let named = upstream("localhost:7878").unwrap();
        assert!(named.ip().is_loopback() && named.port() == 7878, "{named}");
        let error = upstream("localhost").unwrap_err().to_string();
        assert!(error.contains("cannot resolve localhost (HOST:PORT)"), "{error}");
    }

    /// A fault's half given alone, or a spacing of 0, is refused: each turned the fault off in silence.
    #[test]
    fn a_fault_half_given_or_a_zero_spacing_is_refused() {
        let parse = |extra: &[&str]| {
            let base = ["netem", "--listen", "127.0.0.1:1", "--upstream", "127.0.0.1:2"];
            Netem::try_parse_from(base.iter().chain(extra)).map(|c| Faults::from(&c.args))
        };
        let f = parse(&["--stall-every", "1M", "--stall-ms", "5", "--down-after-s", "2", "--down-ms", "300"]).unwrap();
        assert_eq!((f.stall_every, f.stall), (Some(1 << 20), Duration::from_millis(5)));
        assert_eq!(f.down, Some((Duration::from_secs(2), Duration::from_millis(300))));
        let f = parse(&["--reset-every", "4M", "--corrupt-every", "1K"]).unwrap();
        assert_eq!((f.reset_every, f.corrupt_every), (Some(4 << 20), Some(1 << 10)));
        for alone in
            [&["--stall-ms", "5"][..], &["--down-ms", "300"], &["--stall-every", "1M"], &["--down-after-s", "2"]]
        {
            let e = parse(alone).unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::MissingRequiredArgument, "{alone:?}: {e}");
        }
        for zero in ["--reset-every", "--corrupt-every", "--stall-every"] {
            assert!(parse(&[zero, "0", "--stall-ms", "5", "--stall-every", "1M"]).is_err(), "{zero} 0");
        }
        assert!(parse(&["--down-after-s", "0", "--down-ms", "300"]).is_err());
    }
}
