//! Plain-data views of a shard for metrics, the admin API and
//! `/v1/models`: gathered from every shard by message, never shared live.
//!
//! Key types: [`ShardSnapshot`], [`AgentView`].

use serde::Serialize;

use super::model::agent::Agent;
use super::model::stats::ModelStats;
use crate::logic::link::control::Registration;
use crate::logic::link::engine_metrics::EngineSignals;
use crate::logic::link::hardware::HardwareSignals;

/// Plain-data view of one agent.
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
    /// Unix milliseconds of registration or the last heartbeat.
    pub last_seen_ms: u64,
    /// Heartbeats arrive in time.
    pub live: bool,
    /// Agent-reported backend health.
    pub backend_healthy: bool,
    /// The agent is stopping (nothing new is sent to it).
    pub draining: bool,
    /// Of it: drained through the admin API (carried by an upgrade).
    #[serde(skip)]
    pub admin_drained: bool,
    /// SRTT, ms (None: UNKNOWN).
    pub srtt: Option<f64>,
    /// RTTVAR, ms.
    pub rttvar: Option<f64>,
    /// Lifetime input tokens.
    pub input_tokens: u64,
    /// Lifetime output tokens.
    pub output_tokens: u64,
    /// Cached prompt tokens since registration.
    pub cached_prompt_tokens: u64,
    /// Prompt tokens of responses that reported a cached count.
    pub prompt_tokens: u64,
    /// Cached tokens the affinity index predicted on it.
    pub cache_predicted: u64,
    /// Of those, captured (the request went to it).
    pub cache_captured: u64,
    /// Lifetime disconnections.
    pub disconnections: u64,
    /// Busy answers (429, 503) of its backend since registration.
    pub rejected: u64,
    /// Requests other routers have in flight on it (it serves several).
    pub others_active: u32,
    /// Full refusals (its other routers held its capacity).
    pub full_refusals: u64,
    /// Out-of-range signals dropped since registration.
    pub signals_dropped: u64,
    /// Missed-heartbeat transitions.
    pub agent_failures: u64,
    /// Backend-unhealthy transitions.
    pub backend_failures: u64,
    /// Latest engine signals.
    pub signals: EngineSignals,
    /// Latest host signals.
    pub hardware: HardwareSignals,
}

impl AgentView {
    /// The view of a live agent.
    pub fn of(a: &Agent) -> Self {
        let est = a.est.get();
        AgentView {
            peer_id: a.reg.peer_id.clone(),
            reg: a.reg.clone(),
            healthy: a.healthy(),
            active: a.active.get(),
            success: a.success.get(),
            failed: a.failed.get(),
            last_seen_ms: a.last_seen_ms.get(),
            live: a.live.get(),
            backend_healthy: a.backend_healthy.get(),
            draining: a.draining.get() || a.admin_drained.get(),
            admin_drained: a.admin_drained.get(),
            srtt: est.srtt(),
            rttvar: est.rttvar(),
            input_tokens: a.input_tokens.get(),
            output_tokens: a.output_tokens.get(),
            cached_prompt_tokens: a.cached_prompt_tokens.get(),
            prompt_tokens: a.prompt_tokens.get(),
            cache_predicted: a.cache_predicted.get(),
            cache_captured: a.cache_captured.get(),
            disconnections: a.disconnections.get(),
            rejected: a.rejected.get(),
            others_active: a.others.get(),
            full_refusals: a.full_refusals.get(),
            signals_dropped: a.signals_dropped.get(),
            agent_failures: a.agent_failures.get(),
            backend_failures: a.backend_failures.get(),
            signals: a.signals.get(),
            hardware: a.hardware.get(),
        }
    }
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
    /// Of those, by reason.
    pub link_refusals: Vec<(&'static str, u64)>,
    /// 401s not audited.
    pub audit_401_suppressed: u64,
    /// Agents owned here.
    pub agents: Vec<AgentView>,
    /// Routing counters per model owned here.
    pub models: Vec<(String, ModelStats)>,
    /// Redirects answered here by (model, target site).
    pub redirects: Vec<((String, String), u64)>,
    /// Request durations by (method, route, status).
    pub http: crate::runtime::state::model::stats::HttpDurations,
}
