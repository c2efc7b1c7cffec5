//! What every shard reads: configuration, the model directory, the mesh
//! senders and the router's identity. Immutable after start except the
//! directory (single writer at a time, read-mostly).

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::channel::mpsc::UnboundedSender;
use libp2p_identity::Keypair;
use libp2p_pnet::PreSharedKey;

use super::mesh::ShardMsg;
use crate::logic::directory::Directory;
use crate::logic::policy::Policy;

/// Router settings the shards need.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Client HTTP listen address.
    pub http_addr: SocketAddr,
    /// Prometheus listen address.
    pub metrics_addr: SocketAddr,
    /// libp2p listen address.
    pub p2p_addr: SocketAddr,
    /// Request body limit in bytes; 0 disables.
    pub max_request_bytes: u64,
    /// Time allowed to receive a request head.
    pub header_timeout: Duration,
    /// Time allowed to receive a whole request body.
    pub body_timeout: Duration,
    /// Time allowed from forward to the agent's response head.
    pub request_timeout: Duration,
    /// Heartbeat period agents are told to use.
    pub heartbeat_interval: Duration,
    /// Time allowed for the preamble.
    pub preamble_timeout: Duration,
    /// Time allowed for the pnet + noise handshake and registration.
    pub handshake_timeout: Duration,
    /// Period of the history flush to the store.
    pub flush_interval: Duration,
    /// Tries per policy step (`--max-tries-per-step`).
    pub max_tries_per_step: u32,
    /// Capacity-queue bound per model (`--queue-depth`; 0: no queue).
    pub queue_depth: usize,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            http_addr: SocketAddr::from(([0, 0, 0, 0], 8080)),
            metrics_addr: SocketAddr::from(([0, 0, 0, 0], 2112)),
            p2p_addr: SocketAddr::from(([127, 0, 0, 1], 9000)),
            max_request_bytes: 10 * 1024 * 1024,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(60),
            heartbeat_interval: Duration::from_secs(5),
            preamble_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(10),
            flush_interval: Duration::from_secs(30),
            max_tries_per_step: 3,
            queue_depth: 30,
        }
    }
}

/// State shared by all shards.
pub struct Shared {
    /// Settings.
    pub cfg: RouterConfig,
    /// Model -> owning shard.
    pub directory: RwLock<Arc<Directory>>,
    /// Bumped on every directory change: shards keep a snapshot and only
    /// take the lock when it moved (no shared writes on the request path).
    pub directory_version: std::sync::atomic::AtomicU64,
    /// Bumped on every policy change (same scheme).
    pub policy_version: std::sync::atomic::AtomicU64,
    /// One sender per shard, indexed by shard id.
    pub mesh: Vec<UnboundedSender<ShardMsg>>,
    /// The router's libp2p identity.
    pub keypair: Keypair,
    /// Fleet secret for the private network; `None`: noise only.
    pub psk: Option<PreSharedKey>,
    /// The store thread (None: no persistence).
    pub store: Option<super::store_api::StoreTx>,
    /// Failed store operations.
    pub storage_errors: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// SHA-256 of each admin key; empty with `insecure_admin`.
    pub admin_keys: Vec<[u8; 32]>,
    /// Admin routes open without a key (explicit opt-in).
    pub insecure_admin: bool,
    /// Routing policies; a request takes one snapshot at its start.
    pub policies: RwLock<Arc<PolicySet>>,
    /// `hivenet_policy_reload_total{trigger,result}`.
    pub policy_reloads: std::sync::Mutex<std::collections::BTreeMap<(String, String), u64>>,
    /// Subscribers of `/admin/registration-stream` (16 events buffered each;
    /// a slow subscriber loses events rather than slowing registrations).
    pub feed: std::sync::Mutex<Vec<futures::channel::mpsc::Sender<String>>>,
}

/// Per-subscriber buffer of the registration feed.
pub const FEED_BUFFER: usize = 16;

/// The policies in force: the global one and the per-model documents.
#[derive(Debug, Clone, Default)]
pub struct PolicySet {
    /// Used for models no named document claims.
    pub global: Arc<Policy>,
    /// Named (per-model) documents.
    pub named: std::collections::BTreeMap<String, Arc<Policy>>,
}

impl PolicySet {
    /// Check that no model is claimed twice.
    pub fn validate(&self) -> Result<(), String> {
        let mut owner: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
        for (name, p) in &self.named {
            if p.models.is_empty() {
                return Err(format!(
                    "policy {name:?} must include a 'models:' field with at least one model name"
                ));
            }
            for m in &p.models {
                if let Some(other) = owner.insert(m, name) {
                    return Err(format!(
                        "model {m:?} is already claimed by policy {other:?}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The effective policy of a model.
    pub fn for_model(&self, model: &str) -> Arc<Policy> {
        self.named
            .values()
            .find(|p| p.models.iter().any(|m| m == model))
            .cloned()
            .unwrap_or_else(|| self.global.clone())
    }
}

impl Shared {
    /// The current directory snapshot.
    pub fn directory_snapshot(&self) -> Arc<Directory> {
        match self.directory.read() {
            Ok(d) => d.clone(),
            Err(_) => Arc::new(Directory::new(self.mesh.len())),
        }
    }

    /// Copy-on-write change of the directory (rare: agent arrivals).
    fn update_directory<R>(&self, f: impl FnOnce(&mut Directory) -> R) -> Option<R> {
        let mut g = self.directory.write().ok()?;
        let mut next = (**g).clone();
        let r = f(&mut next);
        *g = Arc::new(next);
        self.directory_version
            .fetch_add(1, std::sync::atomic::Ordering::Release);
        Some(r)
    }

    /// Owner of a model, if known (slow path: shards use their snapshot).
    pub fn owner(&self, model: &str) -> Option<usize> {
        self.directory_snapshot().owner(model)
    }

    /// The owner for a registering agent's model: known owner or
    /// reservation, else a new reservation on the least-loaded shard.
    pub fn owner_or_tentative(&self, model: &str) -> usize {
        if let Some(o) = self.directory_snapshot().reserved(model) {
            return o;
        }
        self.update_directory(|d| d.reserve(model)).unwrap_or(0)
    }

    /// Publish a `registered` or `unregistered` event to every subscriber.
    pub fn publish(&self, event: &str, reg: &crate::logic::control::Registration) {
        let (secs, nanos) = super::clock::unix_nanos();
        let line = serde_json::json!({
            "event_type": event,
            "deployment_id": reg.deployment_id,
            "replica_id": reg.replica_id,
            "agent_id": reg.peer_id,
            "timestamp": crate::logic::timefmt::rfc3339_nanos(secs, nanos),
        })
        .to_string();
        if let Ok(mut subs) = self.feed.lock() {
            subs.retain_mut(|tx| match tx.try_send(line.clone()) {
                Ok(()) => true,
                Err(e) => e.is_full(),
            });
        }
    }

    /// The policy snapshot for a request.
    pub fn policy_for(&self, model: &str) -> Arc<Policy> {
        match self.policies.read() {
            Ok(p) => p.for_model(model),
            Err(_) => Arc::new(Policy::default()),
        }
    }

    /// The whole policy set.
    pub fn policy_set(&self) -> Arc<PolicySet> {
        match self.policies.read() {
            Ok(p) => p.clone(),
            Err(_) => Arc::new(PolicySet::default()),
        }
    }

    /// Replace the policy set (validated) and count the reload.
    pub fn swap_policies(&self, set: PolicySet, trigger: &str) -> Result<(), String> {
        let r = set.validate();
        self.count_reload(trigger, r.is_ok());
        r?;
        if let Ok(mut g) = self.policies.write() {
            *g = Arc::new(set);
        }
        self.policy_version
            .fetch_add(1, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// Count a reload attempt.
    pub fn count_reload(&self, trigger: &str, ok: bool) {
        if let Ok(mut m) = self.policy_reloads.lock() {
            *m.entry((
                trigger.to_string(),
                if ok { "success" } else { "error" }.to_string(),
            ))
            .or_default() += 1;
        }
    }

    /// Record `preferred` as the owner of `model` unless it already has one;
    /// returns the owner.
    pub fn assign(&self, model: &str, preferred: usize) -> usize {
        if let Some(o) = self.directory_snapshot().owner(model) {
            return o;
        }
        self.update_directory(|d| d.assign(model, preferred))
            .unwrap_or(preferred)
    }
}

/// Shorthand.
pub type SharedRef = Arc<Shared>;
