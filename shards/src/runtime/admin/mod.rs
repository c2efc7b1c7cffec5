//! `/admin/*`: bearer-key authentication (SHA-256 of the presented key
//! compared in constant time against every configured key, checked before
//! any body is read), the routing table and health gathered from every
//! shard, the lifetime-metrics reset (memory on every shard, then the
//! store), the registration feed, and the policy API
//! ([`crate::runtime::admin::policy`]).
//!
//! Entry point: [`serve`].

pub mod keys;
pub mod policy;
pub mod sites;
pub mod storage;

use std::rc::Rc;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::http::framing::http_parse::RequestHead;
use crate::runtime::request::models_api;
use crate::runtime::request::respond;
use crate::runtime::services::store_api::StoreMsg;
use crate::runtime::state::mesh::ShardMsg;
use crate::runtime::state::router::Router;
use crate::runtime::state::scope::Client;
use crate::runtime::state::shard::Shard;
use crate::runtime::state::views::AgentView;

/// Admin bodies (policy documents) are small.
const ADMIN_BODY: u64 = 1024 * 1024;

/// Per-subscriber buffer of the registration feed.
pub const FEED_BUFFER: usize = 16;

/// Whether the request may use admin routes.
pub fn authorized(router: &Router, head: &RequestHead) -> bool {
    if router.insecure_admin {
        return true;
    }
    let Some(token) = crate::logic::tenancy::auth::bearer_token(head.header("authorization"), None)
    else {
        return false;
    };
    let h: [u8; 32] = Sha256::digest(token).into();
    // Compare against every key without early exit.
    let mut ok = 0u8;
    for k in &router.admin_keys {
        let diff = k
            .iter()
            .zip(h.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        ok |= u8::from(diff == 0);
    }
    ok == 1
}

/// Serve one admin request; returns whether the connection stays open.
pub async fn serve(shard: &Rc<Shard>, c: &mut Client, head: &RequestHead, path: &str) -> bool {
    let keep = head.keep_alive;
    if !authorized(&shard.router, head) {
        // Refused before reading the body: an unauthenticated client
        // cannot make the router buffer anything.
        let err = ApiError::new(ErrorCode::Unauthorized, "unauthorized");
        let www: &[(&'static str, &[u8])] =
            &[("WWW-Authenticate", br#"Bearer realm="hivenet-router""#)];
        let keep =
            keep && head.framing == crate::logic::http::framing::http_parse::BodyFraming::None;
        return respond::send_error_with(c, &err, keep, www).await;
    }
    let mut permit = shard.router.budget.body();
    let body = match c
        .conn
        .read_request_body(
            head.framing,
            if path == "/admin/api-keys/replace" {
                crate::runtime::admin::keys::REPLACE_BODY
            } else if path == "/admin/sibling-map" {
                crate::runtime::admin::sites::MAP_BODY
            } else {
                ADMIN_BODY
            },
            shard.router.cfg.body_timeout,
            &mut permit,
        )
        .await
    {
        Ok(b) => b,
        Err(_) => {
            respond::send_json(
                c,
                400,
                br#"{"error":"failed to read request body (too large or too slow)"}"#,
                false,
            )
            .await;
            return false;
        }
    };
    if let Some((status, body)) =
        crate::runtime::admin::keys::keys_api(&shard.router, &head.method, path, &head.path, &body)
            .await
    {
        return respond::send_json(c, status, &body, keep).await;
    }
    if let Some((status, body)) = crate::runtime::admin::sites::sites_api(
        &shard.router,
        &head.method,
        path,
        &head.path,
        &body,
    ) {
        return respond::send_json(c, status, &body, keep).await;
    }
    if let Some((status, body)) = policy::policy_api(&shard.router, &head.method, path, &body) {
        return respond::send_json(c, status, &body, keep).await;
    }
    match (&*head.method, path) {
        ("GET", "/admin/storage") => {
            let (status, body) = storage::storage(shard).await;
            respond::send_json(c, status, &body, keep).await
        }
        ("GET", "/admin/routing-table") => {
            let body = routing_table(shard).await;
            respond::send_json(c, 200, &body, keep).await
        }
        ("POST", "/admin/metrics/reset") => match reset_metrics(shard).await {
            Ok(body) => respond::send_json(c, 200, &body, keep).await,
            Err(e) => {
                let body =
                    serde_json::to_vec(&json!({"error": format!("failed to reset metrics: {e}")}))
                        .unwrap_or_default();
                respond::send_json(c, 500, &body, keep).await
            }
        },
        ("GET", "/admin/models") => {
            let snaps = shard.gather().await;
            let body =
                models_api::list(snaps.iter().flat_map(|s| s.agents.iter()), &shard.aliases());
            respond::send_json(c, 200, &body, keep).await
        }
        ("GET", p) if p.starts_with("/admin/models/") => {
            let id = p.trim_start_matches("/admin/models/");
            let snaps = shard.gather().await;
            match models_api::detail(id, snaps.iter().flat_map(|s| s.agents.iter()), true) {
                Some(body) => respond::send_json(c, 200, &body, keep).await,
                None => respond::send_error(c, &models_api::not_found(id), keep).await,
            }
        }
        ("GET", "/admin/registration-stream") => {
            registration_stream(shard, c).await;
            false
        }
        ("GET", "/admin/health") => {
            let body = health(shard).await;
            respond::send_json(c, 200, &body, keep).await
        }
        (method @ ("POST" | "DELETE"), p)
            if p.starts_with("/admin/agents/") && p.ends_with("/drain") =>
        {
            let peer = p
                .trim_start_matches("/admin/agents/")
                .trim_end_matches("/drain");
            let (status, body) = drain_agent(shard, peer, method == "POST").await;
            respond::send_json(c, status, &body, keep).await
        }
        (
            _,
            "/admin/routing-table"
            | "/admin/metrics/reset"
            | "/admin/models"
            | "/admin/health"
            | "/admin/storage",
        ) => respond::send_error(c, &respond::method_not_allowed(&head.method, path), keep).await,
        _ => respond::send_error(c, &respond::no_route(&head.method, path), keep).await,
    }
}

/// `GET /admin/health`.
async fn health(shard: &Rc<Shard>) -> Vec<u8> {
    let snaps = shard.gather().await;
    let agents: Vec<&AgentView> = snaps.iter().flat_map(|s| s.agents.iter()).collect();
    let healthy = agents.iter().filter(|a| a.healthy).count();
    let list: Vec<_> = agents
        .iter()
        .map(|a| {
            json!({"peer_id": a.peer_id, "model": a.reg.model, "engine": a.reg.engine, "version": a.reg.version,
                   "capacity": a.reg.capacity, "region": a.reg.region, "is_healthy": a.healthy, "last_seen": a.last_seen_ms / 1000})
        })
        .collect();
    let queued: usize = snaps
        .iter()
        .flat_map(|s| s.models.iter())
        .map(|(_, st)| st.queue_depth)
        .sum();
    let body = json!({
        "status": if healthy > 0 { "healthy" } else { "degraded" },
        "total_agents": agents.len(),
        "healthy_agents": healthy,
        "queue_length": queued,
        "timestamp": crate::runtime::wire::clock::unix_secs(),
        "agents": list,
    });
    serde_json::to_vec(&body).unwrap_or_default()
}

/// `GET /admin/registration-stream`: SSE `data:` lines for every agent
/// registration and removal, a `: keep-alive` comment every 25 s; the
/// stream ends when the client goes away.
async fn registration_stream(shard: &Rc<Shard>, c: &mut Client) {
    use futures::StreamExt;
    let (tx, mut rx) = futures::channel::mpsc::channel::<String>(FEED_BUFFER);
    if let Ok(mut subs) = shard.router.feed.lock() {
        subs.push(tx);
    }
    let mut out = Vec::with_capacity(512);
    respond::event_stream_head(&mut out, &c.scope);
    if c.write_all(out).await.is_err() {
        return;
    }
    loop {
        // The socket is watched while waiting: a subscriber that leaves
        // gives its descriptor back at once, not at the next keepalive
        // (issue 51 #12).
        let next = monoio::time::timeout(std::time::Duration::from_secs(25), rx.next());
        let Some(next) = c.unless_gone(next).await else {
            return;
        };
        let frame = match next {
            Ok(Some(line)) => format!("data: {line}\n\n"),
            Ok(None) => return,
            Err(_) => ": keep-alive\n\n".to_string(),
        };
        let mut chunk = Vec::with_capacity(frame.len() + 16);
        crate::logic::http::framing::http_write::write_chunk(&mut chunk, frame.as_bytes());
        if c.write_all(chunk).await.is_err() {
            return;
        }
    }
}

fn agent_json(a: &AgentView) -> Value {
    let r = &a.reg;
    let mut meta = json!({"model": r.model, "engine": r.engine, "capacity": r.capacity, "capability": r.capability.as_str()});
    for (k, v) in [
        ("region", &r.region),
        ("organization", &r.organization),
        ("machine", &r.machine),
        ("version", &r.version),
        ("deployment_id", &r.deployment_id),
        ("replica_id", &r.replica_id),
        ("gpu_model", &r.gpu_model),
        ("llm_pretty_name", &r.llm_pretty_name),
        ("llm_info", &r.llm_info),
    ] {
        if !v.is_empty() {
            meta[k] = json!(v);
        }
    }
    if !r.tags.is_empty() {
        meta["tags"] = json!(r.tags);
    }
    if r.hide_llm {
        meta["hide_llm"] = json!(true);
    }
    let total = a.success + a.failed;
    let known = a.srtt.is_some();
    let mut v = json!({
        "peer_id": a.peer_id,
        "metadata": meta,
        "status": {
            // Routable by heartbeat and by the agent's backend (spec 02).
            "healthy": a.live && a.backend_healthy,
            "backend_healthy": a.backend_healthy,
            "draining": a.draining,
            "active_requests": a.active,
            // An agent serving several routers: the others' share of it.
            "other_routers_active": a.others_active,
            "capacity_utilization": if r.capacity > 0 { f64::from(a.active) / f64::from(r.capacity) } else { 0.0 },
            // RFC 3339 with nanoseconds (spec 02), in UTC.
            "last_seen": crate::logic::system::timefmt::rfc3339_nanos(
                a.last_seen_ms / 1000,
                u32::try_from(a.last_seen_ms % 1000).unwrap_or(0) * 1_000_000,
            ),
        },
        "universal": {
            "latency_state": if known { "KNOWN" } else { "UNKNOWN" },
            "srtt_ms": a.srtt,
            "rttvar_ms": a.rttvar,
            "successful_requests_total": a.success,
            "failed_requests_total": a.failed,
            "success_rate": if total > 0 { a.success as f64 / total as f64 } else { 0.0 },
            "input_tokens_total": a.input_tokens,
            "output_tokens_total": a.output_tokens,
            "cached_prompt_tokens_total": a.cached_prompt_tokens,
            "rejected_requests_total": a.rejected,
            "disconnections_total": a.disconnections,
            "agent_failures_total": a.agent_failures,
            "backend_failures_total": a.backend_failures,
        }
    });
    if a.signals != Default::default() {
        v["engine"] = json!(a.signals);
    }
    if a.hardware != Default::default() {
        let mut hw = json!({});
        if let Some(c) = a.hardware.cpu_usage_percent {
            hw["cpu"] = json!({"usage_percent": c * 100.0});
        }
        if let Some(m) = a.hardware.memory_used_percent {
            hw["memory"] = json!({"used_percent": m * 100.0});
        }
        if let Some(u) = a.hardware.gpu_util_percent {
            hw["gpu"] = json!({
                "utilization_percent": u * 100.0,
                "vram_used_percent": a.hardware.gpu_vram_used_percent.map(|v| v * 100.0),
                "temperature_c": a.hardware.gpu_temperature_c,
            });
        }
        v["hardware"] = hw;
    }
    v
}

/// `GET /admin/routing-table`.
pub async fn routing_table(shard: &Rc<Shard>) -> Vec<u8> {
    let snaps = shard.gather().await;
    let agents: Vec<Value> = snaps
        .iter()
        .flat_map(|s| s.agents.iter())
        .map(agent_json)
        .collect();
    serde_json::to_vec(&json!({"total": agents.len(), "agents": agents})).unwrap_or_default()
}

/// `POST /admin/agents/{peer_id}/drain` (`on`) and `DELETE` (undrain):
/// the agent's shard marks it; 404 when no shard has it.
async fn drain_agent(shard: &Rc<Shard>, peer: &str, on: bool) -> (u16, Vec<u8>) {
    if peer.is_empty() || peer.len() > 128 || peer.contains('/') {
        let body = json!({"error": "the path must be /admin/agents/{peer_id}/drain"});
        return (400, serde_json::to_vec(&body).unwrap_or_default());
    }
    let mut found = shard.drain_agent(peer, on);
    if found.is_none() {
        let owned = peer.to_string();
        let others = shard
            .ask_others(
                |reply| ShardMsg::DrainAgent {
                    peer_id: owned.clone(),
                    on,
                    reply,
                },
                std::time::Duration::from_secs(5),
            )
            .await;
        found = others.into_iter().flatten().next();
    }
    match found {
        Some(in_flight) => {
            let mut body = json!({"peer_id": peer, "draining": on, "in_flight": in_flight});
            if on {
                body["cut_after_ms"] = json!(shard.router.cfg.drain_timeout.as_millis() as u64);
            }
            (200, serde_json::to_vec(&body).unwrap_or_default())
        }
        None => {
            let body = json!({"error": format!("no agent with peer ID {peer}")});
            (404, serde_json::to_vec(&body).unwrap_or_default())
        }
    }
}

/// `POST /admin/metrics/reset`: every shard clears memory, then the store
/// deletes every record (after any flush already queued: one FIFO channel).
pub async fn reset_metrics(shard: &Rc<Shard>) -> Result<Vec<u8>, String> {
    shard.reset_metrics();
    shard
        .ask_others(
            |reply| ShardMsg::ResetMetrics { reply },
            std::time::Duration::from_secs(5),
        )
        .await;
    if let Some(store) = &shard.router.store {
        let (t, r) = futures::channel::oneshot::channel();
        store
            .send(StoreMsg::ResetAll { reply: t })
            .map_err(|_| "store thread is gone".to_string())?;
        match monoio::time::timeout(std::time::Duration::from_secs(10), r).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => return Err(e),
            _ => return Err("store did not answer".into()),
        }
    }
    Ok(br#"{"status":"metrics reset","message":"per-agent lifetime counters cleared (disk, in-memory, and Prometheus series)"}"#.to_vec())
}
