//! What every shard reads: configuration, the model directory and the
//! policies (versioned snapshots), the mesh senders, the router's identity,
//! the store sender and the admin keys.
//!
//! Key types: [`Router`] (held by every shard as `Arc<Router>`),
//! [`RouterConfig`].

use crate::logic::link::control::Capability;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::channel::mpsc::UnboundedSender;
use libp2p_identity::Keypair;
use libp2p_pnet::PreSharedKey;

use super::mesh::ShardMsg;
use super::snapshot::Versioned;
use crate::logic::routing::directory::Directory;
use crate::logic::routing::policy_set::PolicySet;
use crate::logic::system::config_error::ConfigError;

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
    /// `--responses-max-bytes-per-tenant` (the Redis copy's bound too).
    pub responses_per_tenant: u64,
    /// `--responses-ttl-days`, in seconds (0: no expiry).
    pub responses_ttl_secs: u64,
    /// Time allowed to receive a request head.
    pub header_timeout: Duration,
    /// Time allowed to receive a whole request body.
    pub body_timeout: Duration,
    /// Time allowed from forward to the agent's response head.
    pub request_timeout: Duration,
    /// Heartbeat period agents are told to use.
    pub heartbeat_interval: Duration,
    /// An agent silent this long is unhealthy (`--unhealthy-after`;
    /// `None`: three heartbeat periods).
    pub unhealthy_after: Option<Duration>,
    /// Time allowed for the preamble.
    pub preamble_timeout: Duration,
    /// Time allowed for the pnet + noise handshake and registration.
    pub handshake_timeout: Duration,
    /// Period of the history flush to the store.
    pub flush_interval: Duration,
    /// Longest silence between bytes of a response being relayed
    /// (`--stream-idle-timeout`): then it is cut with an error event.
    pub stream_idle_timeout: Duration,
    /// Fallback providers' accounts (spec 04 §7).
    pub providers: crate::runtime::services::providers::Providers,
    /// An agent whose control stream stays silent this long is removed
    /// and its link closed (`--remove-after`).
    pub remove_after: Duration,
    /// Tries per policy step (`--max-tries-per-step`).
    pub max_tries_per_step: u32,
    /// Continuations of a streamed chat whose agent died mid-stream
    /// (`--stream-migrations`, 0: cut as before).
    pub stream_migrations: u32,
    /// Time in-flight requests get to finish: at shutdown, and on an
    /// agent drained through the admin API (`--drain-timeout`).
    pub drain_timeout: Duration,
    /// Capacity-queue bound per model (`--queue-depth`; 0: no queue).
    pub queue_depth: usize,
    /// Request-body bytes buffered at once, router-wide
    /// (`--max-buffered-body-bytes`; 0: unlimited).
    pub max_buffered_body_bytes: u64,
    /// Client connections open at once (`--max-client-connections`; 0: unlimited).
    pub max_client_connections: usize,
    /// Most agent links open at once (0: no cap).
    pub max_agent_links: usize,
    /// Most agent links from one source address (0: no cap).
    pub max_agent_links_per_address: usize,
    /// Agent connections before their handshake, in all (`--max-pending-agent-links`).
    pub max_pending_agent_links: usize,
    /// The same per source address (`--max-pending-agent-links-per-address`).
    pub max_pending_agent_links_per_address: usize,
    /// Entries of the cache-affinity index, all shards together
    /// (`--affinity-table-entries`; each shard allocates its share on
    /// its first prefix-aware decision).
    pub affinity_table_entries: usize,
    /// `HIVENET_ROUTER_RPM_BURST_SECONDS` (0: a bucket's burst is the
    /// whole minute).
    pub rpm_burst_secs: u64,
    /// `HIVENET_ROUTER_ADMIT_FRACTION`: share of `admit_budget_tokens`
    /// admission fills, (0, 1].
    pub admit_fraction: f64,
    /// `HIVENET_ROUTER_ADMIT_PARK_TIMEOUT`: how long a request waits for
    /// occupancy room (0: refused at once).
    pub admit_park_timeout: Duration,
    /// `--site-id` (None: no sites, no redirect; behaviour as before).
    pub site_id: Option<String>,
    /// `--sibling-hints-max-age`: warm/cold hints older than this are
    /// ignored.
    pub sibling_hints_max_age: Duration,
    /// `--wake-hold-budget`: how long a request is held at zero unless its
    /// placement sets `hold_budget`.
    pub wake_hold_budget: Duration,
    /// The three hold limits.
    pub hold_limits: crate::logic::sites::hold::Limits,
    /// `--wake-keepalive` (zero: no keepalives, plain status codes).
    pub wake_keepalive: Duration,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            http_addr: SocketAddr::from(([0, 0, 0, 0], 8080)),
            metrics_addr: SocketAddr::from(([0, 0, 0, 0], 2112)),
            p2p_addr: SocketAddr::from(([127, 0, 0, 1], 9000)),
            max_request_bytes: 10 * 1024 * 1024,
            responses_per_tenant: 64 << 20,
            responses_ttl_secs: 30 * 86_400,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(60),
            heartbeat_interval: Duration::from_secs(5),
            unhealthy_after: None,
            preamble_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(10),
            flush_interval: Duration::from_secs(30),
            stream_idle_timeout: Duration::from_secs(30),
            providers: Default::default(),
            remove_after: Duration::from_secs(30),
            max_tries_per_step: 3,
            stream_migrations: 1,
            drain_timeout: Duration::from_secs(10),
            queue_depth: 30,
            max_buffered_body_bytes: 256 * 1024 * 1024,
            max_client_connections: 4096,
            max_agent_links: 1024,
            max_agent_links_per_address: 128,
            max_pending_agent_links: 4096,
            max_pending_agent_links_per_address: 256,
            affinity_table_entries: 1 << 20,
            rpm_burst_secs: 0,
            admit_fraction: 0.9,
            admit_park_timeout: Duration::from_millis(250),
            site_id: None,
            sibling_hints_max_age: Duration::from_secs(60),
            wake_hold_budget: Duration::from_secs(300),
            hold_limits: crate::logic::sites::hold::Limits::default(),
            wake_keepalive: Duration::from_secs(15),
        }
    }
}

/// The router-wide state every shard reads.
pub struct Router {
    /// Settings.
    pub cfg: RouterConfig,
    /// Model -> owning shard (shards read it through their cache).
    pub directory: Versioned<Directory>,
    /// One sender per shard, indexed by shard id.
    pub mesh: Vec<UnboundedSender<ShardMsg>>,
    /// The router's libp2p identity.
    pub keypair: Keypair,
    /// Fleet secret for the private network; `None`: noise only.
    pub psk: Option<PreSharedKey>,
    /// The store thread (None: no persistence).
    pub store: Option<crate::runtime::services::store_api::StoreTx>,
    /// Router-wide memory bounds (body bytes, client connections).
    pub budget: std::sync::Arc<crate::runtime::wire::budget::Budget>,
    /// Caps on agent links that finished their handshake, in total and
    /// per source address.
    pub links: std::sync::Arc<crate::runtime::wire::link::budget::LinkBudget>,
    /// The budget of agent connections before their handshake (their
    /// preamble and handshake deadlines bound how long each holds it).
    pub pending_links: std::sync::Arc<crate::runtime::wire::link::budget::LinkBudget>,
    /// Failed store operations.
    pub storage_errors: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// SHA-256 of each admin key; empty with `insecure_admin`.
    pub admin_keys: Vec<[u8; 32]>,
    /// Admin routes open without a key (explicit opt-in).
    pub insecure_admin: bool,
    /// Routing policies; a request takes one snapshot at its start.
    pub policies: Versioned<PolicySet>,
    /// `hivenet_policy_reload_total{trigger,result}`.
    pub policy_reloads: std::sync::Mutex<std::collections::BTreeMap<(String, String), u64>>,
    /// The policies in force were written through the admin API (or
    /// carried from the router this one replaced) since the files were
    /// last read: a process replacing this one takes them over (issue 54).
    pub policies_from_api: std::sync::atomic::AtomicBool,
    /// Client keys and their buckets; a request takes one snapshot.
    pub auth: Versioned<super::tenancy::AuthState>,
    /// The dynamic key registry (mutated by `/admin/api-keys` only; its
    /// keys are published into `auth`).
    pub registry: std::sync::Mutex<crate::logic::tenancy::registry::Registry>,
    /// The audit log (None: off).
    pub audit: Option<std::sync::Arc<crate::runtime::services::audit::AuditLog>>,
    /// Subscribers of `/admin/registration-stream` (16 events buffered each;
    /// a slow subscriber loses events rather than slowing registrations).
    pub feed: std::sync::Mutex<Vec<futures::channel::mpsc::Sender<String>>>,
    /// The sibling map (pushed by the map writer; memory only).
    pub sites: Versioned<Sites>,
    /// Hold at zero's books (limits, demand, outcomes, wake times).
    pub holds: Arc<super::hold_book::HoldBook>,
    /// Connections going to the process that replaces this one (issue 54).
    pub carry: super::carry_out::CarryOut,
    /// What `/ready` answers: not before its former agents are back, not
    /// once it stops or is replaced (issue 54).
    pub readiness: super::readiness::Readiness,
    /// `--shared-state`: Redis shared with the other routers (None: this
    /// router alone).
    pub shared_state: Option<Arc<crate::runtime::services::shared_state::SharedState>>,
    /// `--shared-state-affinity`: the forwards to publish to the other
    /// routers, taken by the shared-state thread every round (None: off).
    pub affinity_outbox:
        Option<std::sync::Mutex<Vec<crate::logic::routing::affinity::AffinityNote>>>,
    /// OTLP trace export (`OTEL_EXPORTER_OTLP_ENDPOINT`; None: off).
    pub traces: Option<Arc<crate::runtime::services::otlp::TraceExport>>,
}

/// Notes the outbox holds at most between two rounds of the shared-state
/// thread (20 ms): beyond, forwards are not published (counted nowhere:
/// affinity is a hint).
pub const AFFINITY_OUTBOX_MAX: usize = 16_384;

impl crate::runtime::services::shared_state::Host for Router {
    fn name(&self) -> String {
        self.keypair.public().to_peer_id().to_string()
    }

    fn registry(&self) -> &std::sync::Mutex<crate::logic::tenancy::registry::Registry> {
        &self.registry
    }

    fn publish_registry(&self, reg: &crate::logic::tenancy::registry::Registry) {
        Router::publish_registry(self, reg);
    }

    fn with_ledger<R>(&self, f: impl FnOnce(&mut crate::logic::sites::hold::Ledger) -> R) -> R {
        f(&mut self.holds.lock().ledger)
    }

    fn with_buckets<R>(
        &self,
        f: impl FnOnce(
            &std::collections::BTreeMap<super::tenancy::BucketKey, Arc<super::tenancy::Bucket>>,
        ) -> R,
    ) -> R {
        f(&self.auth.load().buckets)
    }

    fn shares_affinity(&self) -> bool {
        self.affinity_outbox.is_some()
    }

    fn take_affinity(&self, into: &mut Vec<crate::logic::routing::affinity::AffinityNote>) {
        if let Some(out) = &self.affinity_outbox {
            let mut g = match out.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            std::mem::swap(&mut *g, into);
        }
    }

    fn deliver_affinity(&self, notes: Vec<crate::logic::routing::affinity::AffinityNote>) {
        use crate::logic::routing::affinity::model_salt;
        let dir = self.directory.load();
        let mut by_model: std::collections::HashMap<u64, (String, usize, Vec<_>)> = dir
            .live()
            .map(|(m, shard)| (model_salt(m), (m.to_string(), shard, Vec::new())))
            .collect();
        for n in notes {
            if let Some((_, _, v)) = by_model.get_mut(&n.salt) {
                v.push(n);
            }
        }
        for (_, (model, shard, notes)) in by_model {
            if notes.is_empty() {
                continue;
            }
            if let Some(tx) = self.mesh.get(shard) {
                let _ = tx.unbounded_send(ShardMsg::Affinity { model, notes });
            }
        }
    }
}

/// The sibling map as this router holds it.
#[derive(Debug, Clone, Default)]
pub struct Sites {
    /// The last accepted push (None: no map).
    pub map: Option<Arc<crate::logic::sites::SiteMap>>,
    /// Unix seconds it was received.
    pub received_at: u64,
    /// Version of the last accepted push or delete (the version rule
    /// survives a delete: an older push stays refused).
    pub version: Option<String>,
}

// === impl Router ===

impl Router {
    /// Reserve the owner for a link whose preamble names `model` (matched
    /// by [`Router::register`] or [`Router::release`]).
    pub fn reserve(&self, model: &str) -> usize {
        // Held requests of a model at zero wait on its hold shard: own it
        // there, so the wake needs no hand-off.
        let held = self.holds.lock().ledger.demand(model) > 0;
        let assigned = self.directory.load().assigned(model);
        let prefer =
            held.then(|| super::hold_book::hold_shard_of(assigned, model, self.mesh.len()));
        self.directory
            .update(|d| d.reserve_preferring(model, prefer))
    }

    /// A link reserved at its preamble failed before registering.
    pub fn release(&self, model: &str) {
        self.directory.update(|d| d.release(model));
    }

    /// Forget a model without links (see [`crate::logic::routing::directory::Directory::forget`]).
    pub fn forget(&self, model: &str) -> bool {
        self.directory.update(|d| d.forget(model))
    }

    /// A link of `model` (capability `cap`) registered on shard
    /// `preferred`; returns the owner.
    pub fn register(&self, model: &str, preferred: usize, cap: Capability) -> usize {
        self.directory.update(|d| d.register(model, preferred, cap))
    }

    /// A registered link of `model` (capability `cap`, counted healthy or
    /// not) ended.
    pub fn unregister(&self, model: &str, cap: Capability, healthy: bool) {
        self.directory.update(|d| d.unregister(model, cap, healthy));
    }

    /// A registered agent of `model` turned healthy (`up`) or unhealthy.
    pub fn set_health(&self, model: &str, cap: Capability, up: bool) {
        self.directory.update(|d| d.set_health(model, cap, up));
    }

    /// Publish a `registered` or `unregistered` event to every subscriber.
    pub fn publish(&self, event: &str, reg: &crate::logic::link::control::Registration) {
        let (secs, nanos) = crate::runtime::wire::clock::unix_nanos();
        let line = serde_json::json!({
            "event_type": event,
            "deployment_id": reg.deployment_id,
            "replica_id": reg.replica_id,
            "agent_id": reg.peer_id,
            "timestamp": crate::logic::system::timefmt::rfc3339_nanos(secs, nanos),
        })
        .to_string();
        if let Ok(mut subs) = self.feed.lock() {
            subs.retain_mut(|tx| match tx.try_send(line.clone()) {
                Ok(()) => true,
                Err(e) => e.is_full(),
            });
        }
    }

    /// Publish the registry's keys as the lookup snapshot (buckets with
    /// the same name carry over).
    pub fn publish_registry(&self, reg: &crate::logic::tenancy::registry::Registry) {
        let prev = self.auth.load();
        let next = super::tenancy::AuthState::build(
            prev.mode,
            reg.keys(),
            Some(&prev),
            &Default::default(),
        );
        self.auth.store(next);
    }

    /// Replace the policy set (validated) and count the reload.
    pub fn swap_policies(&self, set: PolicySet, trigger: &str) -> Result<(), ConfigError> {
        let r = set
            .validate()
            .and_then(|()| self.cfg.providers.check(&set).map_err(|e| e.at("policy")));
        self.count_reload(trigger, r.is_ok());
        r?;
        self.policies.store(set);
        let api = trigger == "api" || trigger == "upgrade";
        self.policies_from_api
            .store(api, std::sync::atomic::Ordering::Relaxed);
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
}
