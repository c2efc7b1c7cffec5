//! `/metrics` on the metrics port: gathers every shard's snapshot by
//! message and renders the Prometheus text format.

pub mod exposition;
pub mod process;
pub mod tenants;

use std::fmt::Write as _;
use std::rc::Rc;

use crate::logic::http::http_parse;
use crate::logic::routing::directory::DirectoryStats;
use crate::runtime::metrics::exposition::{esc, write_histogram};
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
    reloads: &std::collections::BTreeMap<(String, String), u64>,
    directory: DirectoryStats,
    budget: &Budget,
) -> String {
    let mut o = String::with_capacity(4096);
    render_router(&mut o, reloads, directory, storage_errors);
    let _ = writeln!(o, "# HELP hivenet_client_connections Client connections open now (bounded by --max-client-connections).");
    let _ = writeln!(o, "# TYPE hivenet_client_connections gauge");
    let _ = writeln!(o, "hivenet_client_connections {}", budget.connections());
    let _ = writeln!(o, "# HELP hivenet_buffered_body_bytes Request-body bytes buffered now (bounded by --max-buffered-body-bytes).");
    let _ = writeln!(o, "# TYPE hivenet_buffered_body_bytes gauge");
    let _ = writeln!(o, "hivenet_buffered_body_bytes {}", budget.body_bytes());
    render_models(&mut o, snaps);
    render_shards(&mut o, snaps);
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
    let mut redirects: std::collections::BTreeMap<&(String, String), u64> = Default::default();
    for s in snaps {
        for (k, n) in &s.redirects {
            *redirects.entry(k).or_default() += n;
        }
    }
    let _ = writeln!(
        o,
        "# HELP hivenet_redirects_total Requests redirected (307) to another site."
    );
    let _ = writeln!(o, "# TYPE hivenet_redirects_total counter");
    for ((m, site), n) in redirects {
        let _ = writeln!(
            o,
            "hivenet_redirects_total{{model=\"{}\",target_site=\"{}\"}} {n}",
            esc(m),
            esc(site)
        );
    }
    if let Some(local) = holds.0 {
        render_holds(o, sites, local, &holds.1.lock());
    }
    let Some(map) = &sites.map else {
        return;
    };
    let _ = writeln!(
        o,
        "# HELP hivenet_sibling_map_info The sibling map in use (its version)."
    );
    let _ = writeln!(o, "# TYPE hivenet_sibling_map_info gauge");
    let _ = writeln!(
        o,
        "hivenet_sibling_map_info{{version=\"{}\"}} 1",
        esc(&map.dto.version)
    );
    if let Some(age) = map.hints_age(now) {
        let _ = writeln!(
            o,
            "# HELP hivenet_sibling_map_age_seconds Age of the map's warm/cold hints."
        );
        let _ = writeln!(o, "# TYPE hivenet_sibling_map_age_seconds gauge");
        let _ = writeln!(o, "hivenet_sibling_map_age_seconds {age}");
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
    if let Some(map) = &sites.map {
        let _ = writeln!(o, "# HELP hivenet_pending_demand Requests waiting for a model at zero here: held now plus released without a slot yet (one per key and client ID).");
        let _ = writeln!(o, "# TYPE hivenet_pending_demand gauge");
        let mut models: Vec<String> = map
            .holdable_here(local)
            .into_iter()
            .map(|(m, _)| m)
            .collect();
        models.dedup();
        for m in &models {
            let _ = writeln!(
                o,
                "hivenet_pending_demand{{model=\"{}\"}} {}",
                esc(m),
                books.ledger.demand(m)
            );
        }
    }
    let _ = writeln!(o, "# HELP hivenet_wake_holds_total Holds ended, by outcome (woken, expired, full, cancelled, unplaced, shutdown).");
    let _ = writeln!(o, "# TYPE hivenet_wake_holds_total counter");
    for ((m, outcome), n) in &books.outcomes {
        let _ = writeln!(
            o,
            "hivenet_wake_holds_total{{model=\"{}\",outcome=\"{outcome}\"}} {n}",
            esc(m)
        );
    }
    let _ = writeln!(
        o,
        "# HELP hivenet_wake_hold_seconds How long requests were held, by outcome."
    );
    let _ = writeln!(o, "# TYPE hivenet_wake_hold_seconds histogram");
    for ((m, outcome), h) in &books.hold_seconds {
        let labels = format!("model=\"{}\",outcome=\"{outcome}\"", esc(m));
        write_histogram(
            o,
            "hivenet_wake_hold_seconds",
            &labels,
            &crate::runtime::state::hold_book::HOLD_BUCKETS,
            h,
        );
    }
    let _ = writeln!(o, "# HELP hivenet_wake_seconds Observed wake time of a model (first hold to first registration), 90th percentile of the last 32.");
    let _ = writeln!(o, "# TYPE hivenet_wake_seconds gauge");
    let mut models: Vec<&String> = books.wake_times.keys().collect();
    models.sort();
    for m in models {
        if let Some(d) = crate::runtime::state::hold_book::p90(
            books.wake_times.get(m).map(Vec::as_slice).unwrap_or(&[]),
        ) {
            let _ = writeln!(
                o,
                "hivenet_wake_seconds{{model=\"{}\"}} {}",
                esc(m),
                d.as_secs_f64()
            );
        }
    }
}

/// Router-wide series: policy reloads, directory names, store errors.
fn render_router(
    o: &mut String,
    reloads: &std::collections::BTreeMap<(String, String), u64>,
    directory: DirectoryStats,
    storage_errors: u64,
) {
    let _ = writeln!(
        o,
        "# HELP hivenet_directory_models Model names the directory holds: live (registered agents), idle (agents all left; shard kept), reserved (links not registered yet)."
    );
    let _ = writeln!(o, "# TYPE hivenet_directory_models gauge");
    for (state, n) in [
        ("live", directory.live),
        ("idle", directory.idle),
        ("reserved", directory.reserved),
    ] {
        let _ = writeln!(o, "hivenet_directory_models{{state=\"{state}\"}} {n}");
    }
    let _ = writeln!(
        o,
        "# HELP hivenet_policy_reload_total Policy reloads by trigger and result."
    );
    let _ = writeln!(o, "# TYPE hivenet_policy_reload_total counter");
    for ((t, r), n) in reloads {
        let _ = writeln!(
            o,
            "hivenet_policy_reload_total{{trigger=\"{}\",result=\"{}\"}} {n}",
            esc(t),
            esc(r)
        );
    }
    let _ = writeln!(o, "# HELP hivenet_storage_errors_total Failed history-store operations (open, flush, lookup, reset).");
    let _ = writeln!(o, "# TYPE hivenet_storage_errors_total counter");
    let _ = writeln!(o, "hivenet_storage_errors_total {storage_errors}");
}

/// Per-model routing counters and histograms, summed over shards.
fn render_models(o: &mut String, snaps: &[ShardSnapshot]) {
    // Per-model routing counters, summed over shards.
    type RouteKey = (String, String, String, std::sync::Arc<str>);
    let mut routed: std::collections::BTreeMap<RouteKey, u64> = Default::default();
    let mut failed: std::collections::BTreeMap<RouteKey, u64> = Default::default();
    let mut per_model: std::collections::BTreeMap<String, ModelStats> = Default::default();
    for s in snaps {
        for (m, st) in &s.models {
            for ((region, engine, tenant), n) in &st.routed {
                *routed
                    .entry((
                        region.to_string(),
                        engine.to_string(),
                        m.clone(),
                        tenant.clone(),
                    ))
                    .or_default() += n;
            }
            for ((region, engine, tenant), n) in &st.failed {
                *failed
                    .entry((
                        region.to_string(),
                        engine.to_string(),
                        m.clone(),
                        tenant.clone(),
                    ))
                    .or_default() += n;
            }
            let e = per_model.entry(m.clone()).or_default();
            e.primary_routed += st.primary_routed;
            e.fallback_routed += st.fallback_routed;
            e.exhausted += st.exhausted;
            e.queue_depth += st.queue_depth;
            e.wait.merge(&st.wait);
            // A model lives on one shard: its gauges are taken as they are.
            if st.admission.active {
                e.admission = st.admission;
            }
        }
    }
    for (name, help, map) in [
        (
            "hivenet_routing_requests_routed_total",
            "Successful forwards.",
            &routed,
        ),
        (
            "hivenet_routing_requests_failed_total",
            "Failed forward attempts and exhaustions (empty region/engine).",
            &failed,
        ),
    ] {
        let _ = writeln!(o, "# HELP {name} {help}");
        let _ = writeln!(o, "# TYPE {name} counter");
        for ((region, engine, model, tenant), n) in map {
            let _ = writeln!(
                o,
                "{name}{{region=\"{}\",engine=\"{}\",model=\"{}\",tenant_id=\"{}\"}} {n}",
                esc(region),
                esc(engine),
                esc(model),
                esc(tenant)
            );
        }
    }
    type PGet = fn(&ModelStats) -> f64;
    let pm: [(&str, &str, &str, PGet); 4] = [
        (
            "hivenet_policy_primary_routed_total",
            "counter",
            "Requests served by the primary step.",
            |s| s.primary_routed as f64,
        ),
        (
            "hivenet_policy_fallback_routed_total",
            "counter",
            "Requests served by a fallback step.",
            |s| s.fallback_routed as f64,
        ),
        (
            "hivenet_policy_exhausted_total",
            "counter",
            "Requests for which every policy step was exhausted.",
            |s| s.exhausted as f64,
        ),
        (
            "hivenet_queue_depth",
            "gauge",
            "Requests waiting in the model's capacity queue.",
            |s| s.queue_depth as f64,
        ),
    ];
    for (name, kind, help, get) in pm {
        let _ = writeln!(o, "# HELP {name} {help}");
        let _ = writeln!(o, "# TYPE {name} {kind}");
        for (m, st) in &per_model {
            let _ = writeln!(o, "{name}{{model=\"{}\"}} {}", esc(m), get(st));
        }
    }
    type AGet = fn(&crate::runtime::state::model::admission::Gauges) -> u64;
    let adm: [(&str, &str, AGet); 5] = [
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
        let _ = writeln!(o, "# HELP {name} {help}");
        let _ = writeln!(o, "# TYPE {name} gauge");
        for (m, st) in &per_model {
            if st.admission.active {
                let _ = writeln!(o, "{name}{{model=\"{}\"}} {}", esc(m), get(&st.admission));
            }
        }
    }
    let _ = writeln!(o, "# HELP hivenet_request_duration_seconds Client-visible duration of completed responses (first request byte to last response byte, streams included).");
    let _ = writeln!(o, "# TYPE hivenet_request_duration_seconds histogram");
    for s in snaps {
        for (m, st) in &s.models {
            for ((_, status, tenant), series) in &st.durations {
                let labels = format!(
                    "tenant_id=\"{}\",peer_id=\"{}\",model=\"{}\",status_code=\"{status}\"",
                    esc(tenant),
                    esc(&series.peer_id),
                    esc(m)
                );
                write_histogram(
                    o,
                    "hivenet_request_duration_seconds",
                    &labels,
                    &DURATION_BUCKETS,
                    &series.hist,
                );
            }
        }
    }
    let _ = writeln!(
        o,
        "# HELP hivenet_queue_wait_seconds Waits in the capacity queue that ended with a slot."
    );
    let _ = writeln!(o, "# TYPE hivenet_queue_wait_seconds histogram");
    for (m, st) in &per_model {
        let mut cum = 0u64;
        for (i, b) in QUEUE_BUCKETS.iter().enumerate() {
            cum += st.wait.buckets.get(i).copied().unwrap_or(0);
            let _ = writeln!(
                o,
                "hivenet_queue_wait_seconds_bucket{{model=\"{}\",le=\"{b}\"}} {cum}",
                esc(m)
            );
        }
        let _ = writeln!(
            o,
            "hivenet_queue_wait_seconds_bucket{{model=\"{}\",le=\"+Inf\"}} {}",
            esc(m),
            st.wait.count
        );
        let _ = writeln!(
            o,
            "hivenet_queue_wait_seconds_sum{{model=\"{}\"}} {}",
            esc(m),
            st.wait.sum
        );
        let _ = writeln!(
            o,
            "hivenet_queue_wait_seconds_count{{model=\"{}\"}} {}",
            esc(m),
            st.wait.count
        );
    }
}

/// Per-shard counters.
fn render_shards(o: &mut String, snaps: &[ShardSnapshot]) {
    let _ = writeln!(
        o,
        "# HELP hivenet_shard_requests_total Inference requests served by each shard."
    );
    let _ = writeln!(o, "# TYPE hivenet_shard_requests_total counter");
    for s in snaps {
        let _ = writeln!(
            o,
            "hivenet_shard_requests_total{{shard=\"{}\"}} {}",
            s.shard, s.requests
        );
    }
    let _ = writeln!(
        o,
        "# HELP hivenet_shard_handoffs_total Client connections handed between shards."
    );
    let _ = writeln!(o, "# TYPE hivenet_shard_handoffs_total counter");
    for s in snaps {
        let _ = writeln!(
            o,
            "hivenet_shard_handoffs_total{{shard=\"{}\",direction=\"out\"}} {}",
            s.shard, s.handoffs_out
        );
        let _ = writeln!(
            o,
            "hivenet_shard_handoffs_total{{shard=\"{}\",direction=\"in\"}} {}",
            s.shard, s.handoffs_in
        );
    }
    let _ = writeln!(o, "# HELP hivenet_agent_links_rejected_total Agent links refused (preamble, handshake or registration).");
    let _ = writeln!(o, "# TYPE hivenet_agent_links_rejected_total counter");
    for s in snaps {
        let _ = writeln!(
            o,
            "hivenet_agent_links_rejected_total{{shard=\"{}\"}} {}",
            s.shard, s.links_rejected
        );
    }
}

/// Per-agent series (latency only while KNOWN).
fn render_agents(o: &mut String, snaps: &[ShardSnapshot]) {
    let agents: Vec<_> = snaps.iter().flat_map(|s| s.agents.iter()).collect();
    let label_a = |a: &AgentView| {
        format!(
            "peer_id=\"{}\",region=\"{}\",engine=\"{}\",model=\"{}\",capacity=\"{}\",organization=\"{}\",machine=\"{}\"",
            esc(&a.peer_id), esc(&a.reg.region), esc(&a.reg.engine), esc(&a.reg.model), a.reg.capacity, esc(&a.reg.organization), esc(&a.reg.machine)
        )
    };
    let label_u = |a: &AgentView| {
        format!(
            "peer_id=\"{}\",model=\"{}\",engine=\"{}\",organization=\"{}\",machine=\"{}\"",
            esc(&a.peer_id),
            esc(&a.reg.model),
            esc(&a.reg.engine),
            esc(&a.reg.organization),
            esc(&a.reg.machine)
        )
    };
    let _ = writeln!(
        o,
        "# HELP hivenet_routing_agent_info 1 while the agent is registered."
    );
    let _ = writeln!(o, "# TYPE hivenet_routing_agent_info gauge");
    for a in &agents {
        let _ = writeln!(o, "hivenet_routing_agent_info{{{}}} 1", label_a(a));
    }
    let _ = writeln!(
        o,
        "# HELP hivenet_routing_agent_healthy 1 when the agent is routable."
    );
    let _ = writeln!(o, "# TYPE hivenet_routing_agent_healthy gauge");
    for a in &agents {
        let _ = writeln!(
            o,
            "hivenet_routing_agent_healthy{{{}}} {}",
            label_a(a),
            u8::from(a.healthy)
        );
    }
    let _ = writeln!(
        o,
        "# HELP hivenet_agent_active_requests Requests in flight on the agent."
    );
    let _ = writeln!(o, "# TYPE hivenet_agent_active_requests gauge");
    for a in &agents {
        let _ = writeln!(
            o,
            "hivenet_agent_active_requests{{{}}} {}",
            label_u(a),
            a.active
        );
    }
    let _ = writeln!(
        o,
        "# HELP hivenet_agent_requests_success_total Successful requests per agent."
    );
    let _ = writeln!(o, "# TYPE hivenet_agent_requests_success_total counter");
    for a in &agents {
        let _ = writeln!(
            o,
            "hivenet_agent_requests_success_total{{{}}} {}",
            label_u(a),
            a.success
        );
    }
    let _ = writeln!(
        o,
        "# HELP hivenet_agent_requests_failed_total Failed requests per agent."
    );
    let _ = writeln!(o, "# TYPE hivenet_agent_requests_failed_total counter");
    for a in &agents {
        let _ = writeln!(
            o,
            "hivenet_agent_requests_failed_total{{{}}} {}",
            label_u(a),
            a.failed
        );
    }
    type Get = fn(&AgentView) -> Option<f64>;
    let per_agent: [(&str, &str, &str, Get); 10] = [
        (
            "hivenet_agent_input_tokens_total",
            "counter",
            "Input tokens per agent (from response usage).",
            |a| Some(a.input_tokens as f64),
        ),
        (
            "hivenet_agent_output_tokens_total",
            "counter",
            "Output tokens per agent (from response usage).",
            |a| Some(a.output_tokens as f64),
        ),
        (
            "hivenet_agent_disconnections_total",
            "counter",
            "Times the agent's link closed.",
            |a| Some(a.disconnections as f64),
        ),
        (
            "hivenet_agent_failure_total",
            "counter",
            "Missed-heartbeat healthy to unhealthy transitions.",
            |a| Some(a.agent_failures as f64),
        ),
        (
            "hivenet_model_backend_failure_total",
            "counter",
            "Backend-unhealthy transitions reported by the agent.",
            |a| Some(a.backend_failures as f64),
        ),
        (
            "hivenet_agent_success_rate",
            "gauge",
            "Lifetime successful / all requests.",
            |a| {
                let t = a.success + a.failed;
                (t > 0).then(|| a.success as f64 / t as f64)
            },
        ),
        // Latency: emitted only while the estimator is KNOWN (no misleading 0).
        (
            "hivenet_agent_srtt_ms",
            "gauge",
            "Smoothed request latency to response headers, ms (only once known).",
            |a| a.srtt,
        ),
        (
            "hivenet_agent_rttvar_ms",
            "gauge",
            "Latency variation, ms (only once known).",
            |a| a.rttvar,
        ),
        (
            "hivenet_router_agent_srtt_ms",
            "gauge",
            "Older name of hivenet_agent_srtt_ms.",
            |a| a.srtt,
        ),
        (
            "hivenet_router_agent_rttvar_ms",
            "gauge",
            "Older name of hivenet_agent_rttvar_ms.",
            |a| a.rttvar,
        ),
    ];
    for (name, kind, help, get) in per_agent {
        let _ = writeln!(o, "# HELP {name} {help}");
        let _ = writeln!(o, "# TYPE {name} {kind}");
        for a in &agents {
            if let Some(v) = get(a) {
                let _ = writeln!(o, "{name}{{{}}} {v}", label_u(a));
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
