//! Client keys end to end (spec 05 §11's failure table): 401 with
//! `WWW-Authenticate` for missing, wrong and expired keys (Bearer and
//! `x-api-key`), `403 model_forbidden` outside the allowlist, `429` for a
//! per-model key without the model, discovery filtered by key, aliases,
//! 501 for the registry outside dynamic mode, start-up refusals naming
//! file, entry and field, and the keygen round trip.

mod common;
use common::*;
use std::process::Command;

const GOOD: &str = "sk-good-key";
const LIMITED: &str = "sk-limited-to-m2";
const PER_MODEL: &str = "sk-per-model";
const EXPIRED: &str = "sk-expired";

fn auth_yaml() -> String {
    format!(
        r#"api:
  mode: api-key
  keys:
    - key_hash: "{}"
      key_preview: "sk-...-key"
      metadata: {{name: good, owner: acme}}
    - key_hash: "{}"
      metadata: {{name: limited, owner: beta}}
      models: [m2]
    - key_hash: "{}"
      metadata: {{name: per-model, owner: gamma}}
      quota:
        per_model:
          m2: {{requests_per_minute_per_replica: 100, tokens_per_day: 0}}
    - key_hash: "{}"
      metadata: {{name: old, owner: acme, expires_at: "01-01-2020"}}
"#,
        sha256_hex(GOOD),
        sha256_hex(LIMITED),
        sha256_hex(PER_MODEL),
        sha256_hex(EXPIRED)
    )
}

#[test]
fn failure_table_allowlists_discovery_and_aliases() {
    let dir = tmpdir("client-auth");
    std::fs::write(dir.join("auth.yaml"), auth_yaml()).expect("auth.yaml");
    std::fs::write(
        dir.join("policy.yaml"),
        "routing_policy:\n  strategy: least-loaded\naliases:\n  fast: m1\n",
    )
    .expect("policy");
    let r = start_router(
        &dir,
        &[
            "--auth-config-file",
            "auth.yaml",
            "--policy-file",
            "policy.yaml",
            "--shards",
            "2",
        ],
        &[],
    );
    let (_s1, p1) = start_sim(&dir, "m1", &[]);
    let (_s2, p2) = start_sim(&dir, "m2", &[]);
    let _a1 = start_agent(&dir, &r, p1, "a1.key", &[]);
    let _a2 = start_agent(&dir, &r, p2, "a2.key", &[]);
    let admin_models = |m: &str| -> bool {
        Req::get(&format!("/admin/models/{m}"))
            .bearer(ADMIN_KEY)
            .send(r.http)
            .map(Resp::pair)
            .map(|(s, _)| s == 200)
            .unwrap_or(false)
    };
    wait_until(
        std::time::Duration::from_secs(30),
        || admin_models("m1") && admin_models("m2"),
        "agents",
    );

    // 401: missing, wrong, expired, bare garbage; same body and challenge.
    let body = chat_body("m1", false);
    for extra in [
        String::new(),
        "Authorization: Bearer sk-wrong\r\n".to_string(),
        format!("Authorization: Bearer {EXPIRED}\r\n"),
        "x-api-key: sk-wrong\r\n".to_string(),
        "Authorization: Bearer \r\n".to_string(),
    ] {
        let (st, head, b) = Req::new("POST", "/v1/chat/completions")
            .body(body.as_bytes())
            .raw_headers(&extra)
            .send(r.http)
            .map(Resp::triple)
            .expect("req");
        assert_eq!(st, 401, "{extra:?}");
        assert_eq!(
            header_of(&head, "www-authenticate").as_deref(),
            Some("bearer realm=\"hivenet-router\"")
        );
        let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
        assert_eq!(
            v,
            serde_json::json!({"error":{"code":"unauthorized","message":"unauthorized","source":"router"}})
        );
    }
    // /v1/models needs a key too.
    assert_eq!(
        Req::get("/v1/models")
            .send(r.http)
            .map(Resp::pair)
            .expect("models")
            .0,
        401
    );

    // A valid key: Bearer, bare, and x-api-key (Anthropic SDKs).
    assert_eq!(
        Req::chat("m1")
            .bearer(GOOD)
            .send(r.http)
            .expect("chat")
            .triple()
            .0,
        200
    );
    for extra in [
        format!("Authorization: {GOOD}\r\n"),
        format!("x-api-key: {GOOD}\r\n"),
    ] {
        let (st, _, b) = Req::new("POST", "/v1/chat/completions")
            .body(body.as_bytes())
            .raw_headers(&extra)
            .send(r.http)
            .map(Resp::triple)
            .expect("req");
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    }

    // Allowlist: 403 with the spec's message; the model is invisible.
    let (st, _, b) = Req::chat("m1")
        .bearer(LIMITED)
        .send(r.http)
        .expect("chat")
        .triple();
    assert_eq!(st, 403);
    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
    assert_eq!(v["error"]["code"], "model_forbidden");
    assert_eq!(
        v["error"]["message"],
        "your API key does not have access to model: m1"
    );
    assert_eq!(
        Req::chat("m2")
            .bearer(LIMITED)
            .send(r.http)
            .expect("chat")
            .triple()
            .0,
        200
    );
    let (st, b) = Req::get("/v1/models")
        .bearer(LIMITED)
        .send(r.http)
        .map(Resp::pair)
        .expect("models");
    assert_eq!(st, 200);
    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
    let ids: Vec<&str> = v["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, vec!["m2"], "alias 'fast' -> m1 is hidden too");
    assert_eq!(
        Req::get("/v1/models/m1")
            .bearer(LIMITED)
            .send(r.http)
            .map(Resp::pair)
            .expect("detail")
            .0,
        404
    );
    assert_eq!(
        Req::get("/v1/models/m2")
            .bearer(LIMITED)
            .send(r.http)
            .map(Resp::pair)
            .expect("detail")
            .0,
        200
    );

    // Per-model key: undeclared model -> 429 with remaining 0.
    let (st, head, b) = Req::chat("m1")
        .bearer(PER_MODEL)
        .send(r.http)
        .expect("chat")
        .triple();
    assert_eq!(st, 429);
    assert_eq!(
        header_of(&head, "x-ratelimit-remaining-requests").as_deref(),
        Some("0")
    );
    assert!(String::from_utf8_lossy(&b).contains("no quota declared for model m1 on this API key"));
    let (st, head, _) = Req::chat("m2")
        .bearer(PER_MODEL)
        .send(r.http)
        .expect("chat")
        .triple();
    assert_eq!(st, 200);
    assert_eq!(
        header_of(&head, "x-ratelimit-limit-requests").as_deref(),
        Some("100")
    );

    // Alias: resolved, echoed, forwarded with the real name, listed.
    let (st, head, b) = Req::chat("fast")
        .bearer(GOOD)
        .send(r.http)
        .expect("chat")
        .triple();
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(
        header_of(&head, "x-hivenet-routed-model").as_deref(),
        Some("m1")
    );
    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
    assert_eq!(v["model"], "m1", "the sim echoes the model it was sent");
    let (_, b) = Req::get("/v1/models")
        .bearer(GOOD)
        .send(r.http)
        .map(Resp::pair)
        .expect("models");
    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
    let fast = v["data"]
        .as_array()
        .expect("data")
        .iter()
        .find(|m| m["id"] == "fast")
        .cloned()
        .expect("alias listed");
    assert_eq!(fast["alias_of"], "m1");
    assert_eq!(
        Req::get("/v1/models/fast")
            .bearer(GOOD)
            .send(r.http)
            .map(Resp::pair)
            .expect("alias detail")
            .0,
        200
    );

    // The registry is not active in api-key mode.
    let (st, b) = Req::get("/admin/api-keys")
        .bearer(ADMIN_KEY)
        .send(r.http)
        .map(Resp::pair)
        .expect("registry");
    assert_eq!(st, 501);
    assert_eq!(
        String::from_utf8_lossy(&b),
        r#"{"error":"dynamic key registry not active"}"#
    );

    // SIGHUP: a broken file keeps the old keys; a good one applies
    // (here: the limited key removed).
    std::fs::write(
        dir.join("auth.yaml"),
        "api:\n  mode: api-key\n  keys: [{key_hash: nope}]\n",
    )
    .expect("bad");
    signal(&r.proc, "HUP");
    wait_until(
        std::time::Duration::from_secs(10),
        || r.proc.log_text().contains("auth reload rejected"),
        "rejected reload",
    );
    assert_eq!(
        Req::chat("m2")
            .bearer(LIMITED)
            .send(r.http)
            .expect("chat")
            .triple()
            .0,
        200,
        "old keys kept"
    );
    let without_limited: String = auth_yaml()
        .split("    - key_hash:")
        .enumerate()
        .filter(|(i, _)| *i != 2)
        .map(|(_, part)| part)
        .collect::<Vec<_>>()
        .join("    - key_hash:");
    std::fs::write(dir.join("auth.yaml"), without_limited).expect("good");
    signal(&r.proc, "HUP");
    wait_until(
        std::time::Duration::from_secs(10),
        || {
            Req::chat("m2")
                .bearer(LIMITED)
                .send(r.http)
                .expect("chat")
                .triple()
                .0
                == 401
        },
        "limited key removed",
    );
    assert_eq!(
        Req::chat("m1")
            .bearer(GOOD)
            .send(r.http)
            .expect("chat")
            .triple()
            .0,
        200
    );

    // The key never reaches the agent, the log or the metrics.
    let metrics = metrics_text(r.metrics);
    assert!(
        metrics.contains("hivenet_tenant_requests_success_total{tenant_id=\"acme\""),
        "{metrics}"
    );
    assert!(!metrics.contains("sk-wrong") && !metrics.contains(GOOD));
    assert!(!r.proc.log_text().contains(GOOD));
}

#[test]
fn startup_refuses_invalid_auth_configs_in_one_line() {
    let dir = tmpdir("auth-invalid");
    let h = sha256_hex(GOOD);
    let cases = [
        ("api:\n  mode: api-key\n", "api.keys", &[][..]),
        ("api:\n  mode: oauth\n", "supported: none, api-key, dynamic", &[][..]),
        (&*format!("api:\n  mode: api-key\n  keys:\n    - key_hash: \"{h}\"\n      metadata: {{name: a}}\n"), "api.keys[0].metadata.owner", &[][..]),
        (&*format!("api:\n  mode: api-key\n  keys:\n    - key_hash: \"{h}\"\n      metadata: {{name: a, owner: b}}\n      quota: {{tokens_per_day: 1, per_model: {{m: {{requests_per_minute_per_replica: 1, tokens_per_day: 1}}}}}}\n"), "api.keys[0].quota.tokens_per_day", &[][..]),
        (&*format!("api:\n  mode: api-key\n  keys:\n    - key_hash: \"{h}\"\n      metadata: {{name: a, owner: b}}\n      priority: urgent\n"), "api.keys[0].priority: \"urgent\" is not one of interactive, standard, batch", &[][..]),
        ("admin:\n  mode: none\n", "HIVENET_ROUTER_ALLOW_INSECURE_ADMIN", &[][..]),
        ("api:\n  mode: dynamic\n", "HIVENET_ROUTER_ADMIN_API_KEYS", &[("HIVENET_ROUTER_ADMIN_API_KEYS", "")][..]),
    ];
    for (i, (yaml, want, env)) in cases.iter().enumerate() {
        let file = format!("auth-{i}.yaml");
        std::fs::write(dir.join(&file), yaml).expect("write");
        let mut cmd = Command::new(bin("hivenet-router"));
        cmd.args([
            "--auth-config-file",
            &file,
            "--http-port",
            "127.0.0.1:0",
            "--metrics-port",
            "127.0.0.1:0",
            "--p2p-port",
            "0",
        ])
        .current_dir(&dir)
        .env("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN_KEY);
        for (k, v) in *env {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "case {i}: {err}");
        let line = err
            .lines()
            .find(|l| l.starts_with("hivenet-router:"))
            .unwrap_or_default();
        assert!(line.contains(want), "case {i}: {line:?} lacks {want:?}");
        if (2..=3).contains(&i) {
            assert!(line.contains(&file), "case {i} names the file: {line}");
        }
    }
}

#[test]
fn keygen_round_trip() {
    let dir = tmpdir("keygen");
    let out = Command::new(bin("hivenet-router"))
        .args(["keygen", "--tenant", "acme"])
        .output()
        .expect("keygen");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let key = text
        .split_whitespace()
        .find(|w| w.starts_with("sk-hivenet-"))
        .expect("key printed")
        .to_string();
    assert!(
        !text.contains(&format!("key_hash: \"{key}")),
        "only the hash goes in the file"
    );
    let snippet: String = text
        .lines()
        .skip_while(|l| !l.starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(
        dir.join("auth.yaml"),
        format!("api:\n  mode: api-key\n  keys:\n{snippet}\n"),
    )
    .expect("write");
    let r = start_router(&dir, &["--auth-config-file", "auth.yaml"], &[]);
    let (st, b) = Req::get("/v1/models")
        .bearer(&key)
        .send(r.http)
        .map(Resp::pair)
        .expect("models");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(
        Req::get("/v1/models")
            .bearer("sk-hivenet-wrong")
            .send(r.http)
            .map(Resp::pair)
            .expect("models")
            .0,
        401
    );
    let m = metrics_text(r.metrics);
    assert!(
        m.contains("hivenet_tenant_quota_rpm_limit{tenant_id=\"acme\"} 100"),
        "{m}"
    );
    assert!(
        m.contains("hivenet_tenant_quota_tpd_limit{tenant_id=\"acme\"} 500000"),
        "{m}"
    );
}
