//! `/admin/sibling-map` (spec 07 §4): `PUT` replaces the whole map
//! (validated whole: a bad push keeps the previous map), `GET` shows it,
//! `DELETE ?version=` clears it. The version rule is the key registry's:
//! a push older than the current version (byte-wise) is refused with 409.
//! Every shard reads the map through a versioned snapshot: a push never
//! blocks the request path.

use std::sync::Arc;

use serde_json::json;

use crate::logic::sites::{self, MapDto};
use crate::runtime::admin::policy::{reply, AdminReply};
use crate::runtime::state::router::{Router, Sites};
use crate::runtime::wire::clock;

/// Largest map body accepted.
pub const MAP_BODY: u64 = 4 * 1024 * 1024;

fn query_value<'a>(target: &'a str, name: &str) -> Option<&'a str> {
    let (_, q) = target.split_once('?')?;
    q.split('&').find_map(|p| {
        let (k, v) = p.split_once('=').unwrap_or((p, ""));
        (k == name).then_some(v)
    })
}

/// Tell every shard the map changed (held requests re-check placement).
fn announce(router: &Router) {
    for tx in &router.mesh {
        let _ = tx.unbounded_send(crate::runtime::state::mesh::ShardMsg::MapChanged);
    }
}

/// `/admin/sibling-map`; `None` for other paths.
pub fn sites_api(
    router: &Router,
    method: &str,
    path: &str,
    target: &str,
    body: &[u8],
) -> Option<AdminReply> {
    if path != "/admin/sibling-map" {
        return None;
    }
    let Some(local) = router.cfg.site_id.as_deref() else {
        return Some(reply(
            400,
            json!({"error": "this router has no --site-id: it takes no sibling map"}),
        ));
    };
    let now = clock::unix_secs();
    // `?force=true`: the way out of a version pushed too far ahead.
    let force = query_value(target, "force") == Some("true");
    Some(match method {
        "GET" => {
            let s = router.sites.load();
            match &s.map {
                Some(m) => {
                    let mut v = serde_json::to_value(&m.dto).unwrap_or_default();
                    v["received_at"] = json!(crate::logic::system::timefmt::rfc3339_nanos(
                        s.received_at,
                        0
                    ));
                    reply(200, v)
                }
                None => reply(404, json!({"error": "no sibling map"})),
            }
        }
        "PUT" => {
            let dto: MapDto = match serde_json::from_slice(body) {
                Ok(d) => d,
                Err(e) => {
                    return Some(reply(
                        400,
                        json!({"error": format!("invalid sibling map: {e}")}),
                    ))
                }
            };
            let map = match sites::validate(dto, local) {
                Ok(m) => m,
                Err(e) => return Some(reply(400, json!({"error": e}))),
            };
            let placements = map.dto.placements.len();
            let version = map.dto.version.clone();
            let r = router.sites.update(|s| {
                if !force && !sites::version_ok(s.version.as_deref(), &version) {
                    return reply(
                        409,
                        json!({"error": "stale version", "current_version": s.version}),
                    );
                }
                *s = Sites {
                    map: Some(Arc::new(map)),
                    received_at: now,
                    version: Some(version.clone()),
                };
                reply(
                    200,
                    json!({"ok": true, "version": version, "placements": placements}),
                )
            });
            announce(router);
            r
        }
        "DELETE" => {
            let Some(v) = query_value(target, "version").filter(|v| !v.is_empty()) else {
                return Some(reply(
                    400,
                    json!({"error": "version query parameter is required"}),
                ));
            };
            let v = v.to_string();
            let r = router.sites.update(|s| {
                if !force && !sites::version_ok(s.version.as_deref(), &v) {
                    return reply(
                        409,
                        json!({"error": "stale version", "current_version": s.version}),
                    );
                }
                *s = Sites {
                    map: None,
                    received_at: now,
                    version: Some(v.clone()),
                };
                reply(200, json!({"ok": true, "version": v}))
            });
            announce(router);
            r
        }
        _ => reply(
            405,
            json!({"error": format!("method {method} not allowed on /admin/sibling-map")}),
        ),
    })
}
