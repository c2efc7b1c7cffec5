//! The dynamic key registry end to end (spec 02 §9, 05 §7): keys created,
//! rotated, deleted and replaced through `/admin/api-keys` take effect at
//! once; stale versions get 409 (400 for replace); lists are snake_case
//! and never show the hash.

mod common;
use common::*;
use serde_json::json;

fn key(version: &str, raw: &str) -> serde_json::Value {
    json!({"version": version, "key_hash": sha256_hex(raw), "key_preview": "sk-...x", "owner": "acme", "name": "prod",
           "allowed_models": ["m"], "quota": {"requests_per_minute": 1000}})
}

#[test]
fn registry_versions_rotation_and_replace() {
    let dir = tmpdir("dyn-keys");
    let r = start_router(&dir, &[], &[("HIVENET_ROUTER_AUTH_MODE", "dynamic")]);
    let (_s, port) = start_sim(&dir, "m", &[]);
    let _a = start_agent(&dir, &r, port, "a.key", &[]);
    wait_until(
        std::time::Duration::from_secs(30),
        || {
            Req::get("/admin/models/m")
                .bearer(ADMIN_KEY)
                .send(r.http)
                .map(Resp::pair)
                .map(|x| x.0 == 200)
                .unwrap_or(false)
        },
        "agent",
    );

    // Empty until bootstrapped: every client key is refused.
    let (st, v) = admin(r.http, "GET", "/admin/api-keys", serde_json::Value::Null);
    assert_eq!(
        (st, v["keys"].clone(), v["version"].clone()),
        (200, json!([]), json!(""))
    );
    assert_eq!(
        Req::chat("m")
            .bearer("sk-1")
            .send(r.http)
            .expect("chat")
            .triple()
            .0,
        401
    );
    // Admin routes need the admin key.
    assert_eq!(
        Req::new("GET", "/admin/api-keys")
            .body(b"")
            .raw_headers("")
            .send(r.http)
            .map(Resp::triple)
            .expect("r")
            .0,
        401
    );

    let (st, v) = admin(r.http, "PUT", "/admin/api-keys/k1", key("rev_02", "sk-1"));
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["ok"], true, "the spec's write answer (02 §9): {v}");
    assert_eq!(
        Req::chat("m")
            .bearer("sk-1")
            .send(r.http)
            .expect("chat")
            .triple()
            .0,
        200
    );
    // Replay of the same version is accepted; an older one is stale.
    assert_eq!(
        admin(r.http, "PUT", "/admin/api-keys/k1", key("rev_02", "sk-1")).0,
        200
    );
    let (st, v) = admin(r.http, "PUT", "/admin/api-keys/k1", key("rev_01", "sk-1"));
    assert_eq!(
        (st, v),
        (
            409,
            json!({"error": "stale version", "current_version": "rev_02"})
        )
    );
    let mut no_version = key("", "sk-1");
    no_version["version"] = json!("");
    assert_eq!(
        admin(r.http, "PUT", "/admin/api-keys/k1", no_version).1,
        json!({"error": "version is required"})
    );
    let mut bad_hash = key("rev_02", "sk-1");
    bad_hash["key_hash"] = json!("abc");
    assert_eq!(admin(r.http, "PUT", "/admin/api-keys/k9", bad_hash).0, 400);
    // The same hash under another ID is refused.
    assert_eq!(
        admin(r.http, "PUT", "/admin/api-keys/k2", key("rev_03", "sk-1")).0,
        400
    );

    // Rotation: same ID, new hash; the old key stops at once.
    assert_eq!(
        admin(r.http, "PUT", "/admin/api-keys/k1", key("rev_03", "sk-1b")).0,
        200
    );
    assert_eq!(
        Req::chat("m")
            .bearer("sk-1")
            .send(r.http)
            .expect("chat")
            .triple()
            .0,
        401
    );
    assert_eq!(
        Req::chat("m")
            .bearer("sk-1b")
            .send(r.http)
            .expect("chat")
            .triple()
            .0,
        200
    );

    // A disabled or expired key authenticates nobody.
    let mut off = key("rev_03", "sk-off");
    off["enabled"] = json!(false);
    assert_eq!(admin(r.http, "PUT", "/admin/api-keys/off", off).0, 200);
    assert_eq!(
        Req::chat("m")
            .bearer("sk-off")
            .send(r.http)
            .expect("chat")
            .triple()
            .0,
        401
    );
    let mut old = key("rev_03", "sk-old");
    old["expires_at"] = json!("2020-01-01T00:00:00Z");
    assert_eq!(admin(r.http, "PUT", "/admin/api-keys/old", old).0, 200);
    assert_eq!(
        Req::chat("m")
            .bearer("sk-old")
            .send(r.http)
            .expect("chat")
            .triple()
            .0,
        401
    );

    // snake_case, no hash, in the spec's {"key": ...}.
    let (st, v) = admin(r.http, "GET", "/admin/api-keys/k1", serde_json::Value::Null);
    assert_eq!(st, 200);
    let v = v["key"].clone();
    assert_eq!(v["id"], "k1");
    assert_eq!(v["allowed_models"], json!(["m"]));
    assert_eq!(v["quota"]["requests_per_minute"], 1000);
    assert!(
        v.get("key_hash").is_none() && v.get("KeyHash").is_none(),
        "{v}"
    );
    assert_eq!(
        admin(
            r.http,
            "GET",
            "/admin/api-keys/nope",
            serde_json::Value::Null
        )
        .0,
        404
    );

    // Delete: version required, stale refused, then gone (idempotent).
    assert_eq!(
        admin(
            r.http,
            "DELETE",
            "/admin/api-keys/k1",
            serde_json::Value::Null
        )
        .0,
        400
    );
    assert_eq!(
        admin(
            r.http,
            "DELETE",
            "/admin/api-keys/k1?version=rev_01",
            serde_json::Value::Null
        )
        .0,
        409
    );
    assert_eq!(
        admin(
            r.http,
            "DELETE",
            "/admin/api-keys/k1?version=rev_04",
            serde_json::Value::Null
        )
        .0,
        200
    );
    assert_eq!(
        admin(
            r.http,
            "DELETE",
            "/admin/api-keys/k1?version=rev_04",
            serde_json::Value::Null
        )
        .0,
        200
    );
    assert_eq!(
        Req::chat("m")
            .bearer("sk-1b")
            .send(r.http)
            .expect("chat")
            .triple()
            .0,
        401
    );

    // Replace swaps everything at once; a stale replace is a 400.
    let mut a = key("", "sk-a");
    a["id"] = json!("a");
    let mut b = key("", "sk-b");
    b["id"] = json!("b");
    b["owner"] = json!("beta");
    let (st, v) = admin(
        r.http,
        "POST",
        "/admin/api-keys/replace",
        json!({"version": "rev_05", "keys": [a, b]}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        (v["ok"].clone(), v["count"].clone()),
        (json!(true), json!(2)),
        "{v}"
    );
    let (st, v) = admin(r.http, "GET", "/admin/api-keys", serde_json::Value::Null);
    assert_eq!((st, v["count"].clone()), (200, json!(2)), "{v}");
    let (st, v) = admin(
        r.http,
        "GET",
        "/admin/api-keys/version",
        serde_json::Value::Null,
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v, json!({"version": "rev_05", "count": 2}));
    let (st, v) = admin(
        r.http,
        "GET",
        "/admin/api-keys/ghost",
        serde_json::Value::Null,
    );
    assert_eq!(
        (st, v["error"].clone()),
        (404, json!("key not found: ghost"))
    );
    assert_eq!(
        Req::chat("m")
            .bearer("sk-a")
            .send(r.http)
            .expect("chat")
            .triple()
            .0,
        200
    );
    assert_eq!(
        Req::chat("m")
            .bearer("sk-b")
            .send(r.http)
            .expect("chat")
            .triple()
            .0,
        200
    );
    assert_eq!(
        admin(
            r.http,
            "POST",
            "/admin/api-keys/replace",
            json!({"version": "rev_01", "keys": []})
        )
        .0,
        400
    );
    let m = metrics_text(r.metrics);
    assert!(
        m.contains("hivenet_tenant_requests_success_total{tenant_id=\"beta\",key_id=\"b\""),
        "{m}"
    );
}

/// Spec 02 §9: a PUT runs the serverless cross-config check against every
/// policy the key can reach; a policy outside its allowlist does not count.
#[test]
fn put_runs_the_serverless_cross_check_on_reachable_policies() {
    let dir = tmpdir("dyn-keys-cross");
    let pdir = dir.join("policies");
    std::fs::create_dir_all(&pdir).expect("dir");
    std::fs::write(
        pdir.join("_default.yaml"),
        "mode: serverless\nmax_input_tokens: 4096\nrouting_policy:\n  strategy: least-loaded\n",
    )
    .expect("global");
    std::fs::write(
        pdir.join("big.yaml"),
        "models: [big]\nmode: serverless\nmax_input_tokens: 100000\nrouting_policy:\n  strategy: least-loaded\n",
    )
    .expect("named");
    let r = start_router(
        &dir,
        &["--policy-model-dir", pdir.to_str().expect("utf-8")],
        &[("HIVENET_ROUTER_AUTH_MODE", "dynamic")],
    );
    let with_itpm = |v: &str, itpm: i64, models: serde_json::Value| {
        json!({"version": v, "key_hash": sha256_hex(v), "owner": "acme", "name": "n",
               "allowed_models": models, "quota": {"input_tokens_per_minute": itpm}})
    };
    // Below the global policy's cap: refused, naming both.
    let (st, v) = admin(
        r.http,
        "PUT",
        "/admin/api-keys/k1",
        with_itpm("r1", 1000, json!(["m"])),
    );
    let e = v["error"].as_str().unwrap_or_default().to_string();
    assert_eq!(st, 400, "{v}");
    assert!(
        e.contains("max_input_tokens 4096") && e.contains("global"),
        "{e}"
    );
    // At or above it, with `big` outside the allowlist: accepted.
    let (st, v) = admin(
        r.http,
        "PUT",
        "/admin/api-keys/k1",
        with_itpm("r2", 5000, json!(["m"])),
    );
    assert_eq!(st, 200, "{v}");
    // The same ITPM reaching `big` (allowlist, or none at all): refused.
    for models in [json!(["big"]), json!([])] {
        let (st, v) = admin(
            r.http,
            "PUT",
            "/admin/api-keys/k2",
            with_itpm("r3", 5000, models),
        );
        let e = v["error"].as_str().unwrap_or_default().to_string();
        assert_eq!(st, 400, "{v}");
        assert!(e.contains("\"big\""), "{e}");
    }
    // No ITPM at all: nothing to check.
    let (st, v) = admin(
        r.http,
        "PUT",
        "/admin/api-keys/k3",
        with_itpm("r4", 0, json!([])),
    );
    assert_eq!(st, 200, "{v}");
}

/// Issue 29 #15: versions compare as operators mean them (`j10` after
/// `j2`, timestamps by instant), and `?force=true` is the way out of a
/// version pushed too far ahead.
#[test]
fn versions_in_natural_order_and_a_forced_way_out() {
    let dir = tmpdir("dyn-keys-versions");
    let r = start_router(&dir, &[], &[("HIVENET_ROUTER_AUTH_MODE", "dynamic")]);
    let put = |path: &str, v: &str| admin(r.http, "PUT", path, key(v, "sk-v"));
    assert_eq!(put("/admin/api-keys/k", "j2").0, 200);
    assert_eq!(put("/admin/api-keys/k", "j10").0, 200, "j10 follows j2");
    assert_eq!(put("/admin/api-keys/k", "j9").0, 409, "j9 is before j10");
    // A version far ahead blocks every later push...
    assert_eq!(put("/admin/api-keys/k", "j999999").0, 200);
    assert_eq!(put("/admin/api-keys/k", "j11").0, 409);
    // ...until a forced push; a failing forced push changes nothing.
    let mut bad = key("j12", "sk-v");
    bad["key_hash"] = json!("abc");
    assert_eq!(
        admin(r.http, "PUT", "/admin/api-keys/k?force=true", bad).0,
        400
    );
    assert_eq!(put("/admin/api-keys/k", "j12").0, 409, "still blocked");
    let (st, v) = put("/admin/api-keys/k?force=true", "j12");
    assert_eq!(st, 200, "{v}");
    assert_eq!(put("/admin/api-keys/k", "j13").0, 200, "unblocked");
    let (_, v) = admin(
        r.http,
        "GET",
        "/admin/api-keys/version",
        serde_json::Value::Null,
    );
    assert_eq!(v["version"], "j13");
}
