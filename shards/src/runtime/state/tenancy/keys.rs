//! Client keys at run time: [`AuthState`], the lookup snapshot every shard
//! reads (SHA-256 of the token -> [`Credential`]), and who a request is
//! ([`Principal`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::tenancy::auth::{self, Access, ApiMode, KeyRecord, Limits};
use crate::runtime::services::buckets::{Bucket, BucketKey, Lease, QuotaLink};

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

    /// Add `delta` tokens to `day`'s usage of the bucket `key`: what the
    /// process this one replaced counted after it gave the store away
    /// (issue 54). `false`: no such bucket here.
    pub fn add_usage(&self, key: &BucketKey, day: u64, delta: i64) -> bool {
        match self.buckets.get(key) {
            Some(b) => {
                b.adjust_daily(day, delta);
                true
            }
            None => false,
        }
    }

    /// The request-rate state of every bucket spending ahead of `now_ns`
    /// (its GCRA arrival time, as nanoseconds ahead): what a replacing
    /// process takes over (issue 54), clocks being per process.
    pub fn rates_ahead(&self, now_ns: u64) -> Vec<(BucketKey, u64)> {
        self.buckets
            .iter()
            .filter_map(|(k, b)| {
                let tat = b.rpm.load(Ordering::Relaxed);
                (tat > now_ns).then(|| (k.clone(), tat - now_ns))
            })
            .collect()
    }

    /// Take the request-rate state of the process this one replaced: a
    /// bucket's arrival time moves to `now_ns + ahead` when that is later
    /// (no tenant gets a second minute's budget across an upgrade).
    pub fn take_rates(&self, rates: &[(BucketKey, u64)], now_ns: u64) {
        for (k, ahead) in rates {
            if let Some(b) = self.buckets.get(k) {
                b.rpm
                    .fetch_max(now_ns.saturating_add(*ahead), Ordering::AcqRel);
            }
        }
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
