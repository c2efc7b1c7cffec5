//! Model directory assignment: which shard owns a model.
//!
//! Balanced: a new model goes to the shard that owns the fewest models
//! (lowest index on ties). The assignment is stable for the process
//! lifetime. [`Directory`] is the plain value; the runtime keeps it behind
//! a versioned snapshot.
//!
//! Agents reserve their model's shard when their preamble arrives (so two
//! agents of two new models that connect at once land on different
//! shards), and confirm it when they register; a link that fails before
//! registering releases its reservation, so names nobody registered never
//! stay. Unconfirmed reservations are also bounded by [`MAX_PROVISIONAL`].
//! A model is visible to clients ([`Directory::owner`]) only while it has
//! registered links: a model whose agents all left is not found.

use std::collections::HashMap;

use crate::logic::link::control::Capability;

/// Counts with one link of `cap`.
fn one(cap: Capability) -> [u32; 3] {
    let mut c = [0; 3];
    if let Some(n) = c.get_mut(cap_index(cap)) {
        *n = 1;
    }
    c
}

/// The slot of a capability in an entry's per-capability link counts.
fn cap_index(cap: Capability) -> usize {
    match cap {
        Capability::Llm => 0,
        Capability::Embedding => 1,
        Capability::Reranker => 2,
    }
}

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
    /// Links between their preamble and their registration.
    pending: u32,
    /// Registered links (agents) now.
    links: u32,
    /// Of those, per capability (llm, embedding, reranker): a model
    /// held at zero for one kind is woken by an agent of that kind only.
    caps: [u32; 3],
    /// Of those, the healthy ones per capability: a model whose agents
    /// are all unhealthy is redirected or held as one at zero (seed 2).
    healthy: [u32; 3],
}

/// How many names the directory holds, by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DirectoryStats {
    /// Models with registered agents now.
    pub live: usize,
    /// Models assigned once whose agents all left (the shard is kept).
    pub idle: usize,
    /// Reservations of links not registered yet.
    pub reserved: usize,
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

    /// Every model with registered agents, and its owner.
    pub fn live(&self) -> impl Iterator<Item = (&str, usize)> + '_ {
        self.owners
            .iter()
            .filter(|(_, e)| e.confirmed && e.links > 0)
            .map(|(m, e)| (m.as_str(), e.shard))
    }

    /// Owner of a model with registered agents.
    pub fn owner(&self, model: &str) -> Option<usize> {
        self.owners
            .get(model)
            .filter(|e| e.confirmed && e.links > 0)
            .map(|e| e.shard)
    }

    /// Owner of a model with registered agents, and whether a healthy
    /// one has capability `cap` (one lookup on the request path).
    pub fn owner_and_cap(&self, model: &str, cap: Capability) -> Option<(usize, bool)> {
        self.owners
            .get(model)
            .filter(|e| e.confirmed && e.links > 0)
            .map(|e| {
                let has = e.healthy.get(cap_index(cap)).is_some_and(|n| *n > 0);
                (e.shard, has)
            })
    }

    /// A registered agent of `model` (capability `cap`) turned healthy
    /// (`up`) or unhealthy.
    pub fn set_health(&mut self, model: &str, cap: Capability, up: bool) {
        if let Some(n) = self
            .owners
            .get_mut(model)
            .and_then(|e| e.healthy.get_mut(cap_index(cap)))
        {
            *n = if up {
                n.saturating_add(1)
            } else {
                n.saturating_sub(1)
            };
        }
    }

    /// Owner of a model with a healthy registered agent of capability
    /// `cap`.
    pub fn owner_with(&self, model: &str, cap: Capability) -> Option<usize> {
        self.owners
            .get(model)
            .filter(|e| e.confirmed && e.healthy.get(cap_index(cap)).is_some_and(|n| *n > 0))
            .map(|e| e.shard)
    }

    /// The shard of a confirmed model (with or without agents now).
    pub fn assigned(&self, model: &str) -> Option<usize> {
        self.owners
            .get(model)
            .filter(|e| e.confirmed)
            .map(|e| e.shard)
    }

    /// The shard an agent of `model` should be served by: its owner or
    /// reservation, else a new reservation on the least-loaded shard
    /// (when the reservation bound is reached: the tentative shard,
    /// unreserved). Every call is matched by [`Directory::register`] or
    /// [`Directory::release`].
    pub fn reserve(&mut self, model: &str) -> usize {
        self.reserve_preferring(model, None)
    }

    /// [`Directory::reserve`], giving a new model `prefer` (in range)
    /// instead of the least-loaded shard: a model at zero whose held
    /// requests wait on one shard is owned there, so its wake releases
    /// them without moving a socket.
    pub fn reserve_preferring(&mut self, model: &str, prefer: Option<usize>) -> usize {
        if let Some(e) = self.owners.get_mut(model) {
            e.pending = e.pending.saturating_add(1);
            return e.shard;
        }
        let shard = prefer
            .filter(|p| *p < self.counts.len())
            .unwrap_or_else(|| self.tentative());
        if self.provisional < MAX_PROVISIONAL {
            self.owners.insert(
                model.to_string(),
                Entry {
                    shard,
                    confirmed: false,
                    pending: 1,
                    links: 0,
                    caps: [0; 3],
                    healthy: [0; 3],
                },
            );
            self.provisional += 1;
            if let Some(c) = self.counts.get_mut(shard) {
                *c += 1;
            }
        }
        shard
    }

    /// A link reserved at its preamble failed before registering: drop its
    /// reservation, and the name when nobody else holds it.
    pub fn release(&mut self, model: &str) {
        let Some(e) = self.owners.get_mut(model) else {
            return;
        };
        e.pending = e.pending.saturating_sub(1);
        if e.confirmed || e.pending > 0 {
            return;
        }
        let shard = e.shard;
        self.owners.remove(model);
        self.provisional = self.provisional.saturating_sub(1);
        if let Some(c) = self.counts.get_mut(shard) {
            *c = c.saturating_sub(1);
        }
    }

    /// The shard a new model would be given now (fewest models, lowest index).
    pub fn tentative(&self) -> usize {
        pick_fewest(&self.counts)
    }

    /// A link of capability `cap` registered for `model` (healthy, as
    /// every agent starts): confirm its owner (assigning `preferred`, or
    /// the tentative shard when `preferred` is out of range, when the model
    /// is new) and count the link. Returns the owner.
    pub fn register(&mut self, model: &str, preferred: usize, cap: Capability) -> usize {
        if let Some(e) = self.owners.get_mut(model) {
            if !e.confirmed {
                e.confirmed = true;
                self.provisional = self.provisional.saturating_sub(1);
            }
            e.pending = e.pending.saturating_sub(1);
            e.links = e.links.saturating_add(1);
            if let Some(n) = e.caps.get_mut(cap_index(cap)) {
                *n = n.saturating_add(1);
            }
            if let Some(n) = e.healthy.get_mut(cap_index(cap)) {
                *n = n.saturating_add(1);
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
                pending: 0,
                links: 1,
                caps: one(cap),
                healthy: one(cap),
            },
        );
        if let Some(c) = self.counts.get_mut(shard) {
            *c += 1;
        }
        shard
    }

    /// A registered link of `model` (capability `cap`; `healthy`: as the
    /// directory counted it last) ended.
    pub fn unregister(&mut self, model: &str, cap: Capability, healthy: bool) {
        if let Some(e) = self.owners.get_mut(model) {
            e.links = e.links.saturating_sub(1);
            if let Some(n) = e.caps.get_mut(cap_index(cap)) {
                *n = n.saturating_sub(1);
            }
            if healthy {
                if let Some(n) = e.healthy.get_mut(cap_index(cap)) {
                    *n = n.saturating_sub(1);
                }
            }
        }
    }

    /// Forget `model` when it has neither registered nor arriving links
    /// (issue 29 #2: names of models whose agents all left must not stay
    /// until restart); returns whether it was forgotten.
    pub fn forget(&mut self, model: &str) -> bool {
        let Some(e) = self.owners.get(model) else {
            return false;
        };
        if !e.confirmed || e.links > 0 || e.pending > 0 {
            return false;
        }
        let shard = e.shard;
        self.owners.remove(model);
        if let Some(c) = self.counts.get_mut(shard) {
            *c = c.saturating_sub(1);
        }
        true
    }

    /// Names held, by state.
    pub fn stats(&self) -> DirectoryStats {
        let mut s = DirectoryStats::default();
        for e in self.owners.values() {
            match (e.confirmed, e.links > 0) {
                (true, true) => s.live += 1,
                (true, false) => s.idle += 1,
                (false, _) => s.reserved += 1,
            }
        }
        s
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

    #[test]
    fn a_model_without_links_is_forgotten_and_its_shard_count_given_back() {
        let mut d = Directory::new(2);
        let s = d.register("m", 0, Capability::Llm);
        assert!(!d.forget("m"), "a live model stays");
        d.unregister("m", Capability::Llm, true);
        d.reserve_preferring("m", None);
        assert!(!d.forget("m"), "a link arriving for it keeps it");
        d.release("m");
        assert!(d.forget("m"));
        assert_eq!(d.counts().get(s), Some(&0));
        assert_eq!(d.stats(), DirectoryStats::default());
        assert!(!d.forget("m"), "once");
    }
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
        assert_eq!(d.register("a", 9, Capability::Llm), a);
        assert_eq!(d.owner("a"), Some(a));
        d.unregister("a", Capability::Llm, true);
        assert_eq!(d.owner("a"), None, "no agent left: not found");
        assert_eq!(d.assigned("a"), Some(a), "but the shard is kept");
        assert_eq!(d.register("a", 1 - a, Capability::Llm), a, "stable");
    }

    #[test]
    fn failed_links_release_their_reservations() {
        let mut d = Directory::new(2);
        for i in 0..2000 {
            let m = format!("junk{i}");
            d.reserve(&m);
            d.release(&m);
        }
        assert_eq!(d.stats(), DirectoryStats::default());
        assert_eq!(d.counts(), &[0, 0]);
        // Two links for one name: the reservation stays until both end.
        d.reserve("x");
        d.reserve("x");
        d.release("x");
        assert_eq!(d.stats().reserved, 1);
        d.release("x");
        assert_eq!(d.stats().reserved, 0);
        // Releasing a registered model's extra link keeps the model.
        d.reserve("y");
        d.register("y", 0, Capability::Llm);
        d.reserve("y");
        d.release("y");
        assert_eq!(d.owner("y"), Some(0));
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
        let a = d.register("a", d.tentative(), Capability::Llm);
        let b = d.register("b", d.tentative(), Capability::Llm);
        assert_ne!(a, b);
        assert_eq!(d.register("a", 1 - a, Capability::Llm), a, "stable");
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
                let o = d.register(m, t, Capability::Llm);
                let prev = *first.entry(m.clone()).or_insert(o);
                prop_assert_eq!(prev, o);
            }
            let max = d.counts().iter().max().copied().unwrap_or(0);
            let min = d.counts().iter().min().copied().unwrap_or(0);
            prop_assert!(max - min <= 1);
            prop_assert_eq!(d.counts().iter().sum::<usize>(), first.len());
        }
    }

    /// Issue 28 #5: a model held at zero for chat is not "served" by an
    /// embedding agent registered under its name.
    #[test]
    fn the_owner_with_a_capability_counts_only_that_kind() {
        let mut d = Directory::new(2);
        let s = d.register("m", 1, Capability::Embedding);
        assert_eq!(d.owner("m"), Some(s));
        assert_eq!(d.owner_with("m", Capability::Embedding), Some(s));
        assert_eq!(d.owner_with("m", Capability::Llm), None, "no chat agent");
        assert_eq!(d.owner_and_cap("m", Capability::Llm), Some((s, false)));
        d.register("m", 0, Capability::Llm);
        assert_eq!(d.owner_with("m", Capability::Llm), Some(s), "same owner");
        d.unregister("m", Capability::Llm, true);
        assert_eq!(d.owner_with("m", Capability::Llm), None);
        d.unregister("m", Capability::Embedding, true);
        assert_eq!(d.owner("m"), None);
        assert_eq!(d.owner_with("m", Capability::Embedding), None);
    }

    /// Issue 28 #2: a model whose agents are all unhealthy has no healthy
    /// owner for its kind (it is redirected or held as one at zero); one
    /// recovering makes it served again.
    #[test]
    fn only_healthy_agents_serve() {
        let mut d = Directory::new(1);
        d.register("m", 0, Capability::Llm);
        d.register("m", 0, Capability::Llm);
        assert_eq!(d.owner_and_cap("m", Capability::Llm), Some((0, true)));
        d.set_health("m", Capability::Llm, false);
        assert_eq!(d.owner_with("m", Capability::Llm), Some(0), "one left");
        d.set_health("m", Capability::Llm, false);
        assert_eq!(d.owner_and_cap("m", Capability::Llm), Some((0, false)));
        assert_eq!(d.owner_with("m", Capability::Llm), None);
        assert_eq!(d.owner("m"), Some(0), "still registered");
        d.set_health("m", Capability::Llm, true);
        assert_eq!(d.owner_with("m", Capability::Llm), Some(0), "recovered");
        d.unregister("m", Capability::Llm, false);
        d.unregister("m", Capability::Llm, true);
        assert_eq!(d.owner("m"), None);
        d.register("m", 0, Capability::Llm);
        assert_eq!(d.owner_with("m", Capability::Llm), Some(0), "no drift");
    }
}
