//! A cache of values that are pure functions of their key and costly to compute (an epoch's manifest,
//! a slot table: seconds at a million samples): each is computed once however many requests ask for it
//! at the same time, and the last few used are kept.

use lru::LruCache;
use std::collections::HashSet;
use std::hash::Hash;
use std::num::NonZeroUsize;
use std::sync::{Arc, Condvar, Mutex};

pub struct Memo<K, V> {
    cache: Mutex<LruCache<K, Arc<V>>>,
    /// Keys being computed now: a second request for one waits for it rather than computing it again.
    computing: Mutex<HashSet<K>>,
    computed: Condvar,
}

impl<K: Hash + Eq + Clone, V> Memo<K, V> {
    /// A memo keeping the `kept` values used last.
    pub fn new(kept: usize) -> Self {
        Memo {
            cache: Mutex::new(LruCache::new(NonZeroUsize::new(kept.max(1)).expect("nonzero"))),
            computing: Mutex::new(HashSet::new()),
            computed: Condvar::new(),
        }
    }

    /// The value of `key`: cached, or computed by `compute` (once, while other callers for the same key
    /// wait for it). An error is returned to the caller that computed it and not kept: the next caller
    /// computes again.
    pub fn get_or_compute<E>(&self, key: K, compute: impl FnOnce() -> Result<V, E>) -> Result<Arc<V>, E> {
        let cached = || self.cache.lock().expect("memo cache").get(&key).cloned();
        let mut computing = self.computing.lock().expect("memo computing");
        loop {
            // Checked with `computing` held: a computation puts its value in the cache before it leaves
            // `computing`, so a value is either here, being computed, or for this thread to compute.
            if let Some(v) = cached() {
                return Ok(v);
            }
            if computing.insert(key.clone()) {
                break;
            }
            computing = self.computed.wait(computing).expect("memo computing");
        }
        drop(computing);
        // Leaves `computing` and wakes the waiters however the computation ends (a panic included).
        struct Done<'a, K: Hash + Eq, V>(&'a Memo<K, V>, Option<K>);
        impl<K: Hash + Eq, V> Drop for Done<'_, K, V> {
            fn drop(&mut self) {
                if let Some(key) = self.1.take() {
                    self.0.computing.lock().expect("memo computing").remove(&key);
                }
                self.0.computed.notify_all();
            }
        }
        let _done = Done(self, Some(key.clone()));
        let value = Arc::new(compute()?);
        self.cache.lock().expect("memo cache").put(key, value.clone());
        Ok(value)
    }

    /// Whether `key` is cached or being computed.
    pub fn has(&self, key: &K) -> bool {
        self.computing.lock().expect("memo computing").contains(key)
            || self.cache.lock().expect("memo cache").contains(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn concurrent_callers_share_one_computation_and_errors_are_not_kept() {
        let memo: Memo<u32, u32> = Memo::new(2);
        let runs = AtomicU32::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    let got = memo.get_or_compute(1, || {
                        runs.fetch_add(1, Ordering::Relaxed);
                        std::thread::sleep(std::time::Duration::from_millis(50));
                        Ok::<_, ()>(10)
                    });
                    assert_eq!(*got.unwrap(), 10);
                });
            }
        });
        assert_eq!(runs.load(Ordering::Relaxed), 1);
        assert!(memo.has(&1) && !memo.has(&2));
        assert_eq!(memo.get_or_compute(2, || Err::<u32, _>("no")), Err("no"));
        assert!(!memo.has(&2), "a failure leaves nothing behind");
        assert_eq!(*memo.get_or_compute(2, || Ok::<_, ()>(20)).unwrap(), 20);
    }
}
