//! `/metrics` on the metrics port: gathers every shard's snapshot by
//! message and renders the Prometheus text format.

mod agents;
mod models;
pub mod process;
pub mod tenants;

use self::agents::render_agents;
use self::models::{render_models, ModelTotals};

use std::collections::BTreeMap;
use std::rc::Rc;

use crate::logic::http::framing::http_parse;
use crate::logic::routing::directory::DirectoryStats;
use crate::runtime::request::respond;
use crate::runtime::state::shard::Shard;
use crate::runtime::state::views::ShardSnapshot;
use crate::runtime::wire::budget::Budget;
use crate::runtime::wire::conn::Conn;
use crate::runtime::wire::exposition::Family;
use crate::runtime::wire::exposition::Kind::{Counter, Gauge, Histogram};

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
            crate::runtime::request::responses::render_stored(&shard, &mut body).await;
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
            if let Some(t) = &shard.router.traces {
                t.render(&mut body);
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
