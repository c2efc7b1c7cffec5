//! Hold at zero, its limits on real processes: the pending demand counts
//! a key and UUID once; forbidden models and count_tokens are never held;
//! per-key and total hold limits refuse at once and name their flag; every
//! quota is checked (and charged) before the hold; held bodies never take
//! the awake models' body budget.

mod common;
use common::hold::*;
use common::*;
use std::time::{Duration, Instant};

#[test]
fn demand_dedups_by_key_and_uuid_and_limits_refuse_at_once() {
    let dir = tmpdir("hold-dedup");
    let r = site_router(
        &dir,
        &["--wake-keepalive", "0", "--wake-hold-max-per-model", "4"],
        &[],
    );
    push_map(&r, "3s");
    let id = "Client-Request-ID-IGNORED";
    let uuid = "123E4567-e89b-12d3-a456-426614174000";
    let h1 = send(
        r.http,
        "/v1/chat/completions",
        &chat_body("m", false),
        &format!("X-Client-Request-ID: {uuid}\r\n"),
    );
    let h2 = send(
        r.http,
        "/v1/chat/completions",
        &chat_body("m", false),
        &format!("X-Client-Request-ID: {}\r\n", uuid.to_lowercase()),
    );
    wait_until(
        Duration::from_secs(5),
        || demand(&r) == Some(1.0),
        "same key and UUID: one",
    );
    let h3 = send(
        r.http,
        "/v1/chat/completions",
        &chat_body("m", false),
        &format!("X-Client-Request-ID: {id}\r\n"),
    );
    wait_until(
        Duration::from_secs(5),
        || demand(&r) == Some(2.0),
        "a non-UUID ID counts alone",
    );
    let h4 = send(r.http, "/v1/chat/completions", &chat_body("m", false), "");
    wait_until(
        Duration::from_secs(5),
        || demand(&r) == Some(3.0),
        "no ID counts alone",
    );
    // The fifth is over --wake-hold-max-per-model 4: refused at once.
    let t = Instant::now();
    let (st, head, body) = Req::chat("m").send(r.http).map(Resp::triple).expect("full");
    assert!(t.elapsed() < Duration::from_secs(1), "at once");
    assert_eq!(st, 503);
    assert_eq!(header_of(&head, "retry-after").as_deref(), Some("5"));
    assert!(
        String::from_utf8_lossy(&body).contains("hold limit reached (--wake-hold-max-per-model)")
    );
    assert_eq!(demand(&r), Some(3.0), "not counted in the demand");
    assert_eq!(outcome(&r, "full"), 1.0);
    // count_tokens is never held.
    let (st, _, _) = Req::new("POST", "/v1/messages/count_tokens")
        .body(chat_body("m", false).as_bytes())
        .raw_headers("")
        .send(r.http)
        .map(Resp::triple)
        .expect("count");
    assert_eq!(st, 404);
    // A client that leaves is noticed at once.
    drop(h4);
    let t = Instant::now();
    wait_until(Duration::from_secs(5), || demand(&r) == Some(2.0), "left");
    eprintln!(
        "a departed held client left the demand in {:?}",
        t.elapsed()
    );
    assert!(
        t.elapsed() <= Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    wait_until(
        Duration::from_secs(2),
        || outcome(&r, "cancelled") == 1.0,
        "cancelled",
    );
    for h in [h1, h2, h3] {
        let (head, _) = read_all(h);
        assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    }
    assert_eq!(demand(&r), Some(0.0));
}

#[test]
fn forbidden_models_are_never_held_and_keys_count_apart() {
    let dir = tmpdir("hold-keys");
    let mut yaml = String::from("api:\n  mode: api-key\n  keys:\n");
    for (key, models) in [("sk-1", "[]"), ("sk-2", "[]"), ("sk-other", "[other]")] {
        yaml.push_str(&format!(
            "    - key_hash: \"{}\"\n      metadata: {{name: {key}, owner: {key}}}\n      models: {models}\n",
            sha256_hex(key)
        ));
    }
    std::fs::write(dir.join("auth.yaml"), yaml).expect("auth");
    let r = site_router(
        &dir,
        &["--wake-keepalive", "0", "--auth-config-file", "auth.yaml"],
        &[],
    );
    push_map(&r, "2s");
    let (st, _, _) = Req::new("POST", "/v1/chat/completions")
        .body(chat_body("m", false).as_bytes())
        .raw_headers("Authorization: Bearer sk-other\r\n")
        .send(r.http)
        .map(Resp::triple)
        .expect("forbidden");
    assert_eq!(st, 403, "never held");
    let uuid = "123e4567-e89b-12d3-a456-426614174000";
    let a = send(
        r.http,
        "/v1/chat/completions",
        &chat_body("m", false),
        &format!("Authorization: Bearer sk-1\r\nX-Request-ID: {uuid}\r\n"),
    );
    let b = send(
        r.http,
        "/v1/chat/completions",
        &chat_body("m", false),
        &format!("Authorization: Bearer sk-2\r\nX-Request-ID: {uuid}\r\n"),
    );
    wait_until(
        Duration::from_secs(5),
        || demand(&r) == Some(2.0),
        "two keys, same ID: two",
    );
    for s in [a, b] {
        assert!(read_all(s).0.starts_with("HTTP/1.1 503"));
    }
}

#[test]
fn a_request_refused_by_a_hold_limit_is_still_charged_its_quota() {
    let dir = tmpdir("hold-quota");
    std::fs::write(
        dir.join("auth.yaml"),
        format!(
            "api:\n  mode: api-key\n  keys:\n    - key_hash: \"{}\"\n      metadata: {{name: k, owner: t}}\n      quota: {{requests_per_minute: 2}}\n",
            sha256_hex("sk-q")
        ),
    )
    .expect("auth");
    let r = site_router(
        &dir,
        &[
            "--wake-keepalive",
            "0",
            "--wake-hold-max-per-model",
            "1",
            "--auth-config-file",
            "auth.yaml",
        ],
        &[],
    );
    push_map(&r, "3s");
    let key = "Authorization: Bearer sk-q\r\n";
    let held = send(r.http, "/v1/chat/completions", &chat_body("m", false), key);
    wait_until(Duration::from_secs(5), || demand(&r) == Some(1.0), "held");
    let full = |extra: &str| {
        Req::new("POST", "/v1/chat/completions")
            .body(chat_body("m", false).as_bytes())
            .raw_headers(extra)
            .send(r.http)
            .map(Resp::triple)
            .expect("answer")
    };
    let (st, _, body) = full(key);
    assert_eq!(st, 503, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("hold limit reached"));
    // Two requests taken of 2 per minute: the third is refused by the quota.
    let (st, _, body) = full(key);
    assert_eq!(st, 429, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("rate_limit_exceeded"));
    // Counted for the key although the model has no state (it is at zero).
    let limited = metric(
        r.metrics,
        "hivenet_tenant_rate_limited_total{tenant_id=\"t\",",
    );
    assert_eq!(limited, Some(1.0));
    assert!(read_all(held).0.starts_with("HTTP/1.1 503"));
}

/// Issue 28 #3 and #6: every quota is checked before the hold, not only
/// the per-minute one. A key over its daily token budget is refused at
/// once (429 token_limit_exceeded) and never counts in the pending
/// demand; a key within its limits is held, and the committed head its
/// first keepalive sends carries the quota's `X-RateLimit-*` headers.
#[test]
fn daily_budget_before_the_hold_and_rate_limit_headers_on_the_committed_head() {
    let dir = tmpdir("hold-daily");
    std::fs::write(
        dir.join("auth.yaml"),
        format!(
            "api:\n  mode: api-key\n  keys:\n    - key_hash: \"{}\"\n      metadata: {{name: small, owner: t}}\n      quota: {{tokens_per_day: 50}}\n    - key_hash: \"{}\"\n      metadata: {{name: big, owner: t}}\n      quota: {{requests_per_minute: 100, tokens_per_day: 100000}}\n",
            sha256_hex("sk-small"),
            sha256_hex("sk-big")
        ),
    )
    .expect("auth");
    let r = site_router(
        &dir,
        &[
            "--wake-keepalive",
            "200ms",
            "--auth-config-file",
            "auth.yaml",
        ],
        &[],
    );
    push_map(&r, "3s");
    // 4 output tokens of 50 fit, 500 do not: refused before the hold.
    let big =
        r#"{"model":"m","max_tokens":500,"messages":[{"role":"user","content":"hello there"}]}"#;
    let t = Instant::now();
    let (st, _, body) = Req::new("POST", "/v1/chat/completions")
        .body(big.as_bytes())
        .raw_headers("Authorization: Bearer sk-small\r\n")
        .send(r.http)
        .map(Resp::triple)
        .expect("answer");
    assert_eq!(st, 429, "{}", String::from_utf8_lossy(&body));
    assert!(
        String::from_utf8_lossy(&body).contains("token_limit_exceeded"),
        "{}",
        String::from_utf8_lossy(&body)
    );
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "at once, not after the hold"
    );
    assert_eq!(demand(&r), Some(0.0), "never counted as demand");
    assert_eq!(outcome(&r, "expired"), 0.0);
    // Within its limits: held, and the committed head has the headers.
    let s = send(
        r.http,
        "/v1/chat/completions",
        &chat_body("m", false),
        "Authorization: Bearer sk-big\r\n",
    );
    let (head, body) = read_all(s);
    assert!(head.starts_with("HTTP/1.1 200"), "committed: {head}");
    assert!(body.contains("model_waking"), "{body}");
    let h = head.to_ascii_lowercase();
    for name in [
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-remaining-tokens",
    ] {
        assert!(h.contains(name), "{name} on the committed head: {head}");
    }
}

/// Issue 28 (missing tests): the per-key and router-wide hold limits end
/// to end: with `--wake-hold-max-per-key 2` a key's third held request is
/// refused at once (503 model_waking naming the flag, not counted as
/// demand); with `--wake-hold-max-total` in bytes, another key's body that
/// would pass it is refused too.
#[test]
fn per_key_and_total_hold_limits_refuse_at_once_and_name_their_flag() {
    let dir = tmpdir("hold-limits");
    std::fs::write(
        dir.join("auth.yaml"),
        format!(
            "api:\n  mode: api-key\n  keys:\n    - key_hash: \"{}\"\n      metadata: {{name: k, owner: t}}\n    - key_hash: \"{}\"\n      metadata: {{name: j, owner: t}}\n",
            sha256_hex("sk-k"),
            sha256_hex("sk-j")
        ),
    )
    .expect("auth");
    let r = site_router(
        &dir,
        &[
            "--wake-keepalive",
            "0",
            "--wake-hold-max-per-key",
            "2",
            "--wake-hold-max-total",
            "4096",
            "--auth-config-file",
            "auth.yaml",
        ],
        &[],
    );
    push_map(&r, "5s");
    let refused = |body: &str, extra: &str| {
        let t = Instant::now();
        let (head, body) = read_all(send(r.http, "/v1/chat/completions", body, extra));
        (head, body, t.elapsed())
    };
    let key = "Authorization: Bearer sk-k\r\n";
    let a = send(r.http, "/v1/chat/completions", &chat_body("m", false), key);
    let b = send(r.http, "/v1/chat/completions", &chat_body("m", false), key);
    wait_until(
        Duration::from_secs(5),
        || demand(&r) == Some(2.0),
        "two held",
    );
    let (head, body, took) = refused(&chat_body("m", false), key);
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    assert!(
        body.contains("hold limit reached (--wake-hold-max-per-key)"),
        "{body}"
    );
    assert!(took < Duration::from_secs(2), "at once: {took:?}");
    assert_eq!(demand(&r), Some(2.0), "the refused one is not demand");
    // A body over what is left of the 4,096 bytes: refused by the total.
    let big = format!(
        r#"{{"model":"m","max_tokens":4,"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(5000)
    );
    let (head, body, _) = refused(&big, "Authorization: Bearer sk-j\r\n");
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    assert!(
        body.contains("hold limit reached (--wake-hold-max-total)"),
        "{body}"
    );
    assert_eq!(outcome(&r, "full"), 2.0, "both refusals counted as full");
    for s in [a, b] {
        assert!(read_all(s).0.starts_with("HTTP/1.1 503"), "expired in band");
    }
}

/// Issue 29 #9 (the probe: 27 anonymous held requests of 10 MB filled the
/// 256 MiB body budget and every awake request over 100 bytes got 503 for
/// the whole hold): held bodies count under --wake-hold-max-total only.
/// Here the awake budget is 1 MiB and three held bodies of 600 KB are
/// held at once; an awake model's 600 KB request is still served.
#[test]
fn held_bodies_never_take_the_awake_models_body_budget() {
    let dir = tmpdir("hold-body-budget");
    let r = site_router(
        &dir,
        &[
            "--wake-keepalive",
            "0",
            "--max-buffered-body-bytes",
            "1048576",
            "--wake-hold-max-total",
            "67108864",
        ],
        &[],
    );
    push_map(&r, "20s");
    let (_s, port) = start_sim(&dir, "awake", &[]);
    let _a = start_agent(&dir, &r, port, "a.key", &[]);
    wait_agents(r.http, "awake", 1);
    let big = |model: &str| {
        let pad = "x".repeat(600_000);
        format!(
            r#"{{"model":"{model}","max_tokens":4,"messages":[{{"role":"user","content":"{pad}"}}]}}"#
        )
    };
    // One after another: each body is read under the awake budget, then
    // leaves it when held.
    let mut held = Vec::new();
    for n in 1..=3 {
        held.push(send(r.http, "/v1/chat/completions", &big("m"), ""));
        wait_until(
            Duration::from_secs(10),
            || demand(&r) == Some(f64::from(n)),
            "a big body held",
        );
    }
    let (head, body) = read_all(send(r.http, "/v1/chat/completions", &big("awake"), ""));
    assert!(head.starts_with("HTTP/1.1 200"), "{head}\n{body}");
    drop(held);
}

/// Issue 56, seed B4: a serverless key's per-minute input and output
/// token limits are checked before its request is held, not after the
/// wake: a key that spent its minute, or a request larger than a whole
/// minute, is refused at once with the B4 answer and never counts in the
/// pending demand; a key with room is held.
#[test]
fn per_minute_token_limits_refuse_before_the_hold() {
    let dir = tmpdir("hold-b4");
    let mut yaml = String::from("api:\n  mode: api-key\n  keys:\n");
    for (key, quota) in [
        ("sk-in", "{input_tokens_per_minute: 100}"),
        ("sk-out", "{output_tokens_per_minute: 20}"),
        ("sk-room", "{input_tokens_per_minute: 100}"),
    ] {
        yaml.push_str(&format!(
            "    - key_hash: \"{}\"\n      metadata: {{name: {key}, owner: {key}}}\n      quota: {quota}\n",
            sha256_hex(key)
        ));
    }
    std::fs::write(dir.join("auth.yaml"), yaml).expect("auth");
    std::fs::write(
        dir.join("policy.yaml"),
        "mode: serverless\nrouting_policy:\n  strategy: least-loaded\n",
    )
    .expect("policy");
    let r = site_router(
        &dir,
        &[
            "--wake-keepalive",
            "0",
            "--policy-file",
            "policy.yaml",
            "--auth-config-file",
            "auth.yaml",
        ],
        &[],
    );
    push_map(&r, "30s");
    let body = |text: &str, max: u32| {
        format!(
            r#"{{"model":"m","max_tokens":{max},"messages":[{{"role":"user","content":"{text}"}}]}}"#
        )
    };
    // 320 text bytes: a cold estimate of 100 input tokens, the whole minute.
    let big = body(&"y".repeat(320), 4);
    let small = body("hi", 16);
    let chat = |key: &str, b: &str| {
        Req::post("/v1/chat/completions", b)
            .bearer(key)
            .send(r.http)
            .expect("chat")
    };
    // Served while awake: sk-in spends its input minute, sk-out its
    // output minute.
    let (mut sim, port) = start_sim(&dir, "m", &["--output-tokens", "16"]);
    let mut a = start_agent(&dir, &r, port, "a.key", &[]);
    wait_until(
        Duration::from_secs(30),
        || routing_table(r.http)["total"] == 1,
        "agent",
    );
    assert_eq!(chat("sk-in", &big).status, 200);
    while chat("sk-out", &small).status == 200 {}
    // The model goes to zero.
    a.kill9();
    sim.kill9();
    wait_until(
        Duration::from_secs(10),
        || routing_table(r.http)["total"] == 0,
        "at zero",
    );
    for (key, b, what) in [
        ("sk-in", &big, "input token rate exceeded"),
        ("sk-out", &small, "output token rate exceeded"),
        // Twice a whole minute of input: never fits, even with room.
        (
            "sk-room",
            &body(&"y".repeat(640), 4),
            "input token rate exceeded",
        ),
    ] {
        let t0 = Instant::now();
        let resp = chat(key, b);
        assert_eq!(resp.status, 429, "{key}: {}", resp.text());
        assert!(resp.text().contains(what), "{key}: {}", resp.text());
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{key}: refused at once, not after a hold"
        );
        assert_eq!(demand(&r), Some(0.0), "{key}: never in the pending demand");
    }
    // A key with room is held.
    let held = send(
        r.http,
        "/v1/chat/completions",
        &small,
        "Authorization: Bearer sk-room\r\n",
    );
    wait_until(Duration::from_secs(5), || demand(&r) == Some(1.0), "held");
    drop(held);
}
