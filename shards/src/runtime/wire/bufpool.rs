//! Byte buffers reused from request to request on this thread: a
//! request's body, the request bytes sent to the agent, the agent
//! stream's read buffer and the response written to the client were each
//! a fresh heap allocation per proxied request. Buffers come back when
//! they are written or done with ([`give`], [`Pooled`]); at most
//! [`MAX_BUFS`] and [`MAX_BYTES`] are kept per thread, none over
//! [`MAX_ONE`], and a buffer is only handed out for a size it does not
//! exceed by much (body budgets count the size asked for, not the
//! capacity). A full pool drops its oldest buffers for a new one, so a
//! few large buffers that no request takes cannot block it.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ops::{Deref, DerefMut};

/// Buffers kept per thread.
pub const MAX_BUFS: usize = 64;
/// Capacity kept per thread, all buffers together.
pub const MAX_BYTES: usize = 4 << 20;
/// Larger buffers are freed, not kept.
pub const MAX_ONE: usize = 1 << 20;
/// How many of the newest buffers [`take`] looks at.
const LOOK: usize = 8;

#[derive(Default)]
struct Pool {
    /// Oldest first.
    bufs: VecDeque<Vec<u8>>,
    bytes: usize,
}

thread_local! {
    static POOL: RefCell<Pool> = RefCell::new(Pool::default());
}

/// Whether a buffer of capacity `cap` may serve a request for `min`.
fn fits(cap: usize, min: usize) -> bool {
    cap >= min && cap <= min.saturating_mul(4).max(16 * 1024)
}

/// An empty buffer with room for at least `min` bytes.
pub fn take(min: usize) -> Vec<u8> {
    let found = POOL.with(|p| {
        let mut p = p.borrow_mut();
        let n = p.bufs.len();
        let i = (n.saturating_sub(LOOK)..n)
            .rev()
            .find(|&i| p.bufs.get(i).is_some_and(|b| fits(b.capacity(), min)))?;
        let b = p.bufs.swap_remove_back(i)?;
        p.bytes = p.bytes.saturating_sub(b.capacity());
        Some(b)
    });
    found.unwrap_or_else(|| Vec::with_capacity(min))
}

/// Give a buffer back (its contents are dropped).
pub fn give(mut b: Vec<u8>) {
    let cap = b.capacity();
    if cap == 0 || cap > MAX_ONE {
        return;
    }
    b.clear();
    POOL.with(|p| {
        let mut p = p.borrow_mut();
        while p.bufs.len() >= MAX_BUFS || p.bytes + cap > MAX_BYTES {
            let Some(old) = p.bufs.pop_front() else { break };
            p.bytes = p.bytes.saturating_sub(old.capacity());
        }
        p.bytes += cap;
        p.bufs.push_back(b);
    });
}

/// A buffer that goes back to the pool when dropped.
#[derive(Default)]
pub struct Pooled(Vec<u8>);

impl Pooled {
    /// An empty pooled buffer with room for `min` bytes.
    pub fn with_capacity(min: usize) -> Self {
        Pooled(take(min))
    }
}

impl From<Vec<u8>> for Pooled {
    fn from(b: Vec<u8>) -> Self {
        Pooled(b)
    }
}

impl Deref for Pooled {
    type Target = Vec<u8>;

    fn deref(&self) -> &Vec<u8> {
        &self.0
    }
}

impl DerefMut for Pooled {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.0
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        give(std::mem::take(&mut self.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept() -> (usize, usize) {
        POOL.with(|p| {
            let p = p.borrow();
            (p.bufs.len(), p.bytes)
        })
    }

    #[test]
    fn a_given_buffer_is_taken_again_without_an_allocation() {
        let mut b = take(1000);
        b.extend_from_slice(b"request bytes");
        let ptr = b.as_ptr();
        give(b);
        let again = take(900);
        assert_eq!(again.as_ptr(), ptr, "the same allocation");
        assert!(again.is_empty(), "contents are dropped");
        give(again);
        // Much smaller requests get a fresh buffer, not a 4x larger one.
        let big = take(100_000);
        give(big);
        let small = take(100);
        assert!(small.capacity() < 100_000);
    }

    #[test]
    fn the_pool_is_bounded() {
        std::thread::spawn(|| {
            for _ in 0..MAX_BUFS + 10 {
                give(Vec::with_capacity(1024));
            }
            assert_eq!(kept().0, MAX_BUFS);
            give(Vec::with_capacity(MAX_ONE + 1));
            assert_eq!(kept().0, MAX_BUFS, "too large to keep");
            for _ in 0..10 {
                give(Vec::with_capacity(MAX_ONE));
            }
            let (n, bytes) = kept();
            assert!(bytes <= MAX_BYTES, "{bytes}");
            assert_eq!(n, MAX_BYTES / MAX_ONE, "the newest large ones");
        })
        .join()
        .expect("thread");
    }

    #[test]
    fn large_buffers_nobody_takes_do_not_block_the_pool() {
        std::thread::spawn(|| {
            // Filled by large responses, then only small requests.
            for _ in 0..MAX_BYTES / MAX_ONE {
                give(Vec::with_capacity(MAX_ONE));
            }
            let small = take(600);
            assert!(small.capacity() < MAX_ONE);
            give(small);
            // (Not by address: the allocator may hand the same block out
            // again after a drop.)
            let has_small =
                || POOL.with(|p| p.borrow().bufs.iter().any(|b| b.capacity() < MAX_ONE));
            assert!(has_small(), "the small buffer was kept");
            let again = take(600);
            assert!(!has_small(), "and is taken again");
            give(again);
            let dropped = Pooled::with_capacity(10);
            drop(dropped);
            assert!(kept().1 <= MAX_BYTES);
        })
        .join()
        .expect("thread");
    }
}
