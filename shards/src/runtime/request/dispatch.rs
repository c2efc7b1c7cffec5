//! The driver of the decision machine on the model's shard: it asks
//! [`Decision::next`] what to do, carries the action out (forward over
//! the agent's link, wait in the capacity queue, write the error), tells
//! the machine how it ended, and records every statistic in one place
//! ([`record_attempt`], [`record_refusal`]).
//!
//! Entry point: [`serve_inference`].

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, warn};

use super::admission;
use super::continuation;
use super::forward::{attempt, build_request, record_attempt, Ask, Outcome};
use super::provider;
use super::respond;
use crate::logic::http::endpoint::Endpoint;
use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::http::probe::COLD_TOKENS_PER_BYTE;
use crate::logic::routing::affinity::{
    model_salt, peer_hash, raw_key_hash, AffinityCfg, AffinityIndex, AffinityNote, AffinityPick,
    AffinitySource, Holders, RequestKeys,
};
use crate::logic::routing::decision::{
    Action, AdmitEnd, Decision, Entry, Limits, ModelFacts, Park, Rejection, Released, RequestFacts,
    WaitEnd,
};
use crate::logic::routing::policy::Policy;
use crate::logic::routing::refusal::{QuotaLimit, QuotaRefusal, Refusal};
use crate::logic::routing::wait_queue::{Class, Fair, Place, Prefer};
use crate::logic::tenancy::quota;
use crate::runtime::state::model::admission::Admitted;
use crate::runtime::state::model::agent::Agent;
use crate::runtime::state::model::{tenant_ended, wake_for, wake_head, Claim, Waiter, Waiters};
use crate::runtime::state::pending::{Held, PendingRequest};
use crate::runtime::state::router::AFFINITY_OUTBOX_MAX;
use crate::runtime::state::scope::Client;
use crate::runtime::state::shard::{inc, Shard};
use crate::runtime::state::tenancy::{self, Principal, QuotaFacts, Ticket};
use crate::runtime::wire::bufpool::Pooled;
use crate::runtime::wire::clock;

/// What the driver does, with the agent resolved out of the pool.
enum Next {
    TakeQuota,
    Admit(Park),
    ChargeDaily,
    Forward {
        agent: Rc<Agent>,
        step: usize,
        waited: Option<Duration>,
        affinity: Option<AffinityPick>,
    },
    Wait {
        until: clock::Instant,
        place: Option<Place>,
        wake_first: Option<u64>,
        prefer: Prefer,
        /// Only a slot on its cache holders wakes it.
        pinned: bool,
    },
    Reject(Refusal),
}

/// The shard's affinity index asked for one request (the decision
/// machine's [`AffinitySource`]).
struct IndexView<'a> {
    index: &'a AffinityIndex,
    keys: RequestKeys<'a>,
    now: u32,
}

impl AffinitySource for IndexView<'_> {
    fn lookup(&self, cfg: &AffinityCfg) -> Holders {
        self.index.lookup(&self.keys, cfg, self.now)
    }
}

/// Ask the machine with the model's current facts (one short borrow);
/// a routing decision moves the model's tie-break rotation on. `keys`:
/// the request's cache-affinity keys when its policy has a prefix-aware
/// step (the index is then made on first use).
fn decide(
    shard: &Shard,
    model: &str,
    d: &mut Decision,
    keys: Option<&RequestKeys<'_>>,
    (class, min_share, tenant): (Class, &[f64; 3], u64),
    headroom: u32,
) -> Next {
    let now = clock::now();
    let unix = clock::unix_secs() as u32;
    let (action, agent) = {
        let index = keys.map(|_| shard.affinity_index());
        let view = match (keys, index.as_deref()) {
            (Some(keys), Some(index)) => Some(IndexView {
                index,
                keys: *keys,
                now: unix,
            }),
            _ => None,
        };
        let models = shard.models.borrow();
        let queue: Option<&RefCell<Waiters>> = models.get(model).map(|m| &*m.queue);
        let (pool, rotation, queue_len, running, miss): (
            &[Rc<Agent>],
            usize,
            usize,
            [u32; 3],
            Option<crate::logic::routing::miss_cost::Learned>,
        ) = match models.get(model) {
            Some(m) => (
                &m.agents,
                m.rotation,
                m.queue.borrow().len(),
                m.running,
                // Prefix-aware policies only (a few flops).
                keys.and_then(|_| {
                    m.miss_cost
                        .get()
                        .learned(m.admission.borrow().tokens_per_byte)
                }),
            ),
            // No agent ever registered here: the gates answer 404.
            None => (&[], 0, 0, [0; 3], None),
        };
        let shares = min_share.iter().any(|s| *s > 0.0);
        // The tenant runs a request and so does another: the others'
        // headroom may bind (otherwise it is under its share, or alone).
        let tenants = headroom > 0
            && queue.is_some_and(|q| {
                let q = q.borrow();
                q.tenants.tenants() > 1 && q.tenants.running(tenant) > 0
            });
        // `min_share` and the tenants' headroom: the model's free slots,
        // only counted when one of them may apply.
        let (reserved, headroom_held) = if shares || tenants {
            use crate::logic::routing::decision::Pool;
            let (mut capacity, mut in_flight) = (0u64, 0u64);
            for i in 0..pool.agent_count() {
                if let Some(f) = pool.facts(i).filter(|f| f.healthy) {
                    capacity += u64::from(f.capacity);
                    in_flight += u64::from(f.active);
                }
            }
            let by_tenant = tenants
                && queue.is_some_and(|q| {
                    let mut q = q.borrow_mut();
                    q.tenants.set_view(capacity, headroom);
                    // Woken waiters on their way to a slot count too.
                    let free = capacity.saturating_sub(in_flight.max(q.tenants.in_flight()));
                    !q.tenants.may_start(tenant, capacity, free, headroom)
                });
            let by_class = shares
                && crate::logic::routing::policy::reserved_for_others(
                    min_share,
                    class.index(),
                    capacity,
                    in_flight,
                    &running,
                );
            (by_class, by_tenant)
        } else {
            (false, false)
        };
        let facts = ModelFacts {
            pool,
            rotation,
            queue_len,
            affinity: view.as_ref().map(|v| v as &dyn AffinitySource),
            reserved_for_others: reserved,
            headroom_for_others: headroom_held,
            miss,
        };
        let action = d.next(&facts, now);
        let agent = match &action {
            Action::Forward { agent, .. } => pool.get(*agent).cloned(),
            _ => None,
        };
        (action, agent)
    };
    // The tie rotation moves on once per forward, never on a wait or a
    // refusal: a request that timed out must not move it twice and send
    // the next one back to the same (hung) agent (issue 29 #10).
    if let Action::Forward {
        agent_id, affinity, ..
    } = &action
    {
        if let Some(m) = shard.models.borrow_mut().get_mut(model) {
            m.rotation = m.rotation.wrapping_add(1);
            if let Some(pick) = affinity {
                m.stats.affinity[pick.outcome.index()] += 1;
                if pick.held {
                    m.stats.holder_waits += 1;
                    if pick.outcome == crate::logic::routing::affinity::Outcome::Overloaded {
                        m.stats.holder_wait_timeouts += 1;
                    }
                }
            }
        }
        // The agent now holds the request's key and prefixes.
        if let (Some(pick), Some(keys)) = (affinity, keys) {
            if let Some(ix) = shard.affinity.borrow_mut().as_mut() {
                ix.record_request(keys, pick.block_bytes, *agent_id, unix);
            }
            // And the other routers hear of it (never waiting: a note that
            // finds the outbox busy or full is dropped).
            if let (Some(out), Some(a)) = (&shard.router.affinity_outbox, &agent) {
                let note = AffinityNote::of(keys, pick.block_bytes, peer_hash(&a.reg.peer_id));
                if let Ok(mut v) = out.try_lock() {
                    if v.len() < AFFINITY_OUTBOX_MAX {
                        v.push(note);
                    }
                }
            }
        }
    }
    match action {
        Action::TakeQuota => Next::TakeQuota,
        Action::Admit(park) => Next::Admit(park),
        Action::ChargeDaily => Next::ChargeDaily,
        Action::Forward {
            step,
            waited,
            affinity,
            ..
        } => match agent {
            Some(agent) => Next::Forward {
                agent,
                step,
                waited,
                affinity,
            },
            None => Next::Reject(Rejection::Exhausted.into()),
        },
        Action::Wait {
            until,
            place,
            wake_first,
            prefer,
            pinned,
        } => Next::Wait {
            until,
            place,
            wake_first,
            prefer,
            pinned,
        },
        Action::Reject(r) => Next::Reject(r),
    }
}

/// Serve one inference request on its model's shard. Returns whether the
/// client connection stays open; how it ended is left in the client's
/// scope for [`super::ending::finish`].
pub async fn serve_inference(shard: &Rc<Shard>, c: &mut Client, mut p: PendingRequest) -> bool {
    c.scope.reply_headers = std::mem::take(&mut p.reply_headers);
    if let Some(h) = p.held.as_mut() {
        // Released by a wake: keepalives go on here without a longer gap.
        c.scope.keepalive = h.keepalive.take();
        c.scope.committed = h.committed;
    }
    c.scope.ending.dispatched = true;
    serve(shard, c, &mut p).await
}

/// What applies to `p` before routing, and its deadline.
fn request_facts(
    shard: &Shard,
    p: &PendingRequest,
    held: Option<&Held>,
    gated: bool,
) -> RequestFacts {
    let cfg = &shard.router.cfg;
    let keyed = matches!(p.principal, Principal::Key(_));
    let admission = gated.then(|| match held {
        // Room may come until the hold budget ends (new replicas used).
        Some(h) => Park {
            until: h.until,
            recompute: Some(Duration::from_secs(1)),
        },
        None => Park {
            until: clock::now() + cfg.admit_park_timeout,
            recompute: None,
        },
    });
    RequestFacts {
        endpoint: p.endpoint,
        stream: p.meta.stream,
        body_bytes: p.body.len(),
        // A released request's deadline starts when its routing does.
        deadline: p.received_at + cfg.request_timeout,
        entry: Entry {
            // A released request's quota was taken before its hold.
            quota: keyed && held.is_none(),
            admission,
            daily: keyed,
            released: held.map(|h| Released {
                budget: h.budget,
                retry_after: h.retry_after,
                timeout: cfg.request_timeout,
            }),
        },
    }
}

/// One request's driver state on its model's shard: what the steps of
/// the decision machine read and leave (the quota ticket, the admission
/// reservation, the hold's pending demand).
struct Run<'a> {
    shard: &'a Rc<Shard>,
    p: &'a PendingRequest,
    model: &'a str,
    policy: Arc<Policy>,
    /// Chat or messages: the estimator learns from their usage.
    llm: bool,
    /// The request's input-token estimate (admission and the daily
    /// budget both read it).
    estimate: u64,
    /// The request bytes as the agent receives them.
    request: Pooled,
    /// Released from a hold: its pending demand and keepalive state.
    held: Option<Held>,
    /// The request quota taken, until it moves into the scope's ending.
    ticket: Option<Ticket>,
    /// The admission reservation: released when the run ends.
    admitted: Admitted,
    queue_depth: usize,
    /// The last backend 502-504 answer: what the client gets when the
    /// tries run out on such answers (issue 28 #8).
    last_backend: Option<ApiError>,
    /// Its priority class (the key's, or lower as its header asked).
    class: Class,
    /// Sent to an agent at least once (counted admitted once).
    sent: bool,
    /// How it waited in the capacity queue, if it did: its tenant's
    /// order is trued up with the real usage when it is served.
    fair: Option<Fair>,
    /// Its tenant, hashed (fair order, headroom).
    tenant: u64,
    /// The slot its last wake claimed for its tenant, until it starts.
    claim: Option<Claim>,
}

/// The decision machine's loop: it says what comes next (quota,
/// admission, daily tokens, a forward, a wait, a refusal), the [`Run`]
/// carries it out and reports back.
async fn serve(shard: &Rc<Shard>, c: &mut Client, p: &mut PendingRequest) -> bool {
    inc(&shard.counters.requests);
    let cfg = &shard.router.cfg;
    let policy = shard.policy(&p.meta.model);
    // Chat and messages: the estimator learns from their usage, and the
    // admission gates apply to them when the policy has any.
    let llm = matches!(p.endpoint, Endpoint::ChatCompletions | Endpoint::Messages);
    let mut held = p.held.take();
    let facts = request_facts(shard, p, held.as_ref(), llm && policy.admission.any());
    let request = build_request(p);
    // The request bytes carry the body from here on: one copy is held for
    // the whole exchange (streams included), not two; the body permit still
    // counts it until the request is done.
    crate::runtime::wire::bufpool::give(std::mem::take(&mut p.body));
    let p = &*p;
    let model = p.meta.model.as_str();
    let class = match p.class() {
        Ok(class) => class,
        Err(m) => {
            let e = ApiError::new(ErrorCode::RequestInvalid, m);
            return respond::send_error(c, &e, true).await;
        }
    };
    let limits = Limits {
        max_tries_per_step: cfg.max_tries_per_step,
        // A released request: the hold limits already bound how many;
        // `--queue-depth 0` still means no queue at all (seed 2).
        queue_depth: if held.is_some() && cfg.queue_depth > 0 {
            usize::MAX
        } else {
            cfg.queue_depth
        },
    };
    let mut d = Decision::new(policy.clone(), facts, limits);
    let mut run = Run {
        shard,
        p,
        model,
        policy,
        llm,
        // From the probe's sums and the model's learned ratio.
        estimate: p.meta.estimate(tokens_per_byte(shard, model)),
        request,
        ticket: held.as_mut().and_then(|h| h.quota.take()),
        held,
        admitted: Admitted::default(),
        queue_depth: limits.queue_depth,
        last_backend: None,
        class,
        sent: false,
        tenant: p.principal.tenant_hash(),
        claim: None,
        fair: None,
    };
    // Cache affinity: the session key (header first, then the body's) and
    // the probe's marks, read by prefix-aware steps only.
    let keys = run
        .policy
        .steps
        .iter()
        .any(|s| s.affinity.is_some())
        .then(|| RequestKeys {
            salt: model_salt(model),
            key: SESSION_HEADERS
                .iter()
                .find_map(|h| p.head.header(h).filter(|v| !v.is_empty()))
                .map(raw_key_hash)
                .or(p.meta.affinity.body_key),
            marks: &p.meta.affinity.marks,
        });
    debug!(shard = shard.id, model, "serving request");
    loop {
        match decide(
            shard,
            model,
            &mut d,
            keys.as_ref(),
            (class, &run.policy.min_share, run.tenant),
            run.policy.tenant_headroom,
        ) {
            Next::TakeQuota => d.quota_taken(run.take_quota()),
            Next::Admit(park) => d.admitted(run.admit(c, park).await),
            Next::ChargeDaily => d.daily_charged(run.charge_daily(c), clock::now()),
            Next::Forward {
                agent,
                step,
                waited,
                affinity,
            } => {
                if let Some(keep) = run.forward(c, &mut d, agent, step, waited, affinity).await {
                    return keep;
                }
            }
            Next::Wait {
                until,
                place,
                wake_first,
                prefer,
                pinned,
            } => {
                let at = (until, place, run.queue_depth);
                let fair = run.fair_of();
                run.fair = Some(fair);
                // A slot claimed by an earlier wake and lost to another
                // request is given back before waiting again.
                run.claim = None;
                let (w, claim) = wait_for_capacity(
                    shard,
                    c,
                    model,
                    &mut d,
                    at,
                    (wake_first, prefer, pinned, fair),
                )
                .await;
                run.claim = claim;
                d.wait_ended(w, clock::now());
            }
            Next::Reject(r) => {
                let exhausted = matches!(&r, Refusal::Routing(x) if x.exhausted_policy());
                if exhausted {
                    if let Some(keep) = run.provider_fallback(c).await {
                        return keep;
                    }
                }
                record_refusal(shard, model, &d, &r, &p.principal);
                if !matches!(r, Refusal::Routing(Rejection::ClientGone)) {
                    let class = run.class;
                    with_stats(shard, model, |s| {
                        if let Some(n) = s.class_refused.get_mut(class.index()) {
                            *n += 1;
                        }
                    });
                }
                if let Some(e) = run.last_backend.take().filter(|_| exhausted) {
                    // The backends' own answer, not a generic 503.
                    return respond::send_error(c, &e, p.head.keep_alive).await;
                }
                return respond::send_refusal(c, r, model, p.head.keep_alive).await;
            }
        }
    }
}

/// Headers that carry a session key, first found wins (then the body's
/// `prompt_cache_key`, then `metadata.user_id`).
pub const SESSION_HEADERS: [&str; 1] = ["x-session-id"];

/// A predicted hit is stale when the engine read less than this share of
/// the predicted prefix from its cache.
const STALE_SHARE: f64 = 0.25;

// === impl Run ===

impl Run<'_> {
    /// Its place in a fair order (the capacity queue, the admission
    /// park): class, tenant, and the tokens it is expected to use.
    fn fair_of(&self) -> Fair {
        Fair {
            class: self.class,
            tenant: self.tenant,
            cost: self.estimate.saturating_add(self.p.meta.declared_output),
        }
    }

    /// A key or prefix hit came back: did the engine's cache hold what
    /// the index predicted? An engine that reports no cached count tells
    /// nothing. Few cached tokens: the entry was stale, and the agent's
    /// engine keeps prefixes for less time than the entry's age.
    fn check_prediction(
        &self,
        agent: &Agent,
        hit: crate::logic::routing::affinity::Holder,
        t: &crate::logic::http::usage::Tokens,
    ) {
        if !t.cache_reported {
            return;
        }
        let predicted = if hit.depth > 0 {
            (f64::from(hit.depth) * tokens_per_byte(self.shard, self.model)).min(t.input as f64)
        } else {
            // A key hit predicts the previous turn's prompt: at least half.
            t.input as f64 / 2.0
        };
        let stale = (t.cached as f64) < predicted * STALE_SHARE;
        if let Some(ix) = self.shard.affinity.borrow_mut().as_mut() {
            if stale {
                ix.stale(agent.id, hit.age);
            } else {
                ix.confirmed(agent.id, hit.age);
            }
        }
        if stale {
            with_stats(self.shard, self.model, |s| s.affinity_stale += 1);
        }
    }

    /// Every local step exhausted: the policy's fallback provider, for a
    /// chat or messages request not yet expired (spec 04 §7). `None`:
    /// no provider applies, the refusal stands.
    async fn provider_fallback(&mut self, c: &mut Client) -> Option<bool> {
        let fp = self.policy.fallback_provider.clone()?;
        let api = provider::api_of(self.p.endpoint)?;
        let keep = self.p.head.keep_alive;
        let deadline = self.p.received_at + self.shard.router.cfg.request_timeout;
        if clock::now() >= deadline {
            let e = ApiError::new(
                ErrorCode::RequestTimeout,
                "Request timed out before provider fallback could be attempted",
            );
            return Some(respond::send_error(c, &e, keep).await);
        }
        // Local occupancy is not used by a provider call.
        self.admitted = Admitted::default();
        let started = clock::now();
        let (end, status) =
            provider::fallback(self.shard, c, &fp, api, &self.request, deadline, keep).await;
        let engine = fp.engine.name();
        let labels = (
            Arc::<str>::from("cloud"),
            Arc::<str>::from(engine),
            self.p.principal.tenant_arc(),
        );
        let secs = started.elapsed().as_secs_f64();
        let ok = matches!(end, provider::Fallback::Served { .. });
        if let Some(m) = self.shard.models.borrow_mut().get_mut(self.model) {
            let s = &mut m.stats;
            s.provider_fallback += 1;
            if let Some(st) = status {
                s.provider_calls
                    .entry((engine, st))
                    .or_default()
                    .observe(&crate::runtime::state::model::stats::CLIENT_BUCKETS, secs);
            }
            if ok {
                *s.routed.entry(labels).or_default() += 1;
            } else {
                *s.failed.entry(labels).or_default() += 1;
                s.exhausted += 1;
            }
        }
        Some(match end {
            provider::Fallback::Served { status, tokens } => {
                c.scope.ending.status = status;
                c.scope.ending.relayed = true;
                c.scope.ending.tokens = tokens;
                keep && !c.scope.committed
            }
            provider::Fallback::Failed(e) => {
                warn!(
                    model = self.model,
                    provider = engine,
                    "provider fallback failed: {}",
                    e.message
                );
                respond::send_error(c, &e, keep).await
            }
            provider::Fallback::Cut => false,
        })
    }

    /// What the quotas read of this request.
    fn quota_facts<'f>(&'f self, replicas: &'f dyn Fn() -> u64) -> QuotaFacts<'f> {
        QuotaFacts {
            model: self.model,
            endpoint: self.p.endpoint,
            estimate: self.estimate,
            declared_output: self.p.meta.declared_output,
            replicas,
            burst_secs: self.shard.router.cfg.rpm_burst_secs,
        }
    }

    /// The request quota (RPM).
    fn take_quota(&mut self) -> Result<(), QuotaRefusal> {
        let replicas = || healthy_replicas(self.shard, self.model);
        let facts = self.quota_facts(&replicas);
        let t = tenancy::take_requests(&self.p.principal, &facts, clock::mono_ns())?;
        self.ticket = Some(t);
        Ok(())
    }

    /// The admission gates (B1-B4), parking as `park` says.
    async fn admit(&mut self, c: &mut Client, park: Park) -> AdmitEnd {
        let asked = admission::Request {
            policy: &self.policy.admission,
            principal: &self.p.principal,
            estimate: self.estimate,
            declared_output: self.p.meta.declared_output,
            images: self.p.meta.images,
            fraction: self.shard.router.cfg.admit_fraction,
            fair: self.fair_of(),
        };
        match admission::admit(self.shard, c, self.model, asked, park).await {
            Ok(a) => {
                self.admitted = a;
                AdmitEnd::Admitted
            }
            Err(end) => end,
        }
    }

    /// The daily token budget; the ticket and its `X-RateLimit-*`
    /// headers move into the request's scope when it passes.
    fn charge_daily(&mut self, c: &mut Client) -> Result<(), QuotaRefusal> {
        let mut ticket = self.ticket.take();
        let replicas = || healthy_replicas(self.shard, self.model);
        let facts = self.quota_facts(&replicas);
        let today = || quota::day_of(clock::unix_secs());
        if let Some(t) = ticket.as_mut() {
            tenancy::take_daily(t, &facts, today)?;
        }
        if let Some(mut t) = ticket {
            c.scope.reply_headers.append(&mut t.headers);
            c.scope.ending.ticket = Some(t);
        }
        Ok(())
    }

    /// One forward to `agent`, counted and reported to the machine;
    /// `Some(keep)` when the request is finished.
    async fn forward(
        &mut self,
        c: &mut Client,
        d: &mut Decision,
        agent: Rc<Agent>,
        step: usize,
        waited: Option<Duration>,
        affinity: Option<AffinityPick>,
    ) -> Option<bool> {
        let (shard, p) = (self.shard, self.p);
        let claimed = self.claim.take().map(Claim::started).is_some();
        let _running = ClassRunning::start(
            shard,
            self.model,
            (self.class, self.tenant, claimed),
            !self.sent,
        );
        self.sent = true;
        if let Some(w) = waited {
            let class = self.class;
            let (tenant, key) = p.principal.names();
            with_stats(shard, self.model, |s| {
                s.observe_wait(class, w.as_secs_f64());
                if let Some(t) = s.tenant(tenant, key) {
                    t.queue_waits += 1;
                    t.queue_wait_us += u64::try_from(w.as_micros()).unwrap_or(u64::MAX);
                }
            });
        }
        // A slot on an agent: a released request leaves the pending demand.
        if let Some(h) = self.held.as_mut() {
            h.demand.leave();
        }
        let deadline = d.request().deadline;
        let reserved = self.admitted.reservation.as_ref();
        // A stream that may be continued keeps what it relayed.
        let api = continuation::api_of(shard, p);
        let mut kept = api.map(|_| crate::runtime::wire::bufpool::take(16 * 1024));
        let ask = Ask {
            request: &self.request,
            deadline,
            held: reserved,
            kept: kept.as_mut(),
            splice: None,
        };
        // Prefix-aware requests time their attempt: what a miss costs.
        let started = affinity.is_some().then(clock::now);
        let (outcome, sample) = attempt(shard, c, p, &agent, ask, &mut self.last_backend).await;
        let (agent, mut outcome, sample, continued) = match (outcome, api, kept.take()) {
            (Outcome::Broken(why), Some(api), Some(kept)) => {
                let b = continuation::Broken {
                    api,
                    request: &self.request,
                    kept,
                    first: agent,
                    why,
                    deadline,
                    held: reserved,
                };
                let (a, o, s) = self.continued(c, b, step, sample).await;
                (a, o, s, true)
            }
            (o, _, kept) => {
                if let Some(k) = kept {
                    crate::runtime::wire::bufpool::give(k);
                }
                (agent, o, sample, false)
            }
        };
        // A backend's usage is bounded by what the request could produce
        // (issue 29 #3): a claim of 10^15 tokens must not lock the tenant out.
        if let Outcome::Served {
            tokens: Some(t), ..
        } = &mut outcome
        {
            let bound = crate::logic::http::usage::UsageBound {
                // The whole request's bytes: every endpoint's text is in
                // them (embedding inputs, rerank documents too).
                text_bytes: self.request.len() as u64,
                messages: p.meta.messages,
                images: p.meta.images,
                declared_output: p.meta.declared_output,
            };
            let (kept, cut) = bound.clamp(*t);
            if cut {
                warn!(model = self.model, peer_id = %agent.reg.peer_id, claimed_input = t.input, claimed_output = t.output, "usage beyond what the request could produce: clamped");
                *t = kept;
                with_stats(shard, self.model, |s| s.usage_clamped += 1);
            }
        }
        if let (
            Some(hit),
            Outcome::Served {
                tokens: Some(t), ..
            },
        ) = (affinity.and_then(|a| a.hit), &outcome)
        {
            self.check_prediction(&agent, hit, t);
        }
        if let (
            Some(t0),
            false,
            Outcome::Served {
                tokens: Some(t), ..
            },
        ) = (started, continued, &outcome)
        {
            // Only an engine that reports its cache tells prefill apart.
            if t.cache_reported {
                let secs = clock::now().saturating_duration_since(t0).as_secs_f64();
                if let Some(m) = shard.models.borrow().get(self.model) {
                    let mut cost = m.miss_cost.get();
                    cost.learn(t.input.saturating_sub(t.cached), t.output, secs);
                    m.miss_cost.set(cost);
                }
            }
        }
        if let Outcome::Served {
            tokens: Some(t), ..
        } = &outcome
        {
            // Only a request that waited: an idle queue costs nothing.
            if let Some(who) = self.fair.take() {
                if let Some(m) = shard.models.borrow().get(self.model) {
                    m.queue
                        .borrow_mut()
                        .true_up(who, t.input.saturating_add(t.output));
                }
            }
        }
        let keep = matches!(outcome, Outcome::Served { .. }) && p.head.keep_alive;
        served(shard, c, p, &agent, &outcome, &mut self.admitted, self.llm);
        let tenant = p.principal.tenant_arc();
        let ended = record_attempt(shard, self.model, &agent, step, p, tenant, outcome, sample);
        // After a continuation the client's stream has ended one way or
        // the other: nothing more may be written to it.
        (continued || !d.attempt_ended(agent.id, &ended)).then_some(keep)
    }

    /// Continue a broken stream on other agents. The tries before the
    /// last are counted here; the last one (or, when none was made, the
    /// first agent's) is returned for the caller to count.
    async fn continued(
        &self,
        c: &mut Client,
        b: continuation::Broken<'_>,
        step: usize,
        sample: Option<f64>,
    ) -> (Rc<Agent>, Outcome, Option<f64>) {
        let (shard, p) = (self.shard, self.p);
        let first = b.first.clone();
        let why = b.why.clone();
        let cont = continuation::continue_stream(shard, c, p, b).await;
        with_stats(shard, self.model, |s| {
            *s.stream_migrations.entry(cont.label).or_default() += 1;
        });
        let mut tries = cont.tries;
        let Some(last) = tries.pop() else {
            let outcome = if cont.whole {
                Outcome::Served {
                    status: 200,
                    tokens: None,
                }
            } else {
                Outcome::Failed(why)
            };
            return (first, outcome, sample);
        };
        c.scope.ending.continued_from.push(first.peer.clone());
        let tenant = p.principal.tenant_arc();
        let failed = Outcome::Failed(why);
        record_attempt(
            shard,
            self.model,
            &first,
            step,
            p,
            tenant.clone(),
            failed,
            sample,
        );
        for (a, o, s) in tries {
            c.scope.ending.continued_from.push(a.peer.clone());
            record_attempt(shard, self.model, &a, step, p, tenant.clone(), o, s);
        }
        last
    }
}

/// What an attempt leaves in the request's ending (the agent, status,
/// tokens), and what the model learns from its usage.
fn served(
    shard: &Shard,
    c: &mut Client,
    p: &PendingRequest,
    agent: &Rc<Agent>,
    outcome: &Outcome,
    admitted: &mut Admitted,
    llm: bool,
) {
    let end = &mut c.scope.ending;
    end.agent = Some(agent.clone());
    match outcome {
        Outcome::Served { status, tokens } => {
            end.status = *status;
            end.error_code = "";
            end.tokens = *tokens;
            end.relayed = true;
            if let Some(t) = tokens {
                admitted.charge_output(t.output);
                if llm && p.meta.images == 0 && *status < 400 {
                    learn(shard, &p.meta.model, t.input, p.meta.text_bytes);
                }
            }
        }
        Outcome::ClientGone => {
            end.client_gone();
            end.relayed = true;
        }
        Outcome::Failed(_) | Outcome::Broken(_) | Outcome::Full => {}
    }
}

/// The model's learned input tokens per body text byte.
fn tokens_per_byte(shard: &Shard, model: &str) -> f64 {
    shard
        .models
        .borrow()
        .get(model)
        .map_or(COLD_TOKENS_PER_BYTE, |m| {
            m.admission.borrow().tokens_per_byte
        })
}

/// Teach the model's estimator one exact prompt count.
fn learn(shard: &Shard, model: &str, prompt_tokens: u64, text_bytes: u64) {
    if let Some(m) = shard.models.borrow().get(model) {
        m.admission.borrow_mut().learn(prompt_tokens, text_bytes);
    }
}

/// Healthy agents of `model` on this (its owner) shard.
fn healthy_replicas(shard: &Shard, model: &str) -> u64 {
    shard.models.borrow().get(model).map_or(0, |m| {
        m.agents.iter().filter(|a| a.healthy()).count() as u64
    })
}

/// Count a refusal (the one place that does): quota refusals and
/// admission gates per reason and on the tenant, an exhausted policy on
/// the model (and logged).
fn record_refusal(shard: &Shard, model: &str, d: &Decision, r: &Refusal, principal: &Principal) {
    let (limited, tokens) = match r {
        Refusal::Routing(rejection) => {
            return record_rejection(shard, model, d, *rejection, principal.tenant_arc())
        }
        Refusal::HoldNoRoom { .. } => return,
        Refusal::Quota(q) => (
            q.limit == QuotaLimit::Requests,
            q.limit == QuotaLimit::Tokens,
        ),
        Refusal::Admission { error, .. } => (error.code == ErrorCode::RateLimitExceeded, false),
    };
    with_stats(shard, model, |s| {
        if !tokens {
            *s.admission_rejections.entry(r.reason()).or_default() += 1;
        }
        let (tenant, key) = principal.names();
        if let Some(t) = s.tenant(tenant, key) {
            t.rate_limited += u64::from(limited);
            t.token_limited += u64::from(tokens);
        }
    });
}

/// Queue the request (at its original place when it has one) and wait for
/// a slot until `until`, watching the client socket: a client that closes
/// its connection leaves the queue at once and never reaches a backend.
async fn wait_for_capacity(
    shard: &Shard,
    c: &mut Client,
    model: &str,
    d: &mut Decision,
    (until, place, depth): (clock::Instant, Option<Place>, usize),
    (wake_first, prefer, pinned, fair): (Option<u64>, Prefer, bool, Fair),
) -> (WaitEnd, Option<Claim>) {
    use futures::future::{select, Either};
    let queue = shard.models.borrow().get(model).map(|m| m.queue.clone());
    let Some(queue) = queue else {
        return (WaitEnd::TimedOut, None);
    };
    let (tx, mut rx) = futures::channel::oneshot::channel();
    let w = Waiter {
        tx,
        prefer,
        pinned,
        tenant: fair.tenant,
    };
    let seq = match place {
        Some(seq) => {
            let mut q = queue.borrow_mut();
            q.tenants.wait(fair.tenant);
            q.requeue(seq, w);
            seq
        }
        // A full queue: a higher class goes ahead and nobody leaves (up to
        // twice the bound); within a class, an arrival served before the
        // last waiter takes its place, and the displaced waiter's wait
        // ends (its sender dropped): refused as a full queue, as if it had
        // come last.
        None => {
            let mut q = queue.borrow_mut();
            match q.push_displacing(w, depth, fair) {
                Ok((seq, displaced)) => {
                    q.tenants.wait(fair.tenant);
                    if let Some((_, d)) = displaced {
                        q.tenants.unwait(d.tenant);
                    }
                    seq
                }
                Err(_) => return (WaitEnd::Refused, None),
            }
        }
    };
    // A newcomer that saw a free slot wakes the waiter it goes to once
    // this one is in line: itself when it comes first (a higher class; or
    // the only one the free slot's reservation admits).
    if let Some(agent) = wake_first {
        wake_for(&queue, agent);
    }
    let now = clock::now();
    d.queued(seq, now);
    let timer = monoio::time::sleep(until.saturating_duration_since(now));
    futures::pin_mut!(timer);
    let (end, claimed) = match c.unless_gone(select(&mut rx, timer)).await {
        Some(Either::Left((Ok(claimed), _))) => (WaitEnd::Woken, claimed),
        Some(Either::Left((Err(_), _))) => (WaitEnd::Refused, false),
        Some(Either::Right(_)) => (WaitEnd::TimedOut, false),
        None => (WaitEnd::ClientGone, false),
    };
    let claim = claimed.then(|| Claim::new(queue.clone(), fair.tenant));
    if end != WaitEnd::Woken {
        let mut q = queue.borrow_mut();
        if let Some(w) = q.remove(seq) {
            q.tenants.unwait(w.tenant);
        }
        drop(q);
        // Woken in the same turn as it gave up: the slot goes on (and its
        // claim is given back first).
        if let Ok(Some(claimed)) = rx.try_recv() {
            if claimed {
                tenant_ended(&queue, fair.tenant);
            }
            wake_head(&queue);
        }
    }
    if end == WaitEnd::ClientGone {
        debug!(
            model,
            "client closed its connection while queued; left the queue"
        );
    }
    (end, claim)
}

/// A request of a class and tenant in flight on its model, for
/// `min_share` and `tenant_headroom` (counted from the forward's start
/// to its end, whichever way it ends).
struct ClassRunning<'a> {
    shard: &'a Shard,
    model: &'a str,
    class: Class,
    tenant: u64,
}

impl<'a> ClassRunning<'a> {
    /// `first`: the request's first forward, counted admitted in its class.
    /// `claimed`: its wake already counted it in its tenant's requests.
    fn start(
        shard: &'a Shard,
        model: &'a str,
        (class, tenant, claimed): (Class, u64, bool),
        first: bool,
    ) -> Self {
        if let Some(m) = shard.models.borrow_mut().get_mut(model) {
            if let Some(n) = m.running.get_mut(class.index()) {
                *n += 1;
            }
            if !claimed {
                m.queue.borrow_mut().tenants.start(tenant);
            }
            if let Some(n) = m.stats.class_admitted.get_mut(class.index()) {
                *n += u64::from(first);
            }
        }
        ClassRunning {
            shard,
            model,
            class,
            tenant,
        }
    }
}

impl Drop for ClassRunning<'_> {
    fn drop(&mut self) {
        let queue = match self.shard.models.try_borrow_mut() {
            Ok(mut models) => models.get_mut(self.model).map(|m| {
                if let Some(n) = m.running.get_mut(self.class.index()) {
                    *n = n.saturating_sub(1);
                }
                m.queue.clone()
            }),
            Err(_) => None,
        };
        // The slot was freed before its tenant's count fell: a waiter
        // passed by for its tenant meanwhile may take a slot now.
        if let Some(queue) = queue {
            tenant_ended(&queue, self.tenant);
        }
    }
}

fn with_stats(
    shard: &Shard,
    model: &str,
    f: impl FnOnce(&mut crate::runtime::state::model::stats::ModelStats),
) {
    if let Some(m) = shard.models.borrow_mut().get_mut(model) {
        f(&mut m.stats);
    }
}

/// Count a rejection and log it (an exhausted policy at most once a
/// second per model, with the count it stands for).
fn record_rejection(
    shard: &Shard,
    model: &str,
    d: &Decision,
    r: Rejection,
    tenant: std::sync::Arc<str>,
) {
    if !r.exhausted_policy() {
        return;
    }
    let mut models = shard.models.borrow_mut();
    let Some(m) = models.get_mut(model) else {
        return;
    };
    m.stats.exhausted += 1;
    if r != Rejection::QueueTimeout {
        *m.stats
            .failed
            .entry(("".into(), "".into(), tenant))
            .or_default() += 1;
    }
    if let Some(n) = m.shed_log.hit(clock::now(), Duration::from_secs(1)) {
        warn!(
            model,
            capability = d.request().endpoint.capability().as_str(),
            rejected = n,
            code = r.error().code.as_str(),
            "policy_exhausted: {} (this line stands for {n} rejections since the previous one)",
            d.trail()
        );
    }
}
