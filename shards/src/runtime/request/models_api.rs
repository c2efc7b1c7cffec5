//! `/v1/models`, `/v1/models/{id}`, `/admin/models[/{id}]`: the models
//! with registered agents (healthy or not) and their health counts, in the
//! OpenAI list shape (spec 01, 02).

use serde_json::json;

use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::runtime::state::views::AgentView;

/// Every model with a registered agent, and every alias whose target is
/// listed (the caller filters `agents` by what the key may see).
pub fn list<'a>(
    agents: impl Iterator<Item = &'a AgentView>,
    aliases: &std::collections::BTreeMap<String, String>,
) -> Vec<u8> {
    let mut by_model: std::collections::BTreeMap<&str, Vec<&AgentView>> = Default::default();
    for a in agents {
        by_model.entry(a.reg.model.as_str()).or_default().push(a);
    }
    let mut data: Vec<_> = by_model
        .iter()
        .map(|(m, v)| model_object(m, v, false))
        .collect();
    for (alias, target) in aliases {
        if let Some(v) = by_model.get(target.as_str()) {
            data.push(alias_object(alias, target, v, false));
        }
    }
    serde_json::to_vec(&json!({"object": "list", "data": data})).unwrap_or_default()
}

/// An alias's object: its target's, under the alias's ID.
fn alias_object(
    alias: &str,
    target: &str,
    agents: &[&AgentView],
    with_list: bool,
) -> serde_json::Value {
    let mut o = model_object(alias, agents, with_list);
    o["info"] = json!(format!("alias of {target}"));
    o["alias_of"] = json!(target);
    o
}

/// The detail of an alias whose target has registered agents.
pub fn alias_detail<'a>(
    alias: &str,
    target: &str,
    agents: impl Iterator<Item = &'a AgentView>,
) -> Option<Vec<u8>> {
    let v: Vec<&AgentView> = agents.filter(|a| a.reg.model == target).collect();
    if v.is_empty() {
        return None;
    }
    serde_json::to_vec(&alias_object(alias, target, &v, true)).ok()
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
                "is_healthy": a.healthy, "last_seen": a.last_seen_ms / 1000,
            }))
            .collect();
        summary["list"] = json!(list);
    }
    let mut out = json!({"id": model, "object": "model", "owned_by": "hivenet", "capability": capability, "agents": summary});
    // Spec 01: the first non-empty value among the model's agents;
    // `hide_llm` when any agent sets it (the model stays listed).
    let first = |f: fn(&AgentView) -> &str| agents.iter().map(|a| f(a)).find(|v| !v.is_empty());
    if let Some(v) = first(|a| &a.reg.llm_pretty_name) {
        out["pretty_name"] = json!(v);
    }
    if let Some(v) = first(|a| &a.reg.llm_info) {
        out["info"] = json!(v);
    }
    if agents.iter().any(|a| a.reg.hide_llm) {
        out["hide_llm"] = json!(true);
    }
    out
}
