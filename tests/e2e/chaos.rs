//! The small chaos test: four reader threads read whole epochs through a mount while `batchfs-lab netem`
//! flips bits, cuts connections mid-body, stalls them and takes the link down for a while, and the
//! server is killed and restarted on its address. Every file read equals the server's batch byte for
//! byte (its manifest's size and CRC32C); every flip that reached a body was caught (`checksum_errors`),
//! and every read completed. Run twice: with passthrough (the kernel serves each verified batch whole)
//! and through the daemon (reads may get a batch's prefix verified by its checkpoints before the rest
//! has arrived, so flips land in bodies some of whose bytes were already read). The long version is
//! `tests/bench/chaos_bench.sh`.

use crate::common::{self, fixture, runtime, serve, ServeWith};
use batchfs::api::{self, Manifest};
use batchfs::crc;
use batchfs::index::SourceFormat;
use batchfs_lab::netem::{start_with_faults, Faults, Link};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

#[test]
fn readers_get_every_byte_right_through_flips_cuts_stalls_outages_and_a_restart() {
    chaos("passthrough=true");
}

#[test]
fn readers_through_the_daemon_get_every_byte_right_through_the_same_chaos() {
    chaos("passthrough=false");
}

fn chaos(read_path: &str) {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 480, 40_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let addr = server.running.local_addr();
    let faults = Faults {
        corrupt_every: Some(3 << 20),
        reset_every: Some(6 << 20),
        stall_every: Some(4 << 20),
        stall: Duration::from_millis(300),
        down: Some((Duration::from_millis(2500), Duration::from_millis(1000))),
        seed: 11,
    };
    // 80 Mbit/s: the 57 MB of three epochs take ~6 s, so the outage and the restart land mid-read.
    let link = Link {
        one_way: Duration::from_millis(1),
        jitter: Duration::ZERO,
        rate: Some(10e6),
        queue: batchfs_lab::netem::QUEUE,
    };
    let netem = start_with_faults("127.0.0.1:0".parse().unwrap(), addr, link, faults).unwrap();
    let epochs = 3;
    let options = format!("batch_size=16,epochs={epochs},cache=64M,stall_timeout=2s,{read_path}");
    let (_dir, mounted) = common::mount_url(&format!("http://{}/d", netem.addr), &options);

    let client = common::h2c();
    let manifests: Vec<Manifest> = (0..epochs)
        .map(|e| {
            let url = format!("{}{}?batch_size=16", server.base, api::manifest_path("d", e));
            rt.block_on(async { client.get(url).send().await.unwrap().json().await.unwrap() })
        })
        .collect();
    // The server is killed and comes back on its address partway through.
    let restart = std::thread::spawn({
        let path = fx.path.clone();
        let running = server.running;
        move || {
            std::thread::sleep(Duration::from_millis(3500));
            let rt = runtime();
            rt.block_on(running.shutdown());
            std::thread::sleep(Duration::from_millis(800));
            let server = rt.block_on(common::serve_on(addr, &[("d", &path)]));
            (rt, server)
        }
    });
    let started = Instant::now();
    let readers = 4;
    for (e, manifest) in manifests.iter().enumerate() {
        let epoch = mounted.mountpoint.join(format!("epoch-{e:04}"));
        std::thread::scope(|s| {
            for r in 0..readers {
                let epoch = &epoch;
                s.spawn(move || {
                    for entry in manifest.batches.iter().skip(r).step_by(readers) {
                        let path = epoch.join(format!("batch-{:06}.tfrecord", entry.index));
                        let body = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                        assert_eq!(body.len() as u64, entry.bytes, "{}", path.display());
                        assert_eq!(crc::crc32c(&body), entry.crc32c, "{}: a wrong byte", path.display());
                    }
                });
            }
        });
    }
    let elapsed = started.elapsed();
    let (rt2, server2) = restart.join().unwrap();
    let stats = common::mount_stats(&mounted.mountpoint);
    let n = |k: &str| stats[k].as_u64().unwrap();
    let f = &netem.faults;
    eprintln!("chaos ({read_path}): {} in {elapsed:?}; mount {stats}", f.summary());
    assert!(f.corruptions.load(Ordering::Relaxed) > 0 && f.resets.load(Ordering::Relaxed) > 0, "{}", f.summary());
    assert!(f.stalls.load(Ordering::Relaxed) > 0 && f.cut_by_down.load(Ordering::Relaxed) > 0, "{}", f.summary());
    assert!(elapsed > Duration::from_millis(4500), "the reads must outlast the restart: {elapsed:?}");
    assert!(n("retries") > 0, "{stats}");
    assert!(n("checksum_errors") > 0, "flips in bodies must be caught: {stats}");
    assert_eq!(n("errors"), 0, "every read completed: {stats}");
    drop(mounted);
    rt2.block_on(server2.running.shutdown());
}
