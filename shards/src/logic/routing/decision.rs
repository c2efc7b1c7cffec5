//! The decision machine for one request on its model's shard (pure): the
//! whole owner-side order of a request.
//!
//! Given the model's facts ([`ModelFacts`]: its agents and their signals,
//! the capacity queue), the request's facts ([`RequestFacts`], with its
//! [`Entry`]: which quotas and gates apply, whether it was released from a
//! hold) and `now`, [`Decision::next`] answers one [`Action`], in this
//! order:
//!
//! 1. [`Action::TakeQuota`]: the request quota (a key's request not
//!    released from a hold, whose quota was taken before the hold);
//! 2. [`Action::Admit`]: the admission gates, which may park the request
//!    until a time;
//! 3. [`Action::ChargeDaily`]: the key's daily token budget;
//! 4. [`GATES`], then the policy steps: [`Action::Forward`] to an agent,
//!    [`Action::Wait`] in the capacity queue, retries;
//! 5. or [`Action::Reject`] with the one [`Refusal`], at any step; when
//!    the steps ran out and the policy names a fallback provider,
//!    [`Action::Provider`] first (once, before the deadline);
//! 6. after a forwarded stream broke mid-answer ([`Decision::stream_broke`]),
//!    [`Action::Continue`] on another agent, [`Action::Wait`] at the head
//!    of the line, or [`Action::Cut`] (`decision/continuing.rs`).
//!
//! The machine is the only decider: the shell has no second selector and
//! no second wait loop. A feature that changes where a request goes
//! grows here (or in a sibling module of this one), never in the driver.
//!
//! The runtime's driver carries each action out and reports how it ended
//! ([`Decision::quota_taken`], [`Decision::admitted`],
//! [`Decision::daily_charged`], [`Decision::attempt_ended`],
//! [`Decision::queued`], [`Decision::wait_ended`],
//! [`Decision::continuation_ended`]); every order, retry and
//! error choice is made here. Authentication and "not served here" come
//! before, on the accepting shard.
//!
//! Time comes only from the `now` arguments; the machine reads no clock.

mod continuing;
mod steps;

use std::sync::Arc;
use std::time::{Duration, Instant};

pub use self::continuing::CutReason;

use super::affinity::miss_cost;
use super::affinity::{AffinityPick, AffinitySource};
use super::failure::{Failure, Side};
use super::policy::{AgentFacts, GateCounts, Policy, Session};
pub use super::refusal::Rejection;
use super::refusal::{QuotaRefusal, Refusal};
use super::wait_queue::Prefer;
use crate::logic::http::endpoint::Endpoint;
use crate::logic::http::errors::ApiError;

/// What the machine reads of a model's agents (index order is the pool's).
pub trait Pool {
    /// Number of registered agents.
    fn agent_count(&self) -> usize;
    /// Facts of the agent at `i`.
    fn facts(&self, i: usize) -> Option<AgentFacts<'_>>;
}

/// The model's facts at one decision.
pub struct ModelFacts<'p, P: Pool + ?Sized> {
    /// Its agents.
    pub pool: &'p P,
    /// Where the tie-break starts (rotates per decision).
    pub rotation: usize,
    /// Requests waiting in the model's capacity queue.
    pub queue_len: usize,
    /// The request's cache holders, asked by `prefix-aware` steps (None:
    /// no index on this shard, or no prefix-aware step).
    pub affinity: Option<&'p dyn AffinitySource>,
    /// The model's free slots are reserved for other priority classes
    /// (`min_share`): the request waits as if the step were full.
    pub reserved_for_others: bool,
    /// The request's tenant floods, and the free slots are calm tenants'
    /// headroom (`tenant_headroom`): a
    /// newcomer waits as if the step were full (a woken waiter was
    /// already chosen for the slot).
    pub headroom_for_others: bool,
    /// What a miss and a request cost on the model's engines, once
    /// learned ([`miss_cost`]): a wait for a full holder never outlasts
    /// what its hit would save, and none is made (nor the queue reordered)
    /// where the saving is a small share of a request.
    pub miss: Option<miss_cost::Learned>,
}

/// The request's facts.
#[derive(Debug, Clone)]
pub struct RequestFacts {
    /// Which endpoint (decides the capability).
    pub endpoint: Endpoint,
    /// The client asked for a stream.
    pub stream: bool,
    /// Body size in bytes.
    pub body_bytes: usize,
    /// When the router gives up on it (`--request-timeout` after arrival;
    /// for a request released from a hold, after its admission).
    pub deadline: Instant,
    /// Which steps before routing apply.
    pub entry: Entry,
}

/// What applies to a request before its routing steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Entry {
    /// Take the request quota (a key's request, not released from a hold).
    pub quota: bool,
    /// Admission applies (chat and messages under a policy with admission
    /// fields): park at most this long.
    pub admission: Option<Park>,
    /// Charge the daily token budget (a key's request).
    pub daily: bool,
    /// Released from a hold at zero.
    pub released: Option<Released>,
}

/// How long admission may park a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Park {
    /// Give up at this instant (at or before now: no wait).
    pub until: Instant,
    /// Recompute the room this often while parked (`None`: only when
    /// something is released).
    pub recompute: Option<Duration>,
}

/// A request released from a hold (seed "After the wake").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// Its hold budget (the `model_waking` message).
    pub budget: Duration,
    /// `Retry-After` seconds of a `model_waking` answer.
    pub retry_after: u64,
    /// `--request-timeout`: its deadline starts when routing starts.
    pub timeout: Duration,
}

/// How admission ended, as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdmitEnd {
    /// Admitted.
    Admitted,
    /// A gate refused it (the error names the numbers of B1).
    Refused(super::admission::Reason, ApiError),
    /// Its park ended without room.
    WaitEnded,
    /// The client closed its connection while it was parked.
    ClientGone,
}

/// Router-wide limits the machine applies.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Tries per policy step unless the step sets its own.
    pub max_tries_per_step: u32,
    /// Capacity-queue bound per model (0: no queue).
    pub queue_depth: usize,
}

/// Checks made once, before the first policy step, in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Gate {
    /// The model has registered agents on this shard (else 404: a model
    /// whose agents all left is not found, as the spec says).
    ModelRegistered,
}

/// The gate list, checked once before the first policy step.
pub const GATES: &[Gate] = &[Gate::ModelRegistered];

/// What the driver does next.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Take the request quota; report with [`Decision::quota_taken`].
    TakeQuota,
    /// Run the admission gates, parking at most as `Park` says; report
    /// with [`Decision::admitted`].
    Admit(Park),
    /// Charge the daily token budget; report with
    /// [`Decision::daily_charged`].
    ChargeDaily,
    /// Take a slot on the agent at `agent` (index in the pool this
    /// decision read) and forward the request.
    Forward {
        /// Index in the pool.
        agent: usize,
        /// The agent's id (reported back in `attempt_ended`).
        agent_id: u64,
        /// Policy step (0: primary).
        step: usize,
        /// Time spent in the capacity queue, once, when the request waited.
        waited: Option<Duration>,
        /// A `prefix-aware` step's outcome and what it predicted.
        affinity: Option<AffinityPick>,
    },
    /// Wait in the model's capacity queue until woken or `until`.
    Wait {
        /// Give up at this instant.
        until: Instant,
        /// Go back to this original place (a waiter that lost a race).
        place: Option<crate::logic::routing::wait_queue::Place>,
        /// A slot is free on this agent but others wait: wake one of them
        /// first (the head, or a waiter it holds the prefix of).
        wake_first: Option<u64>,
        /// The holders of its prefix (prefix-aware steps): a slot freed
        /// on one of them may wake it ahead of its turn.
        prefer: Prefer,
        /// Only a slot on those holders may wake it (`holder_wait_ms`).
        pinned: bool,
        /// A continuation: at the head of the line (its answer was
        /// admitted already), charged to no tenant.
        head: bool,
        /// Its last wake found no agent it may take: pass the wake on to
        /// the next waiter before waiting again.
        pass_on: bool,
    },
    /// Answer with this refusal (nothing is written when the client is
    /// gone).
    Reject(Refusal),
    /// Every step ran out: send the request to the policy's fallback
    /// provider (spec 04 §7). The request ends with it.
    Provider,
    /// Continue the broken stream on the agent at `agent`; report with
    /// [`Decision::continuation_ended`].
    Continue {
        /// Index in the pool.
        agent: usize,
        /// The agent's id.
        agent_id: u64,
        /// Policy step it was found in.
        step: usize,
        /// How its engine continues an assistant message.
        prefill: crate::logic::http::api::continuation::Prefill,
    },
    /// The broken stream cannot be continued: cut the client's stream.
    Cut(CutReason),
}

/// How a forward attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptEnd {
    /// The response (of any status) reached the client, or the client left.
    Responded,
    /// It failed.
    Failed(Failure),
    /// The agent was full with other routers' requests (it serves
    /// several): decide again; after [`MAX_FULL_REFUSALS`] of them the
    /// agent counts as failed for this request.
    Full,
}

/// Full refusals one request takes before the refusing agent is treated
/// as failed for it (a bound for an agent that keeps refusing while it
/// reports room).
pub const MAX_FULL_REFUSALS: u32 = 64;

/// How a wait in the capacity queue ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitEnd {
    /// A slot freed or an agent arrived: try the same step again.
    Woken,
    /// The deadline passed (or the queue let the waiter go).
    TimedOut,
    /// The client closed its connection while waiting (the driver already
    /// left the queue): the request must not reach a backend.
    ClientGone,
    /// The queue was full and had no place for it: the step is full, as
    /// without a queue.
    Refused,
}

/// Where a request is in its order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Quota,
    Admission,
    Daily,
    Routing,
}

/// One request's decision state.
#[derive(Debug, Clone)]
pub struct Decision {
    policy: Arc<Policy>,
    session: Session,
    request: RequestFacts,
    limits: Limits,
    phase: Phase,
    gates_passed: bool,
    /// The last step ended with every candidate full.
    last_full: bool,
    /// Gate counts of the step the request waits in.
    waiting_counts: GateCounts,
    /// The queue place held (kept when the request loses a race).
    place: Option<crate::logic::routing::wait_queue::Place>,
    /// When it first queued (one wait observation per request).
    queued_at: Option<Instant>,
    /// A refusal already decided (sticky).
    verdict: Option<Refusal>,
    /// Full refusals taken so far.
    full_refusals: u32,
    /// The queue place it left for its last forward.
    forwarded_from: Option<crate::logic::routing::wait_queue::Place>,
    /// Until when it may wait for a full holder of its prefix
    /// (`holder_wait_ms`; set at the first such wait).
    pin_until: Option<Instant>,
    /// The wait under way is one for its holders only.
    pinned: bool,
    /// The fallback provider was chosen (at most once).
    provider_tried: bool,
    /// A broken stream being continued.
    continuing: Option<continuing::Continuing>,
}

// === impl Decision ===

impl Decision {
    /// A fresh decision under `policy` (the request's snapshot).
    pub fn new(policy: Arc<Policy>, request: RequestFacts, limits: Limits) -> Self {
        let session = Session::new(&policy, limits.max_tries_per_step);
        Decision {
            policy,
            session,
            request,
            limits,
            phase: Phase::Quota,
            gates_passed: false,
            last_full: false,
            waiting_counts: GateCounts::default(),
            place: None,
            queued_at: None,
            verdict: None,
            full_refusals: 0,
            forwarded_from: None,
            pin_until: None,
            pinned: false,
            provider_tried: false,
            continuing: None,
        }
    }

    /// The policy step in use (0: primary).
    pub fn step(&self) -> usize {
        self.session.step
    }

    /// The request's facts.
    pub fn request(&self) -> &RequestFacts {
        &self.request
    }

    /// One line per visited step with what each gate removed (for the log
    /// when the policy is exhausted).
    pub fn trail(&self) -> String {
        use std::fmt::Write;
        // One string written in place (a traced request asks each try).
        let mut out = String::with_capacity(120 * self.session.trail.len());
        for (k, (i, c)) in self.session.trail.iter().enumerate() {
            let name = self
                .policy
                .steps
                .get(*i)
                .map(|s| s.name.as_str())
                .unwrap_or("?");
            let sep = if k == 0 { "" } else { " | " };
            let _ = write!(
                out,
                "{sep}{name}: pool={} unhealthy={} capability_mismatch={} unmatched={} prev_failed={} at_capacity={} exclude_if={}",
                c.pool, c.unhealthy, c.capability, c.unmatched, c.prev_failed, c.at_capacity, c.excluded
            );
        }
        out
    }

    fn gate<P: Pool + ?Sized>(&self, gate: Gate, model: &ModelFacts<'_, P>) -> Option<Rejection> {
        match gate {
            Gate::ModelRegistered => {
                (model.pool.agent_count() == 0).then_some(Rejection::ModelNotFound)
            }
        }
    }

    fn reject(&mut self, r: impl Into<Refusal>, now: Instant) -> Action {
        self.verdict = Some(r.into());
        self.verdict_action(now)
    }

    /// The action of the verdict: the fallback provider once, where the
    /// steps ran out on a chat or messages request and the policy names
    /// one (a request already past its deadline is refused as timed out
    /// instead); otherwise the refusal.
    fn verdict_action(&mut self, now: Instant) -> Action {
        let Some(r) = &self.verdict else {
            return Action::Reject(Rejection::Exhausted.into());
        };
        // A model with no agent here goes to the provider too (issue 56):
        // no local step can serve it.
        let exhausted = matches!(r, Refusal::Routing(x) if x.exhausted_policy() || *x == Rejection::ModelNotFound);
        let api = matches!(
            self.request.endpoint,
            Endpoint::ChatCompletions | Endpoint::Messages
        );
        if exhausted && api && !self.provider_tried && self.policy.fallback_provider.is_some() {
            self.provider_tried = true;
            if now < self.request.deadline {
                return Action::Provider;
            }
            self.verdict = Some(Rejection::ProviderTimeout.into());
        }
        match &self.verdict {
            Some(r) => Action::Reject(r.clone()),
            None => Action::Reject(Rejection::Exhausted.into()),
        }
    }

    /// The step before routing due now, if any (skipping those that do
    /// not apply); entering routing starts a released request's deadline.
    fn before_routing(&mut self, now: Instant) -> Option<Action> {
        let e = self.request.entry;
        loop {
            match self.phase {
                Phase::Quota if e.quota => return Some(Action::TakeQuota),
                Phase::Quota => self.phase = Phase::Admission,
                Phase::Admission => match e.admission {
                    Some(park) => return Some(Action::Admit(park)),
                    None => self.phase = Phase::Daily,
                },
                Phase::Daily if e.daily => return Some(Action::ChargeDaily),
                Phase::Daily => self.enter_routing(now),
                Phase::Routing => return None,
            }
        }
    }

    fn enter_routing(&mut self, now: Instant) {
        self.phase = Phase::Routing;
        if let Some(r) = self.request.entry.released {
            self.request.deadline = now + r.timeout;
        }
    }

    /// The request quota was taken (`Ok`) or refused.
    pub fn quota_taken(&mut self, r: Result<(), QuotaRefusal>) {
        if self.phase != Phase::Quota {
            return;
        }
        match r {
            Ok(()) => self.phase = Phase::Admission,
            Err(q) => self.verdict = Some(Refusal::Quota(q)),
        }
    }

    /// Admission ended.
    pub fn admitted(&mut self, end: AdmitEnd) {
        if self.phase != Phase::Admission {
            return;
        }
        self.verdict = match end {
            AdmitEnd::Admitted => {
                self.phase = Phase::Daily;
                return;
            }
            AdmitEnd::Refused(reason, error) => Some(Refusal::Admission { reason, error }),
            AdmitEnd::WaitEnded => Some(match self.request.entry.released {
                // Woken, but no room before the hold budget ended.
                Some(r) => Refusal::HoldNoRoom {
                    budget: r.budget,
                    retry_after: r.retry_after,
                },
                None => {
                    let reason = super::admission::Reason::B2;
                    Refusal::Admission {
                        reason,
                        error: reason.error(),
                    }
                }
            }),
            AdmitEnd::ClientGone => Some(Rejection::ClientGone.into()),
        };
    }

    /// The daily token budget was charged (`Ok`) or refused; `now`
    /// starts a released request's deadline.
    pub fn daily_charged(&mut self, r: Result<(), QuotaRefusal>, now: Instant) {
        if self.phase != Phase::Daily {
            return;
        }
        match r {
            Ok(()) => self.enter_routing(now),
            Err(q) => self.verdict = Some(Refusal::Quota(q)),
        }
    }

    /// The next action for this request.
    pub fn next<P: Pool + ?Sized>(&mut self, model: &ModelFacts<'_, P>, now: Instant) -> Action {
        if self.verdict.is_some() {
            return self.verdict_action(now);
        }
        if self.continuing.is_some() {
            return self.next_continuation(model, now);
        }
        if let Some(a) = self.before_routing(now) {
            return a;
        }
        if !self.gates_passed {
            for g in GATES {
                if let Some(r) = self.gate(*g, model) {
                    return self.reject(r, now);
                }
            }
            self.gates_passed = true;
        }
        // One reference count: the steps are read while the session moves.
        let policy = self.policy.clone();
        while let Some(step) = policy.steps.get(self.session.step) {
            let choice = self.choose(step, model, now);
            if let Some(a) = self.act(step, model, choice, now) {
                return a;
            }
        }
        let r = self.out_of_steps(model);
        self.reject(r, now)
    }

    /// The driver queued the request at `seq`.
    pub fn queued(&mut self, seq: crate::logic::routing::wait_queue::Place, now: Instant) {
        if self.continuing.is_some() {
            // A continuation's place is at the head, never kept.
            return;
        }
        self.place = Some(seq);
        self.queued_at.get_or_insert(now);
    }

    /// The wait ended (the driver already left the queue on a timeout).
    pub fn wait_ended(&mut self, end: WaitEnd, now: Instant) {
        if let Some(c) = self.continuing.as_mut() {
            c.wait_ended(end);
            return;
        }
        match end {
            // Same step again; the place is kept if it loses the race.
            WaitEnd::Woken => {}
            // The wait for its holders is over, not its wait budget: the
            // same step again, now free to go anywhere, at the same place.
            WaitEnd::TimedOut if self.pinned && now < self.request.deadline => {
                self.pinned = false;
            }
            WaitEnd::TimedOut => {
                self.place = None;
                self.session
                    .trail
                    .push((self.session.step, self.waiting_counts));
                self.session.advance();
                if self.session.exhausted() || now >= self.request.deadline {
                    self.verdict = Some(Rejection::QueueTimeout.into());
                }
            }
            WaitEnd::ClientGone => {
                self.place = None;
                self.verdict = Some(Rejection::ClientGone.into());
            }
            WaitEnd::Refused => {
                self.place = None;
                self.session
                    .trail
                    .push((self.session.step, self.waiting_counts));
                self.session.advance();
            }
        }
    }

    /// A forward to `agent_id` ended. Returns whether the request goes on
    /// (call [`Decision::next`]); `false`: it is finished.
    pub fn attempt_ended(&mut self, agent_id: u64, end: &AttemptEnd) -> bool {
        match end {
            AttemptEnd::Responded => false,
            AttemptEnd::Full => {
                // Another router took the slot first: back to its place in
                // the line, not to the end of it.
                self.place = self.forwarded_from.take();
                self.full_refusals += 1;
                if self.full_refusals >= MAX_FULL_REFUSALS {
                    self.session.record_failure(&self.policy, agent_id);
                }
                true
            }
            AttemptEnd::Failed(f) if f.retryable() => {
                self.session.record_failure(&self.policy, agent_id);
                true
            }
            AttemptEnd::Failed(f) if f.side == Side::Router => {
                self.verdict = Some(Rejection::AgentTimeout.into());
                true
            }
            // Part of the response already reached the client.
            AttemptEnd::Failed(_) => false,
        }
    }
}

#[cfg(test)]
mod tests;
