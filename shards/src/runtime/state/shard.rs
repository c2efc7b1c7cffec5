//! What one core owns: the state of its models (agents, slots, queues,
//! statistics), its counters, and its caches of the router-wide snapshots.
//! Never shared, never locked: tasks on the shard borrow it briefly and
//! never across an await.
//!
//! Key types: [`Shard`], [`Counters`]. The event loop is in
//! [`crate::runtime::front::event_loop`], the agent control protocol in
//! [`crate::runtime::front::agent_link`].

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use tracing::warn;

use super::mesh::ShardMsg;
use super::model::agent::Agent;
use super::model::ModelRef;
use super::router::Router;
use super::snapshot::Cached;
use super::tenancy::{AuthFailure, AuthState, Principal};
use super::views::{AgentView, ShardSnapshot};
use crate::logic::link::control::Registration;
use crate::logic::routing::affinity::AffinityIndex;
use crate::logic::routing::directory::Directory;
use crate::logic::routing::history::History;
use crate::logic::routing::policy::Policy;
use crate::logic::routing::policy_set::PolicySet;
use crate::logic::system::log_gate::LogGate;
use crate::runtime::services::store_api::StoreMsg;
use crate::runtime::wire::clock;
use crate::runtime::wire::link::LinkHandle;

/// Plain per-shard counters.
#[derive(Default)]
pub struct Counters {
    /// Inference requests served on this shard.
    pub requests: Cell<u64>,
    /// Connections handed to another shard.
    pub handoffs_out: Cell<u64>,
    /// Connections adopted from another shard.
    pub handoffs_in: Cell<u64>,
    /// Agent links handed to another shard after the preamble.
    pub link_handoffs_out: Cell<u64>,
    /// Agent links refused (bad preamble, handshake, registration).
    pub links_rejected: Cell<u64>,
    /// 401s answered but not audited (past the audit's 401 rate).
    pub audit_401_suppressed: Cell<u64>,
}

/// Add one to a counter.
pub fn inc(c: &Cell<u64>) {
    c.set(c.get() + 1);
}

/// One core's state.
pub struct Shard {
    /// Shard index.
    pub id: usize,
    /// The router-wide state.
    pub router: Arc<Router>,
    /// Model -> its state here.
    pub models: RefCell<HashMap<String, ModelRef>>,
    /// Counters.
    pub counters: Counters,
    /// Provider calls of models with no agent here.
    pub provider_only: RefCell<crate::runtime::state::model::stats::ProviderOnly>,
    /// Link refusals logged at most once a second per reason.
    pub refusal_log: RefCell<HashMap<&'static str, LogGate>>,
    /// Lines a peer's link events cause (registered, left, its control
    /// stream's end), at most once a second per peer and event (issue 51:
    /// a peer reconnecting in a loop cannot flood the log).
    pub peer_log: RefCell<HashMap<(String, &'static str), LogGate>>,
    /// Agent links refused here, by reason (`link_cap`, `address_cap`,
    /// `handshake`, ...): a bounded set of static names.
    pub refusals: RefCell<std::collections::BTreeMap<&'static str, u64>>,
    /// Paces the audit lines of 401s (an unauthenticated flood must not
    /// grow the audit file at its own rate).
    pub audit_401_gate: RefCell<LogGate>,
    next_agent: Cell<u64>,
    directory: Cached<Directory>,
    policies: Cached<PolicySet>,
    auth: Cached<AuthState>,
    sites: Cached<super::router::Sites>,
    /// Requests held here at zero, by model, in arrival order.
    pub held: RefCell<HashMap<String, Vec<super::hold_book::HeldWaiter>>>,
    /// `hivenet_redirects_total{model,target_site}` of redirects answered here.
    pub redirects: RefCell<std::collections::BTreeMap<(String, String), u64>>,
    /// `http_server_request_duration_seconds` of the requests answered here.
    pub http: RefCell<super::model::stats::HttpDurations>,
    /// The cache-affinity index of the models owned here (issue 30),
    /// allocated at its full size on the first prefix-aware decision.
    pub affinity: RefCell<Option<AffinityIndex>>,
}

/// How a registration's warm-start lookup went.
pub enum WarmStart {
    /// The peer is still registered here: its live state carries over
    /// (and whether that state may be written to the store).
    Live(History, bool),
    /// The store's record (None: no record).
    Stored(Option<History>),
    /// The store did not answer: start from zero and never overwrite it.
    Unknown,
}

// === impl Shard ===

impl Shard {
    /// A fresh shard.
    pub fn new(id: usize, router: Arc<Router>) -> Self {
        Shard {
            id,
            router,
            models: RefCell::new(HashMap::new()),
            counters: Counters::default(),
            provider_only: RefCell::default(),
            refusal_log: RefCell::new(HashMap::new()),
            peer_log: RefCell::new(HashMap::new()),
            audit_401_gate: RefCell::default(),
            refusals: RefCell::default(),
            next_agent: Cell::new(1),
            directory: Cached::default(),
            policies: Cached::default(),
            sites: Cached::default(),
            redirects: RefCell::default(),
            http: RefCell::default(),
            affinity: RefCell::default(),
            held: RefCell::default(),
            auth: Cached::default(),
        }
    }

    /// The state of `model` here, if an agent ever registered it.
    pub fn model(&self, model: &str) -> Option<ModelRef> {
        self.models.borrow().get(model).cloned()
    }

    /// This shard's affinity index, made (at its share of
    /// `--affinity-table-entries`) with every agent here joined.
    pub fn affinity_index(&self) -> std::cell::RefMut<'_, AffinityIndex> {
        let mut slot = self.affinity.borrow_mut();
        if slot.is_none() {
            let shards = self.router.mesh.len().max(1);
            let mut ix = AffinityIndex::new(self.router.cfg.affinity_table_entries / shards);
            for m in self.models.borrow().values() {
                for a in &m.borrow().agents {
                    ix.join(a.id);
                }
            }
            tracing::info!(
                shard = self.id,
                entries = ix.capacity(),
                bytes = ix.table_bytes(),
                "cache-affinity index allocated"
            );
            *slot = Some(ix);
        }
        std::cell::RefMut::map(slot, |s| s.get_or_insert_with(|| AffinityIndex::new(1)))
    }

    /// Authenticate from this shard's copy of the key snapshot.
    pub fn authenticate(
        &self,
        authorization: Option<&[u8]>,
        x_api_key: Option<&[u8]>,
        now_unix: u64,
    ) -> Result<Principal, AuthFailure> {
        self.auth.with(&self.router.auth, |a| {
            a.authenticate(authorization, x_api_key, now_unix)
        })
    }

    /// The model an alias stands for (None: not an alias).
    pub fn resolve_alias(&self, model: &str) -> Option<String> {
        self.policies.with(&self.router.policies, |p| {
            p.resolve_alias(model).map(str::to_string)
        })
    }

    /// The sibling map now (None: no map).
    pub fn site_map(&self) -> Option<Arc<crate::logic::sites::SiteMap>> {
        self.sites.with(&self.router.sites, |s| s.map.clone())
    }

    /// The global aliases (for `/v1/models`).
    pub fn aliases(&self) -> std::collections::BTreeMap<String, String> {
        self.policies
            .with(&self.router.policies, |p| p.global.aliases.clone())
    }

    /// Owner of a model with registered agents, from this shard's copy of
    /// the directory.
    pub fn owner(&self, model: &str) -> Option<usize> {
        self.directory
            .with(&self.router.directory, |d| d.owner(model))
    }

    /// The owner of `model` and whether an agent of capability `cap`
    /// serves it.
    pub fn owner_and_cap(
        &self,
        model: &str,
        cap: crate::logic::link::control::Capability,
    ) -> Option<(usize, bool)> {
        self.directory
            .with(&self.router.directory, |d| d.owner_and_cap(model, cap))
    }

    /// The owner of `model` when an agent of capability `cap` serves it.
    pub fn owner_with(
        &self,
        model: &str,
        cap: crate::logic::link::control::Capability,
    ) -> Option<usize> {
        self.directory
            .with(&self.router.directory, |d| d.owner_with(model, cap))
    }

    /// The policy snapshot for a request.
    pub fn policy(&self, model: &str) -> Arc<Policy> {
        self.policies
            .with(&self.router.policies, |p| p.for_model(model))
    }

    /// The warm-start state of a registering peer: its live state when it
    /// is still registered here, else the store's record (bounded wait).
    pub async fn warm_start(&self, model: &str, peer_id: &str) -> WarmStart {
        let live = self.models.borrow().get(model).and_then(|m| {
            m.borrow()
                .by_peer(peer_id)
                .map(|a| (a.history(), a.persist))
        });
        if let Some((h, persist)) = live {
            return WarmStart::Live(h, persist);
        }
        let Some(tx) = self.router.store.as_ref() else {
            return WarmStart::Stored(None);
        };
        let (reply, rx) = futures::channel::oneshot::channel();
        let sent = tx.send(StoreMsg::Lookup {
            peer_id: peer_id.to_string(),
            reply,
        });
        if sent.is_err() {
            return WarmStart::Unknown;
        }
        match monoio::time::timeout(std::time::Duration::from_secs(2), rx).await {
            Ok(Ok(h)) => WarmStart::Stored(h),
            _ => WarmStart::Unknown,
        }
    }

    /// Register an agent on its model.
    pub fn add_agent(&self, reg: Registration, link: LinkHandle, warm: WarmStart) -> Rc<Agent> {
        let id = self.next_agent.get();
        self.next_agent.set(id + 1);
        let (history, persist) = match warm {
            WarmStart::Live(h, persist) => (Some(h), persist),
            WarmStart::Stored(h) => (h, true),
            WarmStart::Unknown => (None, false),
        };
        let model = self
            .models
            .borrow_mut()
            .entry(reg.model.clone())
            .or_default()
            .clone();
        let mut model = model.borrow_mut();
        let agent = Rc::new(Agent::new(
            id,
            reg,
            link,
            model.queue.clone(),
            history,
            clock::unix_millis(),
            persist,
        ));
        model.add(agent.clone());
        drop(model);
        if let Some(ix) = self.affinity.borrow_mut().as_mut() {
            ix.join(id);
        }
        // Requests held at zero on any shard are released (seed step 6).
        self.wake_held(&agent.reg.model);
        agent
    }

    /// Record the forwards other routers made to agents of `model` (their
    /// agents are named by peer hash; ours by local ID), when the model's
    /// policy here is prefix-aware (the index is made then, as by its
    /// first request).
    pub fn record_foreign_affinity(
        &self,
        model: &str,
        notes: &[crate::logic::routing::affinity::AffinityNote],
    ) {
        use crate::logic::routing::affinity::peer_hash;
        let prefix_aware = self
            .router
            .policies
            .load()
            .for_model(model)
            .steps
            .iter()
            .any(|s| s.affinity.is_some());
        if !prefix_aware {
            return;
        }
        let mut ix = self.affinity_index();
        let Some(m) = self.model(model) else {
            return;
        };
        let peers: Vec<(u64, u64)> = m
            .borrow()
            .agents
            .iter()
            .map(|a| (peer_hash(&a.reg.peer_id), a.id))
            .collect();
        let now = u32::try_from(crate::runtime::wire::clock::unix_secs()).unwrap_or(u32::MAX);
        for n in notes {
            if let Some((_, id)) = peers.iter().find(|(p, _)| *p == n.peer) {
                for h in n.hashes() {
                    ix.record(*h, *id, now);
                }
            }
        }
    }

    /// An agent of `model` registered or recovered: the requests held for
    /// it on every shard are released.
    pub fn wake_held(&self, model: &str) {
        self.router.holds.woke(model);
        for tx in &self.router.mesh {
            let _ = tx.unbounded_send(super::mesh::ShardMsg::Woken(model.to_string()));
        }
    }

    /// Take an agent out of routing; returns whether it was still the
    /// registered one for its peer (false: a newer registration replaced it).
    /// Forget the models that have had no agent for `after` and nothing
    /// waiting: their state and series go, and their directory name
    /// (issue 29 #2). Held or placed models keep their demand series (the
    /// hold book's, not the model's). Returns how many were forgotten.
    pub fn forget_idle_models(&self, after: std::time::Duration) -> usize {
        let now = crate::runtime::wire::clock::now();
        let idle: Vec<String> = self
            .models
            .borrow()
            .iter()
            .filter(|(_, m)| {
                let m = m.borrow();
                m.agents.is_empty()
                    && m.queue.borrow().is_empty()
                    && m.empty_since
                        .is_some_and(|t| now.saturating_duration_since(t) >= after)
            })
            .map(|(k, _)| k.clone())
            .collect();
        let mut n = 0;
        for model in idle {
            // The directory first: a link arriving for the model keeps it.
            if self.router.forget(&model) {
                self.models.borrow_mut().remove(&model);
                n += 1;
            }
        }
        n
    }

    pub fn remove_agent(&self, agent: &Agent) -> bool {
        // Never named again by the affinity index, from this moment.
        if let Some(ix) = self.affinity.borrow_mut().as_mut() {
            ix.leave(agent.id);
        }
        self.models
            .borrow_mut()
            .get(&agent.reg.model)
            .map(|m| m.borrow_mut().remove(agent.id))
            .unwrap_or(false)
    }

    /// Send records to the store (never waits). Agents whose stored record
    /// could not be read are left out.
    pub fn flush(&self, agents: &[Rc<Agent>], done: Option<futures::channel::oneshot::Sender<()>>) {
        let records: Vec<(String, History)> = agents
            .iter()
            .filter(|a| a.persist)
            .map(|a| (a.reg.peer_id.clone(), a.history()))
            .collect();
        if let Some(tx) = &self.router.store {
            if records.is_empty() && done.is_none() {
                return;
            }
            if tx.send(StoreMsg::Flush { records, done }).is_err() {
                self.router
                    .storage_errors
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        } else if let Some(d) = done {
            let _ = d.send(());
        }
    }

    /// Every registered agent here.
    pub fn all_agents(&self) -> Vec<Rc<Agent>> {
        self.models
            .borrow()
            .values()
            .flat_map(|m| m.borrow().agents.clone())
            .collect()
    }

    /// Clear every agent's lifetime metrics in memory.
    /// Bring the directory's count of healthy agents in line with `agent`'s
    /// health (seed 2: a model whose agents are all unhealthy is redirected
    /// or held); a recovered agent releases the requests held for its model.
    pub fn sync_health(&self, agent: &Agent) {
        let now = agent.healthy();
        if agent.counted_healthy.replace(now) == now {
            return;
        }
        self.router
            .set_health(&agent.reg.model, agent.reg.capability, now);
        if now {
            self.wake_held(&agent.reg.model);
        }
    }

    /// Drain (`on`) or undrain the agent `peer_id` if it is on this shard:
    /// nothing new is sent to it; what it still serves after the router's
    /// `--drain-timeout` is cut, and its streams continued elsewhere.
    /// Returns its requests in flight, `None` when it is not here.
    pub fn drain_agent(&self, peer_id: &str, on: bool) -> Option<u32> {
        let agent = self
            .models
            .borrow()
            .values()
            .find_map(|m| m.borrow().by_peer(peer_id).cloned())?;
        if agent.admin_drained.replace(on) != on {
            tracing::info!(peer_id, draining = on, "agent drained by the admin API");
        }
        self.sync_health(&agent);
        if !on {
            // An undrained agent serves the requests queued for it.
            crate::runtime::state::model::wake_all(&agent.queue);
        } else {
            let wait = self.router.cfg.drain_timeout;
            let a = agent.clone();
            monoio::spawn(async move {
                monoio::time::sleep(wait).await;
                if a.admin_drained.get() && a.active.get() > 0 {
                    let cut = a.cuts.cut_all();
                    tracing::warn!(peer_id = %a.reg.peer_id, cut, "drain timeout: cutting the drained agent's responses (streams are continued elsewhere)");
                }
            });
        }
        Some(agent.active.get())
    }

    pub fn reset_metrics(&self) {
        for m in self.models.borrow().values() {
            for a in &m.borrow().agents {
                a.reset_metrics();
            }
        }
    }

    /// This shard's snapshot.
    pub fn snapshot(&self) -> ShardSnapshot {
        let models = self.models.borrow();
        ShardSnapshot {
            shard: self.id,
            requests: self.counters.requests.get(),
            handoffs_out: self.counters.handoffs_out.get(),
            handoffs_in: self.counters.handoffs_in.get(),
            link_handoffs_out: self.counters.link_handoffs_out.get(),
            links_rejected: self.counters.links_rejected.get(),
            link_refusals: self
                .refusals
                .borrow()
                .iter()
                .map(|(k, v)| (*k, *v))
                .collect(),
            audit_401_suppressed: self.counters.audit_401_suppressed.get(),
            agents: models
                .values()
                .flat_map(|m| {
                    m.borrow()
                        .agents
                        .iter()
                        .map(|a| AgentView::of(a))
                        .collect::<Vec<_>>()
                })
                .collect(),
            models: models
                .iter()
                .map(|(name, m)| {
                    let m = m.borrow();
                    let mut st = m.stats.clone();
                    st.queue_depth = m.queue.borrow().len();
                    st.admission = m.admission.borrow().gauges();
                    st.affinity.miss_cost_per_token = m.miss_cost.get().per_token();
                    (name.clone(), st)
                })
                .chain(
                    self.provider_only
                        .borrow()
                        .iter()
                        .map(|(n, st)| (n.clone(), st.clone())),
                )
                .collect(),
            redirects: self
                .redirects
                .borrow()
                .iter()
                .map(|(k, n)| (k.clone(), *n))
                .collect(),
            http: self.http.borrow().clone(),
        }
    }

    /// Ask every other shard: `make` builds the message around a reply
    /// channel; answers come back within `wait` (late ones are dropped).
    pub async fn ask_others<T>(
        &self,
        make: impl Fn(futures::channel::oneshot::Sender<T>) -> ShardMsg,
        wait: std::time::Duration,
    ) -> Vec<T> {
        let mut waits = Vec::new();
        for (i, tx) in self.router.mesh.iter().enumerate() {
            if i == self.id {
                continue;
            }
            let (t, r) = futures::channel::oneshot::channel();
            if tx.unbounded_send(make(t)).is_ok() {
                waits.push(r);
            } else {
                warn!(shard = self.id, peer = i, "shard is gone");
            }
        }
        let mut out = Vec::with_capacity(waits.len());
        for r in waits {
            if let Ok(Ok(v)) = monoio::time::timeout(wait, r).await {
                out.push(v);
            }
        }
        out
    }

    /// Snapshots of every shard (this one directly, the others by message).
    pub async fn gather(&self) -> Vec<ShardSnapshot> {
        let mut out = vec![self.snapshot()];
        out.extend(
            self.ask_others(
                |reply| ShardMsg::Snapshot { reply },
                std::time::Duration::from_secs(2),
            )
            .await,
        );
        out.sort_by_key(|s| s.shard);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::state::router::RouterConfig;
    use crate::runtime::state::snapshot::Versioned;
    use crate::runtime::wire::executor::{run_on_runtime, DriverChoice};

    fn router(store: crate::runtime::services::store_api::StoreTx) -> Arc<Router> {
        Arc::new(Router {
            cfg: RouterConfig::default(),
            directory: Versioned::new(Directory::new(1)),
            policies: Versioned::new(PolicySet::default()),
            mesh: Vec::new(),
            keypair: libp2p_identity::Keypair::generate_ed25519(),
            psk: None,
            store: Some(store),
            budget: crate::runtime::wire::budget::Budget::new(0, 0),
            links: crate::runtime::wire::link::budget::LinkBudget::new(0, 0),
            pending_links: crate::runtime::wire::link::budget::LinkBudget::new(0, 0),
            storage_errors: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            admin_keys: Vec::new(),
            auth: Versioned::new(Default::default()),
            registry: Default::default(),
            shared_state: None,
            affinity_outbox: None,
            traces: None,
            audit: None,
            insecure_admin: false,
            policy_reloads: std::sync::Mutex::new(Default::default()),
            policies_from_api: Default::default(),
            feed: std::sync::Mutex::new(Vec::new()),
            sites: Versioned::new(Default::default()),
            holds: Default::default(),
            carry: Default::default(),
            readiness: Default::default(),
        })
    }

    /// A store that never answers the warm-start lookup: the agent starts
    /// from zero and its flushes leave the stored record alone (they used
    /// to overwrite it with zeros).
    #[test]
    fn a_failed_lookup_never_overwrites_the_stored_record() {
        let (tx, rx) = std::sync::mpsc::channel::<StoreMsg>();
        let shard = Shard::new(0, router(tx));
        let reg = Registration {
            peer_id: "12D3KooWpeer".into(),
            model: "m".into(),
            capacity: 1,
            ..Default::default()
        };
        run_on_runtime(DriverChoice::Auto, |_| async {
            let warm = shard.warm_start("m", "12D3KooWpeer").await;
            assert!(matches!(warm, WarmStart::Unknown), "the lookup timed out");
            let agent = shard.add_agent(reg, LinkHandle::detached(), warm);
            assert!(!agent.persist);
            agent.succeed();
            shard.flush(&shard.all_agents(), None);
        });
        let mut flushed = Vec::new();
        while let Ok(msg) = rx.try_recv() {
            match msg {
                StoreMsg::Lookup { .. } => {}
                StoreMsg::Flush { records, .. } => flushed.extend(records),
                _ => {}
            }
        }
        assert!(
            flushed.is_empty(),
            "nothing written over the record: {flushed:?}"
        );
        // A found record (or none) keeps the agent persisted.
        let (tx, _rx2) = std::sync::mpsc::channel::<StoreMsg>();
        let shard = Shard::new(0, router(tx));
        let reg = Registration {
            peer_id: "12D3KooWother".into(),
            model: "m".into(),
            capacity: 1,
            ..Default::default()
        };
        let agent = shard.add_agent(reg, LinkHandle::detached(), WarmStart::Stored(None));
        assert!(agent.persist);
    }
}
