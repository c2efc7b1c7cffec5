//! The per-model capacity queue's ordering (pure): FIFO by arrival
//! sequence, bounded on entry, and a waiter that loses the race for a
//! freed slot goes back to its original place, ahead of later arrivals.

use std::collections::BTreeMap;

/// Waiters ordered by arrival.
#[derive(Debug)]
pub struct WaitQueue<T> {
    items: BTreeMap<u64, T>,
    next: u64,
}

impl<T> Default for WaitQueue<T> {
    fn default() -> Self {
        WaitQueue {
            items: BTreeMap::new(),
            next: 0,
        }
    }
}

impl<T> WaitQueue<T> {
    /// Waiters queued.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// A new arrival, unless `bound` waiters are already queued (0: no queue).
    pub fn push(&mut self, item: T, bound: usize) -> Result<u64, T> {
        if self.items.len() >= bound {
            return Err(item);
        }
        let seq = self.next;
        self.next += 1;
        self.items.insert(seq, item);
        Ok(seq)
    }

    /// Put a waiter back at its original place (not bounded: it was admitted).
    pub fn requeue(&mut self, seq: u64, item: T) {
        self.items.insert(seq, item);
    }

    /// The oldest waiter.
    pub fn pop_head(&mut self) -> Option<(u64, T)> {
        self.items.pop_first()
    }

    /// Everyone, oldest first.
    pub fn drain(&mut self) -> Vec<(u64, T)> {
        std::mem::take(&mut self.items).into_iter().collect()
    }

    /// Remove a waiter that gave up.
    pub fn remove(&mut self, seq: u64) -> Option<T> {
        self.items.remove(&seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fifo_bound_and_original_place() {
        let mut q = WaitQueue::default();
        let a = q.push("a", 3).expect("a");
        let _b = q.push("b", 3).expect("b");
        let _c = q.push("c", 3).expect("c");
        assert_eq!(q.push("d", 3), Err("d"));
        assert_eq!(q.pop_head(), Some((a, "a")));
        // "a" lost the race: it goes back ahead of b and c.
        q.requeue(a, "a");
        assert_eq!(
            q.drain().into_iter().map(|(_, v)| v).collect::<Vec<_>>(),
            vec!["a", "b", "c"]
        );
        assert_eq!(q.push("x", 0), Err("x"), "depth 0: no queue");
    }

    proptest! {
        /// Length never exceeds the bound through pushes; every item leaves
        /// exactly once; order is arrival order.
        #[test]
        fn each_leaves_once_in_order(ops in proptest::collection::vec(0u8..4, 0..200), bound in 0usize..10) {
            let mut q = WaitQueue::default();
            let mut pushed = 0u64;
            let mut left = Vec::new();
            for op in ops {
                match op {
                    0 | 1 => {
                        if q.push(pushed, bound).is_ok() {
                            pushed += 1;
                        }
                        prop_assert!(q.len() <= bound);
                    }
                    2 => {
                        if let Some((s, v)) = q.pop_head() {
                            left.push(v);
                            let _ = s;
                        }
                    }
                    _ => {
                        if let Some((s, v)) = q.pop_head() {
                            q.requeue(s, v);
                        }
                    }
                }
            }
            left.extend(q.drain().into_iter().map(|(_, v)| v));
            prop_assert_eq!(left.len() as u64, pushed);
            prop_assert!(left.windows(2).all(|w| w[0] < w[1]));
        }
    }
}
