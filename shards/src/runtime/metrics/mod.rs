//! `/metrics` on the metrics port: gathers every shard's snapshot by
//! message and renders the Prometheus text format.

pub mod exposition;
pub mod process;
pub mod tenants;

use std::collections::BTreeMap;
use std::fmt::Display;
use std::rc::Rc;

use crate::logic::http::http_parse;
use crate::logic::routing::directory::DirectoryStats;
use crate::runtime::metrics::exposition::Family;
use crate::runtime::metrics::exposition::Kind::{self, Counter, Gauge, Histogram};
use crate::runtime::request::respond;
use crate::runtime::state::model::stats::{ModelStats, DURATION_BUCKETS, QUEUE_BUCKETS};
use crate::runtime::state::shard::Shard;
use crate::runtime::state::views::{AgentView, ShardSnapshot};
use crate::runtime::wire::budget::Budget;
use crate::runtime::wire::conn::Conn;

/// Render snapshots as Prometheus text.
pub fn render(
    snaps: &[ShardSnapshot],
    storage_errors: u64,
    reloads: &BTreeMap<(String, String), u64>,
    directory: DirectoryStats,
    budget: &Budget,
) -> String {
    let mut o = String::with_capacity(4096);
    render_router(&mut o, reloads, directory, storage_errors);
    Family::new(
        &mut o,
        "hivenet_client_connections",
        Gauge,
        "Client connections open now (bounded by --max-client-connections).",
        [],
    )
    .series([], budget.connections());
    Family::new(
        &mut o,
        "hivenet_buffered_body_bytes",
        Gauge,
        "Request-body bytes buffered now (bounded by --max-buffered-body-bytes).",
        [],
    )
    .series([], budget.body_bytes());
    let per_model = ModelTotals::of(snaps);
    render_models(&mut o, snaps, &per_model);
    render_shards(&mut o, snaps);
    render_http(&mut o, snaps);
    render_agents(&mut o, snaps);
    o
}

/// Sites: redirects answered, the sibling map's version and hint age, and
/// hold at zero.
fn render_sites(
    o: &mut String,
    snaps: &[ShardSnapshot],
    sites: &crate::runtime::state::router::Sites,
    holds: (Option<&str>, &crate::runtime::state::hold_book::HoldBook),
    now: u64,
) {
    let mut redirects: BTreeMap<&(String, String), u64> = Default::default();
    for s in snaps {
        for (k, n) in &s.redirects {
            *redirects.entry(k).or_default() += n;
        }
    }
    let mut f = Family::new(
        o,
        "hivenet_redirects_total",
        Counter,
        "Requests redirected (307) to another site.",
        ["model", "target_site"],
    );
    for ((m, site), n) in redirects {
        f.series([m, site], n);
    }
    if let Some(local) = holds.0 {
        render_holds(o, sites, local, &holds.1.lock());
    }
    let Some(map) = &sites.map else {
        return;
    };
    Family::new(
        o,
        "hivenet_sibling_map_info",
        Gauge,
        "The sibling map in use (its version).",
        ["version"],
    )
    .series([&map.dto.version], 1);
    if let Some(age) = map.hints_age(now) {
        Family::new(
            o,
            "hivenet_sibling_map_age_seconds",
            Gauge,
            "Age of the map's warm/cold hints.",
            [],
        )
        .series([], age);
    }
}

/// Hold at zero: pending demand (a series per model the map places here
/// with scale_from_zero, none without a map), hold outcomes and
/// durations, observed wake times.
fn render_holds(
    o: &mut String,
    sites: &crate::runtime::state::router::Sites,
    local: &str,
    books: &crate::runtime::state::hold_book::Books,
) {
    use crate::runtime::state::hold_book::{p90, HOLD_BUCKETS};
    if let Some(map) = &sites.map {
        let mut f = Family::new(o, "hivenet_pending_demand", Gauge, "Requests waiting for a model at zero here: held now plus released without a slot yet (one per key and client ID).", ["model"]);
        let mut models: Vec<String> = map
            .holdable_here(local)
            .into_iter()
            .map(|(m, _)| m)
            .collect();
        models.dedup();
        for m in &models {
            f.series([m], books.ledger.demand(m));
        }
        Family::new(
            o,
            "hivenet_held_requests",
            Gauge,
            "Requests held by this router now (every model; a client held on two routers is held by both, and counted once in hivenet_pending_demand with --shared-state).",
            [],
        )
        .series([], books.ledger.held().0);
    }
    let mut f = Family::new(
        o,
        "hivenet_wake_holds_total",
        Counter,
        "Holds ended, by outcome (woken, expired, full, cancelled, unplaced, shutdown).",
        ["model", "outcome"],
    );
    for ((m, outcome), n) in &books.outcomes {
        f.series([m, outcome], n);
    }
    let mut f = Family::new(
        o,
        "hivenet_wake_hold_seconds",
        Histogram,
        "How long requests were held, by outcome.",
        ["model", "outcome"],
    );
    for ((m, outcome), h) in &books.hold_seconds {
        f.histogram([m, outcome], &HOLD_BUCKETS, h);
    }
    let mut f = Family::new(o, "hivenet_wake_seconds", Gauge, "Observed wake time of a model (first hold to first registration), 90th percentile of the last 32.", ["model"]);
    let mut models: Vec<&String> = books.wake_times.keys().collect();
    models.sort();
    for m in models {
        if let Some(d) = p90(books.wake_times.get(m).map(Vec::as_slice).unwrap_or(&[])) {
            f.series([m], d.as_secs_f64());
        }
    }
}

/// Router-wide series: policy reloads, directory names, store errors.
fn render_router(
    o: &mut String,
    reloads: &BTreeMap<(String, String), u64>,
    directory: DirectoryStats,
    storage_errors: u64,
) {
    let mut f = Family::new(o, "hivenet_directory_models", Gauge, "Model names the directory holds: live (registered agents), idle (agents all left; shard kept), reserved (links not registered yet).", ["state"]);
    for (state, n) in [
        ("live", directory.live),
        ("idle", directory.idle),
        ("reserved", directory.reserved),
    ] {
        f.series([&state], n);
    }
    let mut f = Family::new(
        o,
        "hivenet_policy_reload_total",
        Counter,
        "Policy reloads by trigger and result.",
        ["trigger", "result"],
    );
    for ((t, r), n) in reloads {
        f.series([t, r], n);
    }
    Family::new(
        o,
        "hivenet_storage_errors_total",
        Counter,
        "Failed history-store operations (open, flush, lookup, reset).",
        [],
    )
    .series([], storage_errors);
}

/// `--shared-state` (only when it is set): whether Redis answers, how old
/// the last sync is, failed calls.
fn render_shared_state(o: &mut String, st: &crate::runtime::services::shared_state::SharedState) {
    use std::sync::atomic::Ordering::Relaxed;
    Family::new(
        o,
        "hivenet_shared_state_up",
        Gauge,
        "Whether the last call to the shared state (Redis) succeeded.",
        [],
    )
    .series([], u8::from(st.link.up.load(Relaxed)));
    let (s, n) = crate::runtime::wire::clock::unix_nanos();
    let now_ms = s.saturating_mul(1000) + u64::from(n / 1_000_000);
    let mut f = Family::new(
        o,
        "hivenet_shared_state_last_sync_age_seconds",
        Gauge,
        "Seconds since the last successful sync with the shared state (absent before the first).",
        [],
    );
    if let Some(age) = st.sync_age_secs(now_ms) {
        f.series([], age);
    }
    Family::new(
        o,
        "hivenet_shared_state_errors_total",
        Counter,
        "Failed calls to the shared state (Redis).",
        [],
    )
    .series([], st.errors.load(Relaxed));
    Family::new(
        o,
        "hivenet_shared_quota_fail_open_total",
        Counter,
        "Requests of quota-limited keys admitted on this router's limits alone while the shared state was unreachable (--shared-state-failure-mode open); charged to the shared quota when it returns.",
        [],
    )
    .series([], st.link.fail_open_admissions.load(Relaxed));
    Family::new(
        o,
        "hivenet_shared_quota_fail_closed_total",
        Counter,
        "Requests of quota-limited keys refused (429) because the shared state was unreachable (--shared-state-failure-mode closed).",
        [],
    )
    .series([], st.link.fail_closed_refusals.load(Relaxed));
    let mut f = Family::new(
        o,
        "hivenet_shared_affinity_notes_total",
        Counter,
        "Prefix-affinity forwards published to the other routers and received from them (--shared-state-affinity).",
        ["direction"],
    );
    f.series([&"published"], st.affinity_notes.0.load(Relaxed));
    f.series([&"received"], st.affinity_notes.1.load(Relaxed));
}

/// (region, engine, model, tenant) of a routing counter.
type RouteKey = (String, String, String, std::sync::Arc<str>);

/// Per-model statistics summed over shards.
struct ModelTotals {
    routed: BTreeMap<RouteKey, u64>,
    failed: BTreeMap<RouteKey, u64>,
    models: BTreeMap<String, ModelStats>,
}

impl ModelTotals {
    fn of(snaps: &[ShardSnapshot]) -> Self {
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
fn render_models(o: &mut String, snaps: &[ShardSnapshot], t: &ModelTotals) {
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
    let pm: [(&'static str, Kind, &str, PGet); 9] = [
        (
            "hivenet_affinity_stale_total",
            Counter,
            "Prefix-aware hits whose engine reported under a quarter of the predicted prefix as cached (the entry was stale).",
            |s| s.affinity_stale as f64,
        ),
        (
            "hivenet_affinity_holder_waits_total",
            Counter,
            "Requests sent after waiting for a full cache holder (holder_wait_ms).",
            |s| s.holder_waits as f64,
        ),
        (
            "hivenet_affinity_holder_wait_timeouts_total",
            Counter,
            "Requests whose wait for a full cache holder ran out: sent where least-loaded chose (counted overloaded too).",
            |s| s.holder_wait_timeouts as f64,
        ),
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
    {
        let mut f = Family::new(
            o,
            "hivenet_affinity_decisions_total",
            Counter,
            "Prefix-aware routing decisions by outcome: key_hit, prefix_hit, miss (no live holder), overloaded (a holder full, excluded or outside the load band: least-loaded instead).",
            ["model", "outcome"],
        );
        for (m, st) in &t.models {
            if st.affinity.iter().all(|n| *n == 0) {
                continue;
            }
            for o in crate::logic::routing::affinity::Outcome::ALL {
                let outcome = o.as_str();
                f.series([m, &outcome], st.affinity[o.index()] as f64);
            }
        }
    }
    {
        let mut f = Family::new(
            o,
            "hivenet_affinity_miss_cost_seconds_per_token",
            Gauge,
            "Seconds an uncached prompt token adds to a request on the model's engines, learned from prefix-aware requests: a wait for a full cache holder never outlasts the prefill its hit saves (absent until learned).",
            ["model"],
        );
        for (m, st) in &t.models {
            if let Some(v) = st.miss_cost_per_token {
                f.series([m], v);
            }
        }
    }
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
    let mut f = Family::new(
        o,
        "hivenet_stream_migrations_total",
        Counter,
        "Streams whose agent broke mid-answer, by outcome: continued on another agent, failed (every continuation broke), no_agent, deadline, finished (the answer was whole), or why it could not be continued (tools, not_text, engine_cannot_continue...).",
        ["model", "outcome"],
    );
    for (m, st) in &t.models {
        for (outcome, n) in &st.stream_migrations {
            f.series([m, outcome], n);
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
    let mut f = Family::new(
        o,
        "hivenet_queue_wait_seconds",
        Histogram,
        "Waits in the capacity queue that ended with a slot, by priority class.",
        ["model", "class"],
    );
    for (m, st) in &t.models {
        // Standard always (the series a model had before classes); the
        // others once they waited.
        for (class, h) in crate::logic::routing::wait_queue::Class::ALL
            .iter()
            .zip(&st.wait)
        {
            if h.count > 0 || *class == crate::logic::routing::wait_queue::Class::Standard {
                f.histogram([m, &class.as_str()], &QUEUE_BUCKETS, h);
            }
        }
    }
    let mut f = Family::new(
        o,
        "hivenet_class_requests_total",
        Counter,
        "Requests by priority class: admitted (sent to an agent, once per request) or refused (no capacity, queue, quota or admission).",
        ["model", "class", "outcome"],
    );
    for (m, st) in &t.models {
        for (i, class) in crate::logic::routing::wait_queue::Class::ALL
            .iter()
            .enumerate()
        {
            let admitted = st.class_admitted.get(i).copied().unwrap_or(0);
            let refused = st.class_refused.get(i).copied().unwrap_or(0);
            // Standard always; the others once they had a request.
            if admitted + refused > 0
                || *class == crate::logic::routing::wait_queue::Class::Standard
            {
                f.series([m, &class.as_str(), &"admitted"], admitted);
                f.series([m, &class.as_str(), &"refused"], refused);
            }
        }
    }
}

/// `http_server_request_duration_seconds` (spec 06): every request's
/// duration by method, route and status, the shards' tables merged.
fn render_http(o: &mut String, snaps: &[ShardSnapshot]) {
    use crate::runtime::state::model::stats::{Histogram as Hist, HTTP_BUCKETS};
    let mut all: std::collections::BTreeMap<(&str, &str, u16), Hist> = Default::default();
    for s in snaps {
        for (k, h) in &s.http {
            all.entry(*k).or_default().merge(h);
        }
    }
    let mut f = Family::new(
        o,
        "http_server_request_duration_seconds",
        Histogram,
        "Duration of HTTP requests, to the last byte of the response (streams included).",
        ["method", "route", "status_code"],
    );
    for ((method, route, status), h) in &all {
        f.histogram([method, route, status], &HTTP_BUCKETS, h);
    }
    let mut f = Family::new(
        o,
        "http_server_active_requests",
        Gauge,
        "HTTP requests in flight (held and streaming ones included).",
        ["method", "route"],
    );
    for (method, route, n) in crate::runtime::state::model::stats::active_requests() {
        f.series([&method, &route], n);
    }
}

/// Per-shard counters.
fn render_shards(o: &mut String, snaps: &[ShardSnapshot]) {
    let mut f = Family::new(
        o,
        "hivenet_shard_requests_total",
        Counter,
        "Inference requests served by each shard.",
        ["shard"],
    );
    for s in snaps {
        f.series([&s.shard], s.requests);
    }
    let mut f = Family::new(
        o,
        "hivenet_shard_handoffs_total",
        Counter,
        "Client connections handed between shards.",
        ["shard", "direction"],
    );
    for s in snaps {
        f.series([&s.shard, &"out"], s.handoffs_out);
        f.series([&s.shard, &"in"], s.handoffs_in);
    }
    let mut f = Family::new(
        o,
        "hivenet_agent_links_rejected_total",
        Counter,
        "Agent links refused (preamble, handshake or registration).",
        ["shard"],
    );
    for s in snaps {
        f.series([&s.shard], s.links_rejected);
    }
    let mut by_reason: std::collections::BTreeMap<&str, u64> = Default::default();
    for s in snaps {
        for (r, n) in &s.link_refusals {
            *by_reason.entry(r).or_default() += n;
        }
    }
    let mut f = Family::new(
        o,
        "hivenet_agent_link_refusals_total",
        Counter,
        "Agent links refused, by reason (link_cap, address_cap, preamble_*, handshake, registration ...).",
        ["reason"],
    );
    for (r, n) in &by_reason {
        f.series([r], n);
    }
    let mut f = Family::new(
        o,
        "hivenet_audit_unauthorized_suppressed_total",
        Counter,
        "401 answers left out of the audit log (at most 10 audited a second per shard).",
        ["shard"],
    );
    for s in snaps {
        f.series([&s.shard], s.audit_401_suppressed);
    }
}

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

fn routing_labels(a: &AgentView) -> [&dyn Display; 7] {
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

fn agent_labels(a: &AgentView) -> [&dyn Display; 5] {
    let r = &a.reg;
    [&a.peer_id, &r.model, &r.engine, &r.organization, &r.machine]
}

/// Per-agent series (latency only while KNOWN).
fn render_agents(o: &mut String, snaps: &[ShardSnapshot]) {
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
        f.series(routing_labels(a), a.last_seen.saturating_mul(1000));
    }
    type Get = fn(&AgentView) -> Option<f64>;
    let per_agent: [(&'static str, Kind, &str, Get); 26] = [
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

/// Serve the metrics port.
pub async fn serve(shard: Rc<Shard>, conn: Conn) {
    let mut c = crate::runtime::state::scope::Client::new(conn);
    loop {
        let head = match monoio::time::timeout(
            std::time::Duration::from_secs(30),
            c.conn.read_request_head(),
        )
        .await
        {
            Ok(Ok(h)) => h,
            _ => return,
        };
        let keep = head.keep_alive && head.framing == http_parse::BodyFraming::None;
        let kept = if head.method == "GET" && head.path_only() == "/metrics" {
            let snaps = shard.gather().await;
            let reloads = shard
                .router
                .policy_reloads
                .lock()
                .map(|m| m.clone())
                .unwrap_or_default();
            let mut body = render(
                &snaps,
                shard
                    .router
                    .storage_errors
                    .load(std::sync::atomic::Ordering::Relaxed),
                &reloads,
                shard.router.directory.load().stats(),
                &shard.router.budget,
            );
            render_sites(
                &mut body,
                &snaps,
                &shard.router.sites.load(),
                (shard.router.cfg.site_id.as_deref(), &shard.router.holds),
                crate::runtime::wire::clock::unix_secs(),
            );
            crate::runtime::metrics::tenants::render(
                &mut body,
                &snaps,
                &shard.router.auth.load(),
                crate::logic::tenancy::quota::day_of(crate::runtime::wire::clock::unix_secs()),
                shard.router.audit.as_deref(),
                &shard.router.holds.lock().quota_refused.clone(),
            );
            if let Some(st) = &shard.router.shared_state {
                render_shared_state(&mut body, st);
            }
            crate::runtime::metrics::process::render(&mut body);
            let ct = "text/plain; version=0.0.4; charset=utf-8";
            respond::send_body(&mut c, 200, ct, body.as_bytes(), keep).await
        } else {
            let nf = b"404 page not found\n";
            respond::send_body(&mut c, 404, "text/plain", nf, keep).await
        };
        if !kept {
            return;
        }
    }
}

#[cfg(test)]
mod tests;
