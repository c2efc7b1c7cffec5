//! Cache affinity (issue 30), pure: where an engine's prefix cache most
//! likely holds a request's prompt.
//!
//! - [`PrefixHasher`] and [`PrefixMarks`] (the prompt's hashes, made by
//!   the body probe) live in [`crate::logic::http::api::prompt_hash`].
//! - [`AffinityIndex`]: a fixed-size set-associative table, hash -> up to
//!   [`HOLDERS`] agents with their last use; entries expire by TTL, the
//!   oldest is replaced when a bucket is full, and an agent that left is
//!   never returned ([`AffinityIndex::leave`]).
//! - [`AffinityCfg`]: a `prefix-aware` step's load band, TTL and block.
//!
//! The choice itself (holder within the load band, else least-loaded) is
//! made in [`super::policy::select_with`]. Time comes in as seconds.

pub mod miss_cost;
mod notes;

pub use notes::*;

use std::collections::HashSet;

pub use crate::logic::http::api::prompt_hash::{
    key_hash, model_salt, raw_key_hash, salted, seed_of, Mark, PrefixHasher, PrefixMarks,
    BASE_BLOCK, MAX_MARKS,
};

/// Buckets of the default table (`--affinity-table-entries` 1,048,576).
const DEFAULT_BUCKETS: usize = (1 << 20) / WAYS;

/// Bytes the index takes in all when `entries` are shared by `shards`
/// shards, as [`AffinityIndex::new`] allocates them on each (`None`: past
/// what can be addressed). Start-up refuses a count the machine cannot
/// hold (issue 51 #1).
pub fn table_bytes(entries: usize, shards: usize) -> Option<u64> {
    let shards = shards.max(1);
    let per_shard = (entries / shards)
        .div_ceil(WAYS)
        .max(1)
        .checked_next_power_of_two()?;
    let bucket = std::mem::size_of::<[Slot; WAYS]>() as u64;
    (per_shard as u64)
        .checked_mul(bucket)?
        .checked_mul(shards as u64)
}

/// Agents one entry remembers.
pub const HOLDERS: usize = 4;
/// Entries per bucket (one bucket is searched per lookup).
pub const WAYS: usize = 8;
/// Bytes one entry takes in the table (exact: the size of one slot).
pub const ENTRY_BYTES: usize = std::mem::size_of::<Slot>();

/// A prefix-aware step's settings (policy fields under `affinity:`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct AffinityCfg {
    /// A cache holder may carry this much more of its capacity in flight
    /// than the least-loaded eligible agent and still be chosen (1: any
    /// holder with a free slot, "sticky until full"). 0.5 was the default
    /// until the GPU-shaped fleet: there a busy holder is the rule under
    /// load, and band 1 served 2-13 % more past saturation with a lower
    /// p95 (perf/2026-12-06-affinity-lead, two runs; 7-10 % far past it:
    /// 2026-12-06-affinity-overload); on the CPU-shaped sims it kept
    /// 95-99 % of the oracle's hits against 91-93 % with p95 no worse
    /// (perf/2026-12-04-affinity-oracle).
    pub load_band: f64,
    /// Seconds an entry stays usable after its last use.
    pub ttl_seconds: u32,
    /// Bytes of text between marks inside a long message (a multiple of
    /// [`BASE_BLOCK`]).
    pub block_bytes: u32,
    /// When every holder of the request's prefix is at capacity, wait up
    /// to this long in the queue for a slot on one of them before going
    /// to another agent and paying the prefill again (0: go at once, the
    /// strict load guard). Past saturation a miss costs a whole prefill
    /// and a hit a few tokens, so a short wait can be worth many misses.
    pub holder_wait_ms: u32,
}

impl Default for AffinityCfg {
    fn default() -> Self {
        AffinityCfg {
            load_band: 1.0,
            ttl_seconds: 600,
            block_bytes: 2048,
            holder_wait_ms: 3000,
        }
    }
}

/// One table entry: a prefix hash and the agents that last served it,
/// latest first. `seen[k] == 0`: holder `k` is empty.
#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    hash: u64,
    agents: [u32; HOLDERS],
    seen: [u32; HOLDERS],
}

/// An agent the index names for a request, with the depth of its match.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Holder {
    /// The agent (its shard-local id, truncated).
    pub agent: u32,
    /// Text bytes of the matched prefix.
    pub depth: u32,
    /// Seconds since the entry was last used by this agent.
    pub age: u32,
    /// The matched entry.
    pub hash: u64,
}

/// What matched: a session key or a prompt prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HitKind {
    /// `X-Session-ID`, `prompt_cache_key` or `metadata.user_id`.
    #[default]
    Key,
    /// The longest prompt prefix with a live holder.
    Prefix,
}

/// The holders of a request's best match (all of one entry).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Holders {
    /// Key or prefix.
    pub kind: HitKind,
    items: [Holder; HOLDERS],
    len: usize,
}

impl Holders {
    /// Holders of one entry, most recent first (at most [`HOLDERS`] kept).
    pub fn of(kind: HitKind, items: &[Holder]) -> Self {
        let mut h = Holders {
            kind,
            ..Holders::default()
        };
        for x in items {
            h.push(*x);
        }
        h
    }

    /// No holder.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The holders, most recently used first.
    pub fn iter(&self) -> impl Iterator<Item = &Holder> {
        self.items.iter().take(self.len)
    }

    /// The holder that is `agent`.
    pub fn find(&self, agent: u64) -> Option<&Holder> {
        self.iter()
            .find(|h| u64::from(h.agent) == agent & 0xffff_ffff)
    }

    fn push(&mut self, h: Holder) {
        if let Some(s) = self.items.get_mut(self.len) {
            *s = h;
            self.len += 1;
        }
    }

    fn sort_recent_first(&mut self) {
        // Stable: the table's order breaks ties within a second.
        if let Some(items) = self.items.get_mut(..self.len) {
            items.sort_by_key(|h| h.age);
        }
    }
}

/// Where the decision machine asks for a request's holders (the shard's
/// index with the request's key and marks; a table in tests).
pub trait AffinitySource {
    /// The best match under a step's settings.
    fn lookup(&self, cfg: &AffinityCfg) -> Holders;
}

/// A prefix-aware forward: how it was decided and what it predicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AffinityPick {
    /// The outcome counted.
    pub outcome: Outcome,
    /// The step's block (which marks to record for the agent).
    pub block_bytes: u32,
    /// The holder chosen, on a hit (its depth predicts cached tokens).
    pub hit: Option<Holder>,
    /// The index's deepest holder, whether or not the request went there
    /// (what the index predicted; `None`: no live holder).
    pub predicted: Option<Holder>,
    /// The request waited for a full holder first (`holder_wait_ms`).
    pub held: bool,
}

/// The cached tokens a holder predicts for a request of `input` prompt
/// tokens: its matched prefix in tokens (`depth` text bytes at
/// `per_byte`), or, for a session-key holder (no prefix depth), half the
/// prompt (the previous turn's).
pub fn predicted_tokens(h: &Holder, per_byte: f64, input: u64) -> u64 {
    if h.depth > 0 {
        ((f64::from(h.depth) * per_byte) as u64).min(input)
    } else {
        input / 2
    }
}

/// How one prefix-aware decision went (`hivenet_affinity_decisions_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Sent where its session key last went.
    KeyHit,
    /// Sent to a holder of its longest cached prefix.
    PrefixHit,
    /// No live holder: least-loaded.
    Miss,
    /// A holder exists but is full, excluded or outside the load band:
    /// least-loaded.
    Overloaded,
}

impl Outcome {
    /// Every outcome, in metric order.
    pub const ALL: [Outcome; 4] = [
        Outcome::KeyHit,
        Outcome::PrefixHit,
        Outcome::Miss,
        Outcome::Overloaded,
    ];

    /// A hit of this kind (sent to a holder).
    pub fn hit(kind: HitKind) -> Outcome {
        match kind {
            HitKind::Key => Outcome::KeyHit,
            HitKind::Prefix => Outcome::PrefixHit,
        }
    }

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::KeyHit => "key_hit",
            Outcome::PrefixHit => "prefix_hit",
            Outcome::Miss => "miss",
            Outcome::Overloaded => "overloaded",
        }
    }

    /// Index in [`Outcome::ALL`].
    pub fn index(self) -> usize {
        match self {
            Outcome::KeyHit => 0,
            Outcome::PrefixHit => 1,
            Outcome::Miss => 2,
            Outcome::Overloaded => 3,
        }
    }
}

/// What the index reads of one request: its model's salt, its session key
/// (raw hash) and its prompt's marks.
#[derive(Debug, Clone, Copy)]
pub struct RequestKeys<'a> {
    /// [`model_salt`] of the (resolved) model.
    pub salt: u64,
    /// [`raw_key_hash`] of its session key.
    pub key: Option<u64>,
    /// Its prompt's marks.
    pub marks: &'a PrefixMarks,
}

/// The fixed-size table of one shard (every model it owns; the model is in
/// each hash). Allocated once, at its full size, on first use.
pub struct AffinityIndex {
    buckets: Vec<[Slot; WAYS]>,
    /// Agents routable now (joined, not left): nothing else is returned.
    ///
    /// A stale hit does not hide an agent's older entries (the index
    /// learned a per-agent horizon from them until 2026-12-06). On the
    /// GPU-shaped fleet the stale hits came from prompts near the cache's
    /// size, not from age; hiding the home of an application after a
    /// pause sent its next conversation to another application's engine,
    /// which then held two prompts its cache could not keep. Without it:
    /// 87.0 served/s against 62.1-71.2 and p95 3.3 s against 5.9-7.0 s at
    /// 32 engines and 128 asked, 134 against 113-115 at 8 engines and
    /// 256 (perf/2026-12-06-affinity-lead, experiments/no-horizon*). The
    /// stale hit still counts (`hivenet_affinity_stale_total`), and the
    /// request re-prefilled its prefix there: the holder holds it again.
    live: HashSet<u32>,
    /// Entries in use (for the gauge).
    used: usize,
}

impl AffinityIndex {
    /// A table of at least `entries` entries (rounded up to whole buckets
    /// and a power of two; at least one bucket).
    pub fn new(entries: usize) -> Self {
        // Start-up bounds `entries` by the machine's memory
        // ([`table_bytes`]); a count past what can be addressed falls back
        // to the default table rather than panicking on a shard.
        let buckets = entries
            .div_ceil(WAYS)
            .max(1)
            .checked_next_power_of_two()
            .unwrap_or(DEFAULT_BUCKETS);
        AffinityIndex {
            buckets: vec![[Slot::default(); WAYS]; buckets],
            live: HashSet::new(),
            used: 0,
        }
    }

    /// Entries the table holds at most.
    pub fn capacity(&self) -> usize {
        self.buckets.len() * WAYS
    }

    /// Bytes of its table.
    pub fn table_bytes(&self) -> usize {
        self.buckets.len() * std::mem::size_of::<[Slot; WAYS]>()
    }

    /// Entries in use.
    pub fn used(&self) -> usize {
        self.used
    }

    /// `agent` may be named from now on.
    pub fn join(&mut self, agent: u64) {
        self.live.insert(agent as u32);
    }

    /// `agent` left: never named again (its entries are reused lazily).
    pub fn leave(&mut self, agent: u64) {
        self.live.remove(&(agent as u32));
    }

    fn bucket_of(&self, hash: u64) -> usize {
        ((hash >> 17) as usize) & (self.buckets.len() - 1)
    }

    /// `agent` now holds `hash` (it was just sent a request with it).
    pub fn record(&mut self, hash: u64, agent: u64, now: u32) {
        let agent = agent as u32;
        let now = now.max(1);
        let b = self.bucket_of(hash);
        let Some(bucket) = self.buckets.get_mut(b) else {
            return;
        };
        // The entry, else an empty one, else the least recently used.
        let pos = bucket
            .iter()
            .position(|s| s.hash == hash && s.seen.iter().any(|t| *t > 0))
            .or_else(|| {
                bucket
                    .iter()
                    .position(|s| s.seen.iter().all(|t| *t == 0))
                    .inspect(|_| self.used += 1)
            })
            .unwrap_or_else(|| {
                let last_use = |s: &Slot| s.seen.iter().copied().max().unwrap_or(0);
                let mut oldest = 0;
                for (i, s) in bucket.iter().enumerate() {
                    if bucket.get(oldest).map(last_use).unwrap_or(0) > last_use(s) {
                        oldest = i;
                    }
                }
                oldest
            });
        let Some(slot) = bucket.get_mut(pos) else {
            return;
        };
        if slot.hash != hash || slot.seen.iter().all(|t| *t == 0) {
            *slot = Slot {
                hash,
                ..Slot::default()
            };
        }
        // This agent's holder, else an empty or departed one, else the oldest.
        let k = slot
            .agents
            .iter()
            .zip(slot.seen.iter())
            .position(|(a, t)| *a == agent && *t > 0)
            .or_else(|| {
                (0..HOLDERS).find(|&k| {
                    slot.seen.get(k).copied().unwrap_or(0) == 0
                        || slot.agents.get(k).is_some_and(|a| !self.live.contains(a))
                })
            })
            .unwrap_or_else(|| {
                // The last of the oldest: the slot is kept latest first.
                let mut oldest = 0;
                for k in 0..HOLDERS {
                    if slot.seen.get(k) <= slot.seen.get(oldest) {
                        oldest = k;
                    }
                }
                oldest
            });
        // Most recent first: the slot's order tells holders of the same
        // second apart (the choice takes the freshest).
        if let (Some(a), Some(t)) = (slot.agents.get_mut(..=k), slot.seen.get_mut(..=k)) {
            a.rotate_right(1);
            t.rotate_right(1);
        }
        if let (Some(a), Some(t)) = (slot.agents.first_mut(), slot.seen.first_mut()) {
            *a = agent;
            *t = now;
        }
    }

    /// Every entry a routable agent holds: (salted hash, agent): what a
    /// process replacing this one takes over (issue 54). One walk of the
    /// table.
    pub fn entries(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::with_capacity(self.used);
        for s in self.buckets.iter().flatten() {
            for (a, t) in s.agents.iter().zip(s.seen.iter()) {
                if *t > 0 && self.live.contains(a) {
                    out.push((s.hash, u64::from(*a)));
                }
            }
        }
        out
    }

    /// A forward to `agent` failed: it does not hold the request's key
    /// (a session whose engine died follows the retry, not the dead
    /// engine; the two were noted in the same second).
    pub fn forget_key(&mut self, req: &RequestKeys<'_>, agent: u64) {
        let Some(k) = req.key else { return };
        let hash = salted(req.salt, k);
        let b = self.bucket_of(hash);
        let Some(slot) = self
            .buckets
            .get_mut(b)
            .and_then(|bucket| bucket.iter_mut().find(|s| s.hash == hash))
        else {
            return;
        };
        for (a, t) in slot.agents.iter().zip(slot.seen.iter_mut()) {
            if *a == agent as u32 {
                *t = 0;
            }
        }
    }

    /// The live, unexpired holders of `hash` (at most [`HOLDERS`]), most
    /// recent first; `depth` is copied into each.
    pub fn holders(&self, hash: u64, depth: u32, now: u32, ttl: u32) -> Holders {
        let mut out = Holders::default();
        let Some(bucket) = self.buckets.get(self.bucket_of(hash)) else {
            return out;
        };
        let Some(slot) = bucket
            .iter()
            .find(|s| s.hash == hash && s.seen.iter().any(|t| *t > 0))
        else {
            return out;
        };
        for (a, t) in slot.agents.iter().zip(slot.seen.iter()) {
            if *t == 0 {
                continue;
            }
            let age = now.saturating_sub(*t);
            if !self.live.contains(a) || age > ttl {
                continue;
            }
            out.push(Holder {
                agent: *a,
                depth,
                age,
                hash,
            });
        }
        out.sort_recent_first();
        out
    }

    /// The best match of a request: its key's holders (most recent only),
    /// else the longest prefix among `marks` with a live holder.
    pub fn lookup(&self, req: &RequestKeys<'_>, cfg: &AffinityCfg, now: u32) -> Holders {
        if let Some(k) = req.key {
            let mut h = self.holders(salted(req.salt, k), 0, now, cfg.ttl_seconds);
            if !h.is_empty() {
                h.len = 1;
                h.kind = HitKind::Key;
                return h;
            }
        }
        // Every forward records the first mark with the rest: when it has
        // no live holder, no longer prefix has one (short of a bucket's
        // eviction), and a miss costs one lookup instead of one per mark.
        if let Some(first) = req.marks.first {
            if self
                .holders(salted(req.salt, first.hash), 0, now, cfg.ttl_seconds)
                .is_empty()
            {
                return Holders::default();
            }
        }
        for m in req.marks.longest_first(cfg.block_bytes) {
            let mut h = self.holders(salted(req.salt, m.hash), m.offset, now, cfg.ttl_seconds);
            if !h.is_empty() {
                h.kind = HitKind::Prefix;
                return h;
            }
        }
        Holders::default()
    }

    /// Record a forward to `agent`: its key and every mark the step uses.
    pub fn record_request(
        &mut self,
        req: &RequestKeys<'_>,
        block_bytes: u32,
        agent: u64,
        now: u32,
    ) {
        if let Some(k) = req.key {
            self.record(salted(req.salt, k), agent, now);
        }
        // Oldest first, so that the longest prefixes are the freshest.
        let all: [Option<Mark>; MAX_MARKS] = {
            let mut a = [None; MAX_MARKS];
            for (slot, m) in a.iter_mut().zip(req.marks.longest_first(block_bytes)) {
                *slot = Some(m);
            }
            a
        };
        for m in all.iter().rev().flatten() {
            self.record(salted(req.salt, m.hash), agent, now);
        }
    }
}

#[cfg(test)]
mod tests;
