//! The per-model families: routing, policy, admission, queue, durations;
//! the features' own (affinity, classes, stream migrations) are rendered
//! by their rooms in [`crate::runtime::state::model`].

use super::*;
use crate::runtime::state::model::stats::{ModelStats, DURATION_BUCKETS};
use crate::runtime::state::model::{affinity, continuity, conversations, fairness};
use crate::runtime::state::views::ShardSnapshot;
use crate::runtime::wire::exposition::Family;
use crate::runtime::wire::exposition::Kind::{self, Counter, Gauge, Histogram};
use std::collections::BTreeMap;
use std::fmt::Display;

/// Per-model statistics summed over shards.
pub(super) struct ModelTotals {
    routed: BTreeMap<RouteKey, u64>,
    failed: BTreeMap<RouteKey, u64>,
    models: BTreeMap<String, ModelStats>,
}

impl ModelTotals {
    pub(super) fn of(snaps: &[ShardSnapshot]) -> Self {
        let mut t = ModelTotals {
            routed: BTreeMap::new(),
            failed: BTreeMap::new(),
            models: BTreeMap::new(),
        };
        for s in snaps {
            for (m, st) in &s.models {
                for (into, from) in [(&mut t.routed, &st.routed), (&mut t.failed, &st.failed)] {
                    for ((region, engine, tenant), n) in from {
                        let key = (
                            region.to_string(),
                            engine.to_string(),
                            m.clone(),
                            tenant.clone(),
                        );
                        *into.entry(key).or_default() += n;
                    }
                }
                t.models.entry(m.clone()).or_default().add_shard(st);
            }
        }
        t
    }
}

/// Per-model routing counters and histograms, summed over shards.
pub(super) fn render_models(o: &mut String, snaps: &[ShardSnapshot], t: &ModelTotals) {
    for (name, help, map) in [
        (
            "hivenet_routing_requests_routed_total",
            "Successful forwards.",
            &t.routed,
        ),
        (
            "hivenet_routing_requests_failed_total",
            "Failed forward attempts and exhaustions (empty region/engine).",
            &t.failed,
        ),
    ] {
        let mut f = Family::new(
            o,
            name,
            Counter,
            help,
            ["region", "engine", "model", "tenant_id"],
        );
        for ((region, engine, model, tenant), n) in map {
            f.series([region, engine, model, tenant], n);
        }
    }
    type PGet = fn(&ModelStats) -> f64;
    let pm: [(&'static str, Kind, &str, PGet); 6] = [
        (
            "hivenet_policy_primary_routed_total",
            Counter,
            "Requests served by the primary step.",
            |s| s.primary_routed as f64,
        ),
        (
            "hivenet_policy_fallback_routed_total",
            Counter,
            "Requests served by a fallback step.",
            |s| s.fallback_routed as f64,
        ),
        (
            "hivenet_policy_exhausted_total",
            Counter,
            "Requests for which every policy step was exhausted.",
            |s| s.exhausted as f64,
        ),
        (
            "hivenet_usage_clamped_total",
            Counter,
            "Responses whose usage claimed more tokens than the request could produce (clamped before counting).",
            |s| s.usage_clamped as f64,
        ),
        (
            "hivenet_policy_provider_fallback_total",
            Counter,
            "Requests sent to the policy's fallback provider once every local step was exhausted.",
            |s| s.provider_fallback as f64,
        ),
        (
            "hivenet_queue_depth",
            Gauge,
            "Requests waiting in the model's capacity queue.",
            |s| s.queue_depth as f64,
        ),
    ];
    // Each feature renders its own families from its own counters.
    let each = || t.models.iter();
    affinity::render(o, each().map(|(m, st)| (m, &st.affinity)));
    fairness::render(o, each().map(|(m, st)| (m, &st.classes)));
    continuity::render(o, each().map(|(m, st)| (m, &st.continuity)));
    conversations::render(o, each().map(|(m, st)| (m, &st.responses)));
    for (name, kind, help, get) in pm {
        let mut f = Family::new(o, name, kind, help, ["model"]);
        for (m, st) in &t.models {
            f.series([m], get(st));
        }
    }
    let mut calls: std::collections::BTreeMap<
        (&str, u16),
        crate::runtime::state::model::stats::Histogram,
    > = Default::default();
    for st in t.models.values() {
        for (k, h) in &st.provider_calls {
            calls.entry(*k).or_default().merge(h);
        }
    }
    let mut f = Family::new(
        o,
        "hivenet_backend_errors_total",
        Counter,
        "Backend failures agents reported, by status: 502 closed or malformed answer, 503 unreachable or busy, 504 timed out.",
        ["model", "status_code"],
    );
    for (m, st) in &t.models {
        for (status, n) in &st.backend_errors {
            f.series([m, status], n);
        }
    }
    let mut f = Family::new(
        o,
        "http_client_request_duration_seconds",
        Histogram,
        "Provider fallback calls, to the end of the answer, by provider and status (0: transport error).",
        ["provider", "status_code"],
    );
    for ((provider, status), h) in &calls {
        f.histogram(
            [provider, status],
            &crate::runtime::state::model::stats::CLIENT_BUCKETS,
            h,
        );
    }
    let mut f = Family::new(
        o,
        "hivenet_agent_connection_resets_total",
        Counter,
        "Exchanges with an agent cut by the transport or a deadline, by reason (forward_failure, stream_cut, deadline).",
        ["model", "reason"],
    );
    for (m, st) in &t.models {
        for (reason, n) in &st.connection_resets {
            f.series([m, reason], n);
        }
    }
    type AGet = fn(&crate::runtime::state::model::admission::Gauges) -> u64;
    let adm: [(&'static str, &str, AGet); 5] = [
        (
            "hivenet_admission_occupancy_tokens",
            "Tokens reserved by requests in flight (estimate + declared output, trued up).",
            |g| g.occupancy_tokens,
        ),
        (
            "hivenet_admission_budget_tokens",
            "Effective token budget last seen (admit fraction x per-replica budget x replicas; 0: unset).",
            |g| g.budget_tokens,
        ),
        (
            "hivenet_admission_inflight_requests",
            "Requests holding an admission reservation.",
            |g| g.inflight_requests,
        ),
        (
            "hivenet_admission_max_inflight",
            "Effective in-flight cap last seen (max_inflight x replicas; 0: unset).",
            |g| g.max_inflight,
        ),
        (
            "hivenet_admission_parked_requests",
            "Requests parked waiting for admission room.",
            |g| g.parked_requests,
        ),
    ];
    for (name, help, get) in adm {
        let mut f = Family::new(o, name, Gauge, help, ["model"]);
        for (m, st) in &t.models {
            if st.admission.active {
                f.series([m], get(&st.admission));
            }
        }
    }
    let mut f = Family::new(o, "hivenet_request_duration_seconds", Histogram, "Client-visible duration of completed responses (first request byte to last response byte, streams included).", ["tenant_id", "peer_id", "model", "status_code"]);
    for s in snaps {
        for (m, st) in &s.models {
            for ((_, status, tenant), series) in &st.durations {
                let labels: [&dyn Display; 4] = [tenant, &series.peer_id, m, status];
                f.histogram(labels, &DURATION_BUCKETS, &series.hist);
            }
        }
    }
}
