//! Sites end to end: two routers on loopback as two sites, agents only at
//! b, the map writer keeping the sibling map fresh. A request at a for
//! b's model gets a 307 to b (`hn_redirects=1`, `hn_from=a`) that curl
//! follows to an answer; a request that was redirected twice is not
//! redirected again; two sites that each think the other is warm do not
//! bounce a request; a key scoped away from b is not sent there; fresh
//! hints with every home sibling cold keep a holdable request here and
//! stale ones redirect; without `--site-id` nothing changes.

mod common;
use common::*;
use std::time::Duration;

const ADMIN: &str = "test-admin-key";

/// A router of `site`, in its own folder (identity and store are per
/// router); `extra` paths are relative to `dir`.
fn site_router(dir: &std::path::Path, site: &str, extra: &[&str]) -> Router {
    let own = dir.join(site);
    std::fs::create_dir_all(&own).expect("site dir");
    let extra: Vec<String> = extra
        .iter()
        .map(|a| {
            if a.ends_with(".yaml") {
                dir.join(a).to_string_lossy().to_string()
            } else {
                a.to_string()
            }
        })
        .collect();
    let mut args = vec!["--shards", "1", "--site-id", site];
    args.extend(extra.iter().map(String::as_str));
    start_router(&own, &args, &[("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN)])
}

fn push(r: &Router, body: &str) -> (u16, String) {
    let (st, b) = Req::new("PUT", "/admin/sibling-map")
        .body(body.as_bytes())
        .raw_headers(&format!("Authorization: Bearer {ADMIN}\r\n"))
        .send(r.http)
        .map(Resp::pair)
        .expect("push");
    (st, String::from_utf8_lossy(&b).to_string())
}

fn map_json(version: &str, hints: Option<&str>, a: u16, b: u16, placements: &str) -> String {
    let hints = hints
        .map(|h| format!(r#""hints_generated_at":"{h}","#))
        .unwrap_or_default();
    format!(
        r#"{{"version":"{version}",{hints}"sites":[{{"site_id":"a","base_url":"http://127.0.0.1:{a}","scopes":["eu"]}},{{"site_id":"b","base_url":"http://127.0.0.1:{b}","scopes":["us"]}}],"placements":[{placements}]}}"#
    )
}

fn now_rfc3339() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock");
    shards::logic::system::timefmt::rfc3339_nanos(t.as_secs(), 0)
}

fn chat_at(http: u16, query: &str, extra: &str) -> (u16, String, Vec<u8>) {
    Req::new("POST", &format!("/v1/chat/completions{query}"))
        .body(chat_body("m", false).as_bytes())
        .raw_headers(extra)
        .send(http)
        .map(Resp::triple)
        .expect("chat")
}

#[test]
fn without_a_site_id_nothing_changes() {
    let dir = tmpdir("sites-off");
    let r = start_router(
        &dir,
        &["--shards", "1"],
        &[("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN)],
    );
    let (st, body) = push(&r, &map_json("1", None, 1, 2, ""));
    assert_eq!(st, 400, "{body}");
    assert!(body.contains("no --site-id"), "{body}");
    let (st, _, b) = chat_at(r.http, "?hn_redirects=0", "");
    assert_eq!(st, 404, "{}", String::from_utf8_lossy(&b));
    assert!(!metrics_text(r.metrics).contains("hivenet_sibling_map_info"));
}

#[test]
fn the_map_writer_keeps_a_redirecting_to_b_and_curl_follows() {
    let dir = tmpdir("sites-writer");
    let a = site_router(&dir, "a", &[]);
    let b = site_router(&dir, "b", &[]);
    let (_s, sp) = start_sim(&dir, "m", &[]);
    let _ag = start_agent(&dir, &b, sp, "b.key", &[]);
    wait_agents(b.http, "m", 1);
    std::fs::write(
        dir.join("sites.yaml"),
        format!(
            "interval: 300ms\nsites:\n  - {{site_id: a, base_url: \"http://127.0.0.1:{}\", admin_key_env: SITE_ADMIN}}\n  - {{site_id: b, base_url: \"http://127.0.0.1:{}\", admin_key_env: SITE_ADMIN}}\nplacements:\n  - {{site_id: a, model: m, kind: chat}}\n  - {{site_id: b, model: m, kind: chat}}\n",
            a.http, b.http
        ),
    )
    .expect("sites.yaml");
    let writer = spawn(
        "hivenet-router",
        &["map-writer", "--config", "sites.yaml"],
        &dir,
        &[("SITE_ADMIN", ADMIN)],
    );
    let map_at = |r: &Router| -> serde_json::Value {
        Req::get("/admin/sibling-map")
            .bearer(ADMIN)
            .send(r.http)
            .map(Resp::pair)
            .ok()
            .filter(|x| x.0 == 200)
            .and_then(|x| serde_json::from_slice(&x.1).ok())
            .unwrap_or_default()
    };
    wait_until(
        Duration::from_secs(15),
        || {
            map_at(&a)["placements"]
                .as_array()
                .is_some_and(|p| p.iter().any(|x| x["site_id"] == "b" && x["warm"] == true))
        },
        "a's map says m is warm at b",
    );
    assert!(writer.log_text().contains("warmth changed"));
    let (st, head, body) = chat_at(a.http, "", "");
    assert_eq!(st, 307, "{}", String::from_utf8_lossy(&body));
    assert!(body.is_empty());
    assert_eq!(
        header_of(&head, "location"),
        Some(format!(
            "http://127.0.0.1:{}/v1/chat/completions?hn_redirects=1&hn_from=a",
            b.http
        ))
    );
    assert_eq!(
        header_of(&head, "x-hivenet-redirect-count").as_deref(),
        Some("1")
    );
    assert_eq!(
        header_of(&head, "x-hivenet-redirect-site").as_deref(),
        Some("b")
    );
    assert!(header_of(&head, "x-request-id").is_some());
    // curl -L re-sends the POST and its body to b (307 keeps the method).
    let out = std::process::Command::new("curl")
        .args([
            "-sS",
            "-L",
            "-w",
            "\n%{http_code} %{num_redirects}",
            "-H",
            "Content-Type: application/json",
            "-d",
            &chat_body("m", false),
            &format!("http://127.0.0.1:{}/v1/chat/completions", a.http),
        ])
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.trim_end().ends_with("200 1"), "{text}");
    assert!(text.contains("chat.completion"), "{text}");
    // Already redirected twice: never again (the model is not here: 404).
    let (st, _, _) = chat_at(a.http, "?hn_redirects=2&hn_from=c", "");
    assert_eq!(st, 404);
    // b serves the redirected URL as it arrives (the hn_* parameters are
    // stripped before forwarding; `strip_hn` is unit-tested).
    let (st, _, _) = chat_at(b.http, "?hn_redirects=1&hn_from=a", "");
    assert_eq!(st, 200);
    let m = metrics_text(a.metrics);
    assert!(
        m.contains("hivenet_redirects_total{model=\"m\",target_site=\"b\"} 2"),
        "{m}"
    );
    assert!(m.contains("hivenet_sibling_map_info{version="), "{m}");
    assert!(m.contains("hivenet_sibling_map_age_seconds"), "{m}");
}

#[test]
fn two_sites_that_each_think_the_other_is_warm_do_not_bounce() {
    let dir = tmpdir("sites-pingpong");
    let a = site_router(&dir, "a", &[]);
    let b = site_router(&dir, "b", &[]);
    let now = now_rfc3339();
    let pa = r#"{"site_id":"a","model":"m","kind":"chat","warm":true},{"site_id":"b","model":"m","kind":"chat","warm":true}"#;
    assert_eq!(
        push(&a, &map_json("1", Some(&now), a.http, b.http, pa)).0,
        200
    );
    assert_eq!(
        push(&b, &map_json("1", Some(&now), a.http, b.http, pa)).0,
        200
    );
    let (st, head, _) = chat_at(a.http, "", "");
    assert_eq!(st, 307);
    let loc = header_of(&head, "location").expect("location");
    // b, told the request comes from a, does not send it back.
    let query = loc
        .split_once('?')
        .map(|(_, q)| format!("?{q}"))
        .unwrap_or_default();
    let (st, _, body) = chat_at(b.http, &query, "");
    assert_eq!(st, 404, "{}", String::from_utf8_lossy(&body));
    // Version rule: an older push is refused, the map stays.
    let (st, body) = push(&a, &map_json("0", Some(&now), a.http, b.http, pa));
    assert_eq!(st, 409, "{body}");
    assert!(body.contains("current_version"), "{body}");
    // A bad hold budget refuses the whole push.
    for bad in ["0s", "2h", "abc"] {
        let p = format!(
            r#"{{"site_id":"a","model":"m","kind":"chat","scale_from_zero":true,"hold_budget":"{bad}"}}"#
        );
        let (st, body) = push(&a, &map_json("9", Some(&now), a.http, b.http, &p));
        assert_eq!(st, 400, "{bad}: {body}");
        assert!(body.contains("hold_budget"), "{body}");
    }
    assert_eq!(chat_at(a.http, "", "").0, 307, "the previous map stays");
    let (st, _) = Req::new("DELETE", "/admin/sibling-map?version=2")
        .body(b"")
        .raw_headers(&format!("Authorization: Bearer {ADMIN}\r\n"))
        .send(a.http)
        .map(Resp::pair)
        .expect("delete");
    assert_eq!(st, 200);
    assert_eq!(
        Req::get("/admin/sibling-map")
            .bearer(ADMIN)
            .send(a.http)
            .map(Resp::pair)
            .expect("get")
            .0,
        404
    );
    assert_eq!(chat_at(a.http, "", "").0, 404, "no map: as before");
}

#[test]
fn scopes_and_hints_decide() {
    let dir = tmpdir("sites-scope");
    let mut yaml = String::from("api:\n  mode: api-key\n  keys:\n");
    for (key, scopes) in [("sk-eu", "[eu]"), ("sk-any", "[]")] {
        yaml.push_str(&format!(
            "    - key_hash: \"{}\"\n      metadata: {{name: {key}, owner: {key}}}\n      site_scopes: {scopes}\n",
            sha256_hex(key)
        ));
    }
    std::fs::write(dir.join("auth.yaml"), yaml).expect("auth");
    // A short hold budget: the holdable model is held (then 503
    // model_waking) rather than failing at once.
    let a = site_router(
        &dir,
        "a",
        &[
            "--auth-config-file",
            "auth.yaml",
            "--wake-hold-budget",
            "1s",
            "--wake-keepalive",
            "0",
        ],
    );
    let b_port = free_port();
    let bearer = |k: &str| format!("Authorization: Bearer {k}\r\n");
    // b is in scope "us", m is warm there.
    let warm_b = r#"{"site_id":"a","model":"m","kind":"chat","scale_from_zero":true},{"site_id":"b","model":"m","kind":"chat","warm":true}"#;
    assert_eq!(
        push(
            &a,
            &map_json("1", Some(&now_rfc3339()), a.http, b_port, warm_b)
        )
        .0,
        200
    );
    assert_eq!(chat_at(a.http, "", &bearer("sk-any")).0, 307);
    assert_eq!(
        chat_at(a.http, "", &bearer("sk-eu")).0,
        503,
        "b is outside the key's scopes: not redirected (held here, then model_waking)"
    );
    // Fresh hints, the only home sibling cold, holdable here: no redirect,
    // the request is held here (the 1 s budget ends in model_waking).
    let cold_b = warm_b.replace(r#""warm":true"#, r#""warm":false"#);
    assert_eq!(
        push(
            &a,
            &map_json("2", Some(&now_rfc3339()), a.http, b_port, &cold_b)
        )
        .0,
        200
    );
    let (st, _, body) = chat_at(a.http, "", &bearer("sk-any"));
    assert_eq!(st, 503, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("model_waking"));
    // Stale hints: the cold hint is not trusted, the request is redirected.
    assert_eq!(
        push(
            &a,
            &map_json("3", Some("2020-01-01T00:00:00Z"), a.http, b_port, &cold_b)
        )
        .0,
        200
    );
    assert_eq!(chat_at(a.http, "", &bearer("sk-any")).0, 307);
    // count_tokens is never redirected.
    let (st, _, _) = Req::new("POST", "/v1/messages/count_tokens")
        .body(chat_body("m", false).as_bytes())
        .raw_headers(&bearer("sk-any"))
        .send(a.http)
        .map(Resp::triple)
        .expect("count");
    assert_eq!(st, 404);
}

/// Issue 29 #15: sibling-map versions in natural order, and `?force=true`
/// past a version pushed too far ahead.
#[test]
fn map_versions_in_natural_order_and_forced_pushes() {
    let dir = tmpdir("sites-versions");
    let a = site_router(&dir, "a", &[]);
    let p = r#"{"site_id":"a","model":"m","kind":"chat"}"#;
    let push_v = |v: &str, q: &str| {
        let (st, b) = Req::new("PUT", &format!("/admin/sibling-map{q}"))
            .body(map_json(v, None, a.http, 1, p).as_bytes())
            .raw_headers(&format!("Authorization: Bearer {ADMIN}\r\n"))
            .send(a.http)
            .map(Resp::pair)
            .expect("push");
        (st, String::from_utf8_lossy(&b).to_string())
    };
    assert_eq!(push_v("j2", "").0, 200);
    assert_eq!(push_v("j10", "").0, 200, "j10 follows j2");
    assert_eq!(push_v("j9", "").0, 409);
    let (st, body) = push_v("j9", "?force=true");
    assert_eq!(st, 200, "{body}");
    assert_eq!(push_v("j9", "").0, 200, "a replay of the forced version");
}
