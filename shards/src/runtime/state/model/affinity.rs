//! Cache affinity (issue 30), the model's sub-state: its counters and
//! their metric families ([`AffinityStats`], [`render`]), a request's
//! keys for the decision's prefix-aware steps, and the bookkeeping at the
//! driver's fixed hooks: [`RequestAffinity::forwarded`] (the index learns
//! where the prefix went, the other routers hear of it, the decision is
//! counted) and [`RequestAffinity::ended`] (was the predicted hit real;
//! what a miss cost). The index itself is the shard's
//! ([`crate::runtime::state::shard::Shard::affinity`]); the pure parts
//! are in [`crate::logic::routing::affinity`] and
//! [`crate::logic::routing::affinity::miss_cost`].

use super::agent::Agent;
use super::ModelState;
use crate::logic::http::api::usage::Tokens;
use crate::logic::routing::affinity::{
    model_salt, peer_hash, raw_key_hash, AffinityCfg, AffinityIndex, AffinityNote, AffinityPick,
    AffinitySource, Holder, Holders, Outcome, RequestKeys,
};
use crate::logic::routing::policy::Policy;
use crate::runtime::state::pending::PendingRequest;
use crate::runtime::state::router::AFFINITY_OUTBOX_MAX;
use crate::runtime::state::shard::Shard;
use crate::runtime::wire::clock;
use crate::runtime::wire::exposition::Family;
use crate::runtime::wire::exposition::Kind::{Counter, Gauge};

/// Headers that carry a session key, first found wins (then the body's
/// `prompt_cache_key`, then `metadata.user_id`).
pub const SESSION_HEADERS: [&str; 1] = ["x-session-id"];

/// A predicted hit is stale when the engine read less than this share of
/// the predicted prefix from its cache.
const STALE_SHARE: f64 = 0.25;

/// The shard's affinity index asked for one request (the decision
/// machine's [`AffinitySource`]).
pub struct IndexView<'a> {
    index: &'a AffinityIndex,
    keys: RequestKeys<'a>,
    now: u32,
}

impl AffinitySource for IndexView<'_> {
    fn lookup(&self, cfg: &AffinityCfg) -> Holders {
        self.index.lookup(&self.keys, cfg, self.now)
    }
}

impl<'a> IndexView<'a> {
    /// The view of `index` for `keys` at `now` (unix seconds).
    pub fn new(index: &'a AffinityIndex, keys: RequestKeys<'a>, now: u32) -> Self {
        IndexView { index, keys, now }
    }
}

/// One request's cache affinity: its keys (only under a policy with a
/// prefix-aware step) and the pick of its last forward.
pub struct RequestAffinity<'a> {
    /// The session key and the probe's prefix marks.
    pub keys: Option<RequestKeys<'a>>,
    /// The last forward's pick, until its attempt ends.
    pick: Option<AffinityPick>,
    /// When that forward started (what a miss costs).
    started: Option<clock::Instant>,
}

impl<'a> RequestAffinity<'a> {
    /// The keys of `p` when `policy` has a prefix-aware step: the session
    /// key (header first, then the body's) and the probe's marks.
    pub fn of(policy: &Policy, p: &'a PendingRequest) -> Self {
        let keys = policy
            .steps
            .iter()
            .any(|s| s.affinity.is_some())
            .then(|| RequestKeys {
                salt: model_salt(&p.meta.model),
                key: SESSION_HEADERS
                    .iter()
                    .find_map(|h| p.head.header(h).filter(|v| !v.is_empty()))
                    .map(raw_key_hash)
                    .or(p.meta.affinity.body_key),
                marks: &p.meta.affinity.marks,
            });
        RequestAffinity {
            keys,
            pick: None,
            started: None,
        }
    }

    /// Hook: the decision forwarded to `agent` with `pick`. The model
    /// counts the decision, the index learns that the agent now holds the
    /// request's key and prefixes, and the other routers hear of it.
    pub fn forwarded(
        &mut self,
        shard: &Shard,
        m: &mut ModelState,
        agent: &Agent,
        pick: Option<AffinityPick>,
    ) {
        self.pick = pick;
        self.started = pick.map(|_| clock::now());
        let (Some(pick), Some(keys)) = (pick, self.keys.as_ref()) else {
            return;
        };
        let st = &mut m.stats.affinity;
        if let Some(n) = st.decisions.get_mut(pick.outcome.index()) {
            *n += 1;
        }
        if pick.held {
            st.holder_waits += 1;
            if pick.outcome == Outcome::Overloaded {
                st.holder_wait_timeouts += 1;
            }
        }
        let unix = clock::unix_secs() as u32;
        if let Some(ix) = shard.affinity.borrow_mut().as_mut() {
            ix.record_request(keys, pick.block_bytes, agent.id, unix);
        }
        // Never waiting: a note that finds the outbox busy or full is
        // dropped.
        if let Some(out) = &shard.router.affinity_outbox {
            let note = AffinityNote::of(keys, pick.block_bytes, peer_hash(&agent.reg.peer_id));
            if let Ok(mut v) = out.try_lock() {
                if v.len() < AFFINITY_OUTBOX_MAX {
                    v.push(note);
                }
            }
        }
    }

    /// Hook: the forward's answer ended on `agent` with usage `t`
    /// (`continued`: on another agent than the pick's, whose timing says
    /// nothing of a miss).
    pub fn ended(
        &mut self,
        shard: &Shard,
        m: &mut ModelState,
        agent: &Agent,
        t: &Tokens,
        continued: bool,
    ) {
        let (pick, started) = (self.pick.take(), self.started.take());
        if let Some(hit) = pick.and_then(|a| a.hit) {
            check_prediction(shard, m, agent, hit, t);
        }
        // Only an engine that reports its cache tells prefill apart.
        if let (Some(t0), false, true) = (started, continued, t.cache_reported) {
            let secs = clock::now().saturating_duration_since(t0).as_secs_f64();
            let mut cost = m.miss_cost.get();
            cost.learn(t.input.saturating_sub(t.cached), t.output, secs);
            m.miss_cost.set(cost);
        }
    }
}

/// A key or prefix hit came back: did the engine's cache hold what the
/// index predicted? An engine that reports no cached count tells
/// nothing. Few cached tokens: the entry was stale, and the agent's
/// engine keeps prefixes for less time than the entry's age.
fn check_prediction(shard: &Shard, m: &mut ModelState, agent: &Agent, hit: Holder, t: &Tokens) {
    if !t.cache_reported {
        return;
    }
    let predicted = if hit.depth > 0 {
        let per_byte = m.admission.borrow().tokens_per_byte;
        (f64::from(hit.depth) * per_byte).min(t.input as f64)
    } else {
        // A key hit predicts the previous turn's prompt: at least half.
        t.input as f64 / 2.0
    };
    let stale = (t.cached as f64) < predicted * STALE_SHARE;
    if let Some(ix) = shard.affinity.borrow_mut().as_mut() {
        if stale {
            ix.stale(agent.id, hit.age);
        } else {
            ix.confirmed(agent.id, hit.age);
        }
    }
    if stale {
        m.stats.affinity.stale += 1;
    }
}

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
}

impl AffinityStats {
    /// Add another shard's counters of the model.
    pub fn add(&mut self, o: &AffinityStats) {
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
