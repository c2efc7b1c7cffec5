//! A request against its key's quota buckets: the request quota
//! ([`take_requests`]), the daily token budget ([`take_daily`]), the
//! [`Ticket`] that settles them once when the request ends.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::keys::Principal;
use crate::logic::http::api::usage::Tokens;
use crate::logic::http::endpoint::Endpoint;
use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::routing::refusal::{QuotaLimit, QuotaRefusal};
use crate::logic::tenancy::auth::Limits;
use crate::logic::tenancy::quota::{self, Daily, Rate, Verdict};
use crate::runtime::services::buckets::{note_spend, Bucket, Lease, LeaseAnswer};
use crate::runtime::wire::clock;

/// The refusal of a quota-limited request while Redis is away and the
/// failure mode is closed.
pub(crate) fn closed(limit: QuotaLimit) -> QuotaRefusal {
    QuotaRefusal {
        error: ApiError::new(
            ErrorCode::RateLimitExceeded,
            "quota state unavailable (shared state unreachable); retry shortly",
        )
        .retry_after(1),
        headers: vec![("retry-after-ms", b"1000".to_vec())],
        limit,
    }
}

/// Quota taken by an admitted request; [`Ticket::settle`] trues it up once.
#[derive(Debug, Default)]
pub struct Ticket {
    /// Headers for the response (`X-RateLimit-*`).
    pub headers: Vec<(&'static str, Vec<u8>)>,
    /// The daily bucket, the day, what was charged (estimate plus the
    /// declared output: reserved, issue 29 #8) and the input estimate.
    daily: Option<(Arc<Bucket>, u64, u64, u64)>,
    /// The bucket and daily limit the token charge uses (after admission).
    pending: Option<(Arc<Bucket>, u64)>,
}

/// The request facts quotas read.
#[derive(Clone, Copy)]
pub struct QuotaFacts<'a> {
    /// The (resolved) model.
    pub model: &'a str,
    /// The endpoint (daily tokens: chat and messages only).
    pub endpoint: Endpoint,
    /// Input-token estimate.
    pub estimate: u64,
    /// Declared output tokens.
    pub declared_output: u64,
    /// Healthy replicas of the model now (per-model RPM scales with it,
    /// floored at 1 so a draining model is never unlimited); asked only
    /// for per-model keys.
    pub replicas: &'a dyn Fn() -> u64,
    /// `HIVENET_ROUTER_RPM_BURST_SECONDS` (0: burst = the whole minute).
    pub burst_secs: u64,
}

/// Decimal digits of `v` (itoa: no formatting machinery on the request path).
pub(crate) fn num(v: u64) -> Vec<u8> {
    itoa::Buffer::new().format(v).as_bytes().to_vec()
}

/// The refusal of a per-model key asking for a model it declares no
/// quota for (also answered on the accepting shard, before any hand-off).
pub fn undeclared(model: &str) -> QuotaRefusal {
    QuotaRefusal {
        error: ApiError::new(
            ErrorCode::RateLimitExceeded,
            format!("no quota declared for model {model} on this API key"),
        ),
        headers: vec![("X-RateLimit-Remaining-Requests", b"0".to_vec())],
        limit: QuotaLimit::Requests,
    }
}

/// Take one request from `b` at `rate` (compare-and-swap over GCRA).
pub(crate) fn take_request(b: &Bucket, rate: Rate, now_ns: u64) -> Verdict {
    let mut cur = b.rpm.load(Ordering::Relaxed);
    loop {
        match quota::take(cur, now_ns, rate) {
            Verdict::Admit { tat, remaining } => {
                match b
                    .rpm
                    .compare_exchange_weak(cur, tat, Ordering::AcqRel, Ordering::Relaxed)
                {
                    Ok(_) => return Verdict::Admit { tat, remaining },
                    Err(now) => cur = now,
                }
            }
            deny => return deny,
        }
    }
}

/// Check and charge the daily budget of `b` (compare-and-swap).
pub(crate) fn take_tokens(b: &Bucket, day: u64, limit: u64, need: u64, charge: u64) -> Daily {
    let mut cur = b.daily.load(Ordering::Relaxed);
    loop {
        match quota::charge(cur, day, limit, need, charge) {
            Daily::Charged { state, remaining } => {
                match b
                    .daily
                    .compare_exchange_weak(cur, state, Ordering::AcqRel, Ordering::Relaxed)
                {
                    Ok(_) => return Daily::Charged { state, remaining },
                    Err(now) => cur = now,
                }
            }
            refused => return refused,
        }
    }
}

/// Requests, then daily tokens, in one call (the admission gates run
/// between the two in the request path: [`take_requests`], [`take_daily`]).
pub fn admit(
    p: &Principal,
    f: QuotaFacts<'_>,
    now_ns: u64,
    day: impl FnOnce() -> u64,
) -> Result<Ticket, QuotaRefusal> {
    let mut t = take_requests(p, &f, now_ns)?;
    take_daily(&mut t, &f, day)?;
    Ok(t)
}

/// The request quota (RPM) of a keyed request; the ticket remembers the
/// bucket its daily charge will use.
pub fn take_requests(
    p: &Principal,
    f: &QuotaFacts<'_>,
    now_ns: u64,
) -> Result<Ticket, QuotaRefusal> {
    let Principal::Key(c) = p else {
        return Ok(Ticket::default());
    };
    let (bucket, rpm, tpd) = match &c.key.limits {
        Limits::None => return Ok(Ticket::default()),
        Limits::Flat { rpm, tpd, .. } => match &c.flat {
            Some(b) => (b, *rpm, *tpd),
            None => return Ok(Ticket::default()),
        },
        Limits::PerModel(m) => {
            let (Some(l), Some(b)) = (m.get(f.model), c.per_model.get(f.model)) else {
                return Err(undeclared(f.model));
            };
            (
                b,
                l.rpm_per_replica.saturating_mul((f.replicas)().max(1)),
                l.tpd,
            )
        }
    };
    let mut ticket = Ticket::default();
    if rpm > 0 {
        let rate = Rate::per_minute(rpm, f.burst_secs);
        match bucket.spend_request(rate, now_ns) {
            LeaseAnswer::Spent => {}
            LeaseAnswer::Closed => return Err(closed(QuotaLimit::Requests)),
            // Requests never reserve (one at a time fits a lease).
            LeaseAnswer::Empty | LeaseAnswer::Reserve => {
                // Honest: when the global bucket holds one again; when it
                // did not say so (a draw in flight), one request interval
                // or a second, whichever is shorter.
                let until = bucket.lease.requests_empty_until.load(Ordering::Relaxed);
                let wait = match until.checked_sub(now_ns) {
                    Some(w) if w > 0 => w,
                    _ => (60_000_000_000 / rate.per_minute.max(1)).min(1_000_000_000),
                };
                return Err(rate_refusal(rpm, wait));
            }
        }
        match take_request(bucket, rate, now_ns) {
            Verdict::Admit { remaining, .. } => {
                let remaining = match &bucket.link {
                    Some(_) => remaining.min(shared_left(&bucket.lease)),
                    None => remaining,
                };
                ticket
                    .headers
                    .push(("X-RateLimit-Limit-Requests", num(rpm)));
                ticket
                    .headers
                    .push(("X-RateLimit-Remaining-Requests", num(remaining)));
            }
            Verdict::Deny { retry_after_ns } => {
                bucket.unspend_request();
                return Err(rate_refusal(rpm, retry_after_ns));
            }
        }
    }
    if tpd > 0 {
        if let Some(link) = &bucket.link {
            note_spend(&bucket.lease, link, now_ns);
        }
        ticket.pending = Some((bucket.clone(), tpd));
    }
    Ok(ticket)
}

/// Requests this router may still admit from the global bucket: what it
/// said was left at the last draw plus the unspent lease.
pub(crate) fn shared_left(l: &Lease) -> u64 {
    let left = l.requests_left.load(Ordering::Relaxed);
    let held = u64::try_from(l.requests.load(Ordering::Relaxed)).unwrap_or(0);
    left.saturating_add(held)
}

/// The 429 of the request quota, retrying in `retry_after_ns`.
pub(crate) fn rate_refusal(rpm: u64, retry_after_ns: u64) -> QuotaRefusal {
    let secs = quota::retry_after_secs(retry_after_ns);
    QuotaRefusal {
        error: ApiError::new(ErrorCode::RateLimitExceeded, "rate limit exceeded").retry_after(secs),
        headers: vec![
            ("X-RateLimit-Limit-Requests", num(rpm)),
            ("X-RateLimit-Remaining-Requests", b"0".to_vec()),
            // Millisecond precision for the SDKs that read it.
            ("retry-after-ms", num(retry_after_ns.div_ceil(1_000_000))),
        ],
        limit: QuotaLimit::Requests,
    }
}

/// Longest a request larger than its router's lease waits for the draw it
/// reserved (a draw every 20 ms while a bucket is in use).
pub const RESERVE_WAIT: std::time::Duration = std::time::Duration::from_millis(250);

/// [`take_daily`], waiting (at most [`RESERVE_WAIT`]) for the draw a
/// request larger than its router's lease reserves.
pub async fn take_daily_reserving(
    ticket: &mut Ticket,
    f: &QuotaFacts<'_>,
    day: impl Fn() -> u64,
) -> Result<(), QuotaRefusal> {
    let until = clock::now() + RESERVE_WAIT;
    loop {
        match take_daily(ticket, f, &day) {
            Err(_) if ticket.pending.is_some() && clock::now() < until => {
                monoio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            r => {
                ticket.pending = None;
                return r;
            }
        }
    }
}

/// What a reserving ticket's bucket has left, as the refusal says it.
fn bucket_left(ticket: &Ticket) -> u64 {
    ticket.pending.as_ref().map_or(0, |(b, _)| {
        let held = u64::try_from(b.lease.tokens.load(Ordering::Relaxed)).unwrap_or(0);
        b.lease
            .tokens_left
            .load(Ordering::Relaxed)
            .saturating_add(held)
    })
}

/// The daily token charge of a request whose [`take_requests`] passed.
pub fn take_daily(
    ticket: &mut Ticket,
    f: &QuotaFacts<'_>,
    day: impl FnOnce() -> u64,
) -> Result<(), QuotaRefusal> {
    let Some((bucket, tpd)) = ticket.pending.take() else {
        return Ok(());
    };
    let metered = f.endpoint.generates();
    if metered {
        let need = f.estimate.saturating_add(f.declared_output);
        let day = day();
        // The whole footprint is reserved, not only the input estimate:
        // concurrent requests then overshoot the budget by at most one
        // reservation (issue 29 #8). The end trues it up.
        let refusal = |remaining: u64| {
            let msg = if f.declared_output > 0 {
                "insufficient daily token budget for requested max_tokens"
            } else {
                "daily token budget exceeded"
            };
            QuotaRefusal {
                error: ApiError::new(ErrorCode::TokenLimitExceeded, msg),
                headers: vec![("X-RateLimit-Remaining-Tokens", num(remaining))],
                limit: QuotaLimit::Tokens,
            }
        };
        match bucket.spend_tokens(tpd, need) {
            LeaseAnswer::Spent => {}
            LeaseAnswer::Closed => return Err(closed(QuotaLimit::Tokens)),
            LeaseAnswer::Reserve => {
                // The ticket keeps its bucket: asked again after the next
                // draw ([`take_daily_reserving`]).
                ticket.pending = Some((bucket, tpd));
                let left = bucket_left(ticket);
                return Err(refusal(left));
            }
            LeaseAnswer::Empty => {
                let held = u64::try_from(bucket.lease.tokens.load(Ordering::Relaxed)).unwrap_or(0);
                let left = bucket.lease.tokens_left.load(Ordering::Relaxed);
                return Err(refusal(left.saturating_add(held)));
            }
        }
        match take_tokens(&bucket, day, tpd, need, need) {
            Daily::Charged { remaining, .. } => {
                let remaining = match &bucket.link {
                    Some(_) => {
                        let l = &bucket.lease;
                        let held = u64::try_from(l.tokens.load(Ordering::Relaxed)).unwrap_or(0);
                        remaining.min(l.tokens_left.load(Ordering::Relaxed).saturating_add(held))
                    }
                    None => remaining,
                };
                ticket
                    .headers
                    .push(("X-RateLimit-Remaining-Tokens", num(remaining)));
                ticket.daily = Some((bucket, day, need, f.estimate));
            }
            Daily::Refused { remaining } => {
                bucket.adjust_lease_tokens(-i64::try_from(need).unwrap_or(i64::MAX));
                return Err(refusal(remaining));
            }
        }
    }
    Ok(())
}

// === impl Ticket ===

impl Ticket {
    /// What its daily charge reserved: (day, charged, input estimate);
    /// carried with a held request to the process that replaces this one
    /// (issue 54), which settles it.
    pub fn reserved(&self) -> Option<(u64, u64, u64)> {
        self.daily.as_ref().map(|(_, d, c, e)| (*d, *c, *e))
    }

    /// A ticket whose daily charge another process took (a held request
    /// carried over by an upgrade): nothing is charged again; it settles
    /// against this process's bucket of `p` for `model`.
    pub fn carried(p: &Principal, model: &str, reserved: Option<(u64, u64, u64)>) -> Ticket {
        let bucket = match p {
            Principal::Key(c) => match &c.key.limits {
                Limits::Flat { .. } => c.flat.clone(),
                Limits::PerModel(_) => c.per_model.get(model).cloned(),
                Limits::None => None,
            },
            _ => None,
        };
        Ticket {
            daily: bucket
                .zip(reserved)
                .map(|(b, (day, charged, estimate))| (b, day, charged, estimate)),
            ..Ticket::default()
        }
    }

    /// True the daily charge up once the request is over: to the exact
    /// usage when the response reported it, refunded in full when the
    /// request failed before any output reached the client, else kept.
    pub fn settle(mut self, end: Settle) {
        let Some((bucket, day, charged, estimate)) = self.daily.take() else {
            return;
        };
        let charged = i64::try_from(charged).unwrap_or(i64::MAX);
        let delta = match end {
            Settle::Usage(t) => {
                i64::try_from(t.input.saturating_add(t.output)).unwrap_or(i64::MAX) - charged
            }
            Settle::NothingSent => -charged,
            // Served without usage: the input estimate stands, the
            // reserved output is given back.
            Settle::Unknown => i64::try_from(estimate).unwrap_or(i64::MAX) - charged,
        };
        if delta != 0 {
            bucket.adjust_daily(day, delta);
            bucket.adjust_lease_tokens(delta);
        }
    }
}

/// How a request with a daily charge ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// The response reported this usage.
    Usage(Tokens),
    /// No response byte reached the client (rejection, agent failure,
    /// client gone before the head): refund.
    NothingSent,
    /// Served without usage: the estimate stands.
    Unknown,
}
