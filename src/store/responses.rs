//! The Responses API's conversations in the store thread (issue 52): one
//! record per response, keyed by tenant and ID, in the `responses`
//! keyspace beside the history (memory only when the store could not be
//! opened). Bounded in bytes per tenant and in total (the oldest records
//! go first) and by age (`--responses-ttl`); a tenant reads only its own.
//!
//! Key type: [`Conversations`].

use std::collections::{BTreeSet, HashMap, HashSet};

use fjall::{Database, Keyspace, PersistMode};
#[cfg(test)]
use shards::logic::http::api::responses::Record;
use shards::logic::http::api::responses::{previous_of, MAX_CHAIN};
use shards::runtime::services::store_api::{ChainError, StoreMsg};
use tracing::warn;

/// The keyspace.
pub const KEYSPACE: &str = "responses";

/// Bounds of the conversations kept.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// `--responses-max-bytes-per-tenant`.
    pub per_tenant: u64,
    /// `--responses-max-bytes`.
    pub total: u64,
    /// `--responses-ttl`, seconds (0: no expiry).
    pub ttl_secs: u64,
}

/// The records' key: tenant, a NUL, the ID (IDs never hold a NUL).
fn key(tenant: &str, id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(tenant.len() + 1 + id.len());
    k.extend_from_slice(tenant.as_bytes());
    k.push(0);
    k.extend_from_slice(id.as_bytes());
    k
}

/// A stored value: created_at (8 bytes, big-endian), then the record.
fn value(created_at: u64, record: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(8 + record.len());
    v.extend_from_slice(&created_at.to_be_bytes());
    v.extend_from_slice(record);
    v
}

fn created_of(v: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(v.get(..8)?.try_into().ok()?))
}

/// The conversations kept, with the index their bounds need.
pub struct Conversations {
    /// The store's keyspace, only for the duration of one call: the
    /// store reopens itself after a failure (a full disk), and a handle
    /// kept here would hold the old database open.
    disk: Option<(Database, Keyspace)>,
    mem: HashMap<Vec<u8>, Vec<u8>>,
    /// (created_at, arrival, key) oldest first (arrival orders the
    /// records of one second), and each key's place and size.
    order: BTreeSet<(u64, u64, Vec<u8>)>,
    sizes: HashMap<Vec<u8>, (u64, u64, u64)>,
    arrivals: u64,
    per_tenant: HashMap<String, u64>,
    /// Each tenant's records oldest first: its eviction takes the first,
    /// never a scan of everyone's.
    tenant_order: HashMap<String, BTreeSet<(u64, u64, Vec<u8>)>>,
    total: u64,
    bounds: Bounds,
}

impl Conversations {
    /// Over the keyspace when the store is open (read once to build the
    /// index), in memory otherwise.
    pub fn open(disk: Option<(Database, Keyspace)>, bounds: Bounds) -> Self {
        let mut c = Conversations {
            disk: None,
            mem: HashMap::new(),
            order: BTreeSet::new(),
            sizes: HashMap::new(),
            per_tenant: HashMap::new(),
            tenant_order: HashMap::new(),
            total: 0,
            arrivals: 0,
            bounds,
        };
        if let Some((_, ks)) = &disk {
            for kv in ks.iter() {
                let Ok((k, v)) = kv.into_inner() else {
                    continue;
                };
                let created = created_of(&v).unwrap_or(0);
                c.note(k.to_vec(), created, (k.len() + v.len()) as u64);
            }
        }
        c
    }

    /// [`Conversations::carry_out`] over the store's keyspace as it is now.
    pub fn handle(
        &mut self,
        msg: StoreMsg,
        now: u64,
        disk: Option<(Database, Keyspace)>,
    ) -> Option<StoreMsg> {
        self.disk = disk;
        let left = self.carry_out(msg, now);
        self.disk = None;
        left
    }

    /// Records kept and their bytes.
    pub fn stats(&self) -> (u64, u64) {
        (self.sizes.len() as u64, self.total)
    }

    fn tenant_of(k: &[u8]) -> String {
        let end = k.iter().position(|b| *b == 0).unwrap_or(k.len());
        String::from_utf8_lossy(k.get(..end).unwrap_or(&[])).into_owned()
    }

    fn note(&mut self, k: Vec<u8>, created: u64, size: u64) {
        let tenant = Self::tenant_of(&k);
        *self.per_tenant.entry(tenant.clone()).or_default() += size;
        self.total += size;
        self.arrivals += 1;
        self.tenant_order
            .entry(tenant)
            .or_default()
            .insert((created, self.arrivals, k.clone()));
        self.order.insert((created, self.arrivals, k.clone()));
        self.sizes.insert(k, (created, self.arrivals, size));
    }

    fn forget(&mut self, k: &[u8]) -> bool {
        let Some((created, arrival, size)) = self.sizes.remove(k) else {
            return false;
        };
        self.order.remove(&(created, arrival, k.to_vec()));
        self.total = self.total.saturating_sub(size);
        let tenant = Self::tenant_of(k);
        if let Some(t) = self.per_tenant.get_mut(&tenant) {
            *t = t.saturating_sub(size);
            if *t == 0 {
                self.per_tenant.remove(&tenant);
            }
        }
        if let Some(o) = self.tenant_order.get_mut(&tenant) {
            o.remove(&(created, arrival, k.to_vec()));
            if o.is_empty() {
                self.tenant_order.remove(&tenant);
            }
        }
        match &self.disk {
            Some((_, ks)) => {
                if let Err(e) = ks.remove(k) {
                    warn!("response record not removed: {e}");
                }
            }
            None => {
                self.mem.remove(k);
            }
        }
        true
    }

    fn read(&self, k: &[u8]) -> Option<Vec<u8>> {
        match &self.disk {
            Some((_, ks)) => ks.get(k).ok().flatten().map(|v| v.to_vec()),
            None => self.mem.get(k).cloned(),
        }
    }

    fn expired(&self, created: u64, now: u64) -> bool {
        self.bounds.ttl_secs > 0 && created.saturating_add(self.bounds.ttl_secs) <= now
    }

    /// Keep `record`; the tenant's oldest records, then everyone's, go
    /// until the bounds hold. One larger than a bound is not kept.
    pub fn put(&mut self, tenant: &str, id: &str, created_at: u64, record: &[u8]) {
        let k = key(tenant, id);
        let v = value(created_at, record);
        let size = (k.len() + v.len()) as u64;
        if size > self.bounds.per_tenant || size > self.bounds.total {
            warn!(
                tenant,
                id,
                bytes = size,
                "response not kept: larger than the conversation bounds"
            );
            return;
        }
        self.forget(&k);
        let stored = match &self.disk {
            Some((db, ks)) => ks
                .insert(&k, &v)
                .and_then(|_| db.persist(PersistMode::Buffer))
                .map_err(|e| warn!("response record not written: {e}"))
                .is_ok(),
            None => {
                self.mem.insert(k.clone(), v);
                true
            }
        };
        if !stored {
            return;
        }
        self.note(k, created_at, size);
        while self.per_tenant.get(tenant).copied().unwrap_or(0) > self.bounds.per_tenant {
            let oldest = self
                .tenant_order
                .get(tenant)
                .and_then(|o| o.iter().next())
                .map(|(_, _, key)| key.clone());
            match oldest {
                Some(o) => {
                    self.forget(&o);
                }
                None => break,
            }
        }
        while self.total > self.bounds.total {
            let Some((_, _, oldest)) = self.order.iter().next().cloned() else {
                break;
            };
            self.forget(&oldest);
        }
    }

    /// The record of `tenant` named `id`, if kept and not expired.
    pub fn get(&mut self, tenant: &str, id: &str, now: u64) -> Option<Vec<u8>> {
        let k = key(tenant, id);
        let (created, _, _) = *self.sizes.get(&k)?;
        if self.expired(created, now) {
            self.forget(&k);
            return None;
        }
        let v = self.read(&k)?;
        Some(v.get(8..).unwrap_or(&[]).to_vec())
    }

    /// The chain ending at `id`, oldest first.
    pub fn chain(&mut self, tenant: &str, id: &str, now: u64) -> Result<Vec<Vec<u8>>, ChainError> {
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        let mut next = Some(id.to_string());
        while let Some(id) = next.take() {
            if out.len() >= MAX_CHAIN || !seen.insert(id.clone()) {
                return Err(ChainError::TooLong(MAX_CHAIN));
            }
            let raw = self
                .get(tenant, &id, now)
                .ok_or_else(|| ChainError::NotFound(id.clone()))?;
            next = previous_of(&raw).map_err(|_| ChainError::NotFound(id.clone()))?;
            out.push(raw);
        }
        out.reverse();
        Ok(out)
    }

    /// Delete the record of `tenant` named `id`.
    pub fn delete(&mut self, tenant: &str, id: &str) -> bool {
        self.forget(&key(tenant, id))
    }

    /// Carry out a conversation message; any other is given back.
    fn carry_out(&mut self, msg: StoreMsg, now: u64) -> Option<StoreMsg> {
        match msg {
            StoreMsg::ResponsePut {
                tenant,
                id,
                created_at,
                record,
            } => self.put(&tenant, &id, created_at, &record),
            StoreMsg::ResponseGet { tenant, id, reply } => {
                let _ = reply.send(self.get(&tenant, &id, now));
            }
            StoreMsg::ResponseChain { tenant, id, reply } => {
                let _ = reply.send(self.chain(&tenant, &id, now));
            }
            StoreMsg::ResponseDelete { tenant, id, reply } => {
                let _ = reply.send(self.delete(&tenant, &id));
            }
            StoreMsg::ResponseTenants { reply } => {
                let mut v: Vec<(String, u64, u64)> = self
                    .per_tenant
                    .iter()
                    .map(|(t, b)| {
                        let n = self.tenant_order.get(t).map_or(0, BTreeSet::len);
                        (t.clone(), n as u64, *b)
                    })
                    .collect();
                v.sort();
                let _ = reply.send(v);
            }
            other => return Some(other),
        }
        None
    }

    /// Drop every record past its TTL.
    pub fn sweep(&mut self, now: u64, disk: Option<(Database, Keyspace)>) {
        self.disk = disk;
        self.sweep_now(now);
        self.disk = None;
    }

    fn sweep_now(&mut self, now: u64) {
        while let Some((created, _, k)) = self.order.iter().next().cloned() {
            if !self.expired(created, now) {
                break;
            }
            self.forget(&k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, prev: Option<&str>, pad: usize) -> Vec<u8> {
        let r = Record {
            id: id.into(),
            model: "m".into(),
            created_at: 0,
            previous_response_id: prev.map(String::from),
            instructions: None,
            input: vec![serde_json::json!({"role": "user", "content": "x".repeat(pad)})],
            output: vec![],
            usage: None,
            status: "completed".into(),
        };
        serde_json::to_vec(&r).expect("json")
    }

    fn book(per_tenant: u64, total: u64, ttl_secs: u64) -> Conversations {
        Conversations::open(
            None,
            Bounds {
                per_tenant,
                total,
                ttl_secs,
            },
        )
    }

    #[test]
    fn a_tenant_reads_only_its_own_and_chains_walk_back() {
        let mut c = book(1 << 20, 1 << 20, 0);
        c.put("a", "r1", 1, &rec("r1", None, 1));
        c.put("a", "r2", 2, &rec("r2", Some("r1"), 1));
        c.put("a", "r3", 3, &rec("r3", Some("r2"), 1));
        assert!(c.get("b", "r1", 10).is_none(), "another tenant's");
        let chain = c.chain("a", "r3", 10).expect("chain");
        let ids: Vec<String> = chain
            .iter()
            .map(|r| serde_json::from_slice::<Record>(r).expect("r").id)
            .collect();
        assert_eq!(ids, ["r1", "r2", "r3"]);
        assert_eq!(
            c.chain("b", "r3", 10),
            Err(ChainError::NotFound("r3".into()))
        );
        assert!(c.delete("a", "r2"));
        assert!(!c.delete("a", "r2"));
        assert_eq!(
            c.chain("a", "r3", 10),
            Err(ChainError::NotFound("r2".into()))
        );
        // A cycle (only bad data could make one) is refused.
        c.put("a", "x", 4, &rec("x", Some("y"), 1));
        c.put("a", "y", 5, &rec("y", Some("x"), 1));
        assert_eq!(c.chain("a", "x", 10), Err(ChainError::TooLong(MAX_CHAIN)));
    }

    #[test]
    fn bounds_evict_the_oldest_and_never_hold_more() {
        let one = (key("a", "r00").len() + 8 + rec("r00", None, 1000).len()) as u64;
        let mut c = book(one * 3, one * 5, 0);
        for i in 0..10u64 {
            let id = format!("r{i:02}");
            c.put("a", &id, i, &rec(&id, None, 1000));
            assert!(c.per_tenant.get("a").copied().unwrap_or(0) <= one * 3);
        }
        assert!(c.get("a", "r09", 0).is_some() && c.get("a", "r06", 0).is_none());
        for i in 0..10u64 {
            let id = format!("q{i:02}");
            c.put("b", &id, 100 + i, &rec(&id, None, 1000));
            assert!(c.stats().1 <= one * 5);
        }
        // The whole book (b keeps its 3, a had 3, 5 fit): the oldest
        // went first, whoever they were.
        assert!(c.get("a", "r07", 0).is_none() && c.get("a", "r08", 0).is_some());
        assert!(c.get("b", "q09", 0).is_some() && c.get("b", "q06", 0).is_none());
        // Larger than a bound: not kept at all.
        c.put("c", "big", 200, &rec("big", None, 10 * 1000));
        assert!(c.get("c", "big", 0).is_none());
    }

    #[test]
    fn records_expire() {
        let mut c = book(1 << 20, 1 << 20, 100);
        c.put("a", "old", 10, &rec("old", None, 1));
        c.put("a", "new", 150, &rec("new", None, 1));
        assert!(c.get("a", "old", 109).is_some());
        assert!(c.get("a", "old", 110).is_none());
        c.sweep(300, None);
        assert_eq!(c.stats().0, 0);
    }
}
