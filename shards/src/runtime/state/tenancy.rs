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
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::logic::http::endpoint::Endpoint;
use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::http::usage::Tokens;
use crate::logic::tenancy::auth::{self, Access, ApiMode, KeyRecord, Limits};
use crate::logic::tenancy::lease;
use crate::logic::tenancy::quota::{self, Daily, Rate, Verdict};

/// One bucket pair: requests per minute (GCRA state) and tokens today
/// (packed day and usage).
#[derive(Debug, Default)]
pub struct Bucket {
    /// GCRA theoretical arrival time (monotonic ns; 0 = full).
    pub rpm: AtomicU64,
    /// [`quota::pack`]ed day index and tokens this router used.
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
}

impl Lease {
    /// Nothing drawn yet: what the global quota has left is unknown.
    fn undrawn() -> Self {
        Lease {
            requests_left: AtomicU64::new(u64::MAX),
            tokens_left: AtomicU64::new(u64::MAX),
            ..Lease::default()
        }
    }
}

/// Refresh an atomic only when it changed (no store, no cache-line
/// ping-pong, on the common path).
fn note(a: &AtomicU64, v: u64) {
    if a.load(Ordering::Relaxed) != v {
        a.store(v, Ordering::Relaxed);
    }
}

/// Note a spend at `now_ns`; a bucket unused until now wakes the thread.
fn note_spend(l: &Lease, link: &QuotaLink, now_ns: u64) {
    let last = l.last_spend.load(Ordering::Relaxed);
    if last != now_ns {
        l.last_spend.store(now_ns, Ordering::Relaxed);
        if last == 0 {
            link.fresh.store(true, Ordering::Relaxed);
        }
    }
}

/// Spend `need` from `balance` as [`lease::spend`] allows.
fn spend_from(balance: &AtomicI64, need: i64, lease_size: i64, exhausted: bool) -> bool {
    balance
        .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |b| {
            lease::spend(b, need, lease_size, exhausted)
        })
        .is_ok()
}

/// What the lease says about one request.
enum LeaseAnswer {
    /// Spent (or no lease: this router alone).
    Spent,
    /// The global quota has none for this router now.
    Empty,
    /// Redis is away and the failure mode is closed.
    Closed,
}

impl Bucket {
    /// Spend one request from the lease at `rate` (`now_ns` monotonic).
    fn spend_request(&self, rate: Rate, now_ns: u64) -> LeaseAnswer {
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
    fn spend_tokens(&self, limit: u64, need: u64) -> LeaseAnswer {
        let Some(link) = &self.link else {
            return LeaseAnswer::Spent;
        };
        let l = &self.lease;
        note(&l.tokens_limit, limit);
        let need = i64::try_from(need).unwrap_or(i64::MAX);
        if !link.up.load(Ordering::Relaxed) {
            return self.away(link, &l.tokens, need);
        }
        let exhausted = l.tokens_exhausted.load(Ordering::Relaxed);
        let spent = spend_from(&l.tokens, need, lease::token_lease(limit), exhausted);
        if spent || !exhausted {
            l.tokens_wanted
                .fetch_add(need.unsigned_abs(), Ordering::Relaxed);
        }
        if spent {
            LeaseAnswer::Spent
        } else {
            LeaseAnswer::Empty
        }
    }

    /// Redis is away: refuse (closed), or spend on local limits only and
    /// keep the debt, charged to the global quota when Redis returns (open).
    fn away(&self, link: &QuotaLink, balance: &AtomicI64, need: i64) -> LeaseAnswer {
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
    fn unspend_request(&self) {
        if self.link.is_some() {
            self.lease.requests.fetch_add(1, Ordering::AcqRel);
            // Not wanted of the global quota: the local limit refused it.
            self.lease.requests_wanted.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Move `delta` tokens of usage through the lease (true-up > 0, refund < 0).
    fn adjust_lease_tokens(&self, delta: i64) {
        if self.link.is_some() {
            self.lease.tokens.fetch_sub(delta, Ordering::AcqRel);
        }
    }
}

/// The refusal of a quota-limited request while Redis is away and the
/// failure mode is closed.
fn closed(limit: QuotaLimit) -> QuotaRefusal {
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

    /// The tenant as the fair queues know it (hashed).
    pub fn tenant_hash(&self) -> u64 {
        xxhash_rust::xxh64::xxh64(self.tenant().as_bytes(), 0)
    }

    /// Its key's priority class (`standard` without a key).
    pub fn key_class(&self) -> crate::logic::routing::wait_queue::Class {
        match self {
            Principal::Key(k) => k.key.priority,
            _ => crate::logic::routing::wait_queue::Class::Standard,
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
    /// `--shared-state`: the link every bucket draws its lease through.
    pub link: Option<Arc<QuotaLink>>,
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
        let link = prev.and_then(|p| p.link.clone());
        Self::build_linked(mode, keys, prev, restored, link)
    }

    /// [`AuthState::build`] with the shared state's link (`--shared-state`;
    /// a rebuild from `prev` keeps its link).
    pub fn build_linked(
        mode: ApiMode,
        keys: Vec<([u8; 32], KeyRecord)>,
        prev: Option<&AuthState>,
        restored: &HashMap<BucketKey, u64>,
        link: Option<Arc<QuotaLink>>,
    ) -> AuthState {
        let mut buckets: BTreeMap<BucketKey, Arc<Bucket>> = BTreeMap::new();
        let mut bucket = |name: BucketKey| -> Arc<Bucket> {
            buckets
                .entry(name.clone())
                .or_insert_with(|| {
                    prev.and_then(|p| p.buckets.get(&name).cloned())
                        .unwrap_or_else(|| {
                            let b = Bucket {
                                link: link.clone(),
                                lease: Lease::undrawn(),
                                ..Bucket::default()
                            };
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
            link,
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
        match bucket.spend_request(rate, now_ns) {
            LeaseAnswer::Spent => {}
            LeaseAnswer::Closed => return Err(closed(QuotaLimit::Requests)),
            LeaseAnswer::Empty => {
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
fn shared_left(l: &Lease) -> u64 {
    let left = l.requests_left.load(Ordering::Relaxed);
    let held = u64::try_from(l.requests.load(Ordering::Relaxed)).unwrap_or(0);
    left.saturating_add(held)
}

/// The 429 of the request quota, retrying in `retry_after_ns`.
fn rate_refusal(rpm: u64, retry_after_ns: u64) -> QuotaRefusal {
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

#[cfg(test)]
mod tests;
