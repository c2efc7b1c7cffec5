//! The dynamic key registry (spec 05 §7, 02 §9), pure: entries by ID,
//! the version rule (a mutation is accepted when its version sorts at or
//! after the current one, byte-wise), hash rotation, and the wire format
//! (snake_case JSON, the documented contract; the hash is never echoed).
//!
//! Key type: [`Registry`]; the runtime keeps one behind a lock (admin
//! calls only) and publishes [`Registry::keys`] as the lookup snapshot.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::auth::{self, KeyRecord, Quota};
use crate::logic::system::config_error::ConfigError;

/// One key as `PUT /admin/api-keys/{id}` and `replace` carry it.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KeyDto {
    /// Entry ID (the URL's wins for PUT).
    #[serde(default)]
    pub id: String,
    /// Version of this mutation (PUT).
    #[serde(default)]
    pub version: String,
    /// SHA-256 of the key, 64 hex digits.
    #[serde(default)]
    pub key_hash: String,
    /// Display preview.
    #[serde(default)]
    pub key_preview: String,
    /// Tenant.
    #[serde(default)]
    pub owner: String,
    /// Display name.
    #[serde(default)]
    pub name: String,
    /// Absent means enabled.
    #[serde(default)]
    pub enabled: Option<bool>,
    /// RFC 3339 instant, or empty/absent for never.
    #[serde(default)]
    pub expires_at: Option<String>,
    /// Allowlist (empty: all models).
    #[serde(default)]
    pub allowed_models: Vec<String>,
    /// Quota (same shape as auth.yaml).
    #[serde(default)]
    pub quota: Option<Quota>,
    /// Serverless per-key occupancy share.
    #[serde(default)]
    pub max_occupancy_share: Option<f64>,
    /// Redirect scopes (empty: all sites).
    #[serde(default)]
    pub site_scopes: Vec<String>,
    /// Priority class: interactive, standard (absent) or batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<String>,
}

/// One key as `GET /admin/api-keys` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KeyView {
    /// Entry ID.
    pub id: String,
    /// Display preview.
    pub key_preview: String,
    /// Tenant.
    pub owner: String,
    /// Display name.
    pub name: String,
    /// Whether it authenticates.
    pub enabled: bool,
    /// RFC 3339 as given, or null.
    pub expires_at: Option<String>,
    /// Allowlist.
    pub allowed_models: Vec<String>,
    /// Quota.
    pub quota: Quota,
    /// Serverless per-key occupancy share.
    pub max_occupancy_share: f64,
    /// Redirect scopes (empty: all sites).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub site_scopes: Vec<String>,
    /// Priority class.
    pub priority: &'static str,
}

#[derive(Debug, Clone)]
struct Entry {
    hash: [u8; 32],
    record: KeyRecord,
    view: KeyView,
    /// As it was put (what a shared store carries to the other routers).
    dto: KeyDto,
}

/// The whole registry as routers sharing it exchange it (the key hashes
/// included: never the keys).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// The registry's version.
    pub version: String,
    /// Every entry as it was put.
    pub keys: Vec<KeyDto>,
}

/// Why a mutation was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistryError {
    /// The version sorts before the current one (`409` for PUT/DELETE).
    Stale {
        /// The current version.
        current: String,
    },
    /// Bad input (`400`), with the message.
    Invalid(String),
}

/// The registry: entries by ID and the current version.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    version: String,
    /// The next mutations skip the version order (an operator's forced
    /// push, `?force=true`: the way out of a version pushed too far).
    pub force: bool,
    entries: BTreeMap<String, Entry>,
    /// The generation of the shared store it mirrors (0: none).
    pub epoch: u64,
}

/// Validate one entry into its hash, record and view.
fn validate(id: &str, dto: KeyDto) -> Result<Entry, ConfigError> {
    let kept = KeyDto {
        id: id.to_string(),
        ..dto.clone()
    };
    if id.trim().is_empty() {
        return Err("id is required".into());
    }
    let hash_s = dto.key_hash.trim().to_ascii_lowercase();
    let hash = auth::parse_hash(&hash_s)
        .ok_or_else(|| "key_hash must be exactly 64 hex characters".to_string())?;
    if dto.owner.trim().is_empty() {
        return Err("owner is required".into());
    }
    if dto.name.trim().is_empty() {
        return Err("name is required".into());
    }
    let expires = match dto.expires_at.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(s) => Some(
            auth::parse_rfc3339(s)
                .ok_or_else(|| format!("expires_at: {s:?} is not an RFC 3339 instant"))?,
        ),
    };
    if dto.allowed_models.iter().any(|m| m.trim().is_empty()) {
        return Err("allowed_models: empty model name".into());
    }
    let quota = dto.quota.unwrap_or_default();
    let limits = auth::validate_quota(&quota, "key")?;
    let share = auth::validate_share(dto.max_occupancy_share, "key")?;
    let priority = auth::parse_priority(dto.priority.as_deref(), "key")?;
    let enabled = dto.enabled.unwrap_or(true);
    let models: BTreeSet<String> = dto.allowed_models.iter().cloned().collect();
    Ok(Entry {
        hash,
        record: KeyRecord {
            key_id: id.into(),
            tenant: dto.owner.trim().into(),
            name: dto.name.clone(),
            preview: dto.key_preview.clone(),
            models,
            limits,
            max_occupancy_share: share,
            expires_at: expires,
            enabled,
            site_scopes: dto.site_scopes.clone(),
            priority,
        },
        view: KeyView {
            id: id.to_string(),
            key_preview: dto.key_preview,
            owner: dto.owner,
            name: dto.name,
            enabled,
            expires_at: dto.expires_at.filter(|s| !s.trim().is_empty()),
            allowed_models: dto.allowed_models,
            quota,
            max_occupancy_share: share,
            site_scopes: dto.site_scopes,
            priority: priority.as_str(),
        },
        dto: kept,
    })
}

// === impl Registry ===

impl Registry {
    /// The current version (`""` before the first mutation).
    /// The current version.
    pub fn version(&self) -> &str {
        &self.version
    }

    fn check_version(&self, version: &str) -> Result<(), RegistryError> {
        if version.is_empty() {
            return Err(RegistryError::Invalid("version is required".into()));
        }
        if !self.force && !crate::logic::system::version::at_or_after(Some(&self.version), version)
        {
            return Err(RegistryError::Stale {
                current: self.version.clone(),
            });
        }
        Ok(())
    }

    /// Create or replace entry `id` (same ID with a new hash rotates the
    /// key: the old hash stops working at once).
    pub fn put(&mut self, id: &str, dto: KeyDto) -> Result<(), RegistryError> {
        let version = dto.version.clone();
        self.check_version(&version)?;
        let e = validate(id, dto).map_err(|e| RegistryError::Invalid(e.into()))?;
        if let Some((other, _)) = self
            .entries
            .iter()
            .find(|(other, x)| x.hash == e.hash && other.as_str() != id)
        {
            return Err(RegistryError::Invalid(format!(
                "auth: key_hash already registered to id {other:?}"
            )));
        }
        self.entries.insert(id.to_string(), e);
        self.version = version;
        Ok(())
    }

    /// Delete entry `id` (idempotent); returns whether it existed.
    pub fn delete(&mut self, id: &str, version: &str) -> Result<bool, RegistryError> {
        if id.trim().is_empty() {
            return Err(RegistryError::Invalid("id is required".into()));
        }
        self.check_version(version)?;
        let existed = self.entries.remove(id).is_some();
        self.version = version.to_string();
        Ok(existed)
    }

    /// Replace every entry at once (all validated first; a stale version
    /// is a `400` here, as the spec says).
    pub fn replace(&mut self, version: &str, keys: Vec<KeyDto>) -> Result<usize, RegistryError> {
        match self.check_version(version) {
            Err(RegistryError::Stale { current }) => {
                return Err(RegistryError::Invalid(format!(
                    "stale version (current {current:?})"
                )))
            }
            Err(e) => return Err(e),
            Ok(()) => {}
        }
        let mut next: BTreeMap<String, Entry> = BTreeMap::new();
        let mut hashes: BTreeSet<[u8; 32]> = BTreeSet::new();
        for (i, dto) in keys.into_iter().enumerate() {
            let id = dto.id.clone();
            let e =
                validate(&id, dto).map_err(|m| RegistryError::Invalid(format!("key[{i}]: {m}")))?;
            if !hashes.insert(e.hash) {
                return Err(RegistryError::Invalid(format!(
                    "key[{i}]: duplicate key_hash"
                )));
            }
            if next.insert(id.clone(), e).is_some() {
                return Err(RegistryError::Invalid(format!(
                    "key[{i}]: duplicate id {id:?}"
                )));
            }
        }
        let n = next.len();
        self.entries = next;
        self.version = version.to_string();
        Ok(n)
    }

    /// Everything, as the other routers sharing it load it.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            version: self.version.clone(),
            keys: self.entries.values().map(|e| e.dto.clone()).collect(),
        }
    }

    /// The registry a shared store holds at `epoch` (validated like a
    /// replace, without the version order: the store's word is final).
    pub fn from_snapshot(snap: Snapshot, epoch: u64) -> Result<Self, RegistryError> {
        let mut r = Registry {
            force: true,
            ..Registry::default()
        };
        if !snap.version.is_empty() {
            r.replace(&snap.version, snap.keys)?;
        }
        r.force = false;
        r.epoch = epoch;
        Ok(r)
    }

    /// Every entry, by ID.
    pub fn list(&self) -> Vec<&KeyView> {
        self.entries.values().map(|e| &e.view).collect()
    }

    /// One entry.
    pub fn get(&self, id: &str) -> Option<&KeyView> {
        self.entries.get(id).map(|e| &e.view)
    }

    /// The lookup table: hash and record of every entry.
    pub fn keys(&self) -> Vec<([u8; 32], KeyRecord)> {
        self.entries
            .values()
            .map(|e| (e.hash, e.record.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H1: &str = "9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B2B0B822CD15D6C15B0F00A08";
    const H2: &str = "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752";

    fn dto(version: &str, hash: &str) -> KeyDto {
        KeyDto {
            version: version.into(),
            key_hash: hash.into(),
            owner: "acme".into(),
            name: "prod".into(),
            ..KeyDto::default()
        }
    }

    #[test]
    fn a_snapshot_carries_every_entry_to_another_router() {
        let mut a = Registry::default();
        a.put("k1", dto("rev_01", H1)).expect("k1");
        a.put("k2", dto("rev_02", H2)).expect("k2");
        a.delete("k1", "rev_03").expect("delete");
        let wire = serde_json::to_string(&a.snapshot()).expect("json");
        let snap: Snapshot = serde_json::from_str(&wire).expect("parse");
        let b = Registry::from_snapshot(snap, 7).expect("load");
        assert_eq!((b.version(), b.epoch), ("rev_03", 7));
        assert_eq!(b.keys(), a.keys());
        assert_eq!(b.list(), a.list());
        // The store's word is final (no version order), and empty is empty.
        let older = Snapshot {
            version: "rev_00".into(),
            keys: vec![],
        };
        let c = Registry::from_snapshot(older, 8).expect("older");
        assert_eq!((c.version(), c.list().len()), ("rev_00", 0));
        assert!(!c.force);
        let bad = Snapshot {
            version: "rev_09".into(),
            keys: vec![dto("rev_09", "nothex")],
        };
        assert!(Registry::from_snapshot(bad, 9).is_err());
    }

    #[test]
    fn version_rule_and_rotation() {
        let mut r = Registry::default();
        assert_eq!(
            r.put("k1", dto("", H1)),
            Err(RegistryError::Invalid("version is required".into()))
        );
        r.put("k1", dto("rev_02", H1)).expect("first");
        // Equal version: idempotent replay.
        r.put("k1", dto("rev_02", H1)).expect("replay");
        assert_eq!(
            r.put("k1", dto("rev_01", H1)),
            Err(RegistryError::Stale {
                current: "rev_02".into()
            })
        );
        // Same hash under another ID is refused.
        assert!(
            matches!(r.put("k2", dto("rev_03", H1)), Err(RegistryError::Invalid(m)) if m.contains("k1"))
        );
        // Rotation: same ID, new hash; the old one is gone.
        r.put("k1", dto("rev_04", H2)).expect("rotate");
        let keys = r.keys();
        assert_eq!(keys.len(), 1);
        assert_eq!(auth::hex(&keys[0].0), H2);
        assert_eq!(r.version(), "rev_04");
        assert_eq!(&*keys[0].1.key_id, "k1");
        assert!(keys[0].1.enabled);
        assert_eq!(
            r.delete("k1", "rev_03"),
            Err(RegistryError::Stale {
                current: "rev_04".into()
            })
        );
        assert_eq!(r.delete("k1", "rev_05"), Ok(true));
        assert_eq!(r.delete("k1", "rev_06"), Ok(false));
        assert!(r.keys().is_empty());
    }

    #[test]
    fn validation_and_replace() {
        let mut r = Registry::default();
        let mut bad = dto("v1", "abc");
        assert!(
            matches!(r.put("k", bad.clone()), Err(RegistryError::Invalid(m)) if m.contains("64 hex"))
        );
        bad.key_hash = H2.into();
        bad.expires_at = Some("tomorrow".into());
        assert!(
            matches!(r.put("k", bad), Err(RegistryError::Invalid(m)) if m.contains("expires_at"))
        );
        let mut a = dto("", H1);
        a.id = "a".into();
        let mut b = dto("", H2);
        b.id = "a".into();
        assert!(
            matches!(r.replace("v1", vec![a.clone(), b.clone()]), Err(RegistryError::Invalid(m)) if m.contains("duplicate id"))
        );
        b.id = "b".into();
        b.expires_at = Some("2027-01-01T00:00:00Z".into());
        assert_eq!(r.replace("v2", vec![a, b]), Ok(2));
        assert!(
            matches!(r.replace("v1", vec![]), Err(RegistryError::Invalid(m)) if m.contains("stale"))
        );
        let view = r.get("b").expect("b");
        assert_eq!(view.expires_at.as_deref(), Some("2027-01-01T00:00:00Z"));
        let json = serde_json::to_string(view).expect("json");
        assert!(
            json.contains("\"key_preview\"") && !json.contains("key_hash"),
            "{json}"
        );
        assert!(json.contains("\"priority\":\"standard\""), "{json}");
    }

    #[test]
    fn a_key_carries_its_priority_class() {
        let mut r = Registry::default();
        let mut d = dto("v1", H1);
        d.priority = Some("batch".into());
        r.put("k", d.clone()).expect("put");
        let keys = r.keys();
        assert_eq!(
            keys.first().map(|(_, k)| k.priority),
            Some(crate::logic::tenancy::class::Class::Batch)
        );
        assert_eq!(r.get("k").map(|v| v.priority), Some("batch"));
        // It travels to the other routers with the snapshot.
        let b = Registry::from_snapshot(r.snapshot(), 2).expect("load");
        assert_eq!(b.keys(), keys);
        d.version = "v2".into();
        d.priority = Some("urgent".into());
        assert!(matches!(r.put("k", d), Err(RegistryError::Invalid(m)) if m.contains("priority")));
    }
}
