//! `/admin/*`: bearer-key authentication (SHA-256 of the presented key
//! compared in constant time against every configured key), the routing
//! table gathered from every shard, and the lifetime-metrics reset
//! (memory on every shard, then the store).

use std::rc::Rc;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::shard::{AgentView, Shard};
use super::store_api::StoreMsg;
use crate::logic::errors::{ApiError, ErrorCode};
use crate::logic::http_parse::RequestHead;

/// Whether the request may use admin routes.
pub fn authorized(shard: &Shard, head: &RequestHead) -> bool {
    if shard.shared.insecure_admin {
        return true;
    }
    let Some(v) = head.header("authorization") else {
        return false;
    };
    let v = std::str::from_utf8(v).unwrap_or("").trim();
    let token = v
        .strip_prefix("Bearer ")
        .or_else(|| v.strip_prefix("bearer "))
        .unwrap_or(v)
        .trim();
    if token.is_empty() {
        return false;
    }
    let h: [u8; 32] = Sha256::digest(token.as_bytes()).into();
    // Compare against every key without early exit.
    let mut ok = 0u8;
    for k in &shard.shared.admin_keys {
        let diff = k
            .iter()
            .zip(h.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        ok |= u8::from(diff == 0);
    }
    ok == 1
}

/// The 401 error.
pub fn unauthorized() -> ApiError {
    ApiError::new(ErrorCode::Unauthorized, "unauthorized")
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
    ] {
        if !v.is_empty() {
            meta[k] = json!(v);
        }
    }
    if !r.tags.is_empty() {
        meta["tags"] = json!(r.tags);
    }
    let total = a.success + a.failed;
    let known = a.srtt.is_some();
    let mut v = json!({
        "peer_id": a.peer_id,
        "metadata": meta,
        "status": {
            "healthy": a.live,
            "backend_healthy": a.backend_healthy,
            "active_requests": a.active,
            "capacity_utilization": if r.capacity > 0 { f64::from(a.active) / f64::from(r.capacity) } else { 0.0 },
            "last_seen": a.last_seen,
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
            "rejected_requests_total": 0,
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

/// `POST /admin/metrics/reset`: every shard clears memory, then the store
/// deletes every record (after any flush already queued: one FIFO channel).
pub async fn reset_metrics(shard: &Rc<Shard>) -> Result<Vec<u8>, String> {
    shard.reset_metrics();
    let mut waits = Vec::new();
    for (i, tx) in shard.shared.mesh.iter().enumerate() {
        if i == shard.id {
            continue;
        }
        let (t, r) = futures::channel::oneshot::channel();
        if tx
            .unbounded_send(super::mesh::ShardMsg::ResetMetrics { reply: t })
            .is_ok()
        {
            waits.push(r);
        }
    }
    for r in waits {
        let _ = monoio::time::timeout(std::time::Duration::from_secs(5), r).await;
    }
    if let Some(store) = &shard.shared.store {
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

fn step_json(s: &crate::logic::policy::Step) -> Value {
    let mut ex = serde_json::Map::new();
    for r in &s.exclude_if {
        ex.insert(r.field.name().to_string(), json!({ serde_json::to_value(r.op).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default(): r.value }));
    }
    let mut v = json!({"match": s.matcher, "strategy": "least-loaded"});
    if !ex.is_empty() {
        v["exclude_if"] = Value::Object(ex);
    }
    if s.max_tries > 0 {
        v["max_tries"] = json!(s.max_tries);
    }
    v
}

/// A policy in the spec's JSON shape.
pub fn policy_json(p: &crate::logic::policy::Policy) -> Value {
    let mut v = json!({});
    if !p.models.is_empty() {
        v["models"] = json!(p.models);
    }
    if let Some(first) = p.steps.first() {
        v["routing_policy"] = step_json(first);
    }
    let chain: Vec<Value> = p
        .steps
        .iter()
        .skip(1)
        .map(|s| {
            let mut j = step_json(s);
            j["name"] = json!(s.name);
            j
        })
        .collect();
    if !chain.is_empty() {
        v["fallback_chain"] = json!(chain);
    }
    v
}

/// Result of a policy admin call: status and JSON body.
pub type AdminReply = (u16, Vec<u8>);

fn reply(status: u16, v: Value) -> AdminReply {
    (status, serde_json::to_vec(&v).unwrap_or_default())
}

/// `/admin/policy` and `/admin/policy/models[/name]`.
pub fn policy_api(shard: &Shard, method: &str, path: &str, body: &[u8]) -> Option<AdminReply> {
    use crate::logic::policy;
    use std::sync::Arc;
    let shared = &shard.shared;
    let set = shared.policy_set();
    let text = || std::str::from_utf8(body).map_err(|_| "policy body is not UTF-8".to_string());
    match (method, path) {
        ("GET", "/admin/policy") => Some(reply(200, policy_json(&set.global))),
        ("PUT", "/admin/policy") => {
            let parsed = text().and_then(|t| policy::parse("<api>", t).map_err(|e| e.to_string()));
            Some(match parsed {
                Ok(p) => {
                    let mut next = (*set).clone();
                    next.global = Arc::new(policy::Policy {
                        models: Vec::new(),
                        ..p
                    });
                    match shared.swap_policies(next, "api") {
                        Ok(()) => reply(200, json!({"status": "policy updated"})),
                        Err(e) => reply(400, json!({"error": e})),
                    }
                }
                Err(e) => {
                    shared.count_reload("api", false);
                    reply(400, json!({"error": e}))
                }
            })
        }
        ("GET", "/admin/policy/models") => {
            let m: serde_json::Map<String, Value> = set
                .named
                .iter()
                .map(|(k, p)| (k.clone(), policy_json(p)))
                .collect();
            Some(reply(200, Value::Object(m)))
        }
        (_, p) if p.starts_with("/admin/policy/models/") => {
            let name = p.trim_start_matches("/admin/policy/models/").to_string();
            if name.is_empty() {
                return Some(reply(
                    400,
                    json!({"error": "policy name is required in URL"}),
                ));
            }
            match method {
                "GET" => Some(match set.named.get(&name) {
                    Some(p) => reply(200, policy_json(p)),
                    None => reply(404, json!({"error": format!("no policy named: {name}")})),
                }),
                "PUT" => {
                    let parsed = text().and_then(|t| {
                        policy::parse(&format!("<api:{name}>"), t).map_err(|e| e.to_string())
                    });
                    Some(match parsed {
                        Ok(p) if p.models.is_empty() => {
                            shared.count_reload("api", false);
                            reply(
                                400,
                                json!({"error": "policy body must include a 'models:' field with at least one model name"}),
                            )
                        }
                        Ok(p) => {
                            let models = p.models.clone();
                            let mut next = (*set).clone();
                            next.named.insert(name.clone(), Arc::new(p));
                            match shared.swap_policies(next, "api") {
                                Ok(()) => reply(
                                    200,
                                    json!({"status": "policy updated", "name": name, "models": models}),
                                ),
                                Err(e) => reply(409, json!({"error": e})),
                            }
                        }
                        Err(e) => {
                            shared.count_reload("api", false);
                            reply(400, json!({"error": e}))
                        }
                    })
                }
                "DELETE" => {
                    let mut next = (*set).clone();
                    next.named.remove(&name);
                    let _ = shared.swap_policies(next, "api");
                    Some(reply(
                        200,
                        json!({"status": "policy deleted", "name": name}),
                    ))
                }
                _ => None,
            }
        }
        _ => None,
    }
}
