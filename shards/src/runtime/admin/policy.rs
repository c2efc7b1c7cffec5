//! `/admin/policy` and `/admin/policy/models[/name]`: read, replace and
//! delete routing policies at run time (validated whole; a bad document
//! keeps the previous set), in the spec's JSON shape.

use std::sync::Arc;

use serde_json::{json, Value};

use crate::logic::routing::policy;
use crate::runtime::state::router::Router;

/// `{field: {op: value}}` of a rule list.
fn rules_json(rules: &[crate::logic::routing::policy::Rule]) -> Value {
    let mut ex = serde_json::Map::new();
    for r in rules {
        ex.insert(r.field.name().to_string(), json!({ serde_json::to_value(r.op).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default(): r.value }));
    }
    Value::Object(ex)
}

fn step_json(s: &crate::logic::routing::policy::Step) -> Value {
    let mut v = json!({"match": s.matcher, "strategy": "least-loaded"});
    // What GET shows must PUT back to the same policy: the strategy and
    // its affinity settings too.
    if let Some(a) = &s.affinity {
        v["strategy"] = json!("prefix-aware");
        v["affinity"] = json!({
            "load_band": a.load_band,
            "ttl_seconds": a.ttl_seconds,
            "block_bytes": a.block_bytes,
            "holder_wait_ms": a.holder_wait_ms,
        });
    }
    if !s.exclude_if.is_empty() {
        v["exclude_if"] = rules_json(&s.exclude_if);
    }
    if s.max_tries > 0 {
        v["max_tries"] = json!(s.max_tries);
    }
    v
}

/// A policy in the spec's JSON shape.
pub fn policy_json(p: &crate::logic::routing::policy::Policy) -> Value {
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
    if !p.aliases.is_empty() {
        v["aliases"] = json!(p.aliases);
    }
    // Spec 02 §8: `fallback_provider{engine,model}` (omitted when none).
    if let Some(fp) = &p.fallback_provider {
        v["fallback_provider"] = json!({"engine": fp.engine.name(), "model": fp.model});
    }
    if p.min_share.iter().any(|s| *s > 0.0) {
        let mut m = serde_json::Map::new();
        for (c, s) in crate::logic::routing::wait_queue::Class::ALL
            .iter()
            .zip(p.min_share)
        {
            if s > 0.0 {
                m.insert(c.as_str().to_string(), json!(s));
            }
        }
        v["min_share"] = Value::Object(m);
    }
    if p.tenant_headroom != crate::logic::routing::wait_queue::tenant_slots::DEFAULT_HEADROOM {
        v["tenant_headroom"] = json!(p.tenant_headroom);
    }
    let a = &p.admission;
    if a.any() {
        v["mode"] = json!(a.mode);
        for (name, n) in [
            ("max_input_tokens", a.max_input_tokens),
            ("images_max", a.images_max),
            ("admit_budget_tokens", a.admit_budget_tokens),
            ("max_inflight", a.max_inflight),
        ] {
            if n > 0 {
                v[name] = json!(n);
            }
        }
        if !a.shed_if.is_empty() {
            v["shed_if"] = rules_json(&a.shed_if);
        }
    }
    v
}

/// The whole policy set in the admin API's shapes (`global`: what
/// `GET /admin/policy` shows, `named`: `GET /admin/policy/models`), for
/// the process replacing this one (issue 54).
pub fn policy_set_json(set: &crate::logic::routing::policy_set::PolicySet) -> Value {
    let named: serde_json::Map<String, Value> = set
        .named
        .iter()
        .map(|(k, p)| (k.clone(), policy_json(p)))
        .collect();
    json!({"global": policy_json(&set.global), "named": named})
}

/// Put [`policy_set_json`]'s output in force, as the admin calls would
/// (validated whole: an invalid set changes nothing).
pub fn apply_policy_set_json(
    router: &Router,
    v: &Value,
) -> Result<(), crate::logic::system::config_error::ConfigError> {
    use crate::logic::system::config_error::ConfigError;
    let parse = |name: &str, v: &Value| {
        policy::parse(&format!("<upgrade:{name}>"), &v.to_string())
            .map_err(|e| ConfigError::new(e.to_string()))
    };
    let mut next = (*router.policies.load()).clone();
    next.global = Arc::new(policy::Policy {
        models: Vec::new(),
        ..parse("global", &v["global"])?
    });
    next.named.clear();
    if let Some(named) = v["named"].as_object() {
        for (name, p) in named {
            next.named.insert(name.clone(), Arc::new(parse(name, p)?));
        }
    }
    router.swap_policies(next, "upgrade")
}

/// Result of a policy admin call: status and JSON body.
pub type AdminReply = (u16, Vec<u8>);

/// A JSON reply of an admin call (shared by the admin modules).
pub fn reply(status: u16, v: Value) -> AdminReply {
    (status, serde_json::to_vec(&v).unwrap_or_default())
}

/// `/admin/policy` and `/admin/policy/models[/name]`.
pub fn policy_api(router: &Router, method: &str, path: &str, body: &[u8]) -> Option<AdminReply> {
    let set = router.policies.load();
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
                    match router.swap_policies(next, "api") {
                        Ok(()) => reply(200, json!({"status": "policy updated"})),
                        Err(e) => reply(400, json!({"error": e})),
                    }
                }
                Err(e) => {
                    router.count_reload("api", false);
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
                            router.count_reload("api", false);
                            reply(
                                400,
                                json!({"error": "policy body must include a 'models:' field with at least one model name"}),
                            )
                        }
                        Ok(p) => {
                            let models = p.models.clone();
                            let mut next = (*set).clone();
                            next.named.insert(name.clone(), Arc::new(p));
                            match router.swap_policies(next, "api") {
                                Ok(()) => reply(
                                    200,
                                    json!({"status": "policy updated", "name": name, "models": models}),
                                ),
                                Err(e) => reply(409, json!({"error": e})),
                            }
                        }
                        Err(e) => {
                            router.count_reload("api", false);
                            reply(400, json!({"error": e}))
                        }
                    })
                }
                "DELETE" => {
                    let mut next = (*set).clone();
                    next.named.remove(&name);
                    let _ = router.swap_policies(next, "api");
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
