//! FUSE over io_uring (`fuse_uring=on`, Linux 6.14+): through a real mount whose requests the kernel
//! hands to the daemon's rings, `raw/` reads every file byte for byte, the epoch folders' batch files
//! (opened by passthrough, whose backing ids travel in the ring's replies) match a mount served over
//! `/dev/fuse`, ImageFolder over `shuffled/` gets every sample once an epoch, and readers waiting out a
//! server outage leave the stats file answered (`mount.rs`'s test, over rings). A kernel that does not
//! offer rings (`enable_uring` off) leaves the same mount on `/dev/fuse`, reading the same bytes. A
//! burst of requests on one CPU, half of them reads that wait out an outage, has the other half answered
//! while the reads wait: those the kernel queued behind the waiting lanes are taken by the watchdog's.

use crate::common::{self, fixture, serve, ServeWith};
use batchfs::index::SourceFormat;
use std::path::Path;
use std::sync::{mpsc, Arc, Barrier, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const ENABLE: &str = "/sys/module/fuse/parameters/enable_uring";

/// Sets the fuse module's `enable_uring` and puts back what it was on drop (a panic included). The
/// setting only lets a mount that asks for rings have them; other mounts are unaffected. It is one setting
/// for the whole machine, so tests that set it hold [`SETTING`] while they rely on it: run at once, one
/// test put back the `N` it found while another still mounted over rings, whose mount then fell back to
/// `/dev/fuse`.
struct EnableUring {
    before: String,
    _held: MutexGuard<'static, ()>,
}

/// Held by whoever relies on `enable_uring`'s value.
static SETTING: Mutex<()> = Mutex::new(());

impl EnableUring {
    fn set(on: bool) -> Option<EnableUring> {
        // A test that failed holding it has put the setting back all the same (on drop).
        let held = SETTING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let ci = std::env::var_os("CI").is_some();
        let Ok(before) = std::fs::read_to_string(ENABLE) else {
            assert!(!ci, "CI must offer FUSE over io_uring (Linux 6.14+ with CONFIG_FUSE_IO_URING): no {ENABLE}");
            eprintln!("skipping: this kernel has no FUSE over io_uring ({ENABLE})");
            return None;
        };
        if let Err(e) = std::fs::write(ENABLE, if on { "Y" } else { "N" }) {
            assert!(!ci, "CI must let root set {ENABLE}: {e}");
            eprintln!("skipping: cannot set {ENABLE}: {e}");
            return None;
        }
        Some(EnableUring { before: before.trim().to_owned(), _held: held })
    }
}

impl Drop for EnableUring {
    fn drop(&mut self) {
        let _ = std::fs::write(ENABLE, &self.before);
    }
}

/// Every batch file of an epoch folder, by name.
fn epoch_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().into_string().unwrap(), std::fs::read(e.path()).unwrap())
        })
        .collect();
    out.sort();
    out
}

#[test]
fn a_mount_over_fuse_rings_reads_every_byte_and_one_without_them_falls_back_to_dev_fuse() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Files, 600, 8_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let want_raw = crate::raw::tree(&fx.path);
    let want_samples = crate::shuffled::tree(&fx.path);
    let (_plain_dir, plain) = common::mount(&server, "d", "batch_size=16");
    let want_epoch = epoch_files(&plain.mountpoint.join("epoch-0000"));
    assert!(!want_epoch.is_empty());

    for rings in [true, false] {
        let Some(_set) = EnableUring::set(rings) else { return };
        let (_dir, mounted) = common::mount(&server, "d", "batch_size=16,fuse_uring=on,supervise=false");
        let at = &mounted.mountpoint;
        assert!(crate::raw::tree(&at.join("raw")) == want_raw, "raw/ differs (rings {rings})");
        assert!(epoch_files(&at.join("epoch-0000")) == want_epoch, "epoch-0000 differs (rings {rings})");
        if let Some(got) = crate::shuffled::imagefolder(&at.join("shuffled"), 1) {
            let (samples, _) = crate::shuffled::epoch_of(got["records"].as_array().unwrap(), 0);
            assert_eq!(samples, want_samples, "shuffled/: every sample once (rings {rings})");
        }
        let stats = common::mount_stats(at);
        assert_eq!(stats["errors"], 0, "{stats}");
        let ring_opens = stats["ring_opens"].as_u64().unwrap();
        match rings {
            true => assert!(ring_opens >= 600, "the opens came over the rings: {stats}"),
            false => assert_eq!(ring_opens, 0, "no rings where the kernel offers none: {stats}"),
        }
        drop(mounted);
        if rings {
            // A ring's threads keep one of them free while the others' reads wait out an outage.
            crate::mount::outage_leaves_the_stats_file_and_listings_answered(",fuse_uring=on,supervise=false");
        }
    }
    drop(plain);
    rt.block_on(server.running.shutdown());
}

/// The first CPU this process may run on.
fn first_cpu() -> usize {
    // SAFETY: a zeroed cpu_set_t is valid; sched_getaffinity fills it, and CPU_ISSET reads within it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set), 0);
        (0..libc::CPU_SETSIZE as usize).find(|&c| libc::CPU_ISSET(c, &set)).expect("a CPU to run on")
    }
}

/// The kernel queues a request that finds none of its CPU's ring entries idle, and only a commit on that
/// CPU's queue takes it: behind lanes that all wait out an outage, it would wait with them. Readers all
/// on one CPU (the first this process may use), let go at once: half read batch files while the server is
/// down, half read the stats file. Every stats read is answered within seconds while the batch reads
/// wait, and every batch reads whole once the server is back. With lanes grown as they were before (one,
/// when a CPU's last idle one is taken), no stats read was answered without the watchdog (3 runs of 3),
/// and all were with it (in 1-6 s, 8 runs of 8 beside two CPU hogs); growing ahead, the lanes leave a
/// queued request rare, and this holds the watchdog to it where there is one.
#[test]
fn a_burst_on_one_cpu_behind_reads_that_wait_is_answered_over_rings() {
    const READERS: usize = 128;
    let Some(_set) = EnableUring::set(true) else { return };
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Lmdb, 2 * READERS as u32, 4000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let addr = server.running.local_addr();
    let m = common::manifest_of(&rt, &server, "d", 0, "batch_size=2");
    let options = "batch_size=2,prefetch=0,timeout=60s,threads=2,fuse_uring=on,supervise=false";
    let (_dir, mounted) = common::mount(&server, "d", options);
    let (epoch, stats_file) = (mounted.mountpoint.join("epoch-0000"), mounted.mountpoint.join(".batchfs/stats"));
    assert_eq!(std::fs::read_dir(&epoch).unwrap().count(), 2 * m.batches.len(), "listed: the manifest is here");
    std::fs::read(&stats_file).unwrap();
    rt.block_on(server.running.shutdown());
    let go = Arc::new(Barrier::new(READERS));
    let (answered, answers) = mpsc::channel();
    let cpu = first_cpu();
    let readers: Vec<_> = (0..READERS)
        .map(|i| {
            let (go, answered) = (go.clone(), answered.clone());
            let path = match i % 2 {
                0 => epoch.join(format!("batch-{:06}.tfrecord", i / 2)),
                _ => stats_file.clone(),
            };
            std::thread::spawn(move || {
                batchfs_lab::floor::pin(cpu).unwrap();
                go.wait();
                let at = Instant::now();
                let read = std::fs::read(&path);
                if i % 2 == 1 {
                    let _ = answered.send(at.elapsed());
                }
                read
            })
        })
        .collect();
    let mut stats_reads = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    while stats_reads.len() < READERS / 2 {
        match answers.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(took) => stats_reads.push(took),
            Err(_) => break,
        }
    }
    let waiting = (0..READERS).step_by(2).filter(|&i| !readers[i].is_finished()).count();
    // The server is back before anything is asserted: a failing check must not leave readers blocked on
    // this process's own mount.
    let server = rt.block_on(common::serve_on(addr, &[("d", &fx.path)]));
    let read: Vec<_> = readers.into_iter().map(|r| r.join().unwrap()).collect();
    let stats = common::mount_stats(&mounted.mountpoint);
    assert_eq!(
        stats_reads.len(),
        READERS / 2,
        "every stats read answered while the batch reads wait (answered in {stats_reads:?}; {stats})"
    );
    assert_eq!(waiting, READERS / 2, "the batch reads waited for the server");
    for (i, body) in read.into_iter().enumerate() {
        match i % 2 {
            0 => assert_eq!(batchfs::crc::crc32c(&body.unwrap()), m.batches[i / 2].crc32c, "batch {}", i / 2),
            _ => assert!(serde_json::from_slice::<serde_json::Value>(&body.unwrap()).is_ok()),
        }
    }
    assert!(stats["ring_opens"].as_u64().unwrap() > 0, "the opens came over the rings: {stats}");
    eprintln!("stats reads answered in {stats_reads:?}; watchdog requests {}", stats["ring_kicks"]);
    drop(mounted);
    rt.block_on(server.running.shutdown());
}
