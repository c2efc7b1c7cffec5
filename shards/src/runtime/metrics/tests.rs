//! Every family of `render` parsed back from a synthetic set of shard
//! snapshots (two shards, agents with and without a known latency, label
//! values that need escaping): the text format's rules, and each family's
//! type, series and values.

use super::*;
use crate::logic::link::control::Registration;
use crate::logic::link::engine_metrics::EngineSignals;
use crate::runtime::state::model::stats::{DurationSeries, Histogram};
use crate::runtime::state::model::stats::{ModelStats, DURATION_BUCKETS, QUEUE_BUCKETS};
use crate::runtime::state::views::AgentView;
use std::collections::BTreeMap;
use std::sync::Arc;

fn agent(peer: &str, model: &str, srtt: Option<f64>) -> AgentView {
    AgentView {
        peer_id: peer.into(),
        reg: Registration {
            peer_id: peer.into(),
            model: model.into(),
            engine: "vllm".into(),
            region: "eu \"west\"\n".into(),
            capacity: 4,
            ..Default::default()
        },
        healthy: srtt.is_some(),
        active: 2,
        success: 30,
        failed: 10,
        last_seen_ms: 1_700_000_000_000,
        live: true,
        backend_healthy: true,
        draining: false,
        admin_drained: false,
        srtt,
        rttvar: srtt.map(|s| s / 2.0),
        input_tokens: 100,
        output_tokens: 50,
        cached_prompt_tokens: 40,
        prompt_tokens: 100,
        cache_predicted: 30,
        cache_captured: 20,
        disconnections: 1,
        rejected: 2,
        others_active: 1,
        full_refusals: 5,
        signals_dropped: 4,
        agent_failures: 2,
        backend_failures: 3,
        signals: EngineSignals {
            // Only some of the engine's signals: the others stay absent.
            kv_cache_utilization: srtt.map(|_| 0.25),
            running_requests: Some(3.0),
            ..Default::default()
        },
        hardware: Default::default(),
    }
}

fn hist(bounds: &[f64], values: &[f64]) -> Histogram {
    let mut h = Histogram::default();
    for v in values {
        h.observe(bounds, *v);
    }
    h
}

fn model_stats(tenant: &str) -> ModelStats {
    let t: Arc<str> = tenant.into();
    let mut s = ModelStats::default();
    s.routed.insert(("eu".into(), "vllm".into(), t.clone()), 5);
    s.failed.insert(("".into(), "".into(), t.clone()), 2);
    s.primary_routed = 4;
    s.fallback_routed = 1;
    s.exhausted = 2;
    s.provider_fallback = 3;
    s.usage_clamped = 1;
    s.affinity.decisions = [3, 5, 7, 1];
    s.affinity.stale = 2;
    s.affinity.holder_waits = 4;
    s.affinity.holder_wait_timeouts = 1;
    s.affinity.miss_cost_per_token = Some(0.25);
    s.affinity.cache = [300, 200, 150];
    s.backend_errors.insert(502, 2);
    s.provider_calls.insert(
        ("openai", 200),
        hist(&crate::runtime::state::model::stats::CLIENT_BUCKETS, &[0.3]),
    );
    s.queue_depth = 3;
    s.connection_resets.insert("forward_failure", 3);
    s.connection_resets.insert("stream_cut", 1);
    s.continuity.migrations.insert("continued", 2);
    s.continuity.migrations.insert("tools", 1);
    s.responses.count("continued");
    s.responses.count("continued");
    s.responses.count("new");
    s.classes.wait[1] = hist(&QUEUE_BUCKETS, &[0.01, 0.2]);
    s.classes.admitted = [2, 3, 0];
    s.classes.refused = [1, 0, 0];
    s.durations.insert(
        (1, 200, t),
        DurationSeries {
            peer_id: "12D3KooWa".into(),
            hist: hist(&DURATION_BUCKETS, &[0.05, 1.5, 30.0]),
        },
    );
    s.admission.active = true;
    s.admission.occupancy_tokens = 700;
    s.admission.inflight_requests = 2;
    s
}

pub(super) fn snapshots() -> Vec<ShardSnapshot> {
    vec![
        ShardSnapshot {
            shard: 0,
            requests: 11,
            handoffs_out: 1,
            handoffs_in: 0,
            link_handoffs_out: 0,
            links_rejected: 2,
            link_refusals: vec![("link_cap", 1), ("handshake", 1)],
            audit_401_suppressed: 5,
            agents: vec![
                agent("12D3KooWa", "m1", Some(12.5)),
                agent("12D3KooWb", "m1", None),
            ],
            models: vec![("m1".into(), model_stats("acme"))],
            redirects: vec![(("m1".into(), "site-b".into()), 3)],
            http: {
                let mut d = Vec::new();
                let chat = ("POST", "/v1/chat/completions", 200);
                crate::runtime::state::model::stats::observe_http(&mut d, chat, 0.02);
                crate::runtime::state::model::stats::observe_http(&mut d, chat, 0.2);
                let gone = ("GET", "unmatched", 404);
                crate::runtime::state::model::stats::observe_http(&mut d, gone, 0.001);
                d
            },
        },
        ShardSnapshot {
            shard: 1,
            requests: 7,
            handoffs_out: 0,
            handoffs_in: 1,
            link_handoffs_out: 0,
            links_rejected: 0,
            link_refusals: vec![("link_cap", 2)],
            audit_401_suppressed: 0,
            agents: vec![agent("12D3KooWc", "m2", Some(40.0))],
            models: vec![("m2".into(), model_stats("default"))],
            redirects: vec![],
            http: {
                // The same key on another shard: merged at scrape.
                let mut d = Vec::new();
                let chat = ("POST", "/v1/chat/completions", 200);
                crate::runtime::state::model::stats::observe_http(&mut d, chat, 3.0);
                d
            },
        },
    ]
}

pub(super) fn rendered() -> String {
    let mut reloads = BTreeMap::new();
    reloads.insert(("sighup".to_string(), "ok".to_string()), 2);
    let directory = DirectoryStats {
        live: 2,
        idle: 1,
        reserved: 0,
    };
    render(
        &snapshots(),
        4,
        &reloads,
        directory,
        &Budget::new(1 << 20, 16),
    )
}

/// The tenant series of the synthetic snapshots, with two keys (one flat
/// quota, one per model).
fn tenants_rendered() -> String {
    use crate::logic::tenancy::auth::parse_config;
    use crate::runtime::state::model::stats::TenantStats;
    use std::collections::HashMap;
    let c = parse_config(
        "auth.yaml",
        "api:\n  mode: api-key\n  keys:\n    - key_hash: \"aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00\"\n      metadata: {name: n, owner: \"ac\\\"me\"}\n      quota: {requests_per_minute: 5, tokens_per_day: 100}\n    - key_hash: \"bb00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00\"\n      metadata: {name: p, owner: beta}\n      quota: {per_model: {m1: {requests_per_minute_per_replica: 3, tokens_per_day: 50}}}\n",
    )
    .expect("config");
    let auth =
        crate::runtime::state::tenancy::AuthState::build(c.api, c.keys, None, &HashMap::new());
    let mut snaps = snapshots();
    for s in &mut snaps {
        for (_, st) in &mut s.models {
            let mut ts = TenantStats {
                success: 3,
                failed: 1,
                input_tokens: 20,
                output_tokens: 9,
                rate_limited: 2,
                token_limited: 1,
                queue_waits: 2,
                queue_wait_us: 1_500_000,
                last_request: 1_700_000_000,
                ..Default::default()
            };
            ts.duration.observe(&DURATION_BUCKETS, 0.3);
            st.tenants
                .entry("acme".into())
                .or_default()
                .insert("sk_1".into(), ts);
            st.admission_rejections.insert("b2", 4);
        }
    }
    let mut o = String::new();
    super::tenants::render(&mut o, &snaps, &auth, 20_000, None, &Default::default());
    o
}

// === a parser of the text format ===

/// A sample's labels, in order.
type Labels = Vec<(String, String)>;

/// One parsed family.
#[derive(Debug, Default)]
struct Parsed {
    kind: String,
    help: String,
    /// (sample name, labels, value), in order.
    samples: Vec<(String, Labels, f64)>,
}

/// A label set `{a="x",b="y"}` (escapes undone); the rest of the line.
fn parse_labels(s: &str) -> Result<(Labels, &str), String> {
    let Some(mut rest) = s.strip_prefix('{') else {
        return Ok((Vec::new(), s));
    };
    let mut out = Vec::new();
    loop {
        if let Some(r) = rest.strip_prefix('}') {
            return Ok((out, r));
        }
        let eq = rest.find("=\"").ok_or(format!("label without =\": {s}"))?;
        let name = &rest[..eq];
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("bad label name {name:?}"));
        }
        let mut value = String::new();
        let mut chars = rest[eq + 2..].char_indices();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    other => return Err(format!("bad escape {other:?} in {s}")),
                },
                Some((i, '"')) => break eq + 2 + i + 1,
                Some((_, c)) => value.push(c),
                None => return Err(format!("unterminated value in {s}")),
            }
        };
        out.push((name.to_string(), value));
        rest = &rest[end..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
}

/// Parse the exposition: every family's `# HELP` then `# TYPE` come once,
/// before its samples; each sample belongs to the family above it
/// (histograms: `_bucket`, `_sum`, `_count`); values are numbers; no series
/// repeats.
fn parse(text: &str) -> Result<BTreeMap<String, Parsed>, String> {
    let mut out: BTreeMap<String, Parsed> = BTreeMap::new();
    let mut current: Option<String> = None;
    let mut seen = std::collections::HashSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').ok_or("HELP without text")?;
            if out.contains_key(name) {
                return Err(format!("{name} twice"));
            }
            out.insert(
                name.to_string(),
                Parsed {
                    help: help.into(),
                    ..Default::default()
                },
            );
            current = Some(name.to_string());
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').ok_or("TYPE without kind")?;
            let f = out
                .get_mut(name)
                .ok_or(format!("TYPE before HELP: {name}"))?;
            if Some(name) != current.as_deref() || !f.kind.is_empty() || !f.samples.is_empty() {
                return Err(format!("TYPE out of place: {name}"));
            }
            if !["counter", "gauge", "histogram"].contains(&kind) {
                return Err(format!("kind {kind}"));
            }
            f.kind = kind.into();
        } else {
            let fam = current
                .clone()
                .ok_or(format!("sample before any family: {line}"))?;
            let cut = line.find(['{', ' ']).ok_or(format!("no value: {line}"))?;
            let (name, rest) = line.split_at(cut);
            let (labels, rest) = parse_labels(rest)?;
            let value: f64 = rest
                .strip_prefix(' ')
                .and_then(|v| v.parse().ok())
                .ok_or(format!("bad value: {line}"))?;
            let f = out.get_mut(&fam).ok_or("family")?;
            let ok = name == fam
                || (f.kind == "histogram"
                    && ["_bucket", "_sum", "_count"]
                        .iter()
                        .any(|s| name.strip_suffix(s) == Some(fam.as_str())));
            if !ok || f.kind.is_empty() {
                return Err(format!("{name} under {fam} ({})", f.kind));
            }
            if !seen.insert((name.to_string(), labels.clone())) {
                return Err(format!("series twice: {line}"));
            }
            f.samples.push((name.to_string(), labels, value));
        }
    }
    Ok(out)
}

fn label<'a>(labels: &'a [(String, String)], name: &str) -> Option<&'a str> {
    labels
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// Every family: (name, type, series, one label set it must have with its
/// value, when it names one).
type Want = (
    &'static str,
    &'static str,
    usize,
    Option<(&'static str, &'static str, f64)>,
);

const FAMILIES: &[Want] = &[
    (
        "hivenet_directory_models",
        "gauge",
        3,
        Some(("state", "idle", 1.0)),
    ),
    (
        "hivenet_policy_reload_total",
        "counter",
        1,
        Some(("trigger", "sighup", 2.0)),
    ),
    ("hivenet_storage_errors_total", "counter", 1, None),
    ("hivenet_client_connections", "gauge", 1, None),
    ("hivenet_buffered_body_bytes", "gauge", 1, None),
    (
        "hivenet_routing_requests_routed_total",
        "counter",
        2,
        Some(("model", "m2", 5.0)),
    ),
    (
        "hivenet_routing_requests_failed_total",
        "counter",
        2,
        Some(("tenant_id", "acme", 2.0)),
    ),
    (
        "hivenet_policy_primary_routed_total",
        "counter",
        2,
        Some(("model", "m1", 4.0)),
    ),
    (
        "hivenet_policy_fallback_routed_total",
        "counter",
        2,
        Some(("model", "m1", 1.0)),
    ),
    (
        "hivenet_policy_exhausted_total",
        "counter",
        2,
        Some(("model", "m2", 2.0)),
    ),
    (
        "hivenet_backend_errors_total",
        "counter",
        2,
        Some(("model", "m1", 2.0)),
    ),
    (
        "hivenet_usage_clamped_total",
        "counter",
        2,
        Some(("model", "m1", 1.0)),
    ),
    (
        "hivenet_affinity_decisions_total",
        "counter",
        8,
        Some(("outcome", "prefix_hit", 5.0)),
    ),
    (
        "hivenet_affinity_stale_total",
        "counter",
        2,
        Some(("model", "m1", 2.0)),
    ),
    (
        "hivenet_affinity_holder_waits_total",
        "counter",
        2,
        Some(("model", "m1", 4.0)),
    ),
    (
        "hivenet_affinity_miss_cost_seconds_per_token",
        "gauge",
        2,
        Some(("model", "m1", 0.25)),
    ),
    (
        "hivenet_affinity_cache_tokens_total",
        "counter",
        6,
        Some(("stage", "delivered", 150.0)),
    ),
    (
        "hivenet_affinity_holder_wait_timeouts_total",
        "counter",
        2,
        Some(("model", "m1", 1.0)),
    ),
    (
        "hivenet_policy_provider_fallback_total",
        "counter",
        2,
        Some(("model", "m1", 3.0)),
    ),
    // One (provider, status) key, merged over models: 11 bounds, +Inf,
    // sum, count.
    (
        "http_client_request_duration_seconds",
        "histogram",
        11 + 3,
        Some(("provider", "openai", 0.0)),
    ),
    // The one request this test holds in flight.
    (
        "http_server_active_requests",
        "gauge",
        1,
        Some(("route", "/v1/rerank", 1.0)),
    ),
    (
        "hivenet_queue_depth",
        "gauge",
        2,
        Some(("model", "m1", 3.0)),
    ),
    (
        "hivenet_admission_occupancy_tokens",
        "gauge",
        2,
        Some(("model", "m1", 700.0)),
    ),
    (
        "hivenet_admission_budget_tokens",
        "gauge",
        2,
        Some(("model", "m1", 0.0)),
    ),
    (
        "hivenet_admission_inflight_requests",
        "gauge",
        2,
        Some(("model", "m2", 2.0)),
    ),
    ("hivenet_admission_max_inflight", "gauge", 2, None),
    ("hivenet_admission_parked_requests", "gauge", 2, None),
    // 2 series x (10 buckets + +Inf + sum + count).
    (
        "hivenet_request_duration_seconds",
        "histogram",
        2 * (DURATION_BUCKETS.len() + 3),
        None,
    ),
    // Two models, two reasons each.
    (
        "hivenet_agent_connection_resets_total",
        "counter",
        4,
        Some(("reason", "forward_failure", 3.0)),
    ),
    // Two models, two outcomes each.
    (
        "hivenet_stream_migrations_total",
        "counter",
        4,
        Some(("outcome", "continued", 2.0)),
    ),
    // Two models, two kinds each.
    (
        "hivenet_responses_requests_total",
        "counter",
        4,
        Some(("kind", "continued", 2.0)),
    ),
    // Two keys (the chat 200s of both shards merged), 13 bounds each.
    (
        "http_server_request_duration_seconds",
        "histogram",
        2 * (13 + 3),
        Some(("route", "/v1/chat/completions", 0.0)),
    ),
    (
        "hivenet_queue_wait_seconds",
        "histogram",
        2 * (QUEUE_BUCKETS.len() + 3),
        None,
    ),
    // Interactive and standard (batch had none) x admitted, refused, on
    // both models.
    (
        "hivenet_class_requests_total",
        "counter",
        8,
        Some(("class", "interactive", 2.0)),
    ),
    (
        "hivenet_shard_requests_total",
        "counter",
        2,
        Some(("shard", "1", 7.0)),
    ),
    (
        "hivenet_shard_handoffs_total",
        "counter",
        4,
        Some(("direction", "in", 0.0)),
    ),
    (
        "hivenet_agent_link_refusals_total",
        "counter",
        2,
        Some(("reason", "link_cap", 3.0)),
    ),
    (
        "hivenet_audit_unauthorized_suppressed_total",
        "counter",
        2,
        Some(("shard", "0", 5.0)),
    ),
    (
        "hivenet_agent_links_rejected_total",
        "counter",
        2,
        Some(("shard", "0", 2.0)),
    ),
    (
        "hivenet_routing_agent_info",
        "gauge",
        3,
        Some(("peer_id", "12D3KooWc", 1.0)),
    ),
    (
        "hivenet_routing_agent_healthy",
        "gauge",
        3,
        Some(("peer_id", "12D3KooWb", 0.0)),
    ),
    (
        "hivenet_routing_agent_last_seen_timestamp",
        "gauge",
        3,
        Some(("peer_id", "12D3KooWa", 1_700_000_000_000.0)),
    ),
    (
        "hivenet_agent_active_requests",
        "gauge",
        3,
        Some(("peer_id", "12D3KooWa", 2.0)),
    ),
    (
        "hivenet_agent_capacity_utilization",
        "gauge",
        3,
        Some(("peer_id", "12D3KooWa", 0.5)),
    ),
    // Engine signals: present ones only (KV use on two agents of three).
    (
        "hivenet_agent_engine_kv_cache_utilization",
        "gauge",
        2,
        Some(("peer_id", "12D3KooWa", 0.25)),
    ),
    (
        "hivenet_agent_engine_running_requests",
        "gauge",
        3,
        Some(("peer_id", "12D3KooWc", 3.0)),
    ),
    ("hivenet_agent_engine_waiting_requests", "gauge", 0, None),
    ("hivenet_agent_engine_avg_ttft_seconds", "gauge", 0, None),
    ("hivenet_agent_engine_p90_ttft_seconds", "gauge", 0, None),
    ("hivenet_agent_engine_avg_itl_seconds", "gauge", 0, None),
    ("hivenet_agent_engine_p90_itl_seconds", "gauge", 0, None),
    (
        "hivenet_agent_requests_success_total",
        "counter",
        3,
        Some(("peer_id", "12D3KooWa", 30.0)),
    ),
    (
        "hivenet_agent_requests_failed_total",
        "counter",
        3,
        Some(("peer_id", "12D3KooWa", 10.0)),
    ),
    (
        "hivenet_agent_input_tokens_total",
        "counter",
        3,
        Some(("peer_id", "12D3KooWa", 100.0)),
    ),
    (
        "hivenet_agent_output_tokens_total",
        "counter",
        3,
        Some(("peer_id", "12D3KooWa", 50.0)),
    ),
    (
        "hivenet_agent_cached_prompt_tokens_total",
        "counter",
        3,
        Some(("peer_id", "12D3KooWa", 40.0)),
    ),
    (
        "hivenet_agent_prompt_tokens_total",
        "counter",
        3,
        Some(("peer_id", "12D3KooWa", 100.0)),
    ),
    (
        "hivenet_agent_cache_predicted_tokens_total",
        "counter",
        3,
        Some(("peer_id", "12D3KooWa", 30.0)),
    ),
    (
        "hivenet_agent_cache_captured_tokens_total",
        "counter",
        3,
        Some(("peer_id", "12D3KooWa", 20.0)),
    ),
    (
        "hivenet_agent_signals_dropped_total",
        "counter",
        3,
        Some(("peer_id", "12D3KooWa", 4.0)),
    ),
    (
        "hivenet_agent_rejected_requests_total",
        "counter",
        3,
        Some(("peer_id", "12D3KooWa", 2.0)),
    ),
    (
        "hivenet_agent_full_refusals_total",
        "counter",
        3,
        Some(("peer_id", "12D3KooWa", 5.0)),
    ),
    ("hivenet_agent_disconnections_total", "counter", 3, None),
    (
        "hivenet_agent_failure_total",
        "counter",
        3,
        Some(("peer_id", "12D3KooWa", 2.0)),
    ),
    (
        "hivenet_model_backend_failure_total",
        "counter",
        3,
        Some(("peer_id", "12D3KooWa", 3.0)),
    ),
    (
        "hivenet_agent_success_rate",
        "gauge",
        3,
        Some(("peer_id", "12D3KooWa", 0.75)),
    ),
    // Latency only while known: two of the three agents.
    (
        "hivenet_agent_srtt_ms",
        "gauge",
        2,
        Some(("peer_id", "12D3KooWa", 12.5)),
    ),
    (
        "hivenet_agent_rttvar_ms",
        "gauge",
        2,
        Some(("peer_id", "12D3KooWc", 20.0)),
    ),
    (
        "hivenet_router_agent_srtt_ms",
        "gauge",
        2,
        Some(("peer_id", "12D3KooWc", 40.0)),
    ),
    ("hivenet_router_agent_rttvar_ms", "gauge", 2, None),
    // Tenant series (two keys' quotas; one tenant's usage on two models).
    (
        "hivenet_tenant_requests_success_total",
        "counter",
        2,
        Some(("model", "m1", 3.0)),
    ),
    (
        "hivenet_tenant_requests_failed_total",
        "counter",
        2,
        Some(("model", "m2", 1.0)),
    ),
    (
        "hivenet_tenant_input_tokens_total",
        "counter",
        2,
        Some(("model", "m1", 20.0)),
    ),
    (
        "hivenet_tenant_output_tokens_total",
        "counter",
        2,
        Some(("model", "m1", 9.0)),
    ),
    (
        "hivenet_tenant_queue_waits_total",
        "counter",
        2,
        Some(("model", "m1", 2.0)),
    ),
    (
        "hivenet_tenant_queue_wait_seconds_total",
        "counter",
        2,
        Some(("model", "m1", 1.5)),
    ),
    (
        "hivenet_tenant_rate_limited_total",
        "counter",
        1,
        Some(("key_id", "sk_1", 4.0)),
    ),
    (
        "hivenet_tenant_token_limited_total",
        "counter",
        1,
        Some(("phase", "input", 2.0)),
    ),
    (
        "hivenet_tenant_last_request_timestamp",
        "gauge",
        1,
        Some(("tenant_id", "acme", 1.7e9)),
    ),
    (
        "hivenet_tenant_request_duration_seconds",
        "histogram",
        2 * (DURATION_BUCKETS.len() + 3),
        None,
    ),
    (
        "hivenet_admission_rejections_total",
        "counter",
        2,
        Some(("reason", "b2", 4.0)),
    ),
    (
        "hivenet_tenant_quota_rpm_limit",
        "gauge",
        1,
        Some(("tenant_id", "ac\"me", 5.0)),
    ),
    (
        "hivenet_tenant_quota_tpd_limit",
        "gauge",
        1,
        Some(("tenant_id", "ac\"me", 100.0)),
    ),
    (
        "hivenet_tenant_per_model_quota_rpm_limit",
        "gauge",
        1,
        Some(("tenant_id", "beta", 3.0)),
    ),
    (
        "hivenet_tenant_per_model_quota_tpd_limit",
        "gauge",
        1,
        Some(("model", "m1", 50.0)),
    ),
    (
        "hivenet_tenant_tokens_used_today",
        "gauge",
        2,
        Some(("tenant_id", "beta", 0.0)),
    ),
];

#[test]
fn every_family_parses_with_its_type_series_and_values() {
    let _in_flight =
        crate::runtime::state::model::stats::ActiveRequest::begin("POST", "/v1/rerank");
    let text = rendered() + &tenants_rendered();
    let parsed = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    for (name, kind, series, want) in FAMILIES {
        let f = parsed
            .get(*name)
            .unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(f.kind, *kind, "{name}");
        assert!(!f.help.is_empty(), "{name}: help");
        assert_eq!(f.samples.len(), *series, "{name}: {:?}", f.samples);
        if let Some((l, v, value)) = want {
            let hit = f
                .samples
                .iter()
                .find(|(_, labels, _)| label(labels, l) == Some(v))
                .unwrap_or_else(|| panic!("{name}: no series with {l}={v:?}"));
            assert_eq!(hit.2, *value, "{name}{{{l}={v:?}}}");
        }
    }
    let extra: Vec<&String> = parsed
        .keys()
        .filter(|k| !FAMILIES.iter().any(|(n, ..)| n == k))
        .collect();
    assert!(extra.is_empty(), "families without a row here: {extra:?}");
}

#[test]
fn label_values_round_trip_their_escapes() {
    let parsed = parse(&rendered()).expect("parse");
    let info = &parsed["hivenet_routing_agent_info"];
    assert!(info
        .samples
        .iter()
        .all(|(_, l, _)| label(l, "region") == Some("eu \"west\"\n")));
    assert!(
        parse("# HELP a x\n# TYPE a gauge\na{b=\"\\q\"} 1\n").is_err(),
        "bad escape"
    );
    assert!(
        parse("# HELP a x\n# TYPE a gauge\nb 1\n").is_err(),
        "foreign sample"
    );
    assert!(
        parse("# HELP a x\n# TYPE a gauge\na 1\na 2\n").is_err(),
        "series twice"
    );
    assert!(parse("a 1\n").is_err(), "sample before a family");
}

#[test]
fn histograms_are_cumulative_and_end_at_their_count() {
    let text = rendered() + &tenants_rendered();
    let parsed = parse(&text).expect("parse");
    for (name, f) in parsed.iter().filter(|(_, f)| f.kind == "histogram") {
        let mut last: BTreeMap<Labels, f64> = BTreeMap::new();
        let mut inf: BTreeMap<Labels, f64> = BTreeMap::new();
        for (sample, labels, v) in &f.samples {
            let series: Labels = labels.iter().filter(|(n, _)| n != "le").cloned().collect();
            if sample.ends_with("_bucket") {
                let prev = last.insert(series.clone(), *v).unwrap_or(0.0);
                assert!(*v >= prev, "{name}: buckets go down");
                if label(labels, "le") == Some("+Inf") {
                    inf.insert(series, *v);
                }
            } else if sample.ends_with("_count") {
                assert_eq!(inf.get(&series), Some(v), "{name}: +Inf is the count");
            }
        }
    }
}

#[test]
fn http_durations_merge_across_shards_and_routes_stay_bounded() {
    use crate::runtime::state::model::stats::{method_of, route_of};
    let text = rendered();
    let count = text
        .lines()
        .find(|l| {
            l.starts_with("http_server_request_duration_seconds_count{")
                && l.contains("route=\"/v1/chat/completions\"")
        })
        .expect("count line");
    assert!(
        count.ends_with(" 3"),
        "three requests over two shards: {count}"
    );
    assert_eq!(route_of("/v1/models/llama"), "/v1/models/:model");
    assert_eq!(route_of("/admin/api-keys/k1"), "/admin/api-keys/:id");
    assert_eq!(route_of("/../../etc/passwd"), "unmatched");
    assert_eq!(method_of("BREW"), "OTHER");
}
