//! The per-agent families: latency (SRTT/RTTVAR), load, counters, the
//! engine's and the host's own signals.

use crate::runtime::state::views::{AgentView, ShardSnapshot};
use crate::runtime::wire::exposition::Family;
use crate::runtime::wire::exposition::Kind::{self, Counter, Gauge};
use std::fmt::Display;

/// The labels of the routing table's agent series.
const ROUTING_LABELS: [&str; 7] = [
    "peer_id",
    "region",
    "engine",
    "model",
    "capacity",
    "organization",
    "machine",
];

pub(super) fn routing_labels(a: &AgentView) -> [&dyn Display; 7] {
    let r = &a.reg;
    [
        &a.peer_id,
        &r.region,
        &r.engine,
        &r.model,
        &r.capacity,
        &r.organization,
        &r.machine,
    ]
}

/// The labels of the per-agent series.
const AGENT_LABELS: [&str; 5] = ["peer_id", "model", "engine", "organization", "machine"];

pub(super) fn agent_labels(a: &AgentView) -> [&dyn Display; 5] {
    let r = &a.reg;
    [&a.peer_id, &r.model, &r.engine, &r.organization, &r.machine]
}

/// Per-agent series (latency only while KNOWN).
pub(super) fn render_agents(o: &mut String, snaps: &[ShardSnapshot]) {
    let agents: Vec<_> = snaps.iter().flat_map(|s| s.agents.iter()).collect();
    let mut f = Family::new(
        o,
        "hivenet_routing_agent_info",
        Gauge,
        "1 while the agent is registered.",
        ROUTING_LABELS,
    );
    for a in &agents {
        f.series(routing_labels(a), 1);
    }
    let mut f = Family::new(
        o,
        "hivenet_routing_agent_healthy",
        Gauge,
        "1 when the agent is routable.",
        ROUTING_LABELS,
    );
    for a in &agents {
        f.series(routing_labels(a), u8::from(a.healthy));
    }
    let mut f = Family::new(
        o,
        "hivenet_routing_agent_last_seen_timestamp",
        Gauge,
        "Unix milliseconds of the agent's registration or last heartbeat.",
        ROUTING_LABELS,
    );
    for a in &agents {
        f.series(routing_labels(a), a.last_seen_ms);
    }
    type Get = fn(&AgentView) -> Option<f64>;
    let per_agent: [(&'static str, Kind, &str, Get); 28] = [
        (
            "hivenet_agent_capacity_utilization",
            Gauge,
            "Requests in flight over the declared capacity, now.",
            |a| (a.reg.capacity > 0).then(|| f64::from(a.active) / f64::from(a.reg.capacity)),
        ),
        // The engine's own signals as the agent last reported them; a
        // signal the engine does not have is absent, never 0.
        (
            "hivenet_agent_engine_kv_cache_utilization",
            Gauge,
            "The engine's KV-cache use, 0-1 (engine-reported).",
            |a| a.signals.kv_cache_utilization,
        ),
        (
            "hivenet_agent_engine_running_requests",
            Gauge,
            "Requests the engine is running (engine-reported).",
            |a| a.signals.running_requests,
        ),
        (
            "hivenet_agent_engine_waiting_requests",
            Gauge,
            "Requests waiting in the engine (engine-reported).",
            |a| a.signals.waiting_requests,
        ),
        (
            "hivenet_agent_engine_avg_ttft_seconds",
            Gauge,
            "The engine's mean time to first token, s (engine-reported).",
            |a| a.signals.avg_ttft_seconds,
        ),
        (
            "hivenet_agent_engine_p90_ttft_seconds",
            Gauge,
            "The engine's p90 time to first token, s (engine-reported).",
            |a| a.signals.p90_ttft_seconds,
        ),
        (
            "hivenet_agent_engine_avg_itl_seconds",
            Gauge,
            "The engine's mean inter-token latency, s (engine-reported).",
            |a| a.signals.avg_itl_seconds,
        ),
        (
            "hivenet_agent_engine_p90_itl_seconds",
            Gauge,
            "The engine's p90 inter-token latency, s (engine-reported).",
            |a| a.signals.p90_itl_seconds,
        ),
        (
            "hivenet_agent_active_requests",
            Gauge,
            "Requests in flight on the agent.",
            |a| Some(f64::from(a.active)),
        ),
        (
            "hivenet_agent_requests_success_total",
            Counter,
            "Successful requests per agent.",
            |a| Some(a.success as f64),
        ),
        (
            "hivenet_agent_requests_failed_total",
            Counter,
            "Failed requests per agent.",
            |a| Some(a.failed as f64),
        ),
        (
            "hivenet_agent_input_tokens_total",
            Counter,
            "Input tokens per agent (from response usage).",
            |a| Some(a.input_tokens as f64),
        ),
        (
            "hivenet_agent_output_tokens_total",
            Counter,
            "Output tokens per agent (from response usage).",
            |a| Some(a.output_tokens as f64),
        ),
        (
            "hivenet_agent_prompt_tokens_total",
            Counter,
            "Prompt tokens of the responses whose engine reported a cached count (the denominator of the cached share; responses without one are unknown, not 0), since registration.",
            |a| Some(a.prompt_tokens as f64),
        ),
        (
            "hivenet_agent_cached_prompt_tokens_total",
            Counter,
            "Of hivenet_agent_prompt_tokens_total, those the engine read from its prompt cache (since registration).",
            |a| Some(a.cached_prompt_tokens as f64),
        ),
        (
            "hivenet_agent_cache_predicted_tokens_total",
            Counter,
            "Cached prompt tokens the prefix-aware index predicted on this agent (it held a request's longest prefix), since registration: with captured and hivenet_agent_cached_prompt_tokens_total (delivered), the cache hit three ways per agent.",
            |a| Some(a.cache_predicted as f64),
        ),
        (
            "hivenet_agent_cache_captured_tokens_total",
            Counter,
            "Of hivenet_agent_cache_predicted_tokens_total, the tokens of requests sent to this agent (the others went elsewhere: load guard, full holder, failure).",
            |a| Some(a.cache_captured as f64),
        ),
        (
            "hivenet_agent_rejected_requests_total",
            Counter,
            "Requests the agent turned away unserved, its backend busy or unavailable (429, 503), since registration.",
            |a| Some(a.rejected as f64),
        ),
        (
            "hivenet_agent_full_refusals_total",
            Counter,
            "Requests an agent serving several routers turned away because the other routers held its capacity (retried or queued, not failures), since registration.",
            |a| Some(a.full_refusals as f64),
        ),
        (
            "hivenet_agent_signals_dropped_total",
            Counter,
            "Routing signals the agent sent out of their range (treated as absent), since registration.",
            |a| Some(a.signals_dropped as f64),
        ),
        (
            "hivenet_agent_disconnections_total",
            Counter,
            "Times the agent's link closed.",
            |a| Some(a.disconnections as f64),
        ),
        (
            "hivenet_agent_failure_total",
            Counter,
            "Missed-heartbeat healthy to unhealthy transitions.",
            |a| Some(a.agent_failures as f64),
        ),
        (
            "hivenet_model_backend_failure_total",
            Counter,
            "Backend-unhealthy transitions reported by the agent.",
            |a| Some(a.backend_failures as f64),
        ),
        (
            "hivenet_agent_success_rate",
            Gauge,
            "Lifetime successful / all requests.",
            |a| {
                let t = a.success + a.failed;
                (t > 0).then(|| a.success as f64 / t as f64)
            },
        ),
        // Latency: emitted only while the estimator is KNOWN (no misleading 0).
        (
            "hivenet_agent_srtt_ms",
            Gauge,
            "Smoothed request latency to response headers, ms (only once known).",
            |a| a.srtt,
        ),
        (
            "hivenet_agent_rttvar_ms",
            Gauge,
            "Latency variation, ms (only once known).",
            |a| a.rttvar,
        ),
        (
            "hivenet_router_agent_srtt_ms",
            Gauge,
            "Older name of hivenet_agent_srtt_ms.",
            |a| a.srtt,
        ),
        (
            "hivenet_router_agent_rttvar_ms",
            Gauge,
            "Older name of hivenet_agent_rttvar_ms.",
            |a| a.rttvar,
        ),
    ];
    for (name, kind, help, get) in per_agent {
        let mut f = Family::new(o, name, kind, help, AGENT_LABELS);
        for a in &agents {
            if let Some(v) = get(a) {
                f.series(agent_labels(a), v);
            }
        }
    }
}
