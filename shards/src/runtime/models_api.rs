//! `/v1/models`, `/v1/models/{id}`, `/admin/models[/{id}]`: the models
//! with registered agents (healthy or not) and their health counts, in the
//! OpenAI list shape (spec 01, 02).

use serde_json::json;

use super::views::AgentView;
use crate::logic::errors::{ApiError, ErrorCode};

/// Every model with a registered agent.
pub fn list<'a>(agents: impl Iterator<Item = &'a AgentView>) -> Vec<u8> {
    let mut by_model: std::collections::BTreeMap<&str, Vec<&AgentView>> = Default::default();
    for a in agents {
        by_model.entry(a.reg.model.as_str()).or_default().push(a);
    }
    let data: Vec<_> = by_model
        .iter()
        .map(|(m, v)| model_object(m, v, false))
        .collect();
    serde_json::to_vec(&json!({"object": "list", "data": data})).unwrap_or_default()
}

/// One model's object, if it has a registered agent; `with_list` adds
/// the per-agent list (admin).
pub fn detail<'a>(
    id: &str,
    agents: impl Iterator<Item = &'a AgentView>,
    with_list: bool,
) -> Option<Vec<u8>> {
    let v: Vec<&AgentView> = agents.filter(|a| a.reg.model == id).collect();
    if v.is_empty() {
        return None;
    }
    serde_json::to_vec(&model_object(id, &v, with_list)).ok()
}

/// 404 for a model without registered agents.
pub fn not_found(id: &str) -> ApiError {
    ApiError::new(
        ErrorCode::ModelNotFound,
        format!("No agents registered for model: {id}"),
    )
}

fn model_object(model: &str, agents: &[&AgentView], with_list: bool) -> serde_json::Value {
    let mut engines: Vec<&str> = agents
        .iter()
        .map(|a| a.reg.engine.as_str())
        .filter(|s| !s.is_empty())
        .collect();
    engines.sort_unstable();
    engines.dedup();
    let mut regions: Vec<&str> = agents
        .iter()
        .map(|a| a.reg.region.as_str())
        .filter(|s| !s.is_empty())
        .collect();
    regions.sort_unstable();
    regions.dedup();
    let capability = agents
        .first()
        .map(|a| a.reg.capability.as_str())
        .unwrap_or("llm");
    let mut summary = json!({
        "total": agents.len(),
        "healthy": agents.iter().filter(|a| a.healthy).count(),
        "total_capacity": agents.iter().map(|a| u64::from(a.reg.capacity)).sum::<u64>(),
        "engines": engines,
        "regions": regions,
    });
    if with_list {
        let list: Vec<_> = agents
            .iter()
            .map(|a| json!({
                "peer_id": a.peer_id, "engine": a.reg.engine, "version": a.reg.version, "region": a.reg.region,
                "organization": a.reg.organization, "machine": a.reg.machine, "capacity": a.reg.capacity,
                "is_healthy": a.healthy, "last_seen": a.last_seen,
            }))
            .collect();
        summary["list"] = json!(list);
    }
    json!({"id": model, "object": "model", "owned_by": "hivenet", "capability": capability, "agents": summary})
}
