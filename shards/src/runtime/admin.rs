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
    json!({
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
    })
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
