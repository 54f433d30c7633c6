//! The page cache of closed files, dropped off the FUSE threads (`page_cache=drop`): a release hands its
//! inode to one background thread, which asks the kernel ([`Kernel::drop_pages`],
//! `FUSE_NOTIFY_INVAL_INODE` in a mount) to drop it.
//!
//! **Why not on the FUSE thread.** The kernel's invalidation waits for the locks of pages that readahead
//! READs of the same inode hold, and only a FUSE thread reading `/dev/fuse` answers those READs. A FUSE
//! thread that sent the invalidation itself could wait on a READ that no thread is free to take: with
//! every FUSE thread in such a release (`threads` is the CPU count by default, 1 or 2 in a small pod),
//! the whole mount hangs. So a FUSE thread never waits here: it queues the inode (an unbounded channel
//! whose send never blocks) and goes back to reading requests. If the thread cannot be started (a pids
//! limit), the drop is skipped with a log, never made on the FUSE thread; the next release tries again.

use super::open_files::Kernel;
use crate::stats::Stats;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};

/// The background thread's name.
pub const THREAD: &str = "batchfs-drop";

/// A page drop asked for: the inode, and the counters that count it.
type Asked = (u64, Arc<Stats>);

/// Where the page drops of closed files are sent: the thread that makes them, started at the first.
pub struct PageDrops {
    kernel: Arc<dyn Kernel>,
    /// The thread's queue, once it runs (it ends when this is dropped).
    queue: Mutex<Option<Sender<Asked>>>,
}

impl PageDrops {
    pub fn new(kernel: Arc<dyn Kernel>) -> Self {
        PageDrops { kernel, queue: Mutex::new(None) }
    }

    /// Has the page cache of `ino` dropped, soon, counted in `stats` (`page_cache_drops`); never waits for
    /// the kernel.
    pub fn drop_pages(&self, ino: u64, stats: Arc<Stats>) {
        let mut queue = self.queue.lock().expect("page drops");
        if let Some(tx) = queue.as_ref() {
            if tx.send((ino, stats.clone())).is_ok() {
                return;
            }
        }
        let (tx, rx) = channel::<Asked>();
        let kernel = self.kernel.clone();
        let spawned = std::thread::Builder::new().name(THREAD.into()).spawn(move || {
            for (ino, stats) in rx {
                match kernel.drop_pages(ino) {
                    Ok(()) => Stats::add(&stats.page_cache_drops, 1),
                    Err(e) => tracing::debug!(ino, error = %e, "cannot drop the page cache of a closed file"),
                }
            }
        });
        match spawned {
            Ok(_) => {
                // The receiver lives as long as the thread: the send cannot fail.
                let _ = tx.send((ino, stats));
                *queue = Some(tx);
            }
            Err(e) => {
                tracing::warn!(ino, error = %e, "cannot start the thread that drops closed files' page cache: kept")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::sync::{Condvar, Mutex};
    use std::time::{Duration, Instant};

    /// A kernel whose page drops wait until `open` is set, as an invalidation waits on a locked page.
    #[derive(Default)]
    struct Held {
        open: (Mutex<bool>, Condvar),
        /// The inodes dropped, and on which thread.
        dropped: Mutex<Vec<(u64, Option<String>)>>,
    }

    impl Kernel for Held {
        fn open_backing(&self, _: &File) -> std::io::Result<u32> {
            unreachable!()
        }

        fn close_backing(&self, _: u32) -> std::io::Result<()> {
            unreachable!()
        }

        fn drop_pages(&self, ino: u64) -> std::io::Result<()> {
            let (lock, cv) = &self.open;
            let mut open = lock.lock().unwrap();
            while !*open {
                open = cv.wait(open).unwrap();
            }
            self.dropped.lock().unwrap().push((ino, std::thread::current().name().map(str::to_owned)));
            Ok(())
        }
    }

    /// A release's page drop is made on the background thread, not the caller's (a FUSE thread): the
    /// caller returns at once while the kernel's invalidation waits, and every drop is made and counted,
    /// in order, once it stops waiting. Made on the caller, as before, the first call would not return.
    #[test]
    fn page_drops_run_on_their_thread_and_never_hold_the_caller() {
        let kernel = Arc::new(Held::default());
        let drops = PageDrops::new(kernel.clone());
        let stats = Arc::new(Stats::default());
        let (tx, rx) = std::sync::mpsc::channel();
        let caller = {
            let stats = stats.clone();
            std::thread::spawn(move || {
                for ino in [7, 8, 9] {
                    drops.drop_pages(ino, stats.clone());
                }
                tx.send(()).unwrap();
                drops
            })
        };
        rx.recv_timeout(Duration::from_secs(10)).expect("the caller waited on the kernel's invalidation");
        assert!(kernel.dropped.lock().unwrap().is_empty());
        *kernel.open.0.lock().unwrap() = true;
        kernel.open.1.notify_all();
        let deadline = Instant::now() + Duration::from_secs(10);
        while stats.page_cache_drops.load(std::sync::atomic::Ordering::Relaxed) < 3 {
            assert!(Instant::now() < deadline, "{:?}", kernel.dropped.lock().unwrap());
            std::thread::sleep(Duration::from_millis(5));
        }
        let thread = Some(THREAD.to_owned());
        assert_eq!(*kernel.dropped.lock().unwrap(), [(7, thread.clone()), (8, thread.clone()), (9, thread)]);
        drop(caller.join().unwrap());
    }
}
