//! Client keys and quotas at run time: the lookup snapshot every shard
//! reads ([`AuthState`]: SHA-256 of the token -> [`Credential`]), the
//! shared buckets (one `AtomicU64` each, updated by compare-and-swap over
//! the pure arithmetic of [`crate::logic::tenancy::quota`]), and the admission of
//! one request against them ([`admit`] -> [`Ticket`], settled once when
//! the request ends).
//!
//! Buckets are carried over when the snapshot is rebuilt (SIGHUP, a
//! registry change), so a reload forgets neither today's token usage nor
//! a minute's requests; they are also restored from the store at start.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::logic::http::endpoint::Endpoint;
use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::http::usage::Tokens;
use crate::logic::tenancy::auth::{self, Access, ApiMode, KeyRecord, Limits};
use crate::logic::tenancy::quota::{self, Daily, Rate, Verdict};

/// One bucket pair: requests per minute (GCRA state) and tokens today
/// (packed day and usage).
#[derive(Debug, Default)]
pub struct Bucket {
    /// GCRA theoretical arrival time (monotonic ns; 0 = full).
    pub rpm: AtomicU64,
    /// [`quota::pack`]ed day index and tokens used.
    pub daily: AtomicU64,
}

/// A bucket's name: tenant, and model for per-model keys (`""` for flat).
pub type BucketKey = (Arc<str>, String);

/// An authenticated key with its buckets.
#[derive(Debug, Clone)]
pub struct Credential {
    /// The key's record.
    pub key: Arc<KeyRecord>,
    /// The tenant's flat bucket (flat keys).
    pub flat: Option<Arc<Bucket>>,
    /// The (tenant, model) buckets (per-model keys).
    pub per_model: Arc<HashMap<String, Arc<Bucket>>>,
}

/// Who sent a request.
#[derive(Debug, Clone, Default)]
pub enum Principal {
    /// No client auth (mode `none`): tenant `default`.
    #[default]
    Anonymous,
    /// An authenticated key.
    Key(Credential),
    /// An admin route (its key is checked by the admin module).
    Admin,
}

/// `default`, `anonymous`, `admin`: built once, borrowed by
/// [`Principal::names`] (labels of anonymous requests allocate nothing).
static NAMES: std::sync::LazyLock<(Arc<str>, Arc<str>, Arc<str>)> =
    std::sync::LazyLock::new(|| {
        (
            Arc::from("default"),
            Arc::from("anonymous"),
            Arc::from("admin"),
        )
    });

// === impl Principal ===

impl Principal {
    /// `tenant_id` label and audit field.
    pub fn tenant(&self) -> &str {
        match self {
            Principal::Anonymous => "default",
            Principal::Admin => "admin",
            Principal::Key(c) => &c.key.tenant,
        }
    }

    /// `key_id` label and audit field (`anonymous` without auth).
    pub fn key_id(&self) -> &str {
        match self {
            Principal::Anonymous => "anonymous",
            Principal::Admin => "admin",
            Principal::Key(c) => &c.key.key_id,
        }
    }

    /// The tenant as a shared string (for per-shard maps).
    pub fn tenant_arc(&self) -> Arc<str> {
        match self {
            Principal::Anonymous => NAMES.0.clone(),
            Principal::Admin => NAMES.2.clone(),
            Principal::Key(c) => c.key.tenant.clone(),
        }
    }

    /// The key ID as a shared string.
    pub fn key_id_arc(&self) -> Arc<str> {
        match self {
            Principal::Anonymous => NAMES.1.clone(),
            Principal::Admin => NAMES.2.clone(),
            Principal::Key(c) => c.key.key_id.clone(),
        }
    }

    /// Tenant and key ID, borrowed (no reference count touched).
    pub fn names(&self) -> (&Arc<str>, &Arc<str>) {
        match self {
            Principal::Anonymous => (&NAMES.0, &NAMES.1),
            Principal::Admin => (&NAMES.2, &NAMES.2),
            Principal::Key(c) => (&c.key.tenant, &c.key.key_id),
        }
    }

    /// What this principal may do with `model`.
    pub fn access(&self, model: &str) -> Access {
        match self {
            Principal::Anonymous | Principal::Admin => Access::Allowed,
            Principal::Key(c) => c.key.access(model),
        }
    }
}

/// The lookup snapshot (replaced whole on reload and registry changes).
#[derive(Debug, Default)]
pub struct AuthState {
    /// Client mode.
    pub mode: ApiMode,
    by_hash: HashMap<[u8; 32], Credential>,
    /// Every bucket, by name (persistence, gauges).
    pub buckets: BTreeMap<BucketKey, Arc<Bucket>>,
    /// Limits per tenant for the gauges: flat (rpm, tpd) and per model
    /// (rpm per replica, tpd); the last key of a tenant wins.
    pub tenant_limits: BTreeMap<Arc<str>, TenantLimits>,
    /// (key name, ITPM) of every key with an ITPM limit: the serverless
    /// cross-config check of a policy reload reads it.
    pub itpm_limits: Vec<(String, u64)>,
}

/// A tenant's configured limits (gauges).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantLimits {
    /// Flat (rpm, tpd).
    pub flat: Option<(u64, u64)>,
    /// Per model: (rpm per replica, tpd).
    pub per_model: BTreeMap<String, (u64, u64)>,
}

/// What the request presented.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    /// No key, a wrong one, an expired or disabled one: all the same 401.
    Unauthorized,
}

impl AuthFailure {
    /// The 401 (its `WWW-Authenticate` comes from [`WWW_AUTHENTICATE`]).
    pub fn error(self) -> ApiError {
        ApiError::new(ErrorCode::Unauthorized, "unauthorized")
    }
}

/// The challenge sent with every 401.
pub const WWW_AUTHENTICATE: (&str, &[u8]) =
    ("WWW-Authenticate", br#"Bearer realm="hivenet-router""#);

// === impl AuthState ===

impl AuthState {
    /// Build the snapshot for `keys`, reusing the buckets of `prev` with
    /// the same name and seeding new ones from `restored` (daily states
    /// read from the store).
    pub fn build(
        mode: ApiMode,
        keys: Vec<([u8; 32], KeyRecord)>,
        prev: Option<&AuthState>,
        restored: &HashMap<BucketKey, u64>,
    ) -> AuthState {
        let mut buckets: BTreeMap<BucketKey, Arc<Bucket>> = BTreeMap::new();
        let mut bucket = |name: BucketKey| -> Arc<Bucket> {
            buckets
                .entry(name.clone())
                .or_insert_with(|| {
                    prev.and_then(|p| p.buckets.get(&name).cloned())
                        .unwrap_or_else(|| {
                            let b = Bucket::default();
                            if let Some(s) = restored.get(&name) {
                                b.daily.store(*s, Ordering::Relaxed);
                            }
                            Arc::new(b)
                        })
                })
                .clone()
        };
        let mut by_hash = HashMap::with_capacity(keys.len());
        let mut tenant_limits: BTreeMap<Arc<str>, TenantLimits> = BTreeMap::new();
        let mut itpm_limits = Vec::new();
        for (hash, rec) in keys {
            if let Limits::Flat { itpm, .. } = rec.limits {
                if itpm > 0 {
                    itpm_limits.push((rec.name.clone(), itpm));
                }
            }
            let tenant = rec.tenant.clone();
            let limits = tenant_limits.entry(tenant.clone()).or_default();
            let (flat, per_model) = match &rec.limits {
                Limits::None => (None, HashMap::new()),
                Limits::Flat { rpm, tpd, .. } => {
                    limits.flat = Some((*rpm, *tpd));
                    (
                        Some(bucket((tenant.clone(), String::new()))),
                        HashMap::new(),
                    )
                }
                Limits::PerModel(m) => {
                    let mut map = HashMap::with_capacity(m.len());
                    for (model, l) in m {
                        limits
                            .per_model
                            .insert(model.clone(), (l.rpm_per_replica, l.tpd));
                        map.insert(model.clone(), bucket((tenant.clone(), model.clone())));
                    }
                    (None, map)
                }
            };
            by_hash.insert(
                hash,
                Credential {
                    key: Arc::new(rec),
                    flat,
                    per_model: Arc::new(per_model),
                },
            );
        }
        AuthState {
            mode,
            by_hash,
            buckets,
            tenant_limits,
            itpm_limits,
        }
    }

    /// Authenticate a request from its `Authorization` / `x-api-key`
    /// values at `now_unix`. One SHA-256 and one map lookup.
    pub fn authenticate(
        &self,
        authorization: Option<&[u8]>,
        x_api_key: Option<&[u8]>,
        now_unix: u64,
    ) -> Result<Principal, AuthFailure> {
        if self.mode == ApiMode::None {
            return Ok(Principal::Anonymous);
        }
        let token =
            auth::bearer_token(authorization, x_api_key).ok_or(AuthFailure::Unauthorized)?;
        let hash: [u8; 32] = Sha256::digest(token).into();
        match self.by_hash.get(&hash) {
            Some(c) if c.key.valid_at(now_unix) => Ok(Principal::Key(c.clone())),
            _ => Err(AuthFailure::Unauthorized),
        }
    }

    /// Number of keys.
    pub fn key_count(&self) -> usize {
        self.by_hash.len()
    }

    /// Today's usage of every bucket that has some (for the store).
    pub fn daily_states(&self) -> Vec<(BucketKey, u64)> {
        self.buckets
            .iter()
            .map(|(k, b)| (k.clone(), b.daily.load(Ordering::Relaxed)))
            .filter(|(_, s)| *s != 0)
            .collect()
    }
}

pub use crate::logic::routing::refusal::{QuotaLimit, QuotaRefusal};

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
fn num(v: u64) -> Vec<u8> {
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
fn take_request(b: &Bucket, rate: Rate, now_ns: u64) -> Verdict {
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
fn take_tokens(b: &Bucket, day: u64, limit: u64, need: u64, charge: u64) -> Daily {
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

fn adjust_tokens(b: &Bucket, day: u64, delta: i64) {
    let _ = b
        .daily
        .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |s| {
            Some(quota::adjust(s, day, delta))
        });
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
        match take_request(bucket, rate, now_ns) {
            Verdict::Admit { remaining, .. } => {
                ticket
                    .headers
                    .push(("X-RateLimit-Limit-Requests", num(rpm)));
                ticket
                    .headers
                    .push(("X-RateLimit-Remaining-Requests", num(remaining)));
            }
            Verdict::Deny { retry_after_ns } => {
                let secs = quota::retry_after_secs(retry_after_ns);
                return Err(QuotaRefusal {
                    error: ApiError::new(ErrorCode::RateLimitExceeded, "rate limit exceeded")
                        .retry_after(secs),
                    headers: vec![
                        ("X-RateLimit-Limit-Requests", num(rpm)),
                        ("X-RateLimit-Remaining-Requests", b"0".to_vec()),
                        // Millisecond precision for the SDKs that read it.
                        ("retry-after-ms", num(retry_after_ns.div_ceil(1_000_000))),
                    ],
                    limit: QuotaLimit::Requests,
                });
            }
        }
    }
    if tpd > 0 {
        ticket.pending = Some((bucket.clone(), tpd));
    }
    Ok(ticket)
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
    let metered = matches!(f.endpoint, Endpoint::ChatCompletions | Endpoint::Messages);
    if metered {
        let need = f.estimate.saturating_add(f.declared_output);
        let day = day();
        // The whole footprint is reserved, not only the input estimate:
        // concurrent requests then overshoot the budget by at most one
        // reservation (issue 29 #8). The end trues it up.
        match take_tokens(&bucket, day, tpd, need, need) {
            Daily::Charged { remaining, .. } => {
                ticket
                    .headers
                    .push(("X-RateLimit-Remaining-Tokens", num(remaining)));
                ticket.daily = Some((bucket, day, need, f.estimate));
            }
            Daily::Refused { remaining } => {
                let msg = if f.declared_output > 0 {
                    "insufficient daily token budget for requested max_tokens"
                } else {
                    "daily token budget exceeded"
                };
                return Err(QuotaRefusal {
                    error: ApiError::new(ErrorCode::TokenLimitExceeded, msg),
                    headers: vec![("X-RateLimit-Remaining-Tokens", num(remaining))],
                    limit: QuotaLimit::Tokens,
                });
            }
        }
    }
    Ok(())
}

// === impl Ticket ===

impl Ticket {
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
            adjust_tokens(&bucket, day, delta);
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

#[cfg(test)]
mod tests;
