//! Model directory assignment: which shard owns a model.
//!
//! Balanced: a new model goes to the shard that owns the fewest models
//! (lowest index on ties). The assignment is stable for the process
//! lifetime. [`Directory`] is the plain value; the runtime keeps it behind
//! a single-writer snapshot.
//!
//! Agents reserve their model's shard when their preamble arrives (so two
//! agents of two new models that connect at once land on different
//! shards), and confirm it when they register. Only confirmed models are
//! visible to clients; unconfirmed reservations are bounded by
//! [`MAX_PROVISIONAL`] so unauthenticated peers cannot grow the map.

use std::collections::HashMap;

/// Model -> shard map plus per-shard model counts.
#[derive(Debug, Clone, Default)]
pub struct Directory {
    owners: HashMap<String, Entry>,
    counts: Vec<usize>,
    provisional: usize,
}

/// Most unconfirmed reservations kept at once.
pub const MAX_PROVISIONAL: usize = 1024;

#[derive(Debug, Clone, Copy)]
struct Entry {
    shard: usize,
    confirmed: bool,
}

impl Directory {
    /// An empty directory over `shards` shards (at least one).
    pub fn new(shards: usize) -> Self {
        Directory {
            owners: HashMap::new(),
            counts: vec![0; shards.max(1)],
            provisional: 0,
        }
    }

    /// Number of shards.
    pub fn shards(&self) -> usize {
        self.counts.len()
    }

    /// Owner of a known (confirmed) model.
    pub fn owner(&self, model: &str) -> Option<usize> {
        self.owners
            .get(model)
            .filter(|e| e.confirmed)
            .map(|e| e.shard)
    }

    /// The shard of a confirmed or reserved model.
    pub fn reserved(&self, model: &str) -> Option<usize> {
        self.owners.get(model).map(|e| e.shard)
    }

    /// The shard an agent of `model` should be served by: its owner or
    /// reservation, else a new reservation on the least-loaded shard
    /// (when the reservation bound is reached: the tentative shard,
    /// unreserved).
    pub fn reserve(&mut self, model: &str) -> usize {
        if let Some(e) = self.owners.get(model) {
            return e.shard;
        }
        let shard = self.tentative();
        if self.provisional < MAX_PROVISIONAL {
            self.owners.insert(
                model.to_string(),
                Entry {
                    shard,
                    confirmed: false,
                },
            );
            self.provisional += 1;
            if let Some(c) = self.counts.get_mut(shard) {
                *c += 1;
            }
        }
        shard
    }

    /// The shard a new model would be given now (fewest models, lowest index).
    pub fn tentative(&self) -> usize {
        pick_fewest(&self.counts)
    }

    /// The owner of `model`, assigning `preferred` (or the tentative shard
    /// when `preferred` is out of range) when it is new.
    pub fn assign(&mut self, model: &str, preferred: usize) -> usize {
        if let Some(e) = self.owners.get_mut(model) {
            if !e.confirmed {
                e.confirmed = true;
                self.provisional -= 1;
            }
            return e.shard;
        }
        let shard = if preferred < self.counts.len() {
            preferred
        } else {
            self.tentative()
        };
        self.owners.insert(
            model.to_string(),
            Entry {
                shard,
                confirmed: true,
            },
        );
        if let Some(c) = self.counts.get_mut(shard) {
            *c += 1;
        }
        shard
    }

    /// All confirmed models with their owners.
    pub fn models(&self) -> impl Iterator<Item = (&str, usize)> {
        self.owners
            .iter()
            .filter(|(_, e)| e.confirmed)
            .map(|(m, e)| (m.as_str(), e.shard))
    }

    /// Models owned by each shard.
    pub fn counts(&self) -> &[usize] {
        &self.counts
    }
}

/// Index of the smallest count; lowest index on ties; 0 when empty.
pub fn pick_fewest(counts: &[usize]) -> usize {
    let mut best = 0usize;
    let mut best_n = usize::MAX;
    for (i, n) in counts.iter().enumerate() {
        if *n < best_n {
            best = i;
            best_n = *n;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn simultaneous_reservations_spread() {
        let mut d = Directory::new(2);
        let a = d.reserve("a");
        let b = d.reserve("b");
        assert_ne!(
            a, b,
            "two new models arriving together go to different shards"
        );
        assert_eq!(d.owner("a"), None, "not visible before registration");
        assert_eq!(d.assign("a", 9), a);
        assert_eq!(d.owner("a"), Some(a));
    }

    #[test]
    fn reservations_are_bounded() {
        let mut d = Directory::new(2);
        for i in 0..MAX_PROVISIONAL + 10 {
            d.reserve(&format!("m{i}"));
        }
        assert_eq!(d.counts().iter().sum::<usize>(), MAX_PROVISIONAL);
    }

    #[test]
    fn two_models_two_shards_are_spread() {
        let mut d = Directory::new(2);
        let a = d.assign("a", d.tentative());
        let b = d.assign("b", d.tentative());
        assert_ne!(a, b);
        assert_eq!(d.assign("a", 1 - a), a, "stable");
    }

    proptest! {
        /// Counts never differ by more than one when models are assigned at
        /// the tentative shard, every model has one owner, and assignment
        /// is stable.
        #[test]
        fn balanced_and_stable(shards in 1usize..8, models in proptest::collection::vec("[a-z]{1,6}", 0..60)) {
            let mut d = Directory::new(shards);
            let mut first = HashMap::new();
            for m in &models {
                let t = d.tentative();
                let o = d.assign(m, t);
                let prev = *first.entry(m.clone()).or_insert(o);
                prop_assert_eq!(prev, o);
            }
            let max = d.counts().iter().max().copied().unwrap_or(0);
            let min = d.counts().iter().min().copied().unwrap_or(0);
            prop_assert!(max - min <= 1);
            prop_assert_eq!(d.counts().iter().sum::<usize>(), first.len());
        }
    }
}
