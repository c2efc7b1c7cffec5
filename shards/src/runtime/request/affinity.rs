//! Cache affinity (issue 30), the request's side: its keys for the
//! decision's prefix-aware steps, and the bookkeeping at the driver's
//! fixed hooks: [`RequestAffinity::forwarded`] (the index learns
//! where the prefix went, the other routers hear of it, the decision is
//! counted) and [`RequestAffinity::ended`] (was the predicted hit real;
//! what a miss cost). The index itself is the shard's
//! ([`crate::runtime::state::shard::Shard::affinity`]), its counters and
//! metric families the model's ([`crate::runtime::state::model::affinity`]);
//! the pure parts
//! are in [`crate::logic::routing::affinity`] and
//! [`crate::logic::routing::affinity::miss_cost`].

use crate::logic::http::api::usage::Tokens;
use crate::logic::routing::affinity::{
    model_salt, peer_hash, predicted_tokens, raw_key_hash, AffinityCfg, AffinityIndex,
    AffinityNote, AffinityPick, AffinitySource, Holder, Holders, Outcome, RequestKeys,
};
use crate::logic::routing::policy::Policy;
use crate::runtime::state::model::agent::Agent;
use crate::runtime::state::model::ModelState;
use crate::runtime::state::pending::PendingRequest;
use crate::runtime::state::router::AFFINITY_OUTBOX_MAX;
use crate::runtime::state::shard::Shard;
use crate::runtime::wire::clock;

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

    /// The last forward's pick as its trace shows it.
    pub fn traced(&self) -> Option<AffinityPick> {
        self.pick
    }

    /// Hook: the forward to `agent` failed; it no longer holds the
    /// request's session key (the retry's agent does).
    pub fn failed(&mut self, shard: &Shard, agent: &Agent) {
        self.pick = None;
        self.started = None;
        if let (Some(keys), Some(ix)) = (self.keys.as_ref(), shard.affinity.borrow_mut().as_mut()) {
            ix.forget_key(keys, agent.id);
        }
    }

    /// Hook: the forward's answer ended on `agent` with usage `t`
    /// (`continued`: on another agent than the pick's, whose timing says
    /// nothing of a miss).
    pub fn ended(&mut self, m: &mut ModelState, agent: &Agent, t: &Tokens, continued: bool) {
        let (pick, started) = (self.pick.take(), self.started.take());
        if let (Some(pick), true) = (pick, t.cache_reported) {
            // The cache hit three ways: what the index predicted, what
            // the pick captured (it went to that holder), what the
            // engine delivered.
            let per_byte = m.admission.borrow().tokens_per_byte;
            let predicted = pick
                .predicted
                .map_or(0, |h| predicted_tokens(&h, per_byte, t.input));
            let captured = if pick.hit.is_some() { predicted } else { 0 };
            m.stats.affinity.cache_tokens(predicted, captured, t.cached);
            // Per agent: predicted on the holder, captured by the agent
            // that served it (the holder, on a hit).
            let holder = pick.predicted.and_then(|h| {
                m.agents
                    .iter()
                    .find(|a| a.id & 0xffff_ffff == u64::from(h.agent))
            });
            if let Some(h) = holder {
                h.cache_predicted
                    .set(h.cache_predicted.get().saturating_add(predicted));
            }
            agent
                .cache_captured
                .set(agent.cache_captured.get().saturating_add(captured));
        }
        if let Some(hit) = pick.and_then(|a| a.hit) {
            check_prediction(m, hit, t);
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
/// nothing. Few cached tokens: the entry was stale (counted; the index
/// keeps the holder, which re-prefilled the prefix for this request:
/// [`AffinityIndex`]'s `live`).
fn check_prediction(m: &mut ModelState, hit: Holder, t: &Tokens) {
    if !t.cache_reported {
        return;
    }
    // A key hit predicts the previous turn's prompt: at least half.
    let per_byte = m.admission.borrow().tokens_per_byte;
    let predicted = predicted_tokens(&hit, per_byte, t.input) as f64;
    if (t.cached as f64) < predicted * STALE_SHARE {
        m.stats.affinity.stale += 1;
    }
}

/// This shard's index as notes per model: (model, note), each note one
/// agent's hashes (at most [`crate::logic::routing::affinity::NOTE_HASHES`]),
/// for the process replacing this one (issue 54), which records them as
/// it records other routers' notes: a conversation keeps its engine
/// across an upgrade.
pub fn dump(shard: &Shard) -> Vec<(String, AffinityNote)> {
    let entries = match shard.affinity.borrow().as_ref() {
        Some(ix) => ix.entries(),
        None => return Vec::new(),
    };
    let agents: std::collections::HashMap<u64, (String, u64)> = shard
        .all_agents()
        .iter()
        .map(|a| (a.id, (a.reg.model.clone(), peer_hash(&a.reg.peer_id))))
        .collect();
    let mut open: std::collections::HashMap<u64, AffinityNote> = Default::default();
    let mut out = Vec::new();
    for (hash, agent) in entries {
        let Some((model, peer)) = agents.get(&agent) else {
            continue;
        };
        let n = open.entry(agent).or_insert_with(|| AffinityNote {
            salt: model_salt(model),
            peer: *peer,
            ..AffinityNote::default()
        });
        if let Some(slot) = n.hashes.get_mut(usize::from(n.len)) {
            *slot = hash;
            n.len += 1;
        }
        if usize::from(n.len) == n.hashes.len() {
            out.push((model.clone(), *n));
            n.len = 0;
        }
    }
    for (agent, n) in open {
        if let (Some((model, _)), true) = (agents.get(&agent), n.len > 0) {
            out.push((model.clone(), n));
        }
    }
    out
}
