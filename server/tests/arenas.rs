//! The server caps glibc's malloc arenas (`policy::limit_malloc_arenas`): threads that allocate at once
//! then share at most that many, where each had one of its own. A test binary of its own, so that no
//! other test's threads made arenas before the cap.

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn threads_allocating_at_once_share_at_most_the_capped_arenas() {
    use std::sync::{Arc, Barrier};

    /// The arenas malloc has made in this process, as `malloc_info` lists them.
    fn arenas() -> usize {
        let dir = tempfile::tempdir().unwrap();
        let path = std::ffi::CString::new(dir.path().join("info.xml").to_str().unwrap()).unwrap();
        // SAFETY: a file opened for writing, handed to malloc_info, then closed.
        unsafe {
            let file = libc::fopen(path.as_ptr(), c"w".as_ptr());
            assert!(!file.is_null());
            assert_eq!(libc::malloc_info(0, file), 0);
            libc::fclose(file);
        }
        std::fs::read_to_string(dir.path().join("info.xml")).unwrap().matches("<heap nr=").count()
    }

    if std::env::var_os("MALLOC_ARENA_MAX").is_some() || std::env::var_os("GLIBC_TUNABLES").is_some() {
        eprintln!("skipped: the environment sets malloc's arenas");
        return;
    }
    let before = arenas();
    let cap = batchfs_server::policy::limit_malloc_arenas().expect("the cap set");
    assert!((2..=8).contains(&cap), "{cap}");
    // 24 threads allocating at once: without the cap, glibc gives each its own arena (up to 8 per CPU).
    let barrier = Arc::new(Barrier::new(24));
    let threads: Vec<_> = (0..24)
        .map(|i| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                let held: Vec<Vec<u8>> = (0..64).map(|k| vec![i as u8; 1000 + k * 100]).collect();
                barrier.wait();
                held.len()
            })
        })
        .collect();
    let made: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(made, 24 * 64);
    let after = arenas();
    assert!(after <= cap.max(before), "{after} arenas for a cap of {cap} ({before} before the cap)");
}
