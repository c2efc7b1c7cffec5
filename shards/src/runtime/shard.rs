//! What one core owns: the agents of its models (links, health, active
//! slots, counters), its listeners, and its counters. Never shared, never
//! locked: tasks on the shard borrow it briefly and never across an await.
//!
//! Key types: [`Shard`], [`Agent`], [`ShardSnapshot`]; entry point [`run`].

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::net::TcpListener as StdListener;
use std::rc::Rc;
use std::sync::Arc;

use futures::channel::mpsc::UnboundedReceiver;
use futures::StreamExt;
use serde::Serialize;
use tracing::{info, warn};

use super::clock;
use super::conn::Conn;
use super::handoff;
use super::link::{self, LinkHandle};
use super::mesh::ShardMsg;
use super::shared::SharedRef;
use super::store_api::StoreMsg;
use crate::logic::control::{Capability, ControlMsg, Registration};
use crate::logic::engine_metrics::EngineSignals;
use crate::logic::hardware::HardwareSignals;
use crate::logic::history::History;
use crate::logic::policy::{self, AgentFacts, GateCounts, Step, StepPick};
use crate::logic::preamble;
use crate::logic::srtt::Estimator;
use crate::logic::wait_queue::WaitQueue;

/// One registered agent, owned by its model's shard.
pub struct Agent {
    /// Shard-local id (stable while registered).
    pub id: u64,
    /// What it declared.
    pub reg: Registration,
    /// Opens request streams.
    pub link: LinkHandle,
    /// Heartbeats arrive in time.
    pub live: Cell<bool>,
    /// The agent's own check of its backend.
    pub backend_healthy: Cell<bool>,
    /// Requests in flight (slot held until the response ends).
    pub active: Cell<u32>,
    /// Lifetime successful requests.
    pub success: Cell<u64>,
    /// Lifetime failed requests.
    pub failed: Cell<u64>,
    /// Unix seconds of registration or last heartbeat.
    pub last_seen: Cell<u64>,
    /// Latency estimator (live: updated before the next routing decision).
    pub est: Cell<Estimator>,
    /// Lifetime input tokens (from response usage).
    pub input_tokens: Cell<u64>,
    /// Lifetime output tokens.
    pub output_tokens: Cell<u64>,
    /// Times the agent left routing (restored from history).
    pub disconnections: Cell<u64>,
    /// Healthy -> unhealthy transitions from missed heartbeats.
    pub agent_failures: Cell<u64>,
    /// Healthy -> unhealthy transitions of reported backend health.
    pub backend_failures: Cell<u64>,
    /// Failures since the last success (this registration only).
    pub consecutive_failures: Cell<u64>,
    /// The model's capacity queue (a freed slot wakes its head).
    pub queue: Rc<RefCell<Waiters>>,
    /// Latest engine signals from the agent.
    pub signals: Cell<EngineSignals>,
    /// Latest host signals from the agent.
    pub hardware: Cell<HardwareSignals>,
}

/// The capacity queue's waiters: each is woken through its channel.
pub type Waiters = WaitQueue<futures::channel::oneshot::Sender<()>>;

/// Wake the oldest waiter still waiting (a cancelled one passes the signal on).
pub fn wake_head(q: &RefCell<Waiters>) {
    loop {
        let next = q.borrow_mut().pop_head();
        match next {
            Some((_, tx)) => {
                if tx.send(()).is_ok() {
                    return;
                }
            }
            None => return,
        }
    }
}

/// Wake every waiter (a new or recovered agent).
pub fn wake_all(q: &RefCell<Waiters>) {
    let all = q.borrow_mut().drain();
    for (_, tx) in all {
        let _ = tx.send(());
    }
}

impl Agent {
    /// Record one outcome's latency sample (ms) and log the update.
    pub fn observe(&self, sample_ms: f64) {
        let mut e = self.est.get();
        if let Some(u) = e.observe(sample_ms) {
            self.est.set(e);
            tracing::debug!(
                target: "router",
                peer_id = %self.reg.peer_id, model = %self.reg.model, sample_ms = u.sample,
                old_srtt_ms = ?u.old_srtt, old_rttvar_ms = ?u.old_rttvar, srtt_ms = u.srtt, rttvar_ms = u.rttvar,
                "SRTT update"
            );
        }
    }

    /// Count one success.
    pub fn succeed(&self) {
        self.success.set(self.success.get() + 1);
        self.consecutive_failures.set(0);
    }

    /// Count one failure.
    pub fn fail(&self) {
        self.failed.set(self.failed.get() + 1);
        self.consecutive_failures
            .set(self.consecutive_failures.get() + 1);
    }

    /// Add usage tokens.
    pub fn add_tokens(&self, t: crate::logic::usage::Tokens) {
        self.input_tokens.set(self.input_tokens.get() + t.input);
        self.output_tokens.set(self.output_tokens.get() + t.output);
    }

    /// The record to persist.
    pub fn history(&self) -> History {
        let e = self.est.get();
        History {
            srtt: e.srtt(),
            rttvar: e.rttvar(),
            success: self.success.get(),
            failed: self.failed.get(),
            input_tokens: self.input_tokens.get(),
            output_tokens: self.output_tokens.get(),
            disconnections: self.disconnections.get(),
            agent_failures: self.agent_failures.get(),
            backend_failures: self.backend_failures.get(),
            written_at: 0,
        }
    }

    /// Clear the lifetime metrics (admin reset).
    pub fn reset_metrics(&self) {
        self.est.set(Estimator::new());
        for c in [
            &self.success,
            &self.failed,
            &self.input_tokens,
            &self.output_tokens,
            &self.disconnections,
            &self.agent_failures,
            &self.backend_failures,
        ] {
            c.set(0);
        }
    }

    /// Routable: live and backend healthy.
    pub fn healthy(&self) -> bool {
        self.live.get() && self.backend_healthy.get()
    }
}

/// A capacity slot on an agent, released on drop (stream end, error or
/// client disconnect alike: no slot leaks).
pub struct Slot(pub Rc<Agent>);

impl Slot {
    /// Take a slot.
    pub fn take(agent: Rc<Agent>) -> Self {
        agent.active.set(agent.active.get() + 1);
        Slot(agent)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.active.set(self.0.active.get().saturating_sub(1));
        // A freed slot wakes the head of the model's queue.
        wake_head(&self.0.queue);
    }
}

/// Agents of one model.
#[derive(Default)]
pub struct ModelPool {
    /// Registered agents.
    pub agents: Vec<Rc<Agent>>,
    /// Rotates the tie-break start.
    pub rotation: usize,
    /// Requests waiting for a slot.
    pub queue: Rc<RefCell<Waiters>>,
    /// Routing counters.
    pub stats: PoolStats,
}

/// Per-model routing counters (plain, per shard; summed at scrape).
#[derive(Debug, Clone, Default, Serialize)]
pub struct PoolStats {
    /// Successful forwards by (region, engine).
    pub routed: std::collections::BTreeMap<(String, String), u64>,
    /// Failed forward attempts and exhaustions by (region, engine).
    pub failed: std::collections::BTreeMap<(String, String), u64>,
    /// Served by the primary step.
    pub primary_routed: u64,
    /// Served by a fallback step.
    pub fallback_routed: u64,
    /// Every step exhausted.
    pub exhausted: u64,
    /// Queue wait histogram: counts per bucket of `QUEUE_BUCKETS`, then +Inf.
    pub wait_buckets: Vec<u64>,
    /// Sum of waits, seconds.
    pub wait_sum: f64,
    /// Waits observed.
    pub wait_count: u64,
    /// Waiters now (filled at snapshot).
    pub queue_depth: usize,
    /// Client-visible duration of completed responses (from the first byte
    /// of the request to the last byte of the response, streams included),
    /// by (agent id, status): peer ID, bucket counts over
    /// `DURATION_BUCKETS` then +Inf, sum, count.
    pub durations: std::collections::BTreeMap<(u64, u16), DurationHist>,
}

/// One duration histogram: peer ID, bucket counts (+Inf last), sum, count.
pub type DurationHist = (String, Vec<u64>, f64, u64);

/// `hivenet_request_duration_seconds` buckets (spec 06).
pub const DURATION_BUCKETS: [f64; 9] = [0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0];

/// `hivenet_queue_wait_seconds` buckets: 0.01 x 2^k, k = 0..12.
pub const QUEUE_BUCKETS: [f64; 13] = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96,
];

impl PoolStats {
    /// Record one completed response.
    pub fn observe_duration(&mut self, agent: &Agent, status: u16, secs: f64) {
        let e = self.durations.entry((agent.id, status)).or_insert_with(|| {
            (
                agent.reg.peer_id.clone(),
                vec![0; DURATION_BUCKETS.len() + 1],
                0.0,
                0,
            )
        });
        let i = DURATION_BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(DURATION_BUCKETS.len());
        if let Some(c) = e.1.get_mut(i) {
            *c += 1;
        }
        e.2 += secs;
        e.3 += 1;
    }

    /// Record one successful queue wait.
    pub fn observe_wait(&mut self, secs: f64) {
        if self.wait_buckets.len() != QUEUE_BUCKETS.len() + 1 {
            self.wait_buckets = vec![0; QUEUE_BUCKETS.len() + 1];
        }
        let i = QUEUE_BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(QUEUE_BUCKETS.len());
        if let Some(c) = self.wait_buckets.get_mut(i) {
            *c += 1;
        }
        self.wait_sum += secs;
        self.wait_count += 1;
    }
}

/// Outcome of one policy step on this shard.
pub enum StepOutcome {
    /// Use this agent.
    Agent(Rc<Agent>),
    /// Candidates exist but are full: the request may queue.
    Full(GateCounts),
    /// No candidate in this step.
    Empty(GateCounts),
}

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
}

fn inc(c: &Cell<u64>) {
    c.set(c.get() + 1);
}

/// One core's state.
pub struct Shard {
    /// Shard index.
    pub id: usize,
    /// Shared state.
    pub shared: SharedRef,
    /// Model -> agents.
    pub models: RefCell<HashMap<String, ModelPool>>,
    /// Counters.
    pub counters: Counters,
    next_agent: Cell<u64>,
    /// Directory snapshot and the version it was taken at.
    dir_cache: RefCell<(u64, Arc<crate::logic::directory::Directory>)>,
    /// Policy snapshot and the version it was taken at.
    policy_cache: RefCell<(u64, Arc<super::shared::PolicySet>)>,
}

/// Plain-data view of one agent for metrics and `/v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct AgentView {
    /// PeerId.
    pub peer_id: String,
    /// Registration.
    pub reg: Registration,
    /// Routable.
    pub healthy: bool,
    /// In flight.
    pub active: u32,
    /// Lifetime successes.
    pub success: u64,
    /// Lifetime failures.
    pub failed: u64,
    /// Unix seconds.
    pub last_seen: u64,
    /// Heartbeats arrive in time.
    pub live: bool,
    /// Agent-reported backend health.
    pub backend_healthy: bool,
    /// SRTT, ms (None: UNKNOWN).
    pub srtt: Option<f64>,
    /// RTTVAR, ms.
    pub rttvar: Option<f64>,
    /// Lifetime input tokens.
    pub input_tokens: u64,
    /// Lifetime output tokens.
    pub output_tokens: u64,
    /// Lifetime disconnections.
    pub disconnections: u64,
    /// Missed-heartbeat transitions.
    pub agent_failures: u64,
    /// Backend-unhealthy transitions.
    pub backend_failures: u64,
    /// Latest engine signals.
    pub signals: EngineSignals,
    /// Latest host signals.
    pub hardware: HardwareSignals,
}

/// Plain-data view of a shard.
#[derive(Debug, Clone, Serialize)]
pub struct ShardSnapshot {
    /// Shard index.
    pub shard: usize,
    /// Inference requests served here.
    pub requests: u64,
    /// Connections handed out.
    pub handoffs_out: u64,
    /// Connections adopted.
    pub handoffs_in: u64,
    /// Links handed out after the preamble.
    pub link_handoffs_out: u64,
    /// Links refused.
    pub links_rejected: u64,
    /// Agents owned here.
    pub agents: Vec<AgentView>,
    /// Routing counters per model owned here.
    pub models: Vec<(String, PoolStats)>,
}

impl Shard {
    /// A fresh shard.
    pub fn new(id: usize, shared: SharedRef) -> Self {
        Shard {
            id,
            shared,
            models: RefCell::new(HashMap::new()),
            counters: Counters::default(),
            next_agent: Cell::new(1),
            dir_cache: RefCell::new((
                u64::MAX,
                Arc::new(crate::logic::directory::Directory::new(1)),
            )),
            policy_cache: RefCell::new((u64::MAX, Arc::new(super::shared::PolicySet::default()))),
        }
    }

    /// Owner of a confirmed model, from this shard's directory snapshot
    /// (refreshed only when the shared version moved).
    pub fn owner(&self, model: &str) -> Option<usize> {
        let v = self
            .shared
            .directory_version
            .load(std::sync::atomic::Ordering::Acquire);
        let mut c = self.dir_cache.borrow_mut();
        if c.0 != v {
            *c = (v, self.shared.directory_snapshot());
        }
        c.1.owner(model)
    }

    /// The policy snapshot for a request, from this shard's cache.
    pub fn policy_for(&self, model: &str) -> Arc<crate::logic::policy::Policy> {
        let v = self
            .shared
            .policy_version
            .load(std::sync::atomic::Ordering::Acquire);
        let mut c = self.policy_cache.borrow_mut();
        if c.0 != v {
            *c = (v, self.shared.policy_set());
        }
        c.1.for_model(model)
    }

    /// Count one served inference request.
    pub fn count_request(&self) {
        inc(&self.counters.requests);
    }

    /// Count a connection handed to another shard.
    pub fn count_handoff_out(&self) {
        inc(&self.counters.handoffs_out);
    }

    /// The capacity queue of a model (created with its pool).
    fn queue_of(&self, model: &str) -> Rc<RefCell<Waiters>> {
        self.models
            .borrow_mut()
            .entry(model.to_string())
            .or_default()
            .queue
            .clone()
    }

    /// Run one policy step for `model`.
    pub fn select_step(
        &self,
        model: &str,
        step: &Step,
        cap: Capability,
        failed: &[u64],
    ) -> StepOutcome {
        let mut models = self.models.borrow_mut();
        let Some(pool) = models.get_mut(model) else {
            return StepOutcome::Empty(GateCounts::default());
        };
        let r = pool.rotation;
        pool.rotation = pool.rotation.wrapping_add(1);
        let agents = &pool.agents;
        let pick = policy::select(
            step,
            cap,
            agents.len(),
            |i| {
                agents.get(i).map(|a| {
                    let total = a.success.get() + a.failed.get();
                    AgentFacts {
                        id: a.id,
                        healthy: a.healthy(),
                        capability: a.reg.capability,
                        engine: &a.reg.engine,
                        region: &a.reg.region,
                        organization: &a.reg.organization,
                        machine: &a.reg.machine,
                        tags: &a.reg.tags,
                        active: a.active.get(),
                        capacity: a.reg.capacity,
                        srtt: a.est.get().srtt(),
                        success_rate: (total > 0).then(|| a.success.get() as f64 / total as f64),
                        consecutive_failures: (total > 0).then(|| a.consecutive_failures.get()),
                        signals: a.signals.get(),
                        hardware: a.hardware.get(),
                    }
                })
            },
            failed,
            r,
        );
        match pick {
            StepPick::Agent(i) => match agents.get(i) {
                Some(a) => StepOutcome::Agent(a.clone()),
                None => StepOutcome::Empty(GateCounts::default()),
            },
            StepPick::Full(c) => StepOutcome::Full(c),
            StepPick::Empty(c) => StepOutcome::Empty(c),
        }
    }

    /// Whether every registered agent of `model` is unhealthy (or none exists).
    pub fn all_unhealthy(&self, model: &str) -> bool {
        self.models
            .borrow()
            .get(model)
            .map(|p| p.agents.iter().all(|a| !a.healthy()))
            .unwrap_or(true)
    }

    /// Update a model's routing counters.
    pub fn with_stats(&self, model: &str, f: impl FnOnce(&mut PoolStats)) {
        if let Some(p) = self.models.borrow_mut().get_mut(model) {
            f(&mut p.stats);
        }
    }

    fn add_agent(&self, reg: Registration, link: LinkHandle, h: Option<History>) -> Rc<Agent> {
        let reg_model = reg.model.clone();
        let id = self.next_agent.get();
        self.next_agent.set(id + 1);
        let h = h.unwrap_or_default();
        let est = match (h.srtt, h.rttvar) {
            (Some(s), Some(v)) => Estimator::restored(s, v),
            _ => Estimator::new(),
        };
        let agent = Rc::new(Agent {
            id,
            reg,
            link,
            live: Cell::new(true),
            backend_healthy: Cell::new(true),
            active: Cell::new(0),
            success: Cell::new(h.success),
            failed: Cell::new(h.failed),
            last_seen: Cell::new(clock::unix_secs()),
            est: Cell::new(est),
            input_tokens: Cell::new(h.input_tokens),
            output_tokens: Cell::new(h.output_tokens),
            disconnections: Cell::new(h.disconnections),
            agent_failures: Cell::new(h.agent_failures),
            backend_failures: Cell::new(h.backend_failures),
            consecutive_failures: Cell::new(0),
            queue: self.queue_of(&reg_model),
            signals: Cell::new(EngineSignals::default()),
            hardware: Cell::new(HardwareSignals::default()),
        });
        let mut models = self.models.borrow_mut();
        let pool = models.entry(agent.reg.model.clone()).or_default();
        // A re-registration of the same peer replaces its old entry.
        pool.agents.retain(|a| a.reg.peer_id != agent.reg.peer_id);
        pool.agents.push(agent.clone());
        // A new agent wakes every queued request of its model.
        let q = pool.queue.clone();
        drop(models);
        wake_all(&q);
        agent
    }

    fn remove_agent(&self, agent: &Agent) {
        let mut models = self.models.borrow_mut();
        if let Some(pool) = models.get_mut(&agent.reg.model) {
            pool.agents.retain(|a| a.id != agent.id);
            // Its series go with it.
            pool.stats.durations.retain(|(id, _), _| *id != agent.id);
        }
    }

    /// Ask the store for a peer's history (bounded wait; None without a store).
    async fn lookup_history(&self, peer_id: &str) -> Option<History> {
        let tx = self.shared.store.as_ref()?;
        let (reply, rx) = futures::channel::oneshot::channel();
        tx.send(StoreMsg::Lookup {
            peer_id: peer_id.to_string(),
            reply,
        })
        .ok()?;
        match monoio::time::timeout(std::time::Duration::from_secs(2), rx).await {
            Ok(Ok(h)) => h,
            _ => {
                warn!(%peer_id, "history lookup timed out; starting without history");
                None
            }
        }
    }

    /// Send records to the store (never waits).
    pub fn flush(
        &self,
        records: Vec<(String, History)>,
        done: Option<futures::channel::oneshot::Sender<()>>,
    ) {
        if let Some(tx) = &self.shared.store {
            if records.is_empty() && done.is_none() {
                return;
            }
            if tx.send(StoreMsg::Flush { records, done }).is_err() {
                self.shared
                    .storage_errors
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        } else if let Some(d) = done {
            let _ = d.send(());
        }
    }

    /// The in-memory record of a registered peer, if any.
    fn live_history(&self, model: &str, peer_id: &str) -> Option<History> {
        self.models.borrow().get(model).and_then(|p| {
            p.agents
                .iter()
                .find(|a| a.reg.peer_id == peer_id)
                .map(|a| a.history())
        })
    }

    /// Every agent's record.
    pub fn all_history(&self) -> Vec<(String, History)> {
        self.models
            .borrow()
            .values()
            .flat_map(|p| p.agents.iter())
            .map(|a| (a.reg.peer_id.clone(), a.history()))
            .collect()
    }

    /// Clear every agent's lifetime metrics in memory.
    pub fn reset_metrics(&self) {
        for p in self.models.borrow().values() {
            for a in &p.agents {
                a.reset_metrics();
            }
        }
    }

    /// This shard's snapshot.
    pub fn snapshot(&self) -> ShardSnapshot {
        let models = self.models.borrow();
        let agents = models
            .values()
            .flat_map(|p| p.agents.iter())
            .map(|a| AgentView {
                peer_id: a.reg.peer_id.clone(),
                reg: a.reg.clone(),
                healthy: a.healthy(),
                active: a.active.get(),
                success: a.success.get(),
                failed: a.failed.get(),
                last_seen: a.last_seen.get(),
                live: a.live.get(),
                backend_healthy: a.backend_healthy.get(),
                srtt: a.est.get().srtt(),
                rttvar: a.est.get().rttvar(),
                input_tokens: a.input_tokens.get(),
                output_tokens: a.output_tokens.get(),
                disconnections: a.disconnections.get(),
                agent_failures: a.agent_failures.get(),
                backend_failures: a.backend_failures.get(),
                signals: a.signals.get(),
                hardware: a.hardware.get(),
            })
            .collect();
        ShardSnapshot {
            shard: self.id,
            requests: self.counters.requests.get(),
            handoffs_out: self.counters.handoffs_out.get(),
            handoffs_in: self.counters.handoffs_in.get(),
            link_handoffs_out: self.counters.link_handoffs_out.get(),
            links_rejected: self.counters.links_rejected.get(),
            agents,
            models: models
                .iter()
                .map(|(m, p)| {
                    let mut st = p.stats.clone();
                    st.queue_depth = p.queue.borrow().len();
                    (m.clone(), st)
                })
                .collect(),
        }
    }

    /// Snapshots of every shard (this one directly, the others by message).
    pub async fn gather(&self) -> Vec<ShardSnapshot> {
        let mut out = vec![self.snapshot()];
        let mut waits = Vec::new();
        for (i, tx) in self.shared.mesh.iter().enumerate() {
            if i == self.id {
                continue;
            }
            let (t, r) = futures::channel::oneshot::channel();
            if tx.unbounded_send(ShardMsg::Snapshot { reply: t }).is_ok() {
                waits.push(r);
            }
        }
        for r in waits {
            if let Ok(Ok(s)) = monoio::time::timeout(std::time::Duration::from_secs(2), r).await {
                out.push(s);
            }
        }
        out.sort_by_key(|s| s.shard);
        out
    }
}

/// Listeners of one shard, bound by the main thread with SO_REUSEPORT.
pub struct ShardListeners {
    /// Client HTTP.
    pub http: StdListener,
    /// Prometheus.
    pub metrics: StdListener,
    /// Agent links.
    pub p2p: StdListener,
}

/// Run a shard until its mesh channel closes.
pub async fn run(
    id: usize,
    shared: SharedRef,
    listeners: ShardListeners,
    mut rx: UnboundedReceiver<ShardMsg>,
) {
    let shard = Rc::new(Shard::new(id, shared));
    let http = match monoio::net::TcpListener::from_std(listeners.http) {
        Ok(l) => l,
        Err(e) => {
            warn!(shard = id, "cannot adopt HTTP listener: {e}");
            return;
        }
    };
    let metrics = match monoio::net::TcpListener::from_std(listeners.metrics) {
        Ok(l) => l,
        Err(e) => {
            warn!(shard = id, "cannot adopt metrics listener: {e}");
            return;
        }
    };
    let p2p = match monoio::net::TcpListener::from_std(listeners.p2p) {
        Ok(l) => l,
        Err(e) => {
            warn!(shard = id, "cannot adopt p2p listener: {e}");
            return;
        }
    };
    {
        let shard = shard.clone();
        monoio::spawn(async move {
            loop {
                match http.accept().await {
                    Ok((s, _)) => {
                        let conn = Conn::new(s, Vec::new());
                        monoio::spawn(super::ingress::serve(shard.clone(), conn, None));
                    }
                    Err(e) => {
                        warn!(shard = shard.id, "HTTP accept: {e}");
                        monoio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                }
            }
        });
    }
    {
        let shard = shard.clone();
        monoio::spawn(async move {
            loop {
                match metrics.accept().await {
                    Ok((s, _)) => {
                        monoio::spawn(super::metrics::serve(
                            shard.clone(),
                            Conn::new(s, Vec::new()),
                        ));
                    }
                    Err(e) => {
                        warn!(shard = shard.id, "metrics accept: {e}");
                        monoio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                }
            }
        });
    }
    {
        let shard = shard.clone();
        monoio::spawn(async move {
            loop {
                match p2p.accept().await {
                    Ok((s, peer)) => {
                        monoio::spawn(accept_link(shard.clone(), s, peer));
                    }
                    Err(e) => {
                        warn!(shard = shard.id, "p2p accept: {e}");
                        monoio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                }
            }
        });
    }
    {
        // Periodic history flush.
        let shard = shard.clone();
        monoio::spawn(async move {
            let every = shard.shared.cfg.flush_interval;
            loop {
                monoio::time::sleep(every).await;
                shard.flush(shard.all_history(), None);
            }
        });
    }
    while let Some(msg) = rx.next().await {
        match msg {
            ShardMsg::ResetMetrics { reply } => {
                shard.reset_metrics();
                let _ = reply.send(());
            }
            ShardMsg::Shutdown { reply } => {
                // Flush everything; the store processes this before the
                // main thread's shutdown message (one FIFO channel).
                shard.flush(shard.all_history(), None);
                let _ = reply.send(());
            }
            ShardMsg::AdoptHttp {
                stream,
                buf,
                pending,
            } => match handoff::adopt(stream) {
                Ok(s) => {
                    inc(&shard.counters.handoffs_in);
                    monoio::spawn(super::ingress::serve(
                        shard.clone(),
                        Conn::new(s, buf),
                        Some(pending),
                    ));
                }
                Err(e) => warn!(shard = id, "cannot adopt client connection: {e}"),
            },
            ShardMsg::AdoptLink {
                stream,
                prefix,
                model,
            } => match handoff::adopt(stream) {
                Ok(s) => {
                    monoio::spawn(serve_link(shard.clone(), s, prefix, model));
                }
                Err(e) => warn!(shard = id, "cannot adopt agent link: {e}"),
            },
            ShardMsg::Snapshot { reply } => {
                let _ = reply.send(shard.snapshot());
            }
        }
    }
}

/// Read the preamble, then serve the link here or hand it to the owner.
async fn accept_link(shard: Rc<Shard>, stream: monoio::net::TcpStream, peer: std::net::SocketAddr) {
    let mut conn = Conn::new(stream, Vec::new());
    let timeout = shard.shared.cfg.preamble_timeout;
    let read = async {
        loop {
            match preamble::decode(&conn.buf) {
                Ok(Some(done)) => return Ok(done),
                Ok(None) => {}
                Err(e) => return Err(e.to_string()),
            }
            match conn.fill().await {
                Ok(0) => return Err("closed before a complete preamble".to_string()),
                Ok(_) => {}
                Err(e) => return Err(format!("read error: {e}")),
            }
        }
    };
    let (model, used) = match monoio::time::timeout(timeout, read).await {
        Ok(Ok(v)) => v,
        Ok(Err(reason)) => {
            inc(&shard.counters.links_rejected);
            warn!(shard = shard.id, %peer, "agent link refused: {reason}");
            return;
        }
        Err(_) => {
            inc(&shard.counters.links_rejected);
            warn!(shard = shard.id, %peer, "agent link refused: no preamble within {timeout:?}");
            return;
        }
    };
    conn.consume(used);
    let owner = shard.shared.owner_or_tentative(&model);
    if owner != shard.id {
        if let Some(tx) = shard.shared.mesh.get(owner) {
            let (stream, buf) = conn.into_parts();
            let msg = ShardMsg::AdoptLink {
                stream: handoff::into_std(stream),
                prefix: buf,
                model,
            };
            if tx.unbounded_send(msg).is_ok() {
                inc(&shard.counters.link_handoffs_out);
            }
            return;
        }
    }
    let (stream, buf) = conn.into_parts();
    serve_link(shard, stream, buf, model).await;
}

/// Handshake, registration, then heartbeats until the link ends.
async fn serve_link(
    shard: Rc<Shard>,
    stream: monoio::net::TcpStream,
    prefix: Vec<u8>,
    model: String,
) {
    let peer_addr = stream.peer_addr().ok();
    let cfg = shard.shared.cfg.clone();
    let setup = async {
        let (peer, conn) = link::accept(stream, prefix, shard.shared.psk, &shard.shared.keypair)
            .await
            .map_err(|e| e.to_string())?;
        let (handle, mut inbound, closed) = link::spawn_driver(conn);
        let ctl = inbound
            .next()
            .await
            .ok_or_else(|| "link closed before the control stream".to_string())?;
        let (_, mut ctl) = link::accept_protocol(ctl, &[link::CONTROL_PROTOCOL])
            .await
            .map_err(|e| format!("control stream negotiation: {e}"))?;
        let mut buf = Vec::new();
        let msg = link::read_frame(&mut ctl, &mut buf)
            .await
            .map_err(|e| format!("registration: {e}"))?
            .ok_or_else(|| "link closed before registration".to_string())?;
        Ok::<_, String>((peer, handle, inbound, closed, ctl, buf, msg))
    };
    let (peer, handle, _inbound, _closed, mut ctl, mut buf, msg) = match monoio::time::timeout(
        cfg.handshake_timeout,
        setup,
    )
    .await
    {
        Ok(Ok(v)) => v,
        Ok(Err(reason)) => {
            inc(&shard.counters.links_rejected);
            warn!(shard = shard.id, peer = ?peer_addr, %model, "agent link refused: {reason}");
            return;
        }
        Err(_) => {
            inc(&shard.counters.links_rejected);
            warn!(shard = shard.id, peer = ?peer_addr, %model, "agent link refused: handshake or registration timed out after {:?}", cfg.handshake_timeout);
            return;
        }
    };
    let reg = match msg {
        ControlMsg::Register(r) => r,
        other => {
            reject(
                &shard,
                &mut ctl,
                &model,
                format!("expected a registration, got {other:?}"),
            )
            .await;
            return;
        }
    };
    let peer_id = peer.to_string();
    if reg.peer_id != peer_id {
        reject(
            &shard,
            &mut ctl,
            &model,
            format!(
                "registration peer_id {} does not match the noise identity {peer_id}",
                reg.peer_id
            ),
        )
        .await;
        return;
    }
    if reg.model != model {
        reject(
            &shard,
            &mut ctl,
            &model,
            format!(
                "registration names model {:?} but the preamble named {model:?}",
                reg.model
            ),
        )
        .await;
        return;
    }
    let mut reg = reg;
    if reg.capacity > link::MAX_AGENT_CAPACITY {
        warn!(peer_id = %reg.peer_id, declared = reg.capacity, granted = link::MAX_AGENT_CAPACITY,
              "agent capacity capped to the link's stream budget");
        reg.capacity = link::MAX_AGENT_CAPACITY;
    }
    if reg.capacity == 0 {
        reject(
            &shard,
            &mut ctl,
            &model,
            "capacity must be greater than 0".to_string(),
        )
        .await;
        return;
    }
    let owner = shard.shared.assign(&model, shard.id);
    if owner != shard.id {
        reject(
            &shard,
            &mut ctl,
            &model,
            format!("model is owned by shard {owner}; reconnect"),
        )
        .await;
        return;
    }
    let hb = ControlMsg::Registered {
        heartbeat_interval_ms: cfg.heartbeat_interval.as_millis() as u64,
    };
    if let Err(e) = link::write_frame(&mut ctl, &hb).await {
        warn!(shard = shard.id, %peer_id, "cannot confirm registration: {e}");
        return;
    }
    // Warm start: the store's record for this peer ID (the registration path
    // may wait for the store; the request path never does).
    // A peer that re-registers while its previous entry is still here keeps
    // its live state (fresher than the store's last flush).
    let live = shard.live_history(&reg.model, &reg.peer_id);
    let history = match live {
        Some(h) => Some(h),
        None => shard.lookup_history(&reg.peer_id).await,
    };
    if let Some(h) = &history {
        info!(peer_id = %reg.peer_id, srtt_ms = ?h.srtt, rttvar_ms = ?h.rttvar, success = h.success, failed = h.failed,
              record_age_s = clock::unix_secs().saturating_sub(h.written_at), "warm start from the history store");
    }
    let agent = shard.add_agent(reg, handle, history);
    shard.shared.publish("registered", &agent.reg);
    info!(
        shard = shard.id, peer_id = %agent.reg.peer_id, model = %agent.reg.model, engine = %agent.reg.engine,
        capability = agent.reg.capability.as_str(), capacity = agent.reg.capacity, "agent registered"
    );
    // Three missed heartbeats: unhealthy; any frame: alive again.
    let miss = cfg.heartbeat_interval * 3;
    loop {
        match monoio::time::timeout(miss, link::read_frame(&mut ctl, &mut buf)).await {
            Ok(Ok(Some(ControlMsg::Heartbeat { backend_healthy }))) => {
                let was_healthy = agent.healthy();
                agent.live.set(true);
                if agent.backend_healthy.get() != backend_healthy {
                    info!(peer_id = %agent.reg.peer_id, backend_healthy, "agent backend health changed");
                    if !backend_healthy {
                        agent.backend_failures.set(agent.backend_failures.get() + 1);
                    }
                }
                agent.backend_healthy.set(backend_healthy);
                agent.last_seen.set(clock::unix_secs());
                if !was_healthy && agent.healthy() {
                    // A recovered agent wakes every queued request.
                    wake_all(&agent.queue);
                }
            }
            Ok(Ok(Some(ControlMsg::RoutingSignals { engine, hardware }))) => {
                agent.live.set(true);
                agent.signals.set(engine);
                agent.hardware.set(hardware);
            }
            Ok(Ok(Some(other))) => {
                warn!(peer_id = %agent.reg.peer_id, "unexpected control message {other:?}; closing link");
                break;
            }
            Ok(Ok(None)) => {
                info!(peer_id = %agent.reg.peer_id, "control stream closed");
                break;
            }
            Ok(Err(e)) => {
                info!(peer_id = %agent.reg.peer_id, "control stream failed: {e}");
                break;
            }
            Err(_) => {
                if agent.live.get() {
                    warn!(peer_id = %agent.reg.peer_id, "3 heartbeats missed: agent unhealthy");
                    agent.agent_failures.set(agent.agent_failures.get() + 1);
                }
                agent.live.set(false);
            }
        }
    }
    // The link is gone: leave routing at once, and flush its history.
    shard.remove_agent(&agent);
    shard.shared.publish("unregistered", &agent.reg);
    agent.disconnections.set(agent.disconnections.get() + 1);
    shard.flush(vec![(agent.reg.peer_id.clone(), agent.history())], None);
    info!(shard = shard.id, peer_id = %agent.reg.peer_id, model = %agent.reg.model, "agent left routing");
}

async fn reject(shard: &Shard, ctl: &mut link::LinkStream, model: &str, reason: String) {
    inc(&shard.counters.links_rejected);
    warn!(shard = shard.id, %model, "agent registration refused: {reason}");
    let _ = monoio::time::timeout(
        std::time::Duration::from_secs(1),
        link::write_frame(ctl, &ControlMsg::Rejected { reason }),
    )
    .await;
}
