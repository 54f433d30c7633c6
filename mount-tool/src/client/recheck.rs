//! The rechecks the HTTP client asks of its servers. A body whose bytes fail their checksum may come from a
//! server's disk tier copy written over in place, which it would serve again on every retry until `timeout`
//! (and every epoch after). So the client remembers, per request, the server that sent the bad bytes and the
//! byte ranges of the body that failed (from the last checkpoint that matched to the one that did not, or
//! the whole body or range where it had none), and sends the request's next attempt to that server, in
//! rotation or not, with the ranges in `x-batchfs-recheck`: the server checks its copies under them before
//! it answers and drops one whose bytes differ (docs/API.md). A body that fails again from the same server
//! is rechecked again at most [`ASKS`] times in all (a link that corrupts bytes is no copy's fault: the
//! attempts after go wherever the servers' health routes them); a body that arrives whole forgets it.

use super::ClientError;
use crate::buffers::FailedCheckpoint;
use std::collections::HashMap;
use std::sync::Mutex;

/// Rechecks asked per request (by path) whose bodies keep failing from the same server.
pub const ASKS: u32 = 3;

/// Requests remembered at once; past it the oldest hints are all forgotten (a lost hint costs only a recheck).
const HELD: usize = 256;

/// A request whose last body failed its checksum.
#[derive(Debug)]
struct Suspect {
    /// The server that sent it (its number in the client's list).
    server: usize,
    /// The body's bytes that failed, `[start, end)` of the whole body.
    span: (u64, u64),
    /// Rechecks asked of `server` for this request so far.
    asked: u32,
    /// The next attempt asks one.
    armed: bool,
}

/// The requests whose bodies failed their checksums, by path and query.
#[derive(Debug, Default)]
pub struct Suspects(Mutex<HashMap<String, Suspect>>);

impl Suspects {
    /// Server `server`'s body for `path` failed its checksum in the bytes `span` of the whole body.
    pub fn failed(&self, path: &str, server: usize, span: (u64, u64)) {
        let mut held = self.0.lock().expect("suspects");
        if held.len() >= HELD && !held.contains_key(path) {
            held.clear();
        }
        let suspect = held.entry(path.to_owned()).or_insert(Suspect { server, span, asked: 0, armed: false });
        if suspect.server != server {
            *suspect = Suspect { server, span, asked: 0, armed: false };
        }
        suspect.span = span;
        suspect.armed = suspect.asked < ASKS;
    }

    /// For the next attempt of `path` whose last body failed: the server to send it to and the value of its
    /// `x-batchfs-recheck` header; once per failure.
    pub fn take(&self, path: &str) -> Option<(usize, String)> {
        let mut held = self.0.lock().expect("suspects");
        let suspect = held.get_mut(path).filter(|s| s.armed)?;
        suspect.armed = false;
        suspect.asked += 1;
        Some((suspect.server, batchfs::api::format_recheck(&[suspect.span])))
    }

    /// `path`'s body came whole: nothing to recheck.
    pub fn passed(&self, path: &str) {
        self.0.lock().expect("suspects").remove(path);
    }
}

/// The bytes of the whole body that the failed attempt `e` (of a body or range starting at `from`) says
/// failed a checkpoint, if it says so.
pub fn failed_span(e: &ClientError, from: u64) -> Option<(u64, u64)> {
    let ClientError::Corrupt { cause, .. } = e else { return None };
    let failed = FailedCheckpoint::of(cause)?;
    Some((from + failed.start, from + failed.end))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failed body arms one recheck of its server for the next attempt; failing again from it re-arms it
    /// up to `ASKS` times; another server's failure starts over; a body that came whole forgets it.
    #[test]
    fn a_failed_body_asks_its_server_to_recheck_on_the_next_attempt_a_bounded_number_of_times() {
        let s = Suspects::default();
        assert_eq!(s.take("/b/0"), None);
        s.failed("/b/0", 1, (100, 200));
        assert_eq!(s.take("/b/0"), Some((1, "100-199".to_owned())));
        assert_eq!(s.take("/b/0"), None, "once per failure");
        for _ in 1..ASKS {
            s.failed("/b/0", 1, (0, 10));
            assert_eq!(s.take("/b/0"), Some((1, "0-9".to_owned())));
        }
        s.failed("/b/0", 1, (0, 10));
        assert_eq!(s.take("/b/0"), None, "at most ASKS rechecks of one server for one request");
        s.failed("/b/0", 0, (0, 10));
        assert_eq!(s.take("/b/0"), Some((0, "0-9".to_owned())), "another server's bad body is its own");
        s.failed("/b/1", 0, (5, 6));
        s.passed("/b/1");
        assert_eq!(s.take("/b/1"), None);
        let checkpoint = FailedCheckpoint { start: 10, end: 20, got: 1, want: 2 };
        let e = ClientError::appending("s", std::io::Error::new(std::io::ErrorKind::InvalidData, checkpoint));
        assert_eq!(failed_span(&e, 1000), Some((1010, 1020)));
        let short = ClientError::appending("s", std::io::Error::new(std::io::ErrorKind::InvalidData, "past"));
        assert_eq!(failed_span(&short, 0), None, "no checkpoint failed: nothing named");
    }
}
