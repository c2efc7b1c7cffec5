//! The router-wide books of hold at zero: the [`Ledger`] (hold limits and
//! pending demand), hold outcomes and durations, and each model's
//! observed wake time. Touched only while a model is at zero or just woke
//! (never on the served-here path), so one lock is enough.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::model::stats::Histogram;
use crate::logic::sites::hold::{Ledger, Ticket};
use crate::runtime::wire::clock::Instant;

/// Buckets of `hivenet_wake_hold_seconds` (spec 07 §9).
pub const HOLD_BUCKETS: [f64; 13] = [
    0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
];

/// Why a held request is let go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// An agent of the model registered.
    Woken,
    /// The map no longer places the model here with `scale_from_zero`:
    /// it fails as before (404).
    Unplaced,
    /// The router is shutting down: answered now, not dropped.
    ShuttingDown,
    /// The process replacing this one takes it over (issue 54).
    HandOver,
}

/// A held request's waker, with what orders the release: its class,
/// tenant (hashed) and estimated tokens.
pub struct HeldWaiter {
    pub tx: futures::channel::oneshot::Sender<Release>,
    pub fair: crate::logic::routing::wait_queue::Fair,
}

/// The shard that holds every held request of a model: its `assigned`
/// shard when it has had one, else a hash of its name over `shards`.
pub fn hold_shard_of(assigned: Option<usize>, model: &str, shards: usize) -> usize {
    if let Some(s) = assigned {
        return s;
    }
    let h = xxhash_rust::xxh64::xxh64(model.as_bytes(), 0);
    usize::try_from(h % shards.max(1) as u64).unwrap_or(0)
}

/// Quota refusals per (tenant, key): (requests per minute, daily tokens).
pub type QuotaRefusals = BTreeMap<(Arc<str>, Arc<str>), (u64, u64)>;

/// Everything hold at zero counts.
#[derive(Default)]
pub struct Books {
    /// Limits and demand.
    pub ledger: Ledger,
    /// `hivenet_wake_holds_total{model,outcome}`.
    pub outcomes: BTreeMap<(String, &'static str), u64>,
    /// `hivenet_wake_hold_seconds{model,outcome}`.
    pub hold_seconds: BTreeMap<(String, &'static str), Histogram>,
    /// First hold of a model still at zero (its wake time starts there).
    pub waking_since: HashMap<String, Instant>,
    /// Observed wake times per model (most recent last, at most 32).
    pub wake_times: HashMap<String, Vec<Duration>>,
    /// Quota refusals before a hold, per (tenant, key): (requests per
    /// minute, daily tokens). A model at zero has no per-model state to
    /// count them in; `hivenet_tenant_{rate,token}_limited_total` add them.
    pub quota_refused: QuotaRefusals,
}

/// The books behind their lock.
#[derive(Default)]
pub struct HoldBook(Mutex<Books>);

impl HoldBook {
    /// Lock the books (a poisoned lock is still usable: counters only).
    pub fn lock(&self) -> MutexGuard<'_, Books> {
        match self.0.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Count one hold's end.
    pub fn outcome(&self, model: &str, outcome: &'static str, held: Duration) {
        let mut b = self.lock();
        *b.outcomes.entry((model.to_string(), outcome)).or_default() += 1;
        b.hold_seconds
            .entry((model.to_string(), outcome))
            .or_default()
            .observe(&HOLD_BUCKETS, held.as_secs_f64());
    }

    /// Count a quota refusal before a hold (`requests`: per minute, else
    /// daily tokens).
    pub fn quota_refused(&self, tenant: &Arc<str>, key: &Arc<str>, requests: bool) {
        let mut b = self.lock();
        let e = b
            .quota_refused
            .entry((tenant.clone(), key.clone()))
            .or_default();
        if requests {
            e.0 += 1;
        } else {
            e.1 += 1;
        }
    }

    /// An agent of `model` registered: its wake time (since the first
    /// hold) is recorded.
    pub fn woke(&self, model: &str) {
        let mut b = self.lock();
        if let Some(t) = b.waking_since.remove(model) {
            let v = b.wake_times.entry(model.to_string()).or_default();
            v.push(t.elapsed());
            if v.len() > 32 {
                v.remove(0);
            }
        }
    }

    /// The 90th percentile of `model`'s observed wake times.
    pub fn wake_p90(&self, model: &str) -> Option<Duration> {
        p90(self.lock().wake_times.get(model)?)
    }
}

/// The 90th percentile of `v` (nearest rank).
pub fn p90(v: &[Duration]) -> Option<Duration> {
    let mut v = v.to_vec();
    v.sort();
    let i = (v.len() * 9).div_ceil(10).saturating_sub(1);
    v.get(i).copied()
}

/// A held request's place in the pending demand: left once, when it gets
/// a slot on an agent or ends (dropped).
pub struct DemandGuard {
    book: Arc<HoldBook>,
    ticket: Option<Ticket>,
}

impl std::fmt::Debug for DemandGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DemandGuard")
            .field("model", &self.ticket.as_ref().map(|t| &t.model))
            .finish()
    }
}

impl DemandGuard {
    /// The demand of `ticket` (already counted by [`Ledger::hold`]).
    pub fn new(book: Arc<HoldBook>, ticket: Ticket) -> Self {
        DemandGuard {
            book,
            ticket: Some(ticket),
        }
    }

    /// Leave the demand now (idempotent).
    pub fn leave(&mut self) {
        if let Some(t) = self.ticket.take() {
            self.book.lock().ledger.undemand(&t);
        }
    }
}

impl Drop for DemandGuard {
    fn drop(&mut self) {
        self.leave();
    }
}
