//! Cache affinity (issue 30), the model's part: its counters
//! ([`AffinityStats`]) and their metric families ([`render`]). The
//! request's keys and the bookkeeping at the driver's hooks are in
//! [`crate::runtime::request::affinity`]; the index is the shard's.

use crate::logic::routing::affinity::Outcome;
use crate::runtime::wire::exposition::Family;
use crate::runtime::wire::exposition::Kind::{Counter, Gauge};

/// The model's affinity counters (`hivenet_affinity_*`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct AffinityStats {
    /// Decisions by outcome, in [`Outcome::ALL`] order.
    pub decisions: [u64; 4],
    /// Predicted cache hits that came back with few cached tokens.
    pub stale: u64,
    /// Requests sent after waiting for a full cache holder.
    pub holder_waits: u64,
    /// Of those, the ones whose wait ran out (sent elsewhere).
    pub holder_wait_timeouts: u64,
    /// The learned seconds per uncached prompt token (filled at snapshot;
    /// None until learned).
    pub miss_cost_per_token: Option<f64>,
    /// Prompt tokens of prefix-aware requests whose engine reports its
    /// cache: predicted cached by the index, captured (sent to that
    /// holder), delivered (the engine's cached count).
    pub cache: [u64; 3],
}

/// The stages of [`AffinityStats::cache`], in order.
pub const CACHE_STAGES: [&str; 3] = ["predicted", "captured", "delivered"];

impl AffinityStats {
    /// One request's cache hit, three ways (tokens).
    pub fn cache_tokens(&mut self, predicted: u64, captured: u64, delivered: u64) {
        for (c, n) in self.cache.iter_mut().zip([predicted, captured, delivered]) {
            *c = c.saturating_add(n);
        }
    }

    /// Add another shard's counters of the model.
    pub fn add(&mut self, o: &AffinityStats) {
        for (a, b) in self.cache.iter_mut().zip(o.cache) {
            *a += b;
        }
        for (a, b) in self.decisions.iter_mut().zip(o.decisions) {
            *a += b;
        }
        self.stale += o.stale;
        self.holder_waits += o.holder_waits;
        self.holder_wait_timeouts += o.holder_wait_timeouts;
        self.miss_cost_per_token = self.miss_cost_per_token.or(o.miss_cost_per_token);
    }
}

/// The affinity families, one series per model (a model that never made
/// a prefix-aware decision has no decision series).
pub fn render<'m, I>(o: &mut String, models: I)
where
    I: Iterator<Item = (&'m String, &'m AffinityStats)> + Clone,
{
    type Get = fn(&AffinityStats) -> u64;
    let counters: [(&str, &str, Get); 3] = [
        (
            "hivenet_affinity_stale_total",
            "Prefix-aware hits whose engine reported under a quarter of the predicted prefix as cached (the entry was stale).",
            |s| s.stale,
        ),
        (
            "hivenet_affinity_holder_waits_total",
            "Requests sent after waiting for a full cache holder (holder_wait_ms).",
            |s| s.holder_waits,
        ),
        (
            "hivenet_affinity_holder_wait_timeouts_total",
            "Requests whose wait for a full cache holder ran out: sent where least-loaded chose (counted overloaded too).",
            |s| s.holder_wait_timeouts,
        ),
    ];
    for (name, help, get) in counters {
        let mut f = Family::new(o, name, Counter, help, ["model"]);
        for (m, st) in models.clone() {
            f.series([m], get(st));
        }
    }
    let mut f = Family::new(
        o,
        "hivenet_affinity_decisions_total",
        Counter,
        "Prefix-aware routing decisions by outcome: key_hit, prefix_hit, miss (no live holder), overloaded (a holder full, excluded or outside the load band: least-loaded instead).",
        ["model", "outcome"],
    );
    for (m, st) in models.clone() {
        if st.decisions.iter().all(|n| *n == 0) {
            continue;
        }
        for o in Outcome::ALL {
            let outcome = o.as_str();
            f.series(
                [m, &outcome],
                st.decisions.get(o.index()).copied().unwrap_or(0),
            );
        }
    }
    let mut f = Family::new(
        o,
        "hivenet_affinity_cache_tokens_total",
        Counter,
        "Prompt tokens of prefix-aware requests whose engine reports its cache, three ways: predicted (the index's deepest holder said this many would hit), captured (of those, the requests sent to that holder), delivered (the engine's own cached count). predicted > captured: the load guard or a full holder sent them elsewhere; captured > delivered: the engines evicted what the index remembers.",
        ["model", "stage"],
    );
    for (m, st) in models.clone() {
        if st.cache.iter().all(|n| *n == 0) {
            continue;
        }
        for (stage, n) in CACHE_STAGES.iter().zip(st.cache) {
            f.series([m, stage], n);
        }
    }
    let mut f = Family::new(
        o,
        "hivenet_affinity_miss_cost_seconds_per_token",
        Gauge,
        "Seconds an uncached prompt token adds to a request on the model's engines, learned from prefix-aware requests: a wait for a full cache holder never outlasts the prefill its hit saves (absent until learned).",
        ["model"],
    );
    for (m, st) in models {
        if let Some(v) = st.miss_cost_per_token {
            f.series([m], v);
        }
    }
}
