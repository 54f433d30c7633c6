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
        let (mut held, mut refused) = (Held { framing: self.clone(), bytes: 0 }, 0);
        let (charged, found) = build(&mut |bytes| {
            let ok = self.take(bytes);
            *if ok { &mut held.bytes } else { &mut refused } += bytes;
            ok
        })?;
        // What the layout would have held with the step refused: past the whole budget, it never fits.
        let needed = held.bytes + refused;
        let (what, limit) = (what.to_owned(), self.limit);
        match charged {
            Ok((layout, _)) => Ok((layout, held, found)),
            Err(_) if needed > limit => Err(Refused::TooLarge { what, needed, limit }.into()),
            Err(_) => Err(Refused::Busy { what, limit }.into()),
        }
    }
}

/// Why a layout was not built.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// Larger than the whole budget: never served (400).
    #[error(
        "{what}: its layout (the framing of each sample, and where its bytes are) takes over {} KiB of memory, \
         more than this server's framing_memory ({} KiB) allows a body: ask for a smaller batch_size",
        needed >> 10,
        limit >> 10
    )]
    TooLarge { what: String, needed: u64, limit: u64 },
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

    /// A layout asking for `steps` of `step` bytes each.
    fn asking(steps: u64, step: u64) -> impl FnOnce(&mut dyn FnMut(u64) -> bool) -> Result<(Charged, ()), Refused> {
        move |charge| {
            for i in 0..steps {
                if !charge(step) {
                    return Ok((Err(i * step), ()));
                }
            }
            let layout = BatchLayout { segments: Vec::new(), len: 0, crc32c: 0, checkpoints: Vec::new() };
            Ok((Ok((layout, steps * step)), ()))
        }
    }

    #[test]
    fn layouts_hold_the_budget_until_dropped_and_the_too_large_are_refused_for_good() {
        let framing = Framing::new(1000, Arc::new(Metrics::default()));
        let used = || framing.used().load(Ordering::Relaxed);
        let (_, first, ()) = framing.build("a", asking(3, 200)).unwrap();
        assert_eq!(used(), 600);
        // Beside the first, a second of 600 bytes does not fit: retried later.
        let busy = framing.build("b", asking(3, 200)).unwrap_err();
        assert!(matches!(&busy, Refused::Busy { what, limit: 1000 } if what == "b"), "{busy:?}");
        assert_eq!(used(), 600, "what the refused one took is given back");
        drop(first);
        assert_eq!(used(), 0);
        let (_, second, ()) = framing.build("b", asking(3, 200)).unwrap();
        drop(second);
        // Larger than the whole budget: never served, said so.
        let never = framing.build("batch 0 of epoch 0", asking(6, 200)).unwrap_err();
        assert!(matches!(never, Refused::TooLarge { needed: 1200, limit: 1000, .. }), "{never:?}");
        let text = never.to_string();
        assert!(text.starts_with("batch 0 of epoch 0: its layout") && text.contains("batch_size"), "{text}");
        assert_eq!(used(), 0);
    }
}
