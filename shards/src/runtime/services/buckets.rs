//! The quota buckets every shard spends from and the shared-state thread
//! refills: one `AtomicU64` pair per bucket (requests per minute and
//! tokens today), updated by compare-and-swap over the pure arithmetic of
//! [`crate::logic::tenancy::quota`], and with `--shared-state` the lease
//! each draws from the quota several routers hold ([`QuotaLink`]).

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use crate::logic::tenancy::lease;
use crate::logic::tenancy::quota::Rate;

/// One bucket pair: requests per minute (GCRA state) and tokens today
/// (packed day and usage).
#[derive(Debug, Default)]
pub struct Bucket {
    /// GCRA theoretical arrival time (monotonic ns; 0 = full).
    pub rpm: AtomicU64,
    /// [`crate::logic::tenancy::quota::pack`]ed day index and tokens this router used.
    pub daily: AtomicU64,
    /// The share of the global quota this router holds (`--shared-state`).
    pub lease: Lease,
    /// The shared state the lease is drawn from (None: this router alone).
    pub link: Option<Arc<QuotaLink>>,
}

/// What the request path reads of `--shared-state` (written by its thread).
#[derive(Debug, Default)]
pub struct QuotaLink {
    /// Whether the last call to Redis succeeded.
    pub up: AtomicBool,
    /// `--shared-state-failure-mode closed`: while Redis is away, refuse
    /// the requests of quota-limited keys (429) instead of admitting them
    /// on local limits.
    pub fail_closed: bool,
    /// Requests of quota-limited keys admitted on local limits only while
    /// Redis was away (fail-open).
    pub fail_open_admissions: AtomicU64,
    /// Requests refused because Redis was away (fail-closed).
    pub fail_closed_refusals: AtomicU64,
    /// A bucket unused until now was spent from: the thread draws for it
    /// at its next round (it looks at every bucket only while some are in
    /// use).
    pub fresh: AtomicBool,
}

/// A bucket's lease on the global quota (see [`lease`]): balances the
/// request path spends and the shared-state thread tops up.
#[derive(Debug, Default)]
pub struct Lease {
    /// Requests drawn and not spent (below 0: admitted on credit).
    pub requests: AtomicI64,
    /// Monotonic ns until which the global bucket has no request left (0:
    /// not known empty).
    pub requests_empty_until: AtomicU64,
    /// Requests left in the global bucket at the last draw (`u64::MAX`:
    /// not drawn yet).
    pub requests_left: AtomicU64,
    /// The rate the request path applied last (requests per minute, burst):
    /// what the thread draws at.
    pub rate: AtomicU64,
    /// The burst of that rate.
    pub burst: AtomicU64,
    /// Tokens drawn from today's global budget and not spent.
    pub tokens: AtomicI64,
    /// The global budget said it has no more today.
    pub tokens_exhausted: AtomicBool,
    /// Tokens left in the global budget at the last draw.
    pub tokens_left: AtomicU64,
    /// The daily limit the request path applied last.
    pub tokens_limit: AtomicU64,
    /// Monotonic ns of the last spend (0: never): the thread draws for
    /// buckets in use and gives back the leases of idle ones.
    pub last_spend: AtomicU64,
    /// Requests asked of the lease: spent, or refused for want of a lease
    /// while the global quota had room (the thread sizes the next top-up
    /// on this pace: counting only what was spent, a router whose lease
    /// runs dry between rounds would never draw more than one lease).
    pub requests_wanted: AtomicU64,
    /// Tokens asked of the lease, the same way.
    pub tokens_wanted: AtomicU64,
    /// The largest request waiting for a draw (more than this router
    /// holds plus one lease): the thread draws at least this much next.
    pub tokens_reserve: AtomicU64,
}

impl Lease {
    /// Nothing drawn yet: what the global quota has left is unknown.
    pub(crate) fn undrawn() -> Self {
        Lease {
            requests_left: AtomicU64::new(u64::MAX),
            tokens_left: AtomicU64::new(u64::MAX),
            ..Lease::default()
        }
    }
}

/// Refresh an atomic only when it changed (no store, no cache-line
/// ping-pong, on the common path).
pub(crate) fn note(a: &AtomicU64, v: u64) {
    if a.load(Ordering::Relaxed) != v {
        a.store(v, Ordering::Relaxed);
    }
}

/// Note a spend at `now_ns`; a bucket unused until now wakes the thread.
pub(crate) fn note_spend(l: &Lease, link: &QuotaLink, now_ns: u64) {
    let last = l.last_spend.load(Ordering::Relaxed);
    if last != now_ns {
        l.last_spend.store(now_ns, Ordering::Relaxed);
        if last == 0 {
            link.fresh.store(true, Ordering::Relaxed);
        }
    }
}

/// Spend `need` from `balance` as [`lease::spend`] allows.
pub(crate) fn spend_from(balance: &AtomicI64, need: i64, lease_size: i64, exhausted: bool) -> bool {
    balance
        .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |b| {
            lease::spend(b, need, lease_size, exhausted)
        })
        .is_ok()
}

/// What the lease says about one request.
pub(crate) enum LeaseAnswer {
    /// Spent (or no lease: this router alone).
    Spent,
    /// The global quota has none for this router now.
    Empty,
    /// Redis is away and the failure mode is closed.
    Closed,
    /// More than this router holds plus one lease, and the global quota
    /// may have it: reserved, the next draw brings it (retry shortly).
    Reserve,
}

impl Bucket {
    /// Add `delta` tokens to `day`'s usage (a true-up, a refund, or what
    /// a replaced process counted).
    pub fn adjust_daily(&self, day: u64, delta: i64) {
        let _ = self
            .daily
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |s| {
                Some(crate::logic::tenancy::quota::adjust(s, day, delta))
            });
    }

    /// Spend one request from the lease at `rate` (`now_ns` monotonic).
    pub(crate) fn spend_request(&self, rate: Rate, now_ns: u64) -> LeaseAnswer {
        let Some(link) = &self.link else {
            return LeaseAnswer::Spent;
        };
        let l = &self.lease;
        note(&l.rate, rate.per_minute);
        note(&l.burst, rate.burst);
        note_spend(l, link, now_ns);
        if !link.up.load(Ordering::Relaxed) {
            return self.away(link, &l.requests, 1);
        }
        let exhausted = l.requests_empty_until.load(Ordering::Relaxed) > now_ns;
        let spent = spend_from(&l.requests, 1, lease::request_lease(rate.burst), exhausted);
        if spent || !exhausted {
            l.requests_wanted.fetch_add(1, Ordering::Relaxed);
        }
        if spent {
            LeaseAnswer::Spent
        } else {
            LeaseAnswer::Empty
        }
    }

    /// Spend `need` tokens of today's lease under `limit`.
    /// (Its time of use was noted when the request quota was taken.)
    pub(crate) fn spend_tokens(&self, limit: u64, need: u64) -> LeaseAnswer {
        let Some(link) = &self.link else {
            return LeaseAnswer::Spent;
        };
        let l = &self.lease;
        note(&l.tokens_limit, limit);
        let need = i64::try_from(need).unwrap_or(i64::MAX);
        if !link.up.load(Ordering::Relaxed) {
            // Fail-open spends at most a quarter of the day's budget per
            // router on its own (issue 51 #7: each router spent the whole
            // day again, 3.0x over three routers).
            let floor = i64::try_from(limit / Self::FAIL_OPEN_SHARE)
                .unwrap_or(i64::MAX)
                .max(lease::token_lease(limit));
            if link.fail_closed || l.tokens.load(Ordering::Acquire).saturating_sub(need) >= -floor {
                return self.away(link, &l.tokens, need);
            }
            link.fail_closed_refusals.fetch_add(1, Ordering::Relaxed);
            return LeaseAnswer::Closed;
        }
        let exhausted = l.tokens_exhausted.load(Ordering::Relaxed);
        let spent = spend_from(&l.tokens, need, lease::token_lease(limit), exhausted);
        if spent {
            l.tokens_wanted
                .fetch_add(need.unsigned_abs(), Ordering::Relaxed);
            LeaseAnswer::Spent
        } else if exhausted {
            LeaseAnswer::Empty
        } else {
            l.tokens_reserve
                .fetch_max(need.unsigned_abs(), Ordering::AcqRel);
            LeaseAnswer::Reserve
        }
    }

    /// While Redis is away, a router spends at most `limit / FAIL_OPEN_SHARE`
    /// of a daily token budget past its lease on its own (fail-open).
    pub const FAIL_OPEN_SHARE: u64 = 4;

    /// Redis is away: refuse (closed), or spend on local limits only and
    /// keep the debt, charged to the global quota when Redis returns (open).
    pub(crate) fn away(&self, link: &QuotaLink, balance: &AtomicI64, need: i64) -> LeaseAnswer {
        if link.fail_closed {
            link.fail_closed_refusals.fetch_add(1, Ordering::Relaxed);
            return LeaseAnswer::Closed;
        }
        link.fail_open_admissions.fetch_add(1, Ordering::Relaxed);
        balance.fetch_sub(need, Ordering::AcqRel);
        LeaseAnswer::Spent
    }

    /// Give back what [`Bucket::spend_request`] took (the local bucket
    /// refused after the lease agreed).
    pub(crate) fn unspend_request(&self) {
        if self.link.is_some() {
            self.lease.requests.fetch_add(1, Ordering::AcqRel);
            // Not wanted of the global quota: the local limit refused it.
            self.lease.requests_wanted.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Move `delta` tokens of usage through the lease (true-up > 0, refund < 0).
    pub(crate) fn adjust_lease_tokens(&self, delta: i64) {
        if self.link.is_some() {
            self.lease.tokens.fetch_sub(delta, Ordering::AcqRel);
        }
    }
}

/// A bucket's name: tenant, and model for per-model keys (`""` for flat).
pub type BucketKey = (Arc<str>, String);
