//! `/admin/api-keys`: the dynamic key registry's endpoints (spec 02 §9):
//! `GET` list and one, `PUT /{id}` (create, replace, rotate), `DELETE
//! /{id}?version=`, `POST /replace`. Every accepted change is published as
//! a new key snapshot at once (buckets of surviving tenants carry over).
//! The registry lives in memory: after a restart it is empty until the
//! operator's service pushes `replace` again (as in the spec); an upgrade
//! (`--upgrade`) carries it to the new process.

use crate::logic::system::config_error::ConfigError;
use serde::Deserialize;
use serde_json::json;

use crate::logic::routing::admission::cross_check;
use crate::logic::routing::policy::Policy;
use crate::logic::routing::policy_set::PolicySet;
use crate::logic::tenancy::auth::ApiMode;
use crate::logic::tenancy::registry::{KeyDto, RegistryError};
use crate::runtime::admin::policy::{reply, AdminReply};
use crate::runtime::state::router::Router;

/// Largest `POST /admin/api-keys/replace` body.
pub const REPLACE_BODY: u64 = 16 * 1024 * 1024;

/// Percent-decode a path segment or query value (`+` stays `+`).
fn decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        if c == b'%' {
            let h = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(h, 16).ok()?);
            i += 3;
        } else {
            out.push(c);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn query_param(target: &str, name: &str) -> Option<String> {
    let q = target.split_once('?')?.1;
    q.split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .and_then(|(_, v)| decode(v))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplaceBody {
    #[serde(default)]
    version: String,
    #[serde(default)]
    keys: Vec<KeyDto>,
}

fn stale_or_invalid(e: RegistryError) -> AdminReply {
    match e {
        RegistryError::Stale { current } => reply(
            409,
            json!({"error": "stale version", "current_version": current}),
        ),
        RegistryError::Invalid(m) => reply(400, json!({ "error": m })),
    }
}

/// The serverless cross-config check of one key on PUT (spec 02 §9):
/// every serverless policy the key can reach (the global one always; a
/// named one when the key has no allowlist or shares a model with it)
/// with `max_input_tokens` needs the key's non-zero ITPM at or above it.
fn serverless_reach_check(dto: &KeyDto, set: &PolicySet) -> Result<(), ConfigError> {
    let itpm = dto
        .quota
        .as_ref()
        .map_or(0, |q| u64::try_from(q.input_tokens_per_minute).unwrap_or(0));
    let reaches = |p: &Policy| {
        dto.allowed_models.is_empty() || p.models.iter().any(|m| dto.allowed_models.contains(m))
    };
    let docs = std::iter::once(("global", &set.global.admission)).chain(
        set.named
            .iter()
            .filter(|(_, p)| reaches(p))
            .map(|(n, p)| (n.as_str(), &p.admission)),
    );
    cross_check(std::iter::once((dto.id.as_str(), itpm)), docs)
}

/// The ID part of a `/admin/api-keys` path; `None` for another path.
fn keys_path(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/admin/api-keys")?;
    (rest.is_empty() || rest.starts_with('/')).then(|| rest.trim_start_matches('/'))
}

/// One call of the key API: its method, key id, path and the whole target
/// (for its query).
#[derive(Clone, Copy)]
struct Call<'a> {
    method: &'a str,
    id: &'a str,
    path: &'a str,
    target: &'a str,
}

/// Apply one call to `reg` (the force flag set and cleared around it).
fn apply(
    router: &Router,
    reg: &mut crate::logic::tenancy::registry::Registry,
    call: Call<'_>,
    body: &[u8],
) -> AdminReply {
    let Call {
        method,
        id,
        path,
        target,
    } = call;
    // The way out of a version pushed too far ahead (issue 29 #15).
    let before = reg.version().to_string();
    reg.force = method != "GET" && query_param(target, "force").as_deref() == Some("true");
    let out = keys_call(router, reg, method, id, path, target, body);
    if reg.force && out.0 == 200 {
        tracing::warn!(from = %before, to = %reg.version(), "key registry: forced version push");
    }
    reg.force = false;
    out
}

/// Serve a `/admin/api-keys` call; `None` when the path is another one.
pub async fn keys_api(
    router: &Router,
    method: &str,
    path: &str,
    target: &str,
    body: &[u8],
) -> Option<AdminReply> {
    let id = keys_path(path)?;
    if router.auth.load().mode != ApiMode::Dynamic {
        return Some(reply(
            501,
            json!({"error": "dynamic key registry not active"}),
        ));
    }
    let call = Call {
        method,
        id,
        path,
        target,
    };
    if let (Some(shared), true) = (&router.shared_state, method != "GET") {
        return Some(shared_call(router, shared, call, body).await);
    }
    let mut reg = match router.registry.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    };
    let out = apply(router, &mut reg, call, body);
    if out.0 == 200 && method != "GET" {
        router.publish_registry(&reg);
    }
    Some(out)
}

/// Times a change is applied again after another router changed the
/// registry first.
const SHARED_TRIES: usize = 3;

/// A change with `--shared-state`: applied to a copy, pushed to Redis as a
/// compare-and-set on the copy's epoch, installed here only once it
/// landed (every router sees the same order of changes, and the version
/// rule holds across them); applied again on a conflict.
async fn shared_call(
    router: &Router,
    shared: &crate::runtime::services::shared_state::SharedState,
    call: Call<'_>,
    body: &[u8],
) -> AdminReply {
    use crate::runtime::services::shared_state::PushError;
    for _ in 0..SHARED_TRIES {
        let mut next = match router.registry.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        };
        let out = apply(router, &mut next, call, body);
        if out.0 != 200 {
            return out;
        }
        let data = serde_json::to_string(&next.snapshot()).unwrap_or_default();
        // Every router must be able to load what is written (issue 51 #11).
        let cap = crate::runtime::services::shared_state::MAX_REGISTRY_BYTES;
        if data.len() as u64 > cap {
            return reply(
                413,
                json!({"error": format!("the key registry would take {} bytes in the shared state, more than the {cap} every router loads; remove keys first", data.len())}),
            );
        }
        match shared.push_keys(next.epoch, data).await {
            Ok(epoch) => {
                next.epoch = epoch;
                let mut reg = match router.registry.lock() {
                    Ok(g) => g,
                    Err(p) => p.into_inner(),
                };
                // The poller may have loaded this very push already.
                if reg.epoch != epoch {
                    *reg = next;
                }
                router.publish_registry(&reg);
                return out;
            }
            // The thread loaded the newer registry: apply the call again.
            Err(PushError::Conflict) => continue,
            Err(PushError::Down(m)) => {
                return reply(
                    503,
                    json!({"error": format!("shared state unavailable ({m}): key changes are refused until it returns; the keys in force are unchanged")}),
                )
            }
        }
    }
    reply(
        409,
        json!({"error": "the key registry changed on other routers during this call, three times; retry"}),
    )
}

/// One call of the key API on the locked registry.
fn keys_call(
    router: &Router,
    reg: &mut crate::logic::tenancy::registry::Registry,
    method: &str,
    id: &str,
    path: &str,
    target: &str,
    body: &[u8],
) -> AdminReply {
    let out = match (method, id) {
        // The spec's shapes (02 §9); `version` beside them is additive.
        ("GET", "") => {
            let keys = reg.list();
            reply(
                200,
                json!({"keys": keys, "count": keys.len(), "version": reg.version()}),
            )
        }
        ("GET", "version") => reply(
            200,
            json!({"version": reg.version(), "count": reg.list().len()}),
        ),
        ("POST", "replace") => {
            let parsed: Result<ReplaceBody, _> = serde_json::from_slice(body);
            match parsed {
                Err(e) => reply(400, json!({"error": format!("invalid JSON: {e}")})),
                Ok(b) => match reg.replace(&b.version, b.keys) {
                    Ok(n) => reply(
                        200,
                        json!({"ok": true, "count": n, "version": reg.version()}),
                    ),
                    Err(e) => stale_or_invalid(match e {
                        // replace answers a stale version with 400 (spec).
                        RegistryError::Stale { current } => {
                            RegistryError::Invalid(format!("stale version (current {current:?})"))
                        }
                        other => other,
                    }),
                },
            }
        }
        (_, "") | (_, "replace") => reply(
            405,
            json!({"error": format!("method {method} not allowed on {path}")}),
        ),
        (m, raw_id) => {
            let Some(id) = decode(raw_id).filter(|i| !i.is_empty()) else {
                return reply(400, json!({"error": "id is required"}));
            };
            match m {
                "GET" => match reg.get(&id) {
                    Some(v) => reply(200, json!({ "key": v })),
                    None => reply(404, json!({"error": format!("key not found: {id}")})),
                },
                "PUT" => match serde_json::from_slice::<KeyDto>(body) {
                    Err(e) => reply(400, json!({"error": format!("invalid JSON: {e}")})),
                    Ok(mut dto) => {
                        // The URL's ID wins over the body's.
                        dto.id.clone_from(&id);
                        let set = router.policies.load();
                        if let Err(e) = serverless_reach_check(&dto, &set) {
                            return reply(400, json!({ "error": e }));
                        }
                        match reg.put(&id, dto) {
                            Ok(()) => {
                                reply(200, json!({"ok": true, "id": id, "version": reg.version()}))
                            }
                            Err(e) => stale_or_invalid(e),
                        }
                    }
                },
                "DELETE" => {
                    let Some(version) = query_param(target, "version").filter(|v| !v.is_empty())
                    else {
                        return reply(400, json!({"error": "version is required"}));
                    };
                    match reg.delete(&id, &version) {
                        Ok(existed) => reply(
                            200,
                            json!({"ok": true, "deleted": existed, "id": id, "version": reg.version()}),
                        ),
                        Err(e) => stale_or_invalid(e),
                    }
                }
                _ => reply(
                    405,
                    json!({"error": format!("method {method} not allowed on {path}")}),
                ),
            }
        }
    };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoding() {
        assert_eq!(decode("a%2Fb").as_deref(), Some("a/b"));
        assert_eq!(decode("%zz"), None);
        assert_eq!(decode("%2"), None);
        assert_eq!(
            query_param("/x?a=1&version=rev%5F2", "version").as_deref(),
            Some("rev_2")
        );
        assert_eq!(query_param("/x", "version"), None);
    }
}
