//! One versioned snapshot shared by every shard, and the per-shard cache
//! that reads it without a lock on the request path: the writer (rare:
//! agent arrivals, reloads) swaps a new `Arc` and bumps the version; a
//! shard takes the lock only when the version it cached has moved. Used
//! for the model directory and the policies; the key registry and the
//! sibling map will use it too.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// A value replaced whole, with a version that moves on every change.
pub struct Versioned<T> {
    current: RwLock<Arc<T>>,
    version: AtomicU64,
}

impl<T> Versioned<T> {
    /// Start with `value` at version 0.
    pub fn new(value: T) -> Self {
        Versioned {
            current: RwLock::new(Arc::new(value)),
            version: AtomicU64::new(0),
        }
    }

    /// The current value (takes the read lock: not for the request path;
    /// shards read through a [`Cached`]).
    pub fn load(&self) -> Arc<T> {
        match self.current.read() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// The version now.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Replace the value.
    pub fn store(&self, value: T) {
        let mut g = match self.current.write() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        *g = Arc::new(value);
        self.version.fetch_add(1, Ordering::Release);
    }
}

impl<T: Clone> Versioned<T> {
    /// Copy-on-write change under the write lock (one writer at a time).
    pub fn update<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let mut g = match self.current.write() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        let mut next = (**g).clone();
        let r = f(&mut next);
        *g = Arc::new(next);
        self.version.fetch_add(1, Ordering::Release);
        r
    }
}

/// One shard's copy of a [`Versioned`] value.
pub struct Cached<T> {
    seen: Cell<u64>,
    value: RefCell<Option<Arc<T>>>,
}

impl<T> Default for Cached<T> {
    fn default() -> Self {
        Cached {
            seen: Cell::new(0),
            value: RefCell::new(None),
        }
    }
}

impl<T> Cached<T> {
    /// Read the current value, refreshing the copy only when the version
    /// moved (no shared write on the request path).
    pub fn with<R>(&self, src: &Versioned<T>, f: impl FnOnce(&T) -> R) -> R {
        let v = src.version();
        let mut slot = self.value.borrow_mut();
        let stale = slot.is_none() || self.seen.get() != v;
        if stale {
            *slot = Some(src.load());
            self.seen.set(v);
        }
        match slot.as_deref() {
            Some(t) => f(t),
            None => f(&src.load()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_follows_versions() {
        let src = Versioned::new(1u32);
        let c = Cached::default();
        assert_eq!(c.with(&src, |v| *v), 1);
        src.store(2);
        assert_eq!(c.with(&src, |v| *v), 2);
        src.update(|v| *v += 5);
        assert_eq!(c.with(&src, |v| *v), 7);
        assert_eq!(src.version(), 2);
    }
}
