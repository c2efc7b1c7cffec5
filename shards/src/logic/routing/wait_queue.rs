//! The per-model capacity queue's ordering (pure): FIFO by arrival
//! sequence, bounded on entry, and a waiter that loses the race for a
//! freed slot goes back to its original place, ahead of later arrivals.
//!
//! A slot freed on one agent may go to a later waiter that agent serves
//! from its cache ([`WaitQueue::pop_for`]): only within the first
//! [`LOOK_AHEAD`] waiters, and the head is passed over at most
//! [`MAX_PASSES`] times, so FIFO order bends by a bounded amount.

use std::collections::BTreeMap;

/// How many of the oldest waiters a freed slot looks at for one its
/// agent holds the prefix of.
pub const LOOK_AHEAD: usize = 64;

/// How many times the head may be passed over before a freed slot goes
/// to it whoever holds what.
pub const MAX_PASSES: u32 = 32;

/// The agents a waiter would rather take a slot on (the holders of its
/// cached prefix, at most four; none when it has no cache affinity).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prefer {
    agents: [u32; 4],
    len: u8,
}

impl Prefer {
    /// Up to four agents (truncated ids, as the affinity index keeps
    /// them); more are ignored.
    pub fn of(agents: impl IntoIterator<Item = u32>) -> Self {
        let mut p = Prefer::default();
        for a in agents {
            if let Some(s) = p.agents.get_mut(usize::from(p.len)) {
                *s = a;
                p.len += 1;
            }
        }
        p
    }

    /// Whether `agent` (a full id) is one of them.
    pub fn contains(&self, agent: u64) -> bool {
        self.agents
            .iter()
            .take(usize::from(self.len))
            .any(|&a| u64::from(a) == agent & 0xffff_ffff)
    }

    /// Whether it names no agent.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Waiters ordered by arrival.
#[derive(Debug)]
pub struct WaitQueue<T> {
    items: BTreeMap<u64, T>,
    next: u64,
    /// The head (by sequence) and how often it was passed over.
    passes: (u64, u32),
}

impl<T> Default for WaitQueue<T> {
    fn default() -> Self {
        WaitQueue {
            items: BTreeMap::new(),
            next: 0,
            passes: (0, 0),
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

    /// The waiter a slot freed on one agent goes to: the oldest of the
    /// first `look_ahead` that `wants` it, unless the head was already
    /// passed over `max_passes` times; otherwise (or when none wants it)
    /// the head.
    pub fn pop_for(
        &mut self,
        look_ahead: usize,
        max_passes: u32,
        mut wants: impl FnMut(&T) -> bool,
    ) -> Option<(u64, T)> {
        let head = *self.items.keys().next()?;
        if self.passes.0 != head {
            self.passes = (head, 0);
        }
        if self.passes.1 < max_passes {
            let found = self
                .items
                .iter()
                .take(look_ahead)
                .find(|(_, v)| wants(v))
                .map(|(k, _)| *k);
            if let Some(seq) = found {
                if seq != head {
                    self.passes.1 += 1;
                }
                return self.items.remove(&seq).map(|v| (seq, v));
            }
        }
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

    #[test]
    fn a_freed_slot_goes_to_a_waiter_it_serves_from_cache_within_bounds() {
        let mut q = WaitQueue::default();
        for v in 0..20u32 {
            q.push(v, 100).expect("room");
        }
        // 5 wants it: it goes ahead of 0..4.
        assert_eq!(q.pop_for(16, 2, |&v| v == 5), Some((5, 5)));
        // 17 is beyond the look-ahead (the 16 oldest are 0..=16 without 5).
        assert_eq!(q.pop_for(16, 2, |&v| v == 17), Some((0, 0)));
        // 1 is the head now: passed twice, then served whoever wants what.
        assert_eq!(q.pop_for(16, 2, |&v| v == 6), Some((6, 6)));
        assert_eq!(q.pop_for(16, 2, |&v| v == 7), Some((7, 7)));
        assert_eq!(q.pop_for(16, 2, |&v| v == 8), Some((1, 1)));
        // The head itself wanting it is no pass.
        assert_eq!(q.pop_for(16, 0, |&v| v == 2), Some((2, 2)));
        let p = Prefer::of([3, 9, 4, 5, 6]);
        assert!(p.contains(9) && p.contains(5) && !p.contains(6) && !p.contains(1));
        assert!(p.contains((7u64 << 32) | 3), "ids are compared truncated");
        assert!(Prefer::default().is_empty() && !p.is_empty());
    }

    proptest! {
        /// Whatever the wants, the head is passed over at most
        /// `max_passes` times in a row, only a waiter within the look-ahead
        /// jumps, and every waiter leaves exactly once.
        #[test]
        fn bounded_bending(ops in proptest::collection::vec((0u8..3, 0u64..64), 0..300), look in 1usize..20, max in 0u32..6) {
            let mut q = WaitQueue::default();
            let mut pushed = 0u64;
            let mut left = 0u64;
            let mut passed = (u64::MAX, 0u32);
            for (op, want) in ops {
                if op == 0 {
                    q.push(pushed, 1000).expect("room");
                    pushed += 1;
                    continue;
                }
                let order: Vec<u64> = q.items.values().copied().collect();
                let Some(&head) = order.first() else { continue };
                let Some((_, v)) = q.pop_for(look, max, |&v| v % 64 == want) else { continue };
                left += 1;
                let pos = order.iter().position(|&x| x == v).expect("was queued");
                prop_assert!(pos < look.max(1));
                if passed.0 != head {
                    passed = (head, 0);
                }
                if v != head {
                    passed.1 += 1;
                    prop_assert!(passed.1 <= max, "head {} passed {} times", head, passed.1);
                }
            }
            prop_assert_eq!(left + q.len() as u64, pushed);
        }
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
