//! Files whose reads timed out and none succeeded since, by a view's key for what the file holds (a
//! `shuffled/` sample, a `rolling/` name's epoch): at the file's last close the view gives it back, to be
//! served again ([`super::View::read_failed`]). `shuffled/` and `rolling/` keep one each.

use crate::sync::{AtomicBool, Mutex, Ordering};
use std::collections::HashSet;
use std::hash::Hash;

pub struct Undelivered<K> {
    keys: Mutex<HashSet<K>>,
    /// `keys` holds any: a read that succeeds, or a close, then looks it up (else it takes no lock).
    any: AtomicBool,
}

impl<K: Hash + Eq> Default for Undelivered<K> {
    fn default() -> Self {
        Undelivered { keys: Mutex::new(HashSet::new()), any: AtomicBool::new(false) }
    }
}

impl<K: Hash + Eq> Undelivered<K> {
    /// A read of `key`'s file timed out.
    pub fn failed(&self, key: K) {
        self.keys.lock().expect("undelivered").insert(key);
        self.any.store(true, Ordering::Release);
    }

    /// A read of `key`'s file succeeded: it is delivered, whatever reads of it failed before.
    pub fn succeeded(&self, key: &K) {
        self.take(key);
    }

    /// `key`'s file was closed for the last time: whether every read of it since one failed failed too
    /// (then it is to be given back; it is forgotten here either way).
    pub fn take(&self, key: &K) -> bool {
        if !self.any.load(Ordering::Acquire) {
            return false;
        }
        let mut keys = self.keys.lock().expect("undelivered");
        let failed = keys.remove(key);
        self.any.store(!keys.is_empty(), Ordering::Release);
        failed
    }
}
