//! Client keys (spec 05), pure: the `auth.yaml` schema and its
//! validation, the key record a request is authenticated as, the bearer
//! token of a request, and the effective allow-set.
//!
//! Key types: [`AuthConfig`] (a validated file), [`KeyRecord`] (one key),
//! [`Access`] (what a key may do with a model). Hashing the token and the
//! lookup table live in the runtime; this module never sees a raw key
//! except in [`bearer_token`], which only slices it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::class::Class;
pub use crate::logic::system::calendar::{days_from_civil, parse_expiry_day, parse_rfc3339};
use crate::logic::system::config_error::ConfigError;
use serde::{Deserialize, Serialize};

/// Client authentication mode (`api.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ApiMode {
    /// Every request is anonymous (tenant `default`).
    #[default]
    None,
    /// Static keys from `auth.yaml`.
    ApiKey,
    /// Keys managed at runtime through `/admin/api-keys`.
    Dynamic,
}

impl ApiMode {
    /// Parse `none | api-key | dynamic`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "none" | "" => Some(ApiMode::None),
            "api-key" => Some(ApiMode::ApiKey),
            "dynamic" => Some(ApiMode::Dynamic),
            _ => None,
        }
    }

    /// The mode's name.
    pub fn as_str(self) -> &'static str {
        match self {
            ApiMode::None => "none",
            ApiMode::ApiKey => "api-key",
            ApiMode::Dynamic => "dynamic",
        }
    }
}

/// A key's quota (flat XOR per-model; 0 = unlimited).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quota {
    /// Flat: requests per minute for the tenant's shared bucket.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub requests_per_minute: i64,
    /// Flat: tokens per UTC day for the tenant's shared bucket.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tokens_per_day: i64,
    /// Flat only: serverless input tokens per minute (enforced by admission).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub input_tokens_per_minute: i64,
    /// Flat only: serverless output tokens per minute (enforced by admission).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub output_tokens_per_minute: i64,
    /// Per-model limits; its keys are the key's allow-set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_model: Option<BTreeMap<String, RawModelQuota>>,
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}

/// One `per_model` entry as written (both fields required).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawModelQuota {
    /// Requests per minute per healthy replica (0 = unlimited).
    pub requests_per_minute_per_replica: Option<i64>,
    /// Tokens per UTC day (0 = unlimited), not replica-scaled.
    pub tokens_per_day: Option<i64>,
}

/// Validated limits of one model for a per-model key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelLimits {
    /// Requests per minute per healthy replica (0 = unlimited).
    pub rpm_per_replica: u64,
    /// Tokens per UTC day (0 = unlimited).
    pub tpd: u64,
}

/// Validated quota.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Limits {
    /// No limits at all.
    #[default]
    None,
    /// One bucket per tenant.
    Flat {
        /// Requests per minute (0 = unlimited).
        rpm: u64,
        /// Tokens per day (0 = unlimited).
        tpd: u64,
        /// Serverless ITPM (0 = unset).
        itpm: u64,
        /// Serverless OTPM (0 = unset).
        otpm: u64,
    },
    /// Buckets per (tenant, model); only these models are allowed.
    PerModel(BTreeMap<String, ModelLimits>),
}

/// What a key may do with a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Allowed.
    Allowed,
    /// Outside the `models` allowlist: `403 model_forbidden`.
    Forbidden,
    /// A per-model key without an entry for it: `429 rate_limit_exceeded`.
    Undeclared,
}

/// One authenticated key, as requests see it (never the key itself).
#[derive(Debug, Clone, PartialEq)]
pub struct KeyRecord {
    /// Stable ID: the registry ID (dynamic) or `sk_` + 16 hex digits of
    /// the key's SHA-256 (static; spec 05 leaves it empty, which made
    /// every static key share one serverless bucket).
    pub key_id: Arc<str>,
    /// Tenant: the key's owner.
    pub tenant: Arc<str>,
    /// Display name.
    pub name: String,
    /// Display preview (`sk-...KJ4`).
    pub preview: String,
    /// `models` / `allowed_models` (empty: all models, unless per-model).
    pub models: BTreeSet<String>,
    /// Quota.
    pub limits: Limits,
    /// Serverless per-key occupancy share (0 = unset).
    pub max_occupancy_share: f64,
    /// Unix second at which the key stops working (None: never).
    pub expires_at: Option<u64>,
    /// Disabled keys authenticate nobody (dynamic registry).
    pub enabled: bool,
    /// Sites this key may be redirected to, by scope (empty: all sites).
    pub site_scopes: Vec<String>,
    /// Priority class of its requests (a request header may lower it,
    /// never raise it).
    pub priority: Class,
}

/// A key's `priority` (absent: standard).
pub fn parse_priority(v: Option<&str>, at: &str) -> Result<Class, ConfigError> {
    match v.map(str::trim) {
        None | Some("") => Ok(Class::Standard),
        Some(s) => Class::parse(s).ok_or_else(|| {
            ConfigError::from(format!(
                "{at}.priority: {s:?} is not one of interactive, standard, batch"
            ))
        }),
    }
}

// === impl KeyRecord ===

impl KeyRecord {
    /// Whether the key works at `now_unix`.
    pub fn valid_at(&self, now_unix: u64) -> bool {
        self.enabled && self.expires_at.is_none_or(|e| now_unix < e)
    }

    /// The effective allow-set rule (spec 05 §4).
    pub fn access(&self, model: &str) -> Access {
        match &self.limits {
            Limits::PerModel(m) => {
                if m.contains_key(model) {
                    Access::Allowed
                } else {
                    Access::Undeclared
                }
            }
            _ if self.models.is_empty() || self.models.contains(model) => Access::Allowed,
            _ => Access::Forbidden,
        }
    }

    /// Whether `/v1/models` shows `model` to this key.
    pub fn sees(&self, model: &str) -> bool {
        self.access(model) == Access::Allowed
    }
}

/// The token of a request, the one parser of credentials (client and
/// admin routes, spec 05 §2 and 05 §4 "same bearer extraction"):
/// `Authorization` trimmed, minus an exact-case `Bearer ` prefix (a bare
/// key is accepted: another case is then part of the token), else
/// `x-api-key` (what the Anthropic SDK sends; the admin routes pass none).
/// `None` when both are absent or empty.
pub fn bearer_token<'a>(
    authorization: Option<&'a [u8]>,
    x_api_key: Option<&'a [u8]>,
) -> Option<&'a [u8]> {
    let from_auth = authorization.map(|v| {
        let v = v.trim_ascii();
        if v == b"Bearer" {
            let empty: &[u8] = &[];
            return empty;
        }
        v.strip_prefix(b"Bearer ")
            .map(<[u8]>::trim_ascii)
            .unwrap_or(v)
    });
    match from_auth {
        Some(t) if !t.is_empty() => Some(t),
        _ => x_api_key.map(<[u8]>::trim_ascii).filter(|t| !t.is_empty()),
    }
}

/// Lowercase hex of a hash.
pub fn hex(bytes: &[u8]) -> String {
    let digit = |n: u8| char::from_digit(u32::from(n), 16).unwrap_or('0');
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(digit(b >> 4));
        s.push(digit(b & 15));
    }
    s
}

/// Parse 64 hex digits (either case) into a hash.
pub fn parse_hash(s: &str) -> Option<[u8; 32]> {
    let b = s.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(b.chunks_exact(2)) {
        let hi = char::from(*pair.first()?).to_digit(16)?;
        let lo = char::from(*pair.get(1)?).to_digit(16)?;
        *o = u8::try_from(hi * 16 + lo).ok()?;
    }
    Some(out)
}

/// The stable ID of a static key.
pub fn static_key_id(hash: &[u8; 32]) -> String {
    format!("sk_{}", hex(hash.get(..8).unwrap_or(&[])))
}

// === auth.yaml ===

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    api: Option<RawApi>,
    #[serde(default)]
    admin: Option<RawAdmin>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawApi {
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    keys: Vec<RawKey>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    #[serde(default)]
    mode: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKey {
    #[serde(default)]
    key_hash: String,
    #[serde(default)]
    key_preview: String,
    #[serde(default)]
    metadata: RawMeta,
    #[serde(default)]
    models: Vec<String>,
    #[serde(default)]
    quota: Option<Quota>,
    #[serde(default)]
    max_occupancy_share: Option<f64>,
    #[serde(default)]
    site_scopes: Vec<String>,
    #[serde(default)]
    priority: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawMeta {
    #[serde(default)]
    name: String,
    #[serde(default)]
    owner: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    created_at: String,
    #[serde(default)]
    expires_at: String,
}

/// Admin authentication mode (`admin.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AdminMode {
    /// Open (needs `HIVENET_ROUTER_ALLOW_INSECURE_ADMIN=true`).
    None,
    /// Keys from `HIVENET_ROUTER_ADMIN_API_KEYS`.
    #[default]
    ApiKey,
}

/// A validated `auth.yaml`.
#[derive(Debug, Clone, Default)]
pub struct AuthConfig {
    /// Client mode.
    pub api: ApiMode,
    /// Admin mode (None when the file does not say).
    pub admin: Option<AdminMode>,
    /// Static keys by SHA-256 (api-key mode).
    pub keys: Vec<([u8; 32], KeyRecord)>,
}

/// Validate a quota (shared by `auth.yaml` and the registry); `at` names
/// the entry in errors.
pub fn validate_quota(q: &Quota, at: &str) -> Result<Limits, ConfigError> {
    let flat = [
        ("requests_per_minute", q.requests_per_minute),
        ("tokens_per_day", q.tokens_per_day),
        ("input_tokens_per_minute", q.input_tokens_per_minute),
        ("output_tokens_per_minute", q.output_tokens_per_minute),
    ];
    for (name, v) in flat {
        if v < 0 {
            return Err(ConfigError::from(format!(
                "{at}.quota.{name}: must be >= 0 (0 = unlimited)"
            )));
        }
    }
    let nonneg = |v: i64| u64::try_from(v).unwrap_or(0);
    match &q.per_model {
        None => Ok(Limits::Flat {
            rpm: nonneg(q.requests_per_minute),
            tpd: nonneg(q.tokens_per_day),
            itpm: nonneg(q.input_tokens_per_minute),
            otpm: nonneg(q.output_tokens_per_minute),
        }),
        Some(pm) => {
            if let Some((name, _)) = flat.iter().find(|(_, v)| *v != 0) {
                return Err(ConfigError::from(format!(
                    "{at}.quota.{name}: per_model cannot be combined with flat quota fields"
                )));
            }
            if pm.is_empty() {
                return Err(ConfigError::from(format!(
                    "{at}.quota.per_model: must list at least one model (or remove it)"
                )));
            }
            let mut out = BTreeMap::new();
            for (model, e) in pm {
                if model.trim().is_empty() {
                    return Err(ConfigError::from(format!(
                        "{at}.quota.per_model: empty model name"
                    )));
                }
                let field = |name: &str, v: Option<i64>| -> Result<u64, ConfigError> {
                    match v {
                        None => Err(ConfigError::from(format!(
                            "{at}.quota.per_model.{model}.{name}: required (write 0 for unlimited)"
                        ))),
                        Some(n) if n < 0 => Err(ConfigError::from(format!(
                            "{at}.quota.per_model.{model}.{name}: must be >= 0"
                        ))),
                        Some(n) => Ok(nonneg(n)),
                    }
                };
                out.insert(
                    model.clone(),
                    ModelLimits {
                        rpm_per_replica: field(
                            "requests_per_minute_per_replica",
                            e.requests_per_minute_per_replica,
                        )?,
                        tpd: field("tokens_per_day", e.tokens_per_day)?,
                    },
                );
            }
            Ok(Limits::PerModel(out))
        }
    }
}

/// Validate `max_occupancy_share` (0 = unset, else (0, 1]).
pub fn validate_share(v: Option<f64>, at: &str) -> Result<f64, ConfigError> {
    let v = v.unwrap_or(0.0);
    if !v.is_finite() || !(0.0..=1.0).contains(&v) {
        return Err(ConfigError::from(format!(
            "{at}.max_occupancy_share: {v} is outside [0, 1] (0 = unset)"
        )));
    }
    Ok(v)
}

/// Parse and validate `auth.yaml` (`file` names it in errors). Every
/// error is one line naming the file, the key entry and the field.
pub fn parse_config(file: &str, text: &str) -> Result<AuthConfig, ConfigError> {
    let raw: RawFile = serde_saphyr::from_str(text).map_err(|e| {
        let line = e.location().map(|l| l.line()).unwrap_or(0);
        let msg = e.to_string();
        let first = msg.lines().next().unwrap_or("invalid YAML").to_string();
        format!("auth: {file}:{line}: {first}")
    })?;
    let api = raw.api.unwrap_or(RawApi {
        mode: None,
        keys: Vec::new(),
    });
    let mode_s = api.mode.unwrap_or_default();
    let mode = ApiMode::parse(&mode_s).ok_or_else(|| {
        format!(
            "auth: {file}: api.mode: unknown mode {mode_s:?} (supported: none, api-key, dynamic)"
        )
    })?;
    let admin = match raw.admin.and_then(|a| a.mode) {
        None => None,
        Some(m) => Some(match m.as_str() {
            "none" => AdminMode::None,
            "api-key" => AdminMode::ApiKey,
            other => {
                return Err(ConfigError::from(format!(
                    "auth: {file}: admin.mode: unknown mode {other:?} (supported: none, api-key)"
                )))
            }
        }),
    };
    let mut keys: Vec<([u8; 32], KeyRecord)> = Vec::new();
    // Duplicates found by set, not by scanning: 100,000 keys load in one pass.
    let mut seen: std::collections::HashSet<[u8; 32]> = std::collections::HashSet::new();
    if mode == ApiMode::ApiKey {
        if api.keys.is_empty() {
            return Err(ConfigError::from(format!(
                "auth: {file}: api.keys: api-key mode needs at least one key (run `hivenet-router keygen`)"
            )));
        }
        for (i, k) in api.keys.into_iter().enumerate() {
            let at = format!("auth: {file}: api.keys[{i}]");
            let hash_s = k.key_hash.trim().to_ascii_lowercase();
            if hash_s.is_empty() {
                return Err(ConfigError::from(format!("{at}.key_hash: required")));
            }
            // Better than the spec: a hash that is not 64 hex digits would
            // silently never match, so it is refused.
            let hash = parse_hash(&hash_s).ok_or_else(|| {
                format!("{at}.key_hash: must be the 64 hex digits of the key's SHA-256")
            })?;
            if !seen.insert(hash) {
                return Err(ConfigError::from(format!(
                    "{at}.key_hash: duplicate of an earlier key"
                )));
            }
            if k.metadata.name.trim().is_empty() {
                return Err(ConfigError::from(format!("{at}.metadata.name: required")));
            }
            if k.metadata.owner.trim().is_empty() {
                return Err(ConfigError::from(format!(
                    "{at}.metadata.owner: required (it is the tenant)"
                )));
            }
            let expires_at = if k.metadata.expires_at.trim().is_empty() {
                None
            } else {
                Some(parse_expiry_day(&k.metadata.expires_at).ok_or_else(|| {
                    format!(
                        "{at}.metadata.expires_at: {:?} is not a DD-MM-YYYY date",
                        k.metadata.expires_at
                    )
                })?)
            };
            if let Some(m) = k.models.iter().find(|m| m.trim().is_empty()) {
                return Err(ConfigError::from(format!(
                    "{at}.models: empty model name {m:?}"
                )));
            }
            let limits = match &k.quota {
                Some(q) => validate_quota(q, &at)?,
                None => Limits::None,
            };
            let share = validate_share(k.max_occupancy_share, &at)?;
            let priority = parse_priority(k.priority.as_deref(), &at)?;
            let _ = (&k.metadata.description, &k.metadata.created_at);
            keys.push((
                hash,
                KeyRecord {
                    key_id: static_key_id(&hash).into(),
                    tenant: k.metadata.owner.trim().into(),
                    name: k.metadata.name,
                    preview: k.key_preview,
                    models: k.models.into_iter().collect(),
                    limits,
                    max_occupancy_share: share,
                    expires_at,
                    enabled: true,
                    site_scopes: k.site_scopes,
                    priority,
                },
            ));
        }
    }
    Ok(AuthConfig {
        api: mode,
        admin,
        keys,
    })
}

#[cfg(test)]
mod tests;
