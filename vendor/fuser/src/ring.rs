//! FUSE over io_uring (Linux 6.14+), added to fuser 0.18.0 for batchfs (VENDORED.md).
//!
//! With `FUSE_OVER_IO_URING` settled at `INIT` (and the `fuse` module's `enable_uring` set), the kernel
//! hands requests to per-CPU queues of entries that the server registers with `IORING_OP_URING_CMD`
//! on its `/dev/fuse` descriptor: a request arrives as the completion of an entry's fetch, with its
//! header and the operation's fixed argument in the entry's header buffer and the rest (names, data) in
//! its payload buffer; the reply is written into the same buffers and committed by the command that
//! fetches the entry's next request. A request then costs one `io_uring_enter` where `/dev/fuse` costs a
//! `read` and a `writev`, and it is served on the CPU that asked.
//!
//! Each CPU's queue is served by lanes: threads pinned to that CPU, each owning a ring that holds one
//! entry of the queue. A lane busy with a request (or waiting in it: on a network, say) holds only its
//! own entry, and the kernel gives the next request of that CPU to an idle lane's, as `/dev/fuse` gives
//! it to an idle reader thread. A request that finds no idle entry is queued by the kernel, and only a
//! *commit* on its CPU's queue takes it: an entry registered later does not. Behind lanes that all wait
//! (on a network that is down, say), such a request would wait with them. So a CPU's lanes grow ahead
//! of its requests: a lane that takes a request leaving fewer than [`SPARE_LANES`] of its CPU's entries
//! idle (those registering counted) starts lanes up to [`LANES_AHEAD`] first (up to [`MOST_LANES`] a
//! CPU), and only a burst of more than [`SPARE_LANES`] requests on one CPU within a lane's start queues
//! one. Such a request is not left behind lanes that all wait: a watchdog looks at the lanes every
//! [`STUCK_AFTER`], and from each CPU where one has been busy that long while another has been idle for
//! [`SETTLED`], asks the mount's `statfs` ([`ring_kicks`]): the idle entry takes that request, and its
//! commit takes the one queued. A queue's lanes grow to the requests it has in flight at once, and stay
//! (an entry, once registered, is only given back when the connection ends). A reply made on the lane's
//! thread is committed with its next submission; a reply made on another thread is handed back through
//! a flag of the lane's and an eventfd its ring polls. The kernel switches from `/dev/fuse` to the rings
//! only once every CPU's queue holds an entry: until then, and for good if a lane cannot be set up,
//! `/dev/fuse` serves every request. `FORGET` and `INTERRUPT` always come through `/dev/fuse`.

use std::io;
use std::os::fd::AsFd;
use std::os::fd::AsRawFd;
use std::os::fd::FromRawFd;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::thread::ThreadId;
use std::time::Duration;

use io_uring::IoUring;
use io_uring::cqueue;
use io_uring::opcode;
use io_uring::squeue;
use io_uring::types;
use log::debug;
use log::warn;
use parking_lot::Mutex;

use crate::Filesystem;
use crate::channel::Channel;
use crate::channel::ChannelSender;
use crate::ll::fuse_abi as abi;
use crate::request::RequestWithSender;
use crate::session::SessionEventLoop;

/// `enum fuse_uring_cmd`.
const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;
/// `struct fuse_uring_req_header`: the in/out header (128 bytes), the operation's fixed argument (128),
/// then `struct fuse_uring_ent_in_out` (flags, commit id, payload size).
const OP_IN: usize = 128;
const ENT_IN_OUT: usize = 256;
const COMMIT_ID: usize = ENT_IN_OUT + 8;
const PAYLOAD_SZ: usize = ENT_IN_OUT + 16;
const HEADER_BYTES: usize = ENT_IN_OUT + 32;
/// The kernel's `FUSE_MIN_READ_BUFFER`.
const MIN_PAYLOAD: usize = 8192;
/// The completions of a lane's ring: its entry's commands, and the poll of its eventfd.
const ENTRY: u64 = 0;
const WAKE: u64 = 1;
/// Lanes (threads, each with one entry) a CPU's queue grows to at most; beyond them, that CPU's
/// requests wait in the kernel for a lane to finish one.
pub(crate) const MOST_LANES: usize = 256;
/// Idle lanes (those registering counted) a CPU keeps at least: a lane that takes a request and leaves
/// fewer starts lanes up to [`LANES_AHEAD`].
const SPARE_LANES: usize = 2;
/// Idle lanes a CPU is grown back to, and the lanes it starts with at least.
const LANES_AHEAD: usize = 4;

/// How long a lane is busy before the watchdog sends a request from its CPU, where another is idle: the
/// longest a request queued behind lanes that all wait is left there.
pub(crate) const STUCK_AFTER: Duration = Duration::from_millis(100);

/// Requests the watchdog sends from one CPU in a period at most, while each takes a queued request.
const MOST_KICKS: usize = 8;

/// The watchdog's requests in flight on one CPU at most (each on a thread of its own: one may wait in
/// the queue itself).
const MOST_KICKING: usize = 4;

/// How long a lane's entry is idle before the watchdog counts on the kernel giving it a request.
const SETTLED: Duration = Duration::from_millis(10);

/// How long the watchdog waits for its request's answer before it leaves it in flight.
const KICK_ANSWER: Duration = Duration::from_millis(5);

/// Requests the watchdog has sent, in this process.
static KICKS: AtomicU64 = AtomicU64::new(0);

/// Milliseconds of the coarse monotonic clock (a read of the vDSO's page wherever the kernel has one),
/// plus 1: never 0, which lanes keep for "none".
fn now_ms() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `clock_gettime` writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut t) };
    t.tv_sec as u64 * 1000 + t.tv_nsec as u64 / 1_000_000 + 1
}

/// Requests the rings' watchdog has sent from a CPU where a lane had been busy for [`STUCK_AFTER`] while
/// another was idle, in this process: each takes an idle entry, and its commit takes a request the
/// kernel may have queued behind the busy ones (one that found no idle entry as it came).
pub fn ring_kicks() -> u64 {
    KICKS.load(Ordering::Relaxed)
}

thread_local! {
    static RING_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is a FUSE ring's lane (not `/dev/fuse`'s, nor any other). A lane may wait
/// in a request: its CPU's other requests go to other lanes.
pub fn served_by_ring() -> bool {
    RING_THREAD.with(|r| r.get())
}

/// How the rings are set up: the lanes each CPU's queue starts with, and each entry's payload buffer (at
/// least the kernel's largest request or reply: `max(8 KiB, max_write, max_pages × page size)`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RingPlan {
    pub(crate) lanes: u16,
    pub(crate) payload: usize,
}

impl RingPlan {
    /// The lanes each CPU starts with for `threads` threads in all: at least [`LANES_AHEAD`] a CPU
    /// (idle ones stay while others wait), at most 64.
    pub(crate) fn lanes_for(threads: usize) -> u16 {
        threads.div_ceil(possible_cpus()).clamp(LANES_AHEAD, 64) as u16
    }

    /// The payload the kernel needs for these settings; `max_pages` is capped by the kernel's limit
    /// (`/proc/sys/fs/fuse/max_pages_limit`, 256 where it is not there).
    pub(crate) fn payload_for(max_write: u32, max_pages: u16) -> usize {
        let limit = std::fs::read_to_string("/proc/sys/fs/fuse/max_pages_limit")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .unwrap_or(256);
        let pages = usize::from(max_pages).min(limit).max(1);
        MIN_PAYLOAD
            .max(max_write as usize)
            .max(pages * page_size::get())
    }
}

/// The CPUs the kernel may ever run (`_SC_NPROCESSORS_CONF`): the kernel has a queue for each.
fn possible_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) }).max(1) as usize
}

/// The size of the fixed argument the kernel puts in `op_in` for each operation a read-only
/// filesystem is sent (`None`: answered `ENOSYS` without reaching the filesystem, as an operation
/// fuser's parser would not know the layout of here).
fn op_in_size(opcode: u32) -> Option<usize> {
    use abi::fuse_opcode as op;
    use std::mem::size_of;
    let code = op::try_from(opcode).ok()?;
    Some(match code {
        op::FUSE_LOOKUP | op::FUSE_READLINK | op::FUSE_STATFS | op::FUSE_DESTROY => 0,
        op::FUSE_FORGET => size_of::<abi::fuse_forget_in>(),
        op::FUSE_GETATTR => size_of::<abi::fuse_getattr_in>(),
        op::FUSE_OPEN | op::FUSE_OPENDIR => size_of::<abi::fuse_open_in>(),
        op::FUSE_READ | op::FUSE_READDIR | op::FUSE_READDIRPLUS => size_of::<abi::fuse_read_in>(),
        op::FUSE_RELEASE | op::FUSE_RELEASEDIR => size_of::<abi::fuse_release_in>(),
        op::FUSE_GETXATTR | op::FUSE_LISTXATTR => size_of::<abi::fuse_getxattr_in>(),
        op::FUSE_FLUSH => size_of::<abi::fuse_flush_in>(),
        op::FUSE_ACCESS => size_of::<abi::fuse_access_in>(),
        op::FUSE_POLL => size_of::<abi::fuse_poll_in>(),
        op::FUSE_LSEEK => size_of::<abi::fuse_lseek_in>(),
        _ => return None,
    })
}

/// An anonymous private mapping, unmapped on drop; its pages are touched only as they are used.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory; who writes it when is the queue's protocol (an entry's buffers
// belong to the kernel while its fetch is pending, to the one request it delivered until that request's
// reply is committed).
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(len: usize) -> io::Result<Mapping> {
        // SAFETY: a fresh anonymous mapping; no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `len` are this mapping's, and nothing refers to it any more.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// One entry: its header buffer (a page) and its payload buffer.
struct Entry {
    header: Mapping,
    payload: Mapping,
}

/// One lane: its entry of a CPU's queue, and what its replies need.
pub(crate) struct Lane {
    qid: u16,
    entry: Entry,
    /// The entry's reply is written and waits to be committed.
    replied: AtomicBool,
    /// Written by a reply made on another thread, to wake the lane's thread.
    wake: OwnedFd,
    /// The lane's thread, whose replies need no wake.
    thread: OnceLock<ThreadId>,
    /// When it took the request it holds ([`now_ms`]; 0: it holds none).
    busy_since: AtomicU64,
    /// When its entry was last registered or committed ([`now_ms`]; 0: it holds a request). An entry
    /// committed while the kernel had a request queued takes that request at once: one idle for
    /// [`SETTLED`] is the kernel's to give the next request to.
    idle_since: AtomicU64,
}

impl Lane {
    fn new(qid: u16, plan: RingPlan) -> io::Result<Lane> {
        let entry = Entry {
            header: Mapping::new(page_size::get().max(HEADER_BYTES))?,
            payload: Mapping::new(plan.payload)?,
        };
        // SAFETY: `eventfd` returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Lane {
            qid,
            entry,
            replied: AtomicBool::new(false),
            // SAFETY: `fd` was just opened and is owned here alone.
            wake: unsafe { OwnedFd::from_raw_fd(fd) },
            thread: OnceLock::new(),
            busy_since: AtomicU64::new(0),
            idle_since: AtomicU64::new(0),
        })
    }

    fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: an 8-byte write to this lane's eventfd. A full counter (EAGAIN) already wakes.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// The request's commit id, which the kernel wrote into the header when it delivered it (0 before
    /// the entry's first request).
    fn commit_id(&self) -> u64 {
        let mut id = [0u8; 8];
        // SAFETY: a read within the entry's header.
        unsafe {
            std::ptr::copy_nonoverlapping(self.entry.header.ptr.add(COMMIT_ID), id.as_mut_ptr(), 8)
        };
        u64::from_ne_bytes(id)
    }
}

/// Where a request delivered by a ring is answered: its lane's entry.
#[derive(Clone)]
pub(crate) struct RingReply {
    lane: Arc<Lane>,
    /// The connection, for backing files of passthrough opens.
    pub(crate) ch: ChannelSender,
}

impl std::fmt::Debug for RingReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RingReply(queue {})", self.lane.qid)
    }
}

impl RingReply {
    /// Writes a reply (the `fuse_out_header`, then its payload) into the entry and hands the entry
    /// back to be committed. A payload larger than the entry's buffer (which the kernel's sizes rule
    /// out) is answered `EIO` instead.
    pub(crate) fn send(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<()> {
        let entry = &self.lane.entry;
        let Some((head, rest)) = bufs.split_first() else {
            return Err(io::Error::other("a reply without its header"));
        };
        let out_len = std::mem::size_of::<abi::fuse_out_header>();
        if head.len() != out_len {
            return Err(io::Error::other("a reply's header of the wrong size"));
        }
        let total: usize = rest.iter().map(|b| b.len()).sum();
        // SAFETY: this entry's buffers belong to this request until its commit (module doc), which
        // this call makes; the writes stay within the two mappings (sizes checked).
        unsafe {
            std::ptr::copy_nonoverlapping(head.as_ptr(), entry.header.ptr, out_len);
            let mut written = 0;
            if total <= entry.payload.len {
                for b in rest {
                    std::ptr::copy_nonoverlapping(
                        b.as_ptr(),
                        entry.payload.ptr.add(written),
                        b.len(),
                    );
                    written += b.len();
                }
            } else {
                warn!(
                    "a reply of {total} bytes exceeds the ring's payload of {}",
                    entry.payload.len
                );
                // fuse_out_header: len (u32), error (i32), unique (u64).
                let error = -libc::EIO;
                std::ptr::copy_nonoverlapping(
                    error.to_ne_bytes().as_ptr(),
                    entry.header.ptr.add(4),
                    4,
                );
            }
            std::ptr::copy_nonoverlapping(
                (written as u32).to_ne_bytes().as_ptr(),
                entry.header.ptr.add(PAYLOAD_SZ),
                4,
            );
        }
        self.lane.replied.store(true, Ordering::Release);
        if self.lane.thread.get() != Some(&std::thread::current().id()) {
            self.lane.wake();
        }
        Ok(())
    }
}

/// A CPU's lanes: how many there are, how many wait for a request (their entry is the kernel's), and
/// how many are starting (their entry not yet registered).
#[derive(Default)]
struct Cpu {
    lanes: std::sync::atomic::AtomicUsize,
    idle: std::sync::atomic::AtomicUsize,
    starting: std::sync::atomic::AtomicUsize,
}

impl Cpu {
    /// Idle lanes, with those starting.
    fn ready(&self) -> usize {
        self.idle.load(Ordering::Acquire) + self.starting.load(Ordering::Acquire)
    }
}

/// The rings of one session: every lane, and how to start another.
struct Shared<FS: Filesystem> {
    plan: RingPlan,
    cpus: Box<[Cpu]>,
    lanes: Mutex<Vec<(Arc<Lane>, std::thread::JoinHandle<()>)>>,
    stop: AtomicBool,
    /// The watchdog's thread, woken to stop.
    watchdog: Mutex<Option<std::thread::JoinHandle<()>>>,
    fuse: std::os::fd::RawFd,
    ch: ChannelSender,
    event_loop: Box<dyn Fn(String) -> SessionEventLoop<FS> + Send + Sync>,
}

impl<FS: Filesystem> Shared<FS> {
    /// `cpu`'s lanes holding a request now, and those idle for [`SETTLED`] or more.
    fn busy_and_settled(&self, cpu: usize) -> (usize, usize) {
        let now = now_ms();
        let settled = SETTLED.as_millis() as u64;
        let (mut busy, mut idle) = (0, 0);
        for (lane, _) in self
            .lanes
            .lock()
            .iter()
            .filter(|(l, _)| usize::from(l.qid) == cpu)
        {
            busy += usize::from(lane.busy_since.load(Ordering::Acquire) != 0);
            let since = lane.idle_since.load(Ordering::Acquire);
            idle += usize::from(since != 0 && now.saturating_sub(since) >= settled);
        }
        (busy, idle)
    }
}

impl<FS: Filesystem + Send + Sync + 'static> Shared<FS> {
    /// Starts lanes on `cpu` up to [`LANES_AHEAD`] ready (idle or starting) where fewer than
    /// [`SPARE_LANES`] are: under the lock that starting a lane takes, so that lanes taking requests at
    /// once start them once.
    fn grow(self: &Arc<Self>, cpu: u16) {
        let mut lanes = self.lanes.lock();
        let ready = self.cpus[usize::from(cpu)].ready();
        if ready >= SPARE_LANES {
            return;
        }
        for _ in ready..LANES_AHEAD {
            if let Err(e) = self.add_lane(&mut lanes, cpu) {
                warn!("FUSE ring {cpu}: no lane added: {e}");
                return;
            }
        }
    }

    /// Starts a lane on `cpu` (none once the rings stop, or at [`MOST_LANES`]); `lanes` is the lock's.
    fn add_lane(
        self: &Arc<Self>,
        lanes: &mut Vec<(Arc<Lane>, std::thread::JoinHandle<()>)>,
        cpu: u16,
    ) -> io::Result<()> {
        let count = &self.cpus[usize::from(cpu)].lanes;
        let starting = &self.cpus[usize::from(cpu)].starting;
        if self.stop.load(Ordering::Acquire) || count.load(Ordering::Acquire) >= MOST_LANES {
            return Ok(());
        }
        let lane = Arc::new(Lane::new(cpu, self.plan)?);
        let name = format!("fuser-ring-{cpu}-{}", count.load(Ordering::Acquire));
        let serve = Serve {
            lane: lane.clone(),
            shared: self.clone(),
            event_loop: (self.event_loop)(name.clone()),
            registered: std::cell::Cell::new(false),
        };
        // Counted before it runs: a lane that ends at once takes itself off after this.
        count.fetch_add(1, Ordering::AcqRel);
        starting.fetch_add(1, Ordering::AcqRel);
        match std::thread::Builder::new()
            .name(name)
            .spawn(move || serve.run())
        {
            Ok(thread) => {
                lanes.push((lane, thread));
                Ok(())
            }
            Err(e) => {
                count.fetch_sub(1, Ordering::AcqRel);
                starting.fetch_sub(1, Ordering::AcqRel);
                Err(e)
            }
        }
    }
}

/// The rings of one session, stopped by [`Rings::stop`].
pub(crate) struct Rings {
    stop: Box<dyn FnOnce() + Send>,
}

impl Rings {
    /// Starts `plan.lanes` lanes on each possible CPU, which register their entries. Fails where a
    /// lane's memory, eventfd or thread cannot be had (the lanes started then stop again); a ring the
    /// kernel refuses is logged by its lane and leaves `/dev/fuse` serving.
    /// With the `mountpoint`, a watchdog keeps requests from waiting behind lanes that all wait
    /// ([`STUCK_AFTER`]); without it (a session over a descriptor), none does.
    pub(crate) fn start<FS: Filesystem + Send + Sync + 'static>(
        plan: RingPlan,
        ch: &Channel,
        mountpoint: Option<PathBuf>,
        event_loop: impl Fn(String) -> SessionEventLoop<FS> + Send + Sync + 'static,
    ) -> io::Result<Rings> {
        let cpus = possible_cpus();
        let shared = Arc::new(Shared {
            plan,
            cpus: (0..cpus).map(|_| Cpu::default()).collect(),
            lanes: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            watchdog: Mutex::new(None),
            fuse: ch.as_fd().as_raw_fd(),
            ch: ch.sender(),
            event_loop: Box::new(event_loop),
        });
        let rings = Rings {
            stop: Box::new({
                let shared = shared.clone();
                move || stop(&shared)
            }),
        };
        for cpu in 0..cpus {
            for _ in 0..plan.lanes.max(1) {
                let added = shared.add_lane(&mut shared.lanes.lock(), cpu as u16);
                if let Err(e) = added {
                    rings.stop();
                    return Err(e);
                }
            }
        }
        if let Some(mountpoint) = mountpoint {
            let watched = shared.clone();
            let spawned = std::thread::Builder::new()
                .name("fuser-ring-watch".into())
                .spawn(move || watch(&watched, &mountpoint));
            match spawned {
                Ok(thread) => *shared.watchdog.lock() = Some(thread),
                Err(e) => warn!("FUSE rings: no watchdog: {e}"),
            }
        }
        Ok(rings)
    }

    /// Ends every lane (the connection is gone or the session ends) and waits for them.
    pub(crate) fn stop(self) {
        (self.stop)()
    }
}

fn stop<FS: Filesystem>(shared: &Shared<FS>) {
    shared.stop.store(true, Ordering::Release);
    if let Some(watchdog) = shared.watchdog.lock().take() {
        watchdog.thread().unpark();
        let _ = watchdog.join();
    }
    // Lanes starting lanes take the same lock: none is added once this has taken them.
    let lanes = std::mem::take(&mut *shared.lanes.lock());
    for (lane, _) in &lanes {
        lane.wake();
    }
    for (_, thread) in lanes {
        let _ = thread.join();
    }
}

/// The watchdog: every [`STUCK_AFTER`], from each CPU where a lane has been busy that long while another
/// is idle, a `statfs` of the mount ([`kick`]). It goes to that CPU's queue (the kernel queues a request
/// on the CPU it is made on), where an idle entry takes it; the lane answers at once, and its commit takes
/// the first request the kernel queued there, if any, which no entry registered since would ever take.
/// While a `statfs` is answered at once and leaves one more of the CPU's lanes busy (its commit took a
/// queued request), another follows, up to [`MOST_KICKS`]; otherwise the next comes a period later. A
/// `statfs` may itself be queued (an entry counted idle had just committed, and took a queued request
/// instead): each is made on a thread of its own, so the watchdog never waits in the queue, and at most
/// [`MOST_KICKING`] a CPU are in flight.
fn watch<FS: Filesystem>(shared: &Shared<FS>, mountpoint: &std::path::Path) {
    let Ok(path) = std::ffi::CString::new(mountpoint.as_os_str().as_encoded_bytes()) else {
        warn!("FUSE rings: no watchdog for a mountpoint with a NUL byte");
        return;
    };
    let path = Arc::new(path);
    let kicking: Vec<Arc<AtomicUsize>> = (0..shared.cpus.len()).map(|_| Arc::default()).collect();
    let after = STUCK_AFTER.as_millis() as u64;
    loop {
        std::thread::park_timeout(STUCK_AFTER);
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        let now = now_ms();
        let mut stuck = vec![false; shared.cpus.len()];
        for (lane, _) in shared.lanes.lock().iter() {
            let since = lane.busy_since.load(Ordering::Acquire);
            if since != 0 && now.saturating_sub(since) >= after {
                stuck[usize::from(lane.qid)] = true;
            }
        }
        for cpu in (0..stuck.len()).filter(|&c| stuck[c]) {
            for _ in 0..MOST_KICKS {
                let (before, settled) = shared.busy_and_settled(cpu);
                // No idle entry: the request would wait in the queue too.
                if settled == 0
                    || kicking[cpu].load(Ordering::Acquire) >= MOST_KICKING
                    || shared.stop.load(Ordering::Acquire)
                {
                    break;
                }
                let Some(answered) = kick(cpu, &path, &kicking[cpu]) else {
                    break;
                };
                if answered.recv_timeout(KICK_ANSWER).is_err() {
                    debug!("FUSE ring {cpu}: the watchdog's statfs waits in the queue");
                    break;
                }
                // The lane that answered takes what its commit found, on that CPU: let it run.
                std::thread::sleep(Duration::from_millis(1));
                let took = shared.busy_and_settled(cpu).0 > before;
                debug!(
                    "FUSE ring {cpu}: a lane busy for {STUCK_AFTER:?}: statfs answered, a queued request taken: {took}"
                );
                if !took {
                    break;
                }
            }
        }
    }
}

/// A `statfs` of `path` from a thread of its own pinned to `cpu`, counted in `kicking` while in flight;
/// what it sends when it is answered (none where no thread could be had).
fn kick(
    cpu: usize,
    path: &Arc<std::ffi::CString>,
    kicking: &Arc<AtomicUsize>,
) -> Option<std::sync::mpsc::Receiver<()>> {
    let (answered, answer) = std::sync::mpsc::channel();
    let (path, in_flight) = (path.clone(), kicking.clone());
    kicking.fetch_add(1, Ordering::AcqRel);
    let spawned = std::thread::Builder::new()
        .name(format!("fuser-kick-{cpu}"))
        .spawn(move || {
            if pin_to(cpu) {
                let mut fs = std::mem::MaybeUninit::<libc::statfs>::uninit();
                // SAFETY: a NUL-terminated path and a buffer of the size `statfs` writes.
                unsafe { libc::statfs(path.as_ptr(), fs.as_mut_ptr()) };
                KICKS.fetch_add(1, Ordering::Relaxed);
            }
            in_flight.fetch_sub(1, Ordering::AcqRel);
            let _ = answered.send(());
        });
    match spawned {
        Ok(_) => Some(answer),
        Err(e) => {
            kicking.fetch_sub(1, Ordering::AcqRel);
            debug!("FUSE ring {cpu}: no thread for the watchdog's statfs: {e}");
            None
        }
    }
}

/// One lane's thread.
struct Serve<FS: Filesystem> {
    lane: Arc<Lane>,
    shared: Arc<Shared<FS>>,
    event_loop: SessionEventLoop<FS>,
    /// Its entry's registration is submitted: no longer counted as starting.
    registered: std::cell::Cell<bool>,
}

impl<FS: Filesystem + Send + Sync + 'static> Serve<FS> {
    fn cpu(&self) -> &Cpu {
        &self.shared.cpus[usize::from(self.lane.qid)]
    }

    fn run(self) {
        let _ = self.lane.thread.set(std::thread::current().id());
        RING_THREAD.with(|r| r.set(true));
        pin_to(usize::from(self.lane.qid));
        if let Err(e) = self.serve() {
            warn!("FUSE ring {} ended: {e}", self.lane.qid);
        }
        // A lane that ended no longer counts against its CPU's most, nor as starting, nor to the
        // watchdog as idle (its entry is gone: a request sent for it would be queued).
        self.lane.idle_since.store(0, Ordering::Release);
        self.lane.busy_since.store(0, Ordering::Release);
        self.cpu().lanes.fetch_sub(1, Ordering::AcqRel);
        if !self.registered.get() {
            self.cpu().starting.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn cmd(&self, cmd_op: u32, commit_id: u64) -> squeue::Entry128 {
        // struct fuse_uring_cmd_req: flags (u64), commit_id (u64), qid (u16), padding.
        let mut cmd = [0u8; 80];
        cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
        cmd[16..18].copy_from_slice(&self.lane.qid.to_ne_bytes());
        opcode::UringCmd80::new(types::Fd(self.shared.fuse), cmd_op)
            .cmd(cmd)
            .build()
            .user_data(ENTRY)
    }

    /// The entry's registration with its iovecs (the header and the payload buffer).
    fn register(&self, iov: &[libc::iovec; 2]) -> squeue::Entry128 {
        let mut sqe = self.cmd(CMD_REGISTER, 0);
        // `struct io_uring_sqe`: `addr` at byte 16 (u64), `len` at byte 24 (u32); io-uring's builder
        // sets `addr` only. `Entry128` is `repr(C)` over the kernel's SQE and 64 more bytes.
        let raw = (&mut sqe as *mut squeue::Entry128).cast::<u8>();
        // SAFETY: both writes are within the SQE's first 64 bytes, at the ABI's offsets.
        unsafe {
            raw.add(16)
                .cast::<u64>()
                .write_unaligned(iov.as_ptr() as u64);
            raw.add(24).cast::<u32>().write_unaligned(2);
        }
        sqe
    }

    fn serve(&self) -> io::Result<()> {
        // The entry's command, the eventfd's poll, and room for one more of each.
        let mut ring: IoUring<squeue::Entry128, cqueue::Entry> =
            IoUring::builder().setup_cqsize(4).build(2)?;
        let entry = &self.lane.entry;
        let iov = [
            libc::iovec {
                iov_base: entry.header.ptr.cast(),
                iov_len: entry.header.len,
            },
            libc::iovec {
                iov_base: entry.payload.ptr.cast(),
                iov_len: entry.payload.len,
            },
        ];
        // SAFETY: the iovecs (and the buffers they name) outlive the submission below, which is when
        // the kernel reads them; the buffers outlive the ring (the lane holds them).
        unsafe { push(&mut ring, &self.register(&iov))? };
        self.arm_wake(&mut ring)?;
        // Registered once submitted (the kernel registers an entry as it takes the command), before it
        // counts as idle: the watchdog sends a request to a CPU only where an entry will take it.
        ring.submit()?;
        self.lane.idle_since.store(now_ms(), Ordering::Release);
        // Idle before no longer starting: the CPU's ready lanes are never undercounted.
        self.cpu().idle.fetch_add(1, Ordering::AcqRel);
        self.cpu().starting.fetch_sub(1, Ordering::AcqRel);
        self.registered.set(true);
        let mut buf: Vec<u64> = vec![0; (MIN_PAYLOAD + entry.payload.len) / 8 + 64];
        let mut ready = Vec::with_capacity(2);
        loop {
            if self.lane.replied.swap(false, Ordering::AcqRel) {
                let commit = self.lane.commit_id();
                // SAFETY: a commit carries no pointers; the entry's buffers are registered already.
                unsafe { push(&mut ring, &self.cmd(CMD_COMMIT_AND_FETCH, commit))? };
                self.lane.busy_since.store(0, Ordering::Release);
                self.lane.idle_since.store(now_ms(), Ordering::Release);
                self.cpu().idle.fetch_add(1, Ordering::AcqRel);
            }
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
            ready.clear();
            ready.extend(ring.completion().map(|c| (c.user_data(), c.result())));
            for &(data, result) in &ready {
                if data == WAKE {
                    if self.shared.stop.load(Ordering::Acquire) {
                        return Ok(());
                    }
                    let mut count = [0u8; 8];
                    // SAFETY: an 8-byte read of the eventfd, which is non-blocking.
                    unsafe { libc::read(self.lane.wake.as_raw_fd(), count.as_mut_ptr().cast(), 8) };
                    self.arm_wake(&mut ring)?;
                    continue;
                }
                match result {
                    0 => {
                        self.lane.idle_since.store(0, Ordering::Release);
                        self.lane.busy_since.store(now_ms(), Ordering::Release);
                        // Few idle entries left: lanes first, so a request that waits here leaves
                        // the next ones of this CPU an entry (a request that finds none waits for a
                        // commit, which lanes that all wait never make).
                        if self.cpu().idle.fetch_sub(1, Ordering::AcqRel) <= SPARE_LANES {
                            self.shared.grow(self.lane.qid);
                        }
                        self.dispatch(&mut buf)
                    }
                    e if e == -libc::EAGAIN || e == -libc::EINTR => {
                        // Not taken: submitted again as it was (a registration carries its iovecs).
                        let commit = self.lane.commit_id();
                        let sqe = match commit {
                            0 => self.register(&iov),
                            _ => self.cmd(CMD_COMMIT_AND_FETCH, commit),
                        };
                        // SAFETY: as at registration: the iovecs live until this loop ends.
                        unsafe { push(&mut ring, &sqe)? };
                    }
                    e if e == -libc::ENOTCONN || e == -libc::ENODEV || e == -libc::ECANCELED => {
                        debug!("FUSE ring {}: the connection ended", self.lane.qid);
                        return Ok(());
                    }
                    // A registration the kernel refused (the lane is of no use: it ends, and
                    // /dev/fuse serves while no ring is ready), or a commit it refused (its request
                    // gone: aborted, timed out; the entry is lost, and so the lane).
                    e => {
                        let error = io::Error::from_raw_os_error(-e);
                        let idle = self.cpu().idle.fetch_sub(1, Ordering::AcqRel);
                        if self.lane.commit_id() == 0 {
                            return Err(io::Error::other(format!("registration refused: {error}")));
                        }
                        warn!("FUSE ring {}: a commit refused: {error}", self.lane.qid);
                        if idle <= SPARE_LANES {
                            self.shared.grow(self.lane.qid);
                        }
                        return Ok(());
                    }
                }
            }
        }
    }

    fn arm_wake(&self, ring: &mut IoUring<squeue::Entry128, cqueue::Entry>) -> io::Result<()> {
        let poll = opcode::PollAdd::new(types::Fd(self.lane.wake.as_raw_fd()), libc::POLLIN as u32)
            .build()
            .user_data(WAKE);
        // SAFETY: a poll of the lane's eventfd, which outlives the ring.
        unsafe { push(ring, &squeue::Entry128::from(poll)) }
    }

    /// Rebuilds the request as `/dev/fuse` would have delivered it (the header, the fixed argument,
    /// the rest) and dispatches it, its replies going to the entry.
    fn dispatch(&self, buf: &mut [u64]) {
        let e = &self.lane.entry;
        let in_len = std::mem::size_of::<abi::fuse_in_header>();
        let mut head = [0u8; 8];
        // SAFETY: reads of the entry's buffers, which hold the request the kernel just delivered and
        // are this thread's until the reply is committed; every read is within the mappings.
        let (opcode, payload) = unsafe {
            std::ptr::copy_nonoverlapping(e.header.ptr, head.as_mut_ptr(), 8);
            let mut sz = [0u8; 4];
            std::ptr::copy_nonoverlapping(e.header.ptr.add(PAYLOAD_SZ), sz.as_mut_ptr(), 4);
            (
                u32::from_ne_bytes(head[4..8].try_into().unwrap()),
                u32::from_ne_bytes(sz) as usize,
            )
        };
        let reply = RingReply {
            lane: self.lane.clone(),
            ch: self.shared.ch.clone(),
        };
        if opcode == abi::fuse_opcode::FUSE_DESTROY as u32 {
            // As the /dev/fuse loop does: answered, the connection ends next.
            self.answer_errno(&reply, 0);
            return;
        }
        let fixed = op_in_size(opcode);
        let total = in_len + fixed.unwrap_or(0) + payload;
        let bytes: &mut [u8] = zerocopy::IntoBytes::as_mut_bytes(buf);
        if fixed.is_none() || payload > e.payload.len || total > bytes.len() {
            self.answer_errno(&reply, libc::ENOSYS);
            return;
        }
        let fixed = fixed.unwrap_or(0);
        // SAFETY: as above; `bytes` holds `total` (checked).
        unsafe {
            std::ptr::copy_nonoverlapping(e.header.ptr, bytes.as_mut_ptr(), in_len);
            std::ptr::copy_nonoverlapping(
                e.header.ptr.add(OP_IN),
                bytes.as_mut_ptr().add(in_len),
                fixed,
            );
            std::ptr::copy_nonoverlapping(
                e.payload.ptr,
                bytes.as_mut_ptr().add(in_len + fixed),
                payload,
            );
        }
        bytes[..4].copy_from_slice(&(total as u32).to_ne_bytes());
        match RequestWithSender::new_ring(reply.clone(), &bytes[..total]) {
            // A filesystem that panics has its reply dropped (answered EIO); the lane serves on.
            Some(req) => {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    req.dispatch(&self.event_loop)
                }));
            }
            None => self.answer_errno(&reply, libc::EIO),
        }
    }

    /// Answers the entry's request with `errno` and no payload (0: success).
    fn answer_errno(&self, reply: &RingReply, errno: i32) {
        let e = &self.lane.entry;
        let mut unique = [0u8; 8];
        // SAFETY: read of the delivered request's header (its unique id at offset 8).
        unsafe { std::ptr::copy_nonoverlapping(e.header.ptr.add(8), unique.as_mut_ptr(), 8) };
        let mut out = [0u8; 16];
        out[..4].copy_from_slice(&16u32.to_ne_bytes());
        out[4..8].copy_from_slice(&(-errno).to_ne_bytes());
        out[8..].copy_from_slice(&unique);
        let _ = reply.send(&[io::IoSlice::new(&out)]);
    }
}

/// # Safety
/// What `sqe` points to must stay valid until the kernel has consumed it.
unsafe fn push(
    ring: &mut IoUring<squeue::Entry128, cqueue::Entry>,
    sqe: &squeue::Entry128,
) -> io::Result<()> {
    // SAFETY: the caller's promise.
    while unsafe { ring.submission().push(sqe) }.is_err() {
        ring.submit()?;
    }
    Ok(())
}

/// Pins the calling thread to `cpu`; false where it cannot be (an offline CPU, say).
fn pin_to(cpu: usize) -> bool {
    if cpu >= libc::CPU_SETSIZE as usize {
        return false;
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET stays within it (checked).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            debug!(
                "FUSE ring {cpu}: not pinned: {}",
                io::Error::last_os_error()
            );
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_arguments_have_the_kernels_sizes() {
        use abi::fuse_opcode as op;
        for (code, size, name) in [
            (op::FUSE_LOOKUP as u32, 0, "FUSE_LOOKUP"),
            (op::FUSE_GETATTR as u32, 16, "FUSE_GETATTR"),
            (op::FUSE_OPEN as u32, 8, "FUSE_OPEN"),
            (op::FUSE_READ as u32, 40, "FUSE_READ"),
            (op::FUSE_RELEASE as u32, 24, "FUSE_RELEASE"),
            (op::FUSE_OPENDIR as u32, 8, "FUSE_OPENDIR"),
            (op::FUSE_READDIRPLUS as u32, 40, "FUSE_READDIRPLUS"),
            (op::FUSE_FLUSH as u32, 24, "FUSE_FLUSH"),
            (op::FUSE_ACCESS as u32, 8, "FUSE_ACCESS"),
            (op::FUSE_GETXATTR as u32, 8, "FUSE_GETXATTR"),
            (op::FUSE_LSEEK as u32, 24, "FUSE_LSEEK"),
            (op::FUSE_POLL as u32, 24, "FUSE_POLL"),
        ] {
            assert_eq!(op_in_size(code), Some(size), "{name}");
        }
        assert_eq!(op_in_size(op::FUSE_WRITE as u32), None);
    }

    #[test]
    fn the_payload_holds_the_largest_read() {
        assert!(RingPlan::payload_for(4096, 256) >= 256 * 4096);
        assert!(RingPlan::payload_for(4096, 1) >= MIN_PAYLOAD);
        assert!(
            usize::from(RingPlan::lanes_for(1)) >= LANES_AHEAD && LANES_AHEAD > SPARE_LANES,
            "idle lanes stay while others wait"
        );
    }
}
