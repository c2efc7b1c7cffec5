//! Hold at zero (seed hold-at-zero, spec 07 §1, §6-§8), pure: the hold
//! limits (per key, per model, held body bytes), the pending demand with
//! its dedup rule (same key + same UUID client ID counts once), the
//! `model_waking` answers and `Retry-After`, the keepalive bytes and the
//! in-band error after a committed 200.
//!
//! Key type: [`Ledger`], router-wide (holds happen only while a model is
//! at zero: off the hot path; the runtime keeps it behind a lock).

use std::collections::HashMap;
use std::time::Duration;

use crate::logic::http::errors::{ApiError, ErrorCode};

/// The three hold limits (`--wake-hold-max-per-key`, `-per-model`,
/// `-total` bytes of held bodies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Held requests per caller identity.
    pub per_key: u64,
    /// Held requests per model.
    pub per_model: u64,
    /// Held request body bytes, router-wide.
    pub total_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            per_key: 32,
            per_model: 512,
            total_bytes: 256 * 1024 * 1024,
        }
    }
}

/// Which limit refused a hold (named in the message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    /// `--wake-hold-max-per-key`.
    PerKey,
    /// `--wake-hold-max-per-model`.
    PerModel,
    /// `--wake-hold-max-total`.
    Total,
}

impl Full {
    /// The flag.
    pub fn flag(self) -> &'static str {
        match self {
            Full::PerKey => "--wake-hold-max-per-key",
            Full::PerModel => "--wake-hold-max-per-model",
            Full::Total => "--wake-hold-max-total",
        }
    }
}

/// One held request's share of the ledger (returned to [`Ledger::unhold`]
/// and [`Ledger::undemand`], each exactly once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    /// Caller identity.
    pub identity: String,
    /// Model.
    pub model: String,
    /// Held body bytes.
    pub bytes: u64,
    /// Client request ID (a UUID), for the demand dedup.
    pub client_id: Option<u128>,
}

#[derive(Debug, Clone, Default)]
struct Demand {
    /// (identity, client ID) -> requests carrying it.
    ids: HashMap<(String, u128), u32>,
    /// Requests without a client ID.
    alone: u64,
}

/// One distinct demanded request: (model, identity, client ID).
pub type DemandId = (String, String, u128);

/// Router-wide hold accounting.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    by_key: HashMap<String, u64>,
    by_model: HashMap<String, u64>,
    bytes: u64,
    demand: HashMap<String, Demand>,
    /// Demanded IDs another router counts (`--shared-state`: the router
    /// that claimed one first counts it, so the sum over routers counts
    /// each client once).
    foreign: std::collections::HashSet<DemandId>,
}

impl Ledger {
    /// Take a hold for `t` under `limits`, counting it in the demand.
    pub fn hold(&mut self, t: &Ticket, limits: Limits) -> Result<(), Full> {
        if self.by_key.get(&t.identity).copied().unwrap_or(0) >= limits.per_key {
            return Err(Full::PerKey);
        }
        if self.by_model.get(&t.model).copied().unwrap_or(0) >= limits.per_model {
            return Err(Full::PerModel);
        }
        if self.bytes.saturating_add(t.bytes) > limits.total_bytes {
            return Err(Full::Total);
        }
        *self.by_key.entry(t.identity.clone()).or_default() += 1;
        *self.by_model.entry(t.model.clone()).or_default() += 1;
        self.bytes += t.bytes;
        let d = self.demand.entry(t.model.clone()).or_default();
        match t.client_id {
            Some(id) => *d.ids.entry((t.identity.clone(), id)).or_default() += 1,
            None => d.alone += 1,
        }
        Ok(())
    }

    /// The hold ends (released by a wake, expired, client gone): its
    /// limits are returned; its demand stays until [`Ledger::undemand`].
    pub fn unhold(&mut self, t: &Ticket) {
        dec(&mut self.by_key, &t.identity);
        dec(&mut self.by_model, &t.model);
        self.bytes = self.bytes.saturating_sub(t.bytes);
    }

    /// The request left the demand (a slot on an agent, an error, gone).
    pub fn undemand(&mut self, t: &Ticket) {
        let Some(d) = self.demand.get_mut(&t.model) else {
            return;
        };
        match t.client_id {
            Some(id) => {
                let k = (t.identity.clone(), id);
                if let Some(n) = d.ids.get_mut(&k) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        d.ids.remove(&k);
                    }
                }
            }
            None => d.alone = d.alone.saturating_sub(1),
        }
    }

    /// `hivenet_pending_demand{model}`: distinct requests waiting (those
    /// with a client ID another router counts left out).
    pub fn demand(&self, model: &str) -> u64 {
        self.demand.get(model).map_or(0, |d| {
            let ids = if self.foreign.is_empty() {
                d.ids.len()
            } else {
                d.ids
                    .keys()
                    .filter(|(who, id)| {
                        !self
                            .foreign
                            .contains(&(model.to_string(), who.clone(), *id))
                    })
                    .count()
            };
            ids as u64 + d.alone
        })
    }

    /// Every demanded request with a client ID (what routers sharing state
    /// deduplicate).
    pub fn demanded_ids(&self) -> std::collections::HashSet<DemandId> {
        self.demand
            .iter()
            .flat_map(|(m, d)| d.ids.keys().map(|(who, id)| (m.clone(), who.clone(), *id)))
            .collect()
    }

    /// The IDs other routers count from now on (replaces the last set).
    pub fn set_foreign(&mut self, foreign: std::collections::HashSet<DemandId>) {
        self.foreign = foreign;
    }

    /// Held requests and body bytes now (gauges, tests).
    pub fn held(&self) -> (u64, u64) {
        (self.by_model.values().sum(), self.bytes)
    }
}

fn dec(m: &mut HashMap<String, u64>, k: &str) {
    if let Some(v) = m.get_mut(k) {
        *v = v.saturating_sub(1);
        if *v == 0 {
            m.remove(k);
        }
    }
}

/// A client request ID: canonical UUID (8-4-4-4-12 hex, any case) from
/// `X-Client-Request-ID`, else `X-Request-ID`; anything else is ignored.
pub fn client_id(x_client: Option<&[u8]>, x_request: Option<&[u8]>) -> Option<u128> {
    x_client.and_then(uuid).or_else(|| x_request.and_then(uuid))
}

fn uuid(v: &[u8]) -> Option<u128> {
    let v = v.trim_ascii();
    if v.len() != 36 {
        return None;
    }
    let mut n: u128 = 0;
    for (i, b) in v.iter().enumerate() {
        if matches!(i, 8 | 13 | 18 | 23) {
            if *b != b'-' {
                return None;
            }
            continue;
        }
        let d = (*b as char).to_digit(16)?;
        n = (n << 4) | u128::from(d);
    }
    Some(n)
}

/// Why a request gets `model_waking`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waking {
    /// The hold budget passed without a wake.
    Expired,
    /// A hold limit refused it at once.
    Full(Full),
    /// Woken, but no admission room before the budget ended.
    NoRoom,
    /// The router shut down while the request was held.
    ShuttingDown,
}

/// `Retry-After` seconds: a high percentile of the model's observed wake
/// time when known, else a tenth of the budget; clamped to [5, 60].
pub fn retry_after(budget: Duration, observed_wake: Option<Duration>) -> u64 {
    let base = observed_wake.unwrap_or(budget / 10);
    base.as_secs()
        .saturating_add(u64::from(base.subsec_nanos() > 0))
        .clamp(5, 60)
}

/// The `model_waking` error (spec 07 §8); the body also carries
/// `retry_after` (see [`waking_body`]).
pub fn waking(model: &str, why: Waking, budget: Duration) -> ApiError {
    let d = humanize(budget);
    let msg = match why {
        Waking::Expired => format!("model {model} is waking: not ready within hold budget {d}"),
        Waking::Full(f) => format!("model {model} is waking: hold limit reached ({})", f.flag()),
        Waking::NoRoom => {
            format!("model {model} woke but has no capacity within hold budget {d}")
        }
        Waking::ShuttingDown => {
            format!("model {model} is waking: this router is shutting down, retry")
        }
    };
    ApiError::new(ErrorCode::ModelWaking, msg)
}

/// The envelope of a `model_waking` error with `retry_after`.
pub fn waking_body(e: &ApiError, retry_after: u64) -> Vec<u8> {
    let v = serde_json::json!({"error": {
        "code": e.code.as_str(),
        "message": e.message,
        "source": "router",
        "retry_after": retry_after,
    }});
    serde_json::to_vec(&v).unwrap_or_default()
}

/// A duration as Go prints short ones (`4m0s` style is avoided: `4m`,
/// `30s`, `1h`, `1m30s`).
pub fn humanize(d: Duration) -> String {
    let s = d.as_secs();
    let (h, m, sec) = (s / 3600, (s % 3600) / 60, s % 60);
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if m > 0 {
        out.push_str(&format!("{m}m"));
    }
    if sec > 0 || out.is_empty() {
        out.push_str(&format!("{sec}s"));
    }
    out
}

/// The keepalive bytes of a held request.
pub fn keepalive(stream: bool) -> &'static [u8] {
    if stream {
        b": keep-alive\n\n"
    } else {
        b" "
    }
}

/// Body bytes of an error written after a committed 200 (spec 07 §7):
/// an SSE event for streams (Anthropic's shape on `/v1/messages`), the
/// envelope otherwise (after the keepalive spaces).
pub fn late_error(
    e: &ApiError,
    stream: bool,
    anthropic: bool,
    retry_after: Option<u64>,
) -> Vec<u8> {
    let envelope = match retry_after {
        Some(s) => waking_body(e, s),
        None => e.body(),
    };
    if !stream {
        return envelope;
    }
    let mut out = Vec::with_capacity(envelope.len() + 64);
    if anthropic {
        #[derive(serde::Serialize)]
        struct Inner<'a> {
            r#type: &'a str,
            message: String,
        }
        #[derive(serde::Serialize)]
        struct Event<'a> {
            r#type: &'a str,
            error: Inner<'a>,
        }
        let v = Event {
            r#type: "error",
            error: Inner {
                r#type: crate::logic::http::errors::anthropic_type(e.status),
                message: format!("{}: {}", e.code.as_str(), e.message),
            },
        };
        out.extend_from_slice(b"event: error\ndata: ");
        out.extend_from_slice(&serde_json::to_vec(&v).unwrap_or_default());
    } else {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(&envelope);
    }
    out.extend_from_slice(b"\n\n");
    out
}

/// The order held requests are released in when their model wakes,
/// given each one's (class, tenant, estimated tokens) in arrival order:
/// class first, then fair by tokens between tenants (each request's
/// start is the tokens its tenant held before it in the class: a tenant
/// that held ten requests does not push another's one behind all ten),
/// then arrival. The capacity queue's order, for a backlog that arrives
/// all at once.
pub fn release_order(held: &[(crate::logic::tenancy::class::Class, u64, u64)]) -> Vec<usize> {
    let mut before: HashMap<(crate::logic::tenancy::class::Class, u64), u64> = HashMap::new();
    let mut keyed: Vec<(crate::logic::tenancy::class::Class, u64, usize)> = held
        .iter()
        .enumerate()
        .map(|(i, &(class, tenant, cost))| {
            let sum = before.entry((class, tenant)).or_default();
            let start = *sum;
            *sum = sum.saturating_add(cost.max(1));
            (class, start, i)
        })
        .collect();
    keyed.sort_unstable();
    keyed.into_iter().map(|(_, _, i)| i).collect()
}

#[cfg(test)]
mod tests;
