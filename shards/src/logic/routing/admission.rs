//! Admission control (spec 04 §9-§10), pure: the gates a request of an
//! LLM endpoint passes after authentication and its request quota, in
//! this order: B1 request caps, B3 pressure shed, B2 occupancy (may
//! park), B4 per-key occupancy share, B4 OTPM then ITPM. Time, replica
//! counts and engine signals are passed in; nothing here reads a clock.
//!
//! - [`caps`] (B1) and [`shed`] (B3) are plain checks.
//! - [`Occupancy`] (B2 + B4 share) is one model's reservations and its
//!   parked requests, granted strictly in arrival order as room frees.
//! - [`TokenBucket`] is one key's ITPM or OTPM bucket.
//! - [`learn`] updates a model's tokens-per-byte ratio from exact usage.

use std::collections::HashMap;
use std::sync::Arc;

use super::policy::{AdmissionPolicy, Field, Mode};
use super::wait_queue::{Fair, Place, WaitQueue};
use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::link::engine_metrics::EngineSignals;
use crate::logic::system::config_error::ConfigError;

/// Why admission refused a request: the metric's `reason` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    /// Request caps.
    B1,
    /// Occupancy budget or in-flight cap.
    B2,
    /// Pressure shed.
    B3,
    /// Per-key occupancy share.
    B4Occupancy,
    /// Per-key input tokens per minute.
    B4Itpm,
    /// Per-key output tokens per minute.
    B4Otpm,
}

impl Reason {
    /// Label value of `hivenet_admission_rejections_total{reason}`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::B1 => "b1",
            Reason::B2 => "b2",
            Reason::B3 => "b3",
            Reason::B4Occupancy => "b4_occupancy",
            Reason::B4Itpm => "b4_itpm",
            Reason::B4Otpm => "b4_otpm",
        }
    }

    /// The client-visible error of every reason but B1 (whose message
    /// names the numbers: see [`caps`]). All carry `Retry-After: 1`.
    pub fn error(self) -> ApiError {
        let e = match self {
            Reason::B1 => {
                return ApiError::new(ErrorCode::InputTooLong, "input over the model limit")
            }
            Reason::B2 => ApiError::new(
                ErrorCode::ConcurrencyLimitExceeded,
                "server at capacity for this model, please retry",
            ),
            Reason::B3 => ApiError::new(
                ErrorCode::ConcurrencyLimitExceeded,
                "model is under high load, please retry",
            ),
            Reason::B4Occupancy => ApiError::new(
                ErrorCode::RateLimitExceeded,
                "per-key occupancy share exceeded, please retry",
            ),
            Reason::B4Itpm => ApiError::new(
                ErrorCode::RateLimitExceeded,
                "input token rate exceeded, please retry",
            ),
            Reason::B4Otpm => ApiError::new(
                ErrorCode::RateLimitExceeded,
                "output token rate exceeded, please retry",
            ),
        };
        e.retry_after(1)
    }
}

// === B1 ===

/// B1: the input estimate and image count against the policy's caps.
pub fn caps(p: &AdmissionPolicy, estimate: u64, images: u64) -> Result<(), ApiError> {
    if p.max_input_tokens > 0 && estimate > p.max_input_tokens {
        return Err(ApiError::new(
            ErrorCode::InputTooLong,
            format!(
                "input is {estimate} tokens, over the model limit of {}",
                p.max_input_tokens
            ),
        ));
    }
    if p.images_max > 0 && images > p.images_max {
        return Err(ApiError::new(
            ErrorCode::InputTooLong,
            format!(
                "request carries {images} images, over the model limit of {}",
                p.images_max
            ),
        ));
    }
    Ok(())
}

// === B3 ===

/// Means of the two shed signals over the healthy agents that report them
/// (`None`: nobody reports it, so its rule passes).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pressure {
    /// Mean KV-cache use, 0-1.
    pub kv_cache_utilization: Option<f64>,
    /// Mean engine queue length.
    pub waiting_requests: Option<f64>,
}

/// The pressure of a pool: `(healthy, signals)` per agent.
pub fn pressure(agents: impl Iterator<Item = (bool, EngineSignals)>) -> Pressure {
    let (mut kv, mut nkv, mut wait, mut nwait) = (0.0, 0u32, 0.0, 0u32);
    for (healthy, s) in agents {
        if !healthy {
            continue;
        }
        if let Some(v) = s.kv_cache_utilization {
            kv += v;
            nkv += 1;
        }
        if let Some(v) = s.waiting_requests {
            wait += v;
            nwait += 1;
        }
    }
    Pressure {
        kv_cache_utilization: (nkv > 0).then(|| kv / f64::from(nkv)),
        waiting_requests: (nwait > 0).then(|| wait / f64::from(nwait)),
    }
}

/// B3: whether any `shed_if` rule is violated by the pool's pressure.
pub fn shed(p: &AdmissionPolicy, pressure: &Pressure) -> bool {
    p.shed_if.iter().any(|r| {
        let v = match r.field {
            Field::KvCacheUtilization => pressure.kv_cache_utilization,
            Field::WaitingRequests => pressure.waiting_requests,
            _ => None,
        };
        v.is_some_and(|v| r.violated(v))
    })
}

// === B2 and B4 share ===

/// The room of a model's pool now: token budget and in-flight cap
/// (`None`: that limit is unset).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Room {
    /// Tokens in flight allowed.
    pub budget: Option<u64>,
    /// Requests in flight allowed.
    pub inflight: Option<u64>,
}

/// The room for `replicas` healthy agents (floored at 1): `budget =
/// max(1, floor(fraction × admit_budget_tokens × replicas))`, `inflight =
/// max_inflight × replicas`.
pub fn room(p: &AdmissionPolicy, fraction: f64, replicas: u64) -> Room {
    let r = replicas.max(1);
    let budget = (p.admit_budget_tokens > 0).then(|| {
        let b = (fraction * p.admit_budget_tokens as f64 * r as f64).floor();
        if b.is_finite() && b >= 1.0 {
            b as u64
        } else {
            1
        }
    });
    let inflight = (p.max_inflight > 0).then(|| p.max_inflight.saturating_mul(r));
    Room { budget, inflight }
}

/// A key's occupancy budget (B4, serverless only): `share ×
/// admit_budget_tokens × replicas`, no admit fraction; floored at 1 so a
/// tiny share limits instead of silently disabling the check (spec 08 A17).
pub fn share_budget(p: &AdmissionPolicy, share: f64, replicas: u64) -> Option<u64> {
    if p.mode != Mode::Serverless || p.admit_budget_tokens == 0 || share <= 0.0 {
        return None;
    }
    let b = (share * p.admit_budget_tokens as f64 * replicas.max(1) as f64).floor();
    Some(if b.is_finite() && b >= 1.0 {
        b as u64
    } else {
        1
    })
}

/// What a request asks of [`Occupancy`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ask {
    /// Estimate + declared output.
    pub footprint: u64,
    /// The key and its occupancy budget, when a share applies.
    pub share: Option<(Arc<str>, u64)>,
    /// Its class and tenant: parked requests are granted in the capacity
    /// queue's order (class, then fair by tokens between tenants).
    pub fair: Fair,
}

/// The answer to an [`Ask`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Reserved under this id: release it exactly once.
    Granted(u64),
    /// Parked under this ticket: a later [`Grant`] answers it.
    Parked(u64),
    /// Larger than the whole budget of the current pool (B2, at once).
    TooLarge,
    /// No room and parking not allowed (B2).
    Full,
    /// Over the key's occupancy share (B4, never waits).
    ShareExceeded,
}

/// The answer to a parked request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant {
    /// Reserved under this id.
    Granted(u64),
    /// The pool shrank below its footprint.
    TooLarge,
    /// Its key went over its share meanwhile.
    ShareExceeded,
}

#[derive(Debug, Clone)]
struct Held {
    footprint: u64,
    key: Option<Arc<str>>,
}

#[derive(Debug, Clone)]
struct Waiting {
    ticket: u64,
    ask: Ask,
}

/// One model's occupancy: the reservations in flight (their footprint sum
/// and count, per key too) and the parked requests, in the capacity
/// queue's order: class, then fair by tokens between tenants, then arrival
/// (a tenant that parks ten times its share waits behind the others).
#[derive(Debug, Clone, Default)]
pub struct Occupancy {
    sum: u64,
    count: u64,
    held: HashMap<u64, Held>,
    by_key: HashMap<Arc<str>, u64>,
    parked: WaitQueue<Waiting>,
    /// Parked ticket -> its place in `parked` (to cancel it).
    places: HashMap<u64, Place>,
    next: u64,
    room: Room,
}

// === impl Occupancy ===

impl Occupancy {
    /// Tokens reserved in flight.
    pub fn sum(&self) -> u64 {
        self.sum
    }

    /// Reservations in flight.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Requests parked.
    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    /// The room last seen.
    pub fn room(&self) -> Room {
        self.room
    }

    /// Tokens `key` holds in flight.
    pub fn key_sum(&self, key: &str) -> u64 {
        self.by_key.get(key).copied().unwrap_or(0)
    }

    /// Footprint of reservation `id` (`None` once released).
    pub fn footprint(&self, id: u64) -> Option<u64> {
        self.held.get(&id).map(|h| h.footprint)
    }

    fn fits(&self, footprint: u64) -> bool {
        self.room
            .budget
            .is_none_or(|b| self.sum.saturating_add(footprint) <= b)
            && self.room.inflight.is_none_or(|n| self.count < n)
    }

    fn too_large(&self, footprint: u64) -> bool {
        self.room.budget.is_some_and(|b| footprint > b)
    }

    fn over_share(&self, ask: &Ask) -> bool {
        ask.share
            .as_ref()
            .is_some_and(|(k, b)| self.key_sum(k).saturating_add(ask.footprint) > *b)
    }

    fn reserve(&mut self, ask: Ask) -> u64 {
        self.next += 1;
        let id = self.next;
        self.sum = self.sum.saturating_add(ask.footprint);
        self.count += 1;
        let key = ask.share.map(|(k, _)| k);
        if let Some(k) = &key {
            *self.by_key.entry(k.clone()).or_default() += ask.footprint;
        }
        self.held.insert(
            id,
            Held {
                footprint: ask.footprint,
                key,
            },
        );
        id
    }

    /// Admit `ask` under `room` (the pool now): at once when it fits and
    /// nobody is parked before it, else parked (when `may_park`) or
    /// refused.
    pub fn admit(&mut self, ask: Ask, room: Room, may_park: bool) -> Admit {
        self.room = room;
        if self.too_large(ask.footprint) {
            return Admit::TooLarge;
        }
        if self.over_share(&ask) {
            return Admit::ShareExceeded;
        }
        if self.parked.is_empty() && self.fits(ask.footprint) {
            return Admit::Granted(self.reserve(ask));
        }
        if !may_park {
            return Admit::Full;
        }
        self.next += 1;
        let ticket = self.next;
        let fair = ask.fair;
        match self
            .parked
            .push_fair(Waiting { ticket, ask }, usize::MAX, fair)
        {
            Ok(place) => {
                self.places.insert(ticket, place);
                Admit::Parked(ticket)
            }
            Err(_) => Admit::Full,
        }
    }

    /// A parked request left (timeout, client gone): drop its ticket.
    /// Returns whether it was still parked, and what its leaving granted
    /// (a large head leaving can let smaller ones in).
    pub fn cancel(&mut self, ticket: u64) -> (bool, Vec<(u64, Grant)>) {
        let was = self
            .places
            .remove(&ticket)
            .and_then(|place| self.parked.remove(place))
            .is_some();
        (was, if was { self.drain() } else { Vec::new() })
    }

    /// New room (replicas joined or left, the periodic recompute): parked
    /// requests that now fit are granted.
    pub fn set_room(&mut self, room: Room) -> Vec<(u64, Grant)> {
        self.room = room;
        self.drain()
    }

    /// Release reservation `id` (a second release is a no-op returning
    /// `None`); returns the grants the freed room allows.
    pub fn release(&mut self, id: u64) -> Option<Vec<(u64, Grant)>> {
        let h = self.held.remove(&id)?;
        self.sum = self.sum.saturating_sub(h.footprint);
        self.count = self.count.saturating_sub(1);
        if let Some(k) = h.key {
            self.take_from_key(&k, h.footprint);
        }
        Some(self.drain())
    }

    fn take_from_key(&mut self, k: &Arc<str>, n: u64) {
        if let Some(v) = self.by_key.get_mut(k) {
            *v = v.saturating_sub(n);
            if *v == 0 {
                self.by_key.remove(k);
            }
        }
    }

    /// Change reservation `id` by `delta` tokens (true-up to exact usage,
    /// or growth of an undeclared stream); never below 0. A decrease wakes
    /// parked requests.
    pub fn adjust(&mut self, id: u64, delta: i64) -> Vec<(u64, Grant)> {
        let Some(h) = self.held.get_mut(&id) else {
            return Vec::new();
        };
        let old = h.footprint;
        let new = if delta < 0 {
            old.saturating_sub(delta.unsigned_abs())
        } else {
            old.saturating_add(delta.unsigned_abs())
        };
        h.footprint = new;
        let key = h.key.clone();
        if new >= old {
            let up = new - old;
            self.sum = self.sum.saturating_add(up);
            if let Some(k) = key {
                *self.by_key.entry(k).or_default() += up;
            }
            Vec::new()
        } else {
            let down = old - new;
            self.sum = self.sum.saturating_sub(down);
            if let Some(k) = key {
                self.take_from_key(&k, down);
            }
            self.drain()
        }
    }

    /// Grant parked requests from the head while they fit; a head that
    /// can never fit the current pool or its key's share is answered too.
    fn drain(&mut self) -> Vec<(u64, Grant)> {
        let mut out = Vec::new();
        while let Some((_, head)) = self.parked.head() {
            let fp = head.ask.footprint;
            let verdict = if self.too_large(fp) {
                Some(Grant::TooLarge)
            } else if self.over_share(&head.ask) {
                Some(Grant::ShareExceeded)
            } else if self.fits(fp) {
                None
            } else {
                break;
            };
            let Some((_, w)) = self.parked.pop_head() else {
                break;
            };
            self.places.remove(&w.ticket);
            let g = verdict.unwrap_or_else(|| Grant::Granted(self.reserve(w.ask)));
            out.push((w.ticket, g));
        }
        out
    }
}

// === B4 rates ===

/// Nanoseconds in a minute: a bucket of capacity `c` per minute refills
/// `c` units per nanosecond when a token is worth this many units.
const UNITS_PER_TOKEN: i128 = 60_000_000_000;

/// One key's ITPM or OTPM bucket on one model: full at `capacity` tokens,
/// refilled at `capacity` per minute. Exact integer arithmetic (a token is
/// 6·10¹⁰ units, so refill is `elapsed_ns × capacity` units).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenBucket {
    level: i128,
    at_ns: u64,
    started: bool,
}

impl TokenBucket {
    fn refill(&mut self, capacity: u64, now_ns: u64) {
        let full = i128::from(capacity) * UNITS_PER_TOKEN;
        if !self.started {
            *self = TokenBucket {
                level: full,
                at_ns: now_ns,
                started: true,
            };
            return;
        }
        let dt = now_ns.saturating_sub(self.at_ns);
        self.at_ns = self.at_ns.max(now_ns);
        self.level = (self.level + i128::from(dt) * i128::from(capacity)).min(full);
    }

    /// Whole tokens available now (negative: in debt).
    pub fn tokens(&mut self, capacity: u64, now_ns: u64) -> i128 {
        self.refill(capacity, now_ns);
        self.level.div_euclid(UNITS_PER_TOKEN)
    }

    /// ITPM: take `need` tokens if that many are there.
    pub fn take(&mut self, capacity: u64, need: u64, now_ns: u64) -> bool {
        self.refill(capacity, now_ns);
        let want = i128::from(need) * UNITS_PER_TOKEN;
        if self.level < want {
            return false;
        }
        self.level -= want;
        true
    }

    /// OTPM check: at least one token is there.
    pub fn has_one(&mut self, capacity: u64, now_ns: u64) -> bool {
        self.refill(capacity, now_ns);
        self.level >= UNITS_PER_TOKEN
    }

    /// OTPM charge after a response: `used` tokens, at most one bucket.
    pub fn charge(&mut self, capacity: u64, used: u64, now_ns: u64) {
        self.refill(capacity, now_ns);
        self.level -= i128::from(used.min(capacity)) * UNITS_PER_TOKEN;
    }
}

// === estimator ===

/// Learn a model's tokens per byte from one request with exact usage and
/// no images: `obs = prompt_tokens / text_bytes` clamped to [0.05, 1];
/// `ratio = 0.2 × obs + 0.8 × ratio`. Nothing to learn from an empty
/// text or a zero count.
pub fn learn(ratio: f64, prompt_tokens: u64, text_bytes: u64) -> f64 {
    if prompt_tokens == 0 || text_bytes == 0 {
        return ratio;
    }
    let obs = (prompt_tokens as f64 / text_bytes as f64).clamp(0.05, 1.0);
    0.2 * obs + 0.8 * ratio
}

/// Footprint of a request: input estimate + declared output.
pub fn footprint(estimate: u64, declared_output: u64) -> u64 {
    estimate.saturating_add(declared_output)
}

/// Tokens an undeclared stream grows by for `content_bytes` streamed.
pub fn growth(content_bytes: u64) -> u64 {
    content_bytes / 4
}

/// The cross-config check of serverless policies (spec 04 §11): a key's
/// ITPM below a policy's `max_input_tokens` would refuse requests B1
/// accepts forever. `keys`: (name, itpm); `policies`: (document, policy).
pub fn cross_check<'a>(
    keys: impl Iterator<Item = (&'a str, u64)> + Clone,
    policies: impl Iterator<Item = (&'a str, &'a AdmissionPolicy)>,
) -> Result<(), ConfigError> {
    for (doc, p) in policies {
        if p.mode != Mode::Serverless || p.max_input_tokens == 0 {
            continue;
        }
        for (key, itpm) in keys.clone() {
            if itpm > 0 && itpm < p.max_input_tokens {
                return Err(ConfigError::from(format!(
                    "key {key:?}: input_tokens_per_minute {itpm} is below max_input_tokens {} of serverless policy {doc:?}: its largest requests could never be admitted",
                    p.max_input_tokens
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
