//! What a batchfs process sets for itself at its start: the limit of open files, and its logs.

/// The process's soft limit of open files now (`RLIMIT_NOFILE`); `u64::MAX` where it has none.
pub fn open_files_limit() -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit only writes the struct passed, which lives for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 || limit.rlim_cur == libc::RLIM_INFINITY {
        return u64::MAX;
    }
    limit.rlim_cur
}

/// Raises the process's soft limit of open files to its hard limit, the most it may have, where a login's
/// soft limit is often 1,024: a server keeps a descriptor per shard it reads by positioned reads (and per
/// mapped shard with `sendfile`) besides its sockets; a mount, one per memory file that holds a cached
/// object for passthrough. Children inherit it. Returns the soft limit now.
pub fn raise_open_files_limit() -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed, which lives for the calls.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max {
            let from = limit.rlim_cur;
            limit.rlim_cur = limit.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                tracing::debug!(from, to = limit.rlim_max, "raised the limit of open files");
            }
        }
    }
    open_files_limit()
}

/// Sends the process's logs (`RUST_LOG`, else `default`) to `file`, else to stderr, in colour only on a
/// terminal (journald, `kubectl logs` and redirected logs get plain text). A log write that fails is
/// dropped: tracing reported it by `eprintln!`, which panics where stderr is a pipe whose reader is gone
/// (`| head`, a log shipper that died), and the thread that logged (a server's indexing, its signal
/// handler) died with it. Does nothing where logs are already set up (a test's).
pub fn init_logs(default: &str, file: Option<std::fs::File>) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).log_internal_errors(false);
    let _ = match file {
        Some(file) => builder.with_ansi(false).with_writer(std::sync::Mutex::new(file)).try_init(),
        None => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr)
            .try_init(),
    };
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let now = super::raise_open_files_limit();
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit only writes the struct passed, which lives for the call.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
        assert_eq!(limit.rlim_cur, limit.rlim_max);
        assert_eq!(now, if limit.rlim_cur == libc::RLIM_INFINITY { u64::MAX } else { limit.rlim_cur });
    }
}
