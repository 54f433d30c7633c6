//! The memory the layouts of bodies take (`framing_memory`): a batch's layout holds its framing (a tar
//! member's 512-byte header and padding, a TFRecord frame's lengths and CRCs) and one segment per piece
//! before any byte of the body is sent, and for as long as the body is in flight. A batch of a million
//! small samples is a gigabyte of it; bodies in flight (`max_bodies_in_flight`) bound their count, not
//! their size. Each layout is charged here as it is built ([`batchfs::encode::layout_within`]) and given
//! back when its body is dropped, so that the layouts of every body together stay within the budget: one
//! larger than the whole budget is refused (400: the client asked for more than this server serves), one
//! that meets the others' charges waits for them (503, retried): [`Refused`].

use crate::metrics::Metrics;
use batchfs::encode::{BatchLayout, Charged};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The budget of the layouts' memory, shared by every body of a server.
pub struct Framing {
    limit: u64,
    /// Bytes held, in the `framing_bytes` gauge.
    metrics: Arc<Metrics>,
}

/// Bytes of [`Framing`] a body holds; given back when dropped.
pub struct Held {
    framing: Arc<Framing>,
    bytes: u64,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held").field("bytes", &self.bytes).finish()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.framing.used().fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl Framing {
    pub fn new(limit: u64, metrics: Arc<Metrics>) -> Arc<Framing> {
        Arc::new(Framing { limit, metrics })
    }

    /// Bytes the layouts of bodies in flight hold.
    fn used(&self) -> &AtomicU64 {
        &self.metrics.framing_bytes
    }

    /// Takes `bytes` of the budget, if that many are left.
    fn take(&self, bytes: u64) -> bool {
        self.used()
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                used.checked_add(bytes).filter(|&after| after <= self.limit)
            })
            .is_ok()
    }

    /// Builds a layout by `build`, which asks this budget for its memory through the function it is given
    /// (and says what else it found, `T`): the layout, what it holds of the budget and `T`, or why it was
    /// refused (`what` names the body: "batch 3 of epoch 0 of dataset \"d\"").
    pub fn build<T, E: From<Refused>>(
        self: &Arc<Self>,
        what: &str,
        build: impl FnOnce(&mut dyn FnMut(u64) -> bool) -> Result<(Charged, T), E>,
    ) -> Result<(BatchLayout, Held, T), E> {
        let (mut held, mut refused, most) = (Held { framing: self.clone(), bytes: 0 }, 0, self.body_limit());
        let (charged, found) = build(&mut |bytes| {
            let ok = held.bytes + bytes <= most && self.take(bytes);
            match ok {
                true => held.bytes += bytes,
                false => refused = bytes,
            }
            ok
        })?;
        // What the layout would have held with the last step refused (its first: all of it, counted before
        // it is built): past what a body may hold, it never fits.
        let needed = held.bytes + refused;
        let (what, limit) = (what.to_owned(), self.limit);
        match charged {
            Ok(layout) => Ok((layout, held, found)),
            Err(_) if needed > most => Err(Refused::TooLarge { what, needed, most }.into()),
            Err(_) => Err(Refused::Busy { what, limit }.into()),
        }
    }

    /// The most one body's layout may hold: a quarter of the budget, so that a client that leaves its bodies
    /// unread cannot hold it all with one.
    fn body_limit(&self) -> u64 {
        self.limit / 4
    }
}

/// Why a layout was not built.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// Larger than a body may hold: never served (400).
    #[error(
        "{what}: its layout (the framing of each sample, and where its bytes are) takes {} KiB of memory, more \
         than a body may hold ({} KiB, a quarter of this server's framing_memory): ask for a smaller batch_size",
        needed.div_ceil(1024),
        most >> 10
    )]
    TooLarge { what: String, needed: u64, most: u64 },
    /// The others' layouts hold what it needs: retried (503).
    #[error(
        "{what}: the layouts of the bodies in flight hold the server's framing_memory ({} KiB); retry shortly or \
         use another replica",
        limit >> 10
    )]
    Busy { what: String, limit: u64 },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layout asking for `bytes`, all at once, as [`batchfs::encode::layout_within`] asks first.
    fn asking(bytes: u64) -> impl FnOnce(&mut dyn FnMut(u64) -> bool) -> Result<(Charged, ()), Refused> {
        move |charge| match charge(bytes) {
            false => Ok((Err(bytes), ())),
            true => {
                let layout = BatchLayout { segments: Vec::new(), len: 0, crc32c: 0, checkpoints: Vec::new() };
                Ok((Ok(layout), ()))
            }
        }
    }

    /// Layouts hold the budget until dropped; one that meets the others' is retried (503), one larger than a
    /// body may hold (a quarter of the budget) is refused for good (400) however busy the budget is (it
    /// was a 503, retried until its client's timeout, while anything else was in flight).
    #[test]
    fn layouts_hold_the_budget_until_dropped_and_the_too_large_are_refused_for_good() {
        let framing = Framing::new(4000, Arc::new(Metrics::default()));
        let used = || framing.used().load(Ordering::Relaxed);
        let held: Vec<Held> = (0..4).map(|i| framing.build(&i.to_string(), asking(1000)).unwrap().1).collect();
        assert_eq!(used(), 4000);
        let busy = framing.build("b", asking(600)).unwrap_err();
        assert!(matches!(&busy, Refused::Busy { what, limit: 4000 } if what == "b"), "{busy:?}");
        let never = framing.build("batch 0 of epoch 0", asking(1200)).unwrap_err();
        assert!(matches!(never, Refused::TooLarge { needed: 1200, most: 1000, .. }), "{never:?}");
        let text = never.to_string();
        assert!(text.starts_with("batch 0 of epoch 0: its layout") && text.contains("batch_size"), "{text}");
        assert_eq!(used(), 4000, "what the refused ones took is given back");
        drop(held);
        assert_eq!(used(), 0);
        let (_, b, ()) = framing.build("b", asking(600)).unwrap();
        assert_eq!(used(), 600);
        drop(b);
        assert!(matches!(framing.build("alone", asking(1001)).unwrap_err(), Refused::TooLarge { .. }));
        assert_eq!(used(), 0);
    }
}
