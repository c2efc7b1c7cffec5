//! Hold at zero on the accepting shard (seed hold-at-zero): a request for
//! a model the sibling map places here with `scale_from_zero`, while no
//! agent serves it, is charged its request quota, counted in the pending
//! demand, kept alive with keepalive bytes, and released when an agent of
//! the model registers (every shard hears of it by a `Woken` message);
//! then it continues as a normal request on the model's shard, carrying
//! its keepalives and hold budget ([`crate::runtime::state::pending::Held`]). Not woken
//! within the budget: `503 model_waking`.
//!
//! Entry point: [`hold`].

use std::rc::Rc;
use std::time::Duration;

use crate::logic::http::api::probe::COLD_TOKENS_PER_BYTE;
use crate::logic::http::endpoint::Endpoint;
use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::link::control::Capability;
use crate::logic::routing::admission;
use crate::logic::routing::wait_queue::Fair;
use crate::logic::sites::hold::{self as pure, Ticket, Waking};
use crate::logic::sites::Kind;
use crate::logic::tenancy::quota;
use crate::runtime::request::{respond, spans};
use crate::runtime::state::hold_book::{DemandGuard, HeldWaiter, Release};
use crate::runtime::state::pending::{Held, PendingRequest};
use crate::runtime::state::scope::{Client, KeepAlive};
use crate::runtime::state::shard::Shard;
use crate::runtime::state::tenancy::{self, Principal, QuotaFacts};
use crate::runtime::wire::clock;

/// How a hold ended.
pub enum HoldEnd {
    /// Answered here (refused, expired, the client left); `keep`.
    Answered(bool),
    /// Woken: serve it on `owner`.
    Released(Box<PendingRequest>, usize),
    /// The process replacing this one takes it over (issue 54), with
    /// its hold state.
    Carry(
        Box<PendingRequest>,
        crate::logic::system::upgrade::CarriedHold,
    ),
}

/// The hold budget of `model` when the map places it on this site, for
/// the endpoint's kind, with `scale_from_zero` (else `None`: not held).
pub fn holdable(shard: &Shard, ep: Endpoint, model: &str) -> Option<Duration> {
    let local = shard.router.cfg.site_id.as_deref()?;
    let kind = Kind::of(ep)?;
    let map = shard.site_map()?;
    let default = shard.router.cfg.wake_hold_budget;
    crate::logic::sites::serving::hold_budget(&map, model, kind, local, default)
}

/// The shard that holds every held request of `model` (a wake releases
/// them from one place, in hold order): the model's shard when it has
/// had one, else a hash of its name (and the model's first agent is then
/// owned there: [`crate::runtime::state::router::Router::reserve`]).
pub fn hold_shard(router: &crate::runtime::state::router::Router, model: &str) -> usize {
    crate::runtime::state::hold_book::hold_shard_of(
        router.directory.load().assigned(model),
        model,
        router.mesh.len(),
    )
}

/// Whose share of the per-key hold limit a request takes: its key, or
/// without one its client address (one anonymous client cannot take the
/// whole hold room, issue 29 #9).
fn identity(p: &Principal, addr: Option<std::net::IpAddr>) -> String {
    match (p, addr) {
        (Principal::Key(c), _) => c.key.key_id.to_string(),
        (_, Some(a)) => format!("addr:{a}"),
        _ => "anonymous".into(),
    }
}

/// Hold `p` for `budget`; see the module doc.
pub async fn hold(
    shard: &Rc<Shard>,
    c: &mut Client,
    mut p: PendingRequest,
    budget: Duration,
) -> HoldEnd {
    let keep = p.head.keep_alive;
    let model = p.meta.model.to_string();
    // Held by the process this one replaced: the hold goes on where it
    // was (its time, keepalives and quota taken there).
    let carried = p.carried.take();
    let now = clock::now();
    let (started, budget) = match &carried {
        Some(h) => (
            now.checked_sub(Duration::from_millis(h.held_ms))
                .unwrap_or(now),
            Duration::from_millis(h.budget_ms),
        ),
        None => (now, budget),
    };
    let until = started + budget;
    let book = shard.router.holds.clone();
    let retry_after = pure::retry_after(budget, book.wake_p90(&model));
    let quota = match &carried {
        Some(h) => matches!(p.principal, Principal::Key(_))
            .then(|| tenancy::Ticket::carried(&p.principal, &model, h.daily)),
        None => match quota_before_hold(shard, c, &p, &model).await {
            Ok(q) => q,
            Err(end) => return end,
        },
    };
    // The quota taken is settled by the request's one ending, whichever
    // way the hold ends (it travels with a released request).
    let (place, mut demand) = match enter_ledger(shard, c, &p, &model, budget, started).await {
        Ok(t) => t,
        Err(end) => return end,
    };
    c.conn.trim();
    p.body.shrink_to_fit();
    // A held body counts under --wake-hold-max-total, never under the
    // awake models' body budget: held requests cannot starve them
    // (issue 29 #9).
    p.body_permit.release();
    start_keepalives(shard, c, &p, started);
    if let Some(h) = &carried {
        c.scope.committed = h.committed;
        if let (Some(k), Some(ms)) = (c.scope.keepalive.as_mut(), h.keepalive_in_ms) {
            k.next = now + Duration::from_millis(ms);
        }
    }
    let fair = fair_of(&p);
    let waited = wait_for_wake(shard, c, &model, p.endpoint.capability(), fair, until).await;
    let (outcome, answer) = match waited {
        Waited::Owner(owner) => {
            drop(place);
            book.outcome(&model, "woken", started.elapsed());
            spans::held(&mut c.scope, started, budget, "woken");
            p.held = Some(Held {
                until,
                budget,
                retry_after,
                keepalive: c.scope.keepalive.take(),
                committed: c.scope.committed,
                demand,
                quota,
            });
            p.reply_headers = std::mem::take(&mut c.scope.reply_headers);
            return HoldEnd::Released(Box::new(p), owner);
        }
        Waited::HandOver => {
            drop(place);
            demand.leave();
            book.outcome(&model, "handed_over", started.elapsed());
            let now = clock::now();
            let carried = crate::logic::system::upgrade::CarriedHold {
                held_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                budget_ms: u64::try_from(budget.as_millis()).unwrap_or(u64::MAX),
                keepalive_in_ms: c.scope.keepalive.as_ref().map(|k| {
                    u64::try_from(k.next.saturating_duration_since(now).as_millis()).unwrap_or(0)
                }),
                committed: c.scope.committed,
                daily: quota.as_ref().and_then(tenancy::Ticket::reserved),
                request_id: c.scope.request_id.as_str().to_string(),
                model: model.clone(),
            };
            // Its quota is settled where it ends, never here.
            drop(quota);
            return HoldEnd::Carry(Box::new(p), carried);
        }
        Waited::ClientGone => ("cancelled", None),
        Waited::Unplaced => (
            "unplaced",
            Some(ApiError::new(
                ErrorCode::ModelNotFound,
                "No agents registered for this model",
            )),
        ),
        Waited::ShuttingDown => (
            "shutdown",
            Some(pure::waking(&model, Waking::ShuttingDown, budget).retry_after(retry_after)),
        ),
        Waited::Expired => (
            "expired",
            Some(pure::waking(&model, Waking::Expired, budget).retry_after(retry_after)),
        ),
    };
    demand.leave();
    book.outcome(&model, outcome, started.elapsed());
    spans::held(&mut c.scope, started, budget, outcome);
    c.scope.ending.ticket = quota;
    let Some(e) = answer else {
        drop(place);
        c.scope.ending.client_gone();
        return HoldEnd::Answered(false);
    };
    // Shutting down: the connection closes after the answer.
    let keep = keep && !matches!(waited, Waited::ShuttingDown);
    let k = respond::send_error(c, &e, keep).await;
    // Held until its answer is written: a draining router waits for it.
    drop(place);
    HoldEnd::Answered(k && !c.scope.committed)
}

/// Quota, B1 caps and the daily budget before the hold (issue 28 #3): a
/// request that would be refused after the wake is refused at once,
/// before it counts in the pending demand and wakes the model; a holdable
/// model counts one replica (seed "Quota while held"). The quota's
/// `X-RateLimit-*` headers go into the scope, so the committed head of a
/// held request carries them (spec 07 §7).
async fn quota_before_hold(
    shard: &Shard,
    c: &mut Client,
    p: &PendingRequest,
    model: &str,
) -> Result<Option<tenancy::Ticket>, HoldEnd> {
    let keep = p.head.keep_alive;
    let one = || 1;
    let estimate = p.meta.estimate(COLD_TOKENS_PER_BYTE);
    let facts = QuotaFacts {
        model,
        endpoint: p.endpoint,
        estimate,
        declared_output: p.meta.declared_output,
        replicas: &one,
        burst_secs: shard.router.cfg.rpm_burst_secs,
    };
    let refused = |r: &tenancy::QuotaRefusal| {
        let (tenant, key) = p.principal.names();
        let requests = r.limit == tenancy::QuotaLimit::Requests;
        shard.router.holds.quota_refused(tenant, key, requests);
    };
    let mut ticket = None;
    if matches!(p.principal, Principal::Key(_)) {
        match tenancy::take_requests(&p.principal, &facts, clock::mono_ns()) {
            Ok(t) => ticket = Some(t),
            Err(r) => {
                refused(&r);
                return Err(HoldEnd::Answered(
                    respond::send_quota_refusal(c, r, keep).await,
                ));
            }
        }
    }
    let policy = shard.policy(model);
    let llm = p.endpoint.generates();
    if llm && policy.admission.any() {
        if let Err(e) = admission::caps(&policy.admission, estimate, p.meta.images) {
            return Err(HoldEnd::Answered(respond::send_error(c, &e, keep).await));
        }
        let rates = crate::runtime::request::admission::rates_before_hold(
            shard,
            model,
            &policy.admission,
            &p.principal,
            estimate,
        );
        if let Err(reason) = rates {
            let e = reason.error();
            return Err(HoldEnd::Answered(respond::send_error(c, &e, keep).await));
        }
    }
    if let Some(t) = ticket.as_mut() {
        let today = || quota::day_of(clock::unix_secs());
        if let Err(r) = tenancy::take_daily_reserving(t, &facts, today).await {
            refused(&r);
            return Err(HoldEnd::Answered(
                respond::send_quota_refusal(c, r, keep).await,
            ));
        }
        c.scope.reply_headers.append(&mut t.headers);
    }
    Ok(ticket)
}

/// A place under the hold limits and in the pending demand, or `503
/// model_waking` (`Retry-After: 5`) when the limits are full.
async fn enter_ledger(
    shard: &Shard,
    c: &mut Client,
    p: &PendingRequest,
    model: &str,
    budget: Duration,
    started: clock::Instant,
) -> Result<(HeldPlace, DemandGuard), HoldEnd> {
    let book = &shard.router.holds;
    let ticket = Ticket {
        identity: identity(&p.principal, c.conn.stream.peer_addr().ok().map(|a| a.ip())),
        model: model.to_string(),
        bytes: p.body.len() as u64,
        client_id: pure::client_id(
            p.head.header("x-client-request-id"),
            p.head.header("x-request-id"),
        ),
    };
    let limited = {
        let mut b = book.lock();
        let r = b.ledger.hold(&ticket, shard.router.cfg.hold_limits);
        if r.is_ok() {
            b.waking_since.entry(model.to_string()).or_insert(started);
        }
        r
    };
    if let Err(full) = limited {
        book.outcome(model, "full", Duration::ZERO);
        let e = pure::waking(model, Waking::Full(full), budget).retry_after(5);
        return Err(HoldEnd::Answered(
            respond::send_error(c, &e, p.head.keep_alive).await,
        ));
    }
    let demand = DemandGuard::new(book.clone(), ticket.clone());
    let place = HeldPlace {
        book: book.clone(),
        ticket,
    };
    Ok((place, demand))
}

/// A request's place under the hold limits, given back when dropped: when
/// it is released to an agent, or once its answer is written.
struct HeldPlace {
    book: std::sync::Arc<crate::runtime::state::hold_book::HoldBook>,
    ticket: Ticket,
}

impl Drop for HeldPlace {
    fn drop(&mut self) {
        self.book.lock().ledger.unhold(&self.ticket);
    }
}

/// Keepalives every `--wake-keepalive` while held (none when it is 0).
fn start_keepalives(shard: &Shard, c: &mut Client, p: &PendingRequest, started: clock::Instant) {
    let every = shard.router.cfg.wake_keepalive;
    if every.is_zero() {
        return;
    }
    let stream = p.meta.stream;
    c.scope.keepalive = Some(KeepAlive {
        every,
        next: started + every,
        head: respond::committed_head(&c.scope, stream),
        bytes: pure::keepalive(stream),
        stream,
        anthropic: p.endpoint == Endpoint::Messages,
    });
}

/// Its class, tenant and estimated tokens: the release's order. (An
/// invalid priority header is answered 400 once served; here it counts
/// as the key's class.)
fn fair_of(p: &PendingRequest) -> Fair {
    Fair {
        // A header that would raise it is refused when the request is
        // served; here it keeps its key's class.
        class: p.class().unwrap_or(p.principal.key_class()),
        tenant: p.principal.tenant_hash(),
        cost: p
            .meta
            .estimate(COLD_TOKENS_PER_BYTE)
            .saturating_add(p.meta.declared_output),
    }
}

/// How a held request's wait ended.
enum Waited {
    /// An agent registered: serve it on this shard.
    Owner(usize),
    /// The hold budget ended.
    Expired,
    /// The client closed its connection.
    ClientGone,
    /// The sibling map no longer places the model here.
    Unplaced,
    /// The router is shutting down.
    ShuttingDown,
    /// The process replacing this one takes it over.
    HandOver,
}

/// Wait for an agent of `model` with the request's capability until
/// `until`, watching the client (an agent of another kind registered
/// under the name does not release it: issue 28 #5).
async fn wait_for_wake(
    shard: &Shard,
    c: &mut Client,
    model: &str,
    cap: Capability,
    fair: Fair,
    until: clock::Instant,
) -> Waited {
    use futures::future::{select, Either};
    loop {
        let (tx, rx) = futures::channel::oneshot::channel();
        shard
            .held
            .borrow_mut()
            .entry(model.to_string())
            .or_default()
            .push(HeldWaiter { tx, fair });
        // Registered between the owner check and now: no wait.
        if let Some(o) = shard.owner_with(model, cap) {
            return Waited::Owner(o);
        }
        let timer = monoio::time::sleep(until.saturating_duration_since(clock::now()));
        futures::pin_mut!(timer);
        match c.unless_gone(select(rx, timer)).await {
            None => return Waited::ClientGone,
            Some(Either::Left((Ok(Release::Unplaced), _))) => return Waited::Unplaced,
            Some(Either::Left((Ok(Release::ShuttingDown), _))) => return Waited::ShuttingDown,
            Some(Either::Left((Ok(Release::HandOver), _))) => return Waited::HandOver,
            Some(Either::Left(_)) => {
                // Woken (or the room was cleared): served here now?
                if let Some(o) = shard.owner_with(model, cap) {
                    return Waited::Owner(o);
                }
                if clock::now() >= until {
                    return Waited::Expired;
                }
            }
            Some(Either::Right(_)) => return Waited::Expired,
        }
    }
}

/// An agent of `model` registered: release every request this shard
/// holds for it, in arrival order.
pub fn wake(shard: &Shard, model: &str) {
    let waiters = shard.held.borrow_mut().remove(model).unwrap_or_default();
    // Woken in the fair order: the first to run take the free slots,
    // the others queue (fairly) in the capacity queue.
    let who: Vec<_> = waiters
        .iter()
        .map(|w| (w.fair.class, w.fair.tenant, w.fair.cost))
        .collect();
    let mut waiters: Vec<Option<HeldWaiter>> = waiters.into_iter().map(Some).collect();
    for i in pure::release_order(&who) {
        if let Some(w) = waiters.get_mut(i).and_then(Option::take) {
            let _ = w.tx.send(Release::Woken);
        }
    }
}

/// The sibling map changed: requests held for a model no longer holdable
/// here fail as before.
pub fn map_changed(shard: &Shard) {
    let models: Vec<String> = shard.held.borrow().keys().cloned().collect();
    for m in models {
        let still = [
            Endpoint::ChatCompletions,
            Endpoint::Embeddings,
            Endpoint::Rerank,
        ]
        .into_iter()
        .any(|ep| holdable(shard, ep, &m).is_some());
        if !still {
            let waiters = shard.held.borrow_mut().remove(&m).unwrap_or_default();
            for w in waiters {
                let _ = w.tx.send(Release::Unplaced);
            }
        }
    }
}

/// Held requests handed over per batch, and the pause between batches
/// (10,000 in about 2.4 s; their keepalives go on meanwhile): carrying
/// them at once stalled the streams relayed beside them by 0.5 s, 128
/// every 4 ms still added 80-100 ms at p99 (perf/2026-12-05-upgrade).
const HAND_OVER_BATCH: usize = 64;
const HAND_OVER_PAUSE: Duration = Duration::from_millis(15);

/// The process replacing this one takes every held request over, in the
/// order a wake would release them (issue 54), a batch at a time.
pub fn hand_over(shard: &Rc<Shard>) {
    let shard = shard.clone();
    monoio::spawn(async move {
        loop {
            let Some(model) = shard.held.borrow().keys().next().cloned() else {
                return;
            };
            let waiters = shard.held.borrow_mut().remove(&model).unwrap_or_default();
            let who: Vec<_> = waiters
                .iter()
                .map(|w| (w.fair.class, w.fair.tenant, w.fair.cost))
                .collect();
            let mut waiters: Vec<Option<HeldWaiter>> = waiters.into_iter().map(Some).collect();
            for (n, i) in pure::release_order(&who).into_iter().enumerate() {
                if let Some(w) = waiters.get_mut(i).and_then(Option::take) {
                    let _ = w.tx.send(Release::HandOver);
                }
                if n % HAND_OVER_BATCH == HAND_OVER_BATCH - 1 {
                    monoio::time::sleep(HAND_OVER_PAUSE).await;
                }
            }
        }
    });
}

/// The router is shutting down: every held request is answered now.
pub fn shut_down(shard: &Shard) {
    let all: Vec<_> = shard.held.borrow_mut().drain().collect();
    for (_, waiters) in all {
        for w in waiters {
            let _ = w.tx.send(Release::ShuttingDown);
        }
    }
}
