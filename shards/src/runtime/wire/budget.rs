//! Router-wide memory bounds that one client cannot exceed: a budget of
//! buffered request-body bytes and a cap on client connections. Both are
//! shared atomics (the only cross-core writes on the request path, once per
//! request or connection); permits give their share back when dropped,
//! whatever path the request takes (hand-off, error, client gone).
//!
//! Key types: [`Budget`], [`BodyPermit`], [`ConnPermit`].

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// The shared counters and their limits.
#[derive(Debug)]
pub struct Budget {
    body_bytes: AtomicU64,
    max_body_bytes: u64,
    connections: AtomicUsize,
    max_connections: usize,
}

impl Budget {
    /// Limits: buffered body bytes and client connections (0: unlimited).
    pub fn new(max_body_bytes: u64, max_connections: usize) -> Arc<Self> {
        Arc::new(Budget {
            body_bytes: AtomicU64::new(0),
            max_body_bytes,
            connections: AtomicUsize::new(0),
            max_connections,
        })
    }

    /// Body bytes buffered now.
    pub fn body_bytes(&self) -> u64 {
        self.body_bytes.load(Ordering::Relaxed)
    }

    /// Client connections open now.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    /// A connection slot, or None at the cap.
    pub fn connection(self: &Arc<Self>) -> Option<ConnPermit> {
        let prev = self.connections.fetch_add(1, Ordering::AcqRel);
        if self.max_connections > 0 && prev >= self.max_connections {
            self.connections.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(ConnPermit(self.clone()))
    }

    /// A connection slot even at the cap: a connection another process
    /// accepted and handed over (issue 54) is not refused a second time.
    pub fn connection_forced(self: &Arc<Self>) -> ConnPermit {
        self.connections.fetch_add(1, Ordering::AcqRel);
        ConnPermit(self.clone())
    }

    /// An empty body permit, grown as bytes are buffered.
    pub fn body(self: &Arc<Self>) -> BodyPermit {
        BodyPermit {
            budget: self.clone(),
            bytes: 0,
        }
    }
}

/// A client connection's place under the cap.
#[derive(Debug)]
pub struct ConnPermit(Arc<Budget>);

impl Drop for ConnPermit {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Body bytes a request holds under the budget.
#[derive(Debug)]
pub struct BodyPermit {
    budget: Arc<Budget>,
    bytes: u64,
}

impl BodyPermit {
    /// Hold `total` bytes in all (no-op when already held); false when the
    /// budget cannot take them (nothing changes then).
    pub fn grow_to(&mut self, total: u64) -> bool {
        if total <= self.bytes {
            return true;
        }
        let more = total - self.bytes;
        let b = &self.budget;
        let prev = b.body_bytes.fetch_add(more, Ordering::AcqRel);
        if b.max_body_bytes > 0 && prev.saturating_add(more) > b.max_body_bytes {
            b.body_bytes.fetch_sub(more, Ordering::AcqRel);
            return false;
        }
        self.bytes = total;
        true
    }

    /// Give every byte back (the body is accounted elsewhere from now
    /// on: a held request's, by the hold limits).
    pub fn release(&mut self) {
        self.budget
            .body_bytes
            .fetch_sub(self.bytes, Ordering::AcqRel);
        self.bytes = 0;
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for BodyPermit {
    fn drop(&mut self) {
        self.budget
            .body_bytes
            .fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_hold_and_give_back() {
        let b = Budget::new(100, 2);
        let c1 = b.connection().expect("1");
        let _c2 = b.connection().expect("2");
        assert!(b.connection().is_none(), "at the cap");
        drop(c1);
        assert!(b.connection().is_some(), "a place freed");
        let mut p = b.body();
        assert!(p.grow_to(60));
        let mut q = b.body();
        assert!(!q.grow_to(41), "over the budget: refused");
        assert!(q.grow_to(40));
        assert_eq!(b.body_bytes(), 100);
        drop(p);
        assert_eq!(b.body_bytes(), 40);
        drop(q);
        assert_eq!(b.body_bytes(), 0);
    }
}
