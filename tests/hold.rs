//! Hold at zero end to end (seed hold-at-zero, spec 07 §10) on real
//! processes: a request for a model placed here with `scale_from_zero`
//! and no agent is held (pending demand 1, keepalive bytes), then served
//! when an agent registers; a budget that runs out answers
//! `model_waking` in the body after keepalives (OpenAI and Anthropic SSE
//! shapes, JSON after spaces) or as a plain 503 without them; the demand
//! counts a key and UUID once; forbidden models and count_tokens are never
//! held; a full hold is refused at once; a client leaving is noticed; 100
//! released requests all served by one agent of 4 slots; an agent leaving
//! makes the model holdable again at once.

mod common;
use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const ADMIN: &str = "test-admin-key";

fn site_router(dir: &std::path::Path, extra: &[&str], env: &[(&str, &str)]) -> Router {
    let mut args = vec!["--shards", "2", "--site-id", "a"];
    args.extend_from_slice(extra);
    let mut e = vec![("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN)];
    e.extend_from_slice(env);
    start_router(dir, &args, &e)
}

/// Push a map of site `a` (this router) with `placements` (JSON objects).
fn push_placements(r: &Router, version: &str, placements: &[String]) {
    let body = format!(
        r#"{{"version":"{version}","sites":[{{"site_id":"a","base_url":"http://127.0.0.1:{}"}}],"placements":[{}]}}"#,
        r.http,
        placements.join(",")
    );
    let (st, b) = Req::new("PUT", "/admin/sibling-map")
        .body(body.as_bytes())
        .raw_headers(&format!("Authorization: Bearer {ADMIN}\r\n"))
        .send(r.http)
        .map(Resp::pair)
        .expect("push");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
}

/// A placement of `model` (`kind`) on site `a` with scale_from_zero.
fn at_zero(model: &str, kind: &str, budget: &str) -> String {
    format!(
        r#"{{"site_id":"a","model":"{model}","kind":"{kind}","scale_from_zero":true,"hold_budget":"{budget}"}}"#
    )
}

/// Place `m` (chat) here with scale_from_zero.
fn push_map(r: &Router, budget: &str) {
    push_placements(r, "1", &[at_zero("m", "chat", budget)]);
}

fn demand(r: &Router) -> Option<f64> {
    metric(r.metrics, "hivenet_pending_demand{model=\"m\"}")
}

fn outcome(r: &Router, o: &str) -> f64 {
    metric(
        r.metrics,
        &format!("hivenet_wake_holds_total{{model=\"m\",outcome=\"{o}\"}}"),
    )
    .unwrap_or(0.0)
}

/// Send a request on a raw socket (the caller reads the answer as it comes).
fn send(http: u16, path: &str, body: &str, extra: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", http)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).ok();
    s.write_all(
        format!(
            "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .expect("write");
    s
}

fn read_all(mut s: TcpStream) -> (String, String) {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    split_response(&out)
}

/// Head and (de-chunked) body of a whole response.
fn split_response(out: &[u8]) -> (String, String) {
    let split = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| p + 4)
        .unwrap_or(out.len());
    let head = String::from_utf8_lossy(&out[..split]).to_string();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(&out[split..])
    } else {
        out[split..].to_vec()
    };
    (head, String::from_utf8_lossy(&body).to_string())
}

/// `n` non-streamed chats for `m`, each on its own connection and thread;
/// each handle gives the whole answer (head, de-chunked body).
fn chats_in_background(http: u16, n: usize) -> Vec<std::thread::JoinHandle<(String, String)>> {
    (0..n)
        .map(|_| {
            std::thread::spawn(move || {
                read_all(send(
                    http,
                    "/v1/chat/completions",
                    &chat_body("m", false),
                    "",
                ))
            })
        })
        .collect()
}

/// Every read of a response with the time it arrived.
fn read_timed(mut s: TcpStream) -> Vec<(Instant, Vec<u8>)> {
    let mut reads = Vec::new();
    let mut buf = [0u8; 65536];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        reads.push((Instant::now(), buf[..n].to_vec()));
    }
    reads
}

/// Seed 2: keepalives every `--wake-keepalive` while held, on after the
/// release "until its response starts", through the agent's whole
/// non-streamed answer (issue 28 #1: they used to stop at the slot).
#[test]
fn held_with_keepalives_then_served_when_an_agent_registers() {
    let dir = tmpdir("hold-wake");
    let r = site_router(&dir, &["--wake-keepalive", "300ms"], &[]);
    push_map(&r, "30s");
    assert_eq!(demand(&r), Some(0.0), "a series for the holdable model");
    let s = send(r.http, "/v1/chat/completions", &chat_body("m", false), "");
    let st = send(r.http, "/v1/chat/completions", &chat_body("m", true), "");
    let whole = std::thread::spawn(move || read_timed(s));
    wait_until(Duration::from_secs(5), || demand(&r) == Some(2.0), "held");
    std::thread::sleep(Duration::from_millis(1000));
    // A slow engine: its non-streamed answer takes 1.5 s after the release.
    let (_sim, port) = start_sim(&dir, "m", &["--ttft", "1500ms"]);
    let _a = start_agent(&dir, &r, port, "a.key", &[]);
    // The stream: keepalive comments, then the backend's events.
    let (head, body) = read_all(st);
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/event-stream"),
        "{head}"
    );
    assert!(body.starts_with(": keep-alive\n\n"), "{body:?}");
    assert!(
        body.contains("data: {") && body.contains("[DONE]"),
        "{body:?}"
    );
    let reads = whole.join().expect("reader");
    let all: Vec<u8> = reads.iter().flat_map(|(_, d)| d.clone()).collect();
    let (head, body) = split_response(&all);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let spaces = body.len() - body.trim_start().len();
    assert!(
        spaces >= 3,
        "keepalive spaces before the JSON: {spaces} ({body:?})"
    );
    let v: serde_json::Value = serde_json::from_str(body.trim()).expect("JSON after the spaces");
    assert_eq!(v["object"], "chat.completion", "{body}");
    // The cadence: one keepalive per read, about 300 ms apart, no long
    // gap anywhere (not at the release, not while the agent answers).
    let beats: Vec<Instant> = reads
        .iter()
        .filter(|(_, d)| d.contains(&b' ') && !d.contains(&b'{'))
        .map(|(t, _)| *t)
        .collect();
    for w in beats.windows(2) {
        let gap = w[1] - w[0];
        assert!(
            gap >= Duration::from_millis(150) && gap <= Duration::from_millis(900),
            "keepalive gap {gap:?} (every 300 ms)"
        );
    }
    // Keepalives went on while the engine worked on the released request:
    // the answer came 1.5 s after the release, and at least 3 beats fell
    // in its last 1.2 s.
    let (answered, _) = reads.last().expect("reads");
    let late = beats
        .iter()
        .filter(|t| **t + Duration::from_millis(1200) > *answered)
        .count();
    assert!(
        late >= 3,
        "keepalives through the exchange: {late} in its last 1.2 s"
    );
    wait_until(
        Duration::from_secs(5),
        || demand(&r) == Some(0.0),
        "demand left at the slot",
    );
    assert_eq!(outcome(&r, "woken"), 2.0);
    assert!(metrics_text(r.metrics).contains("hivenet_wake_seconds{model=\"m\"}"));
}

#[test]
fn budget_expiry_in_band_after_keepalives_and_plain_without() {
    let dir = tmpdir("hold-expire");
    let r = site_router(&dir, &["--wake-keepalive", "200ms"], &[]);
    push_map(&r, "1s");
    // Non-streaming: 200, spaces, then the envelope.
    let s = send(r.http, "/v1/chat/completions", &chat_body("m", false), "");
    let (head, body) = read_all(s);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let v: serde_json::Value = serde_json::from_str(body.trim()).expect("envelope");
    assert_eq!(v["error"]["code"], "model_waking");
    assert_eq!(v["error"]["retry_after"], 5);
    assert!(v["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("not ready within hold budget 1s")));
    // Streaming, OpenAI shape: keepalive comments, then a data: error event.
    let s = send(r.http, "/v1/chat/completions", &chat_body("m", true), "");
    let (_, body) = read_all(s);
    assert!(body.starts_with(": keep-alive\n\n"), "{body:?}");
    assert!(body.trim_end().ends_with('}'), "{body:?}");
    assert!(
        body.contains("data: {\"error\":{\"code\":\"model_waking\""),
        "{body:?}"
    );
    // Streaming /v1/messages: Anthropic's error event.
    let m =
        r#"{"model":"m","stream":true,"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}"#;
    let (_, body) = read_all(send(r.http, "/v1/messages", m, ""));
    assert!(
        body.contains("event: error\ndata: {\"type\":\"error\""),
        "{body:?}"
    );
    assert!(
        body.contains("overloaded_error") && body.contains("model_waking: model m"),
        "{body:?}"
    );
    assert_eq!(outcome(&r, "expired"), 3.0);
    assert_eq!(demand(&r), Some(0.0));

    let dir = tmpdir("hold-expire-plain");
    let r = site_router(&dir, &["--wake-keepalive", "0"], &[]);
    push_map(&r, "1s");
    let (st, head, body) = Req::chat("m")
        .send(r.http)
        .map(Resp::triple)
        .expect("plain");
    assert_eq!(st, 503);
    assert_eq!(header_of(&head, "retry-after").as_deref(), Some("5"));
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(v["error"]["code"], "model_waking");
    assert_eq!(v["error"]["retry_after"], 5);
}

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
fn a_hundred_released_onto_four_slots_and_an_agent_leaving_holds_again() {
    let dir = tmpdir("hold-burst");
    let r = site_router(
        &dir,
        &[
            "--wake-keepalive",
            "0",
            "--queue-depth",
            "2",
            "--wake-hold-max-per-key",
            "1000",
        ],
        &[],
    );
    push_map(&r, "60s");
    let handles = chats_in_background(r.http, 100);
    wait_until(
        Duration::from_secs(10),
        || demand(&r) == Some(100.0),
        "100 held",
    );
    let (_sim, port) = start_sim(&dir, "m", &["--ttft", "50ms"]);
    let mut agent = start_agent(&dir, &r, port, "a.key", &["--capacity", "4"]);
    let mut ok = 0;
    for h in handles {
        let (head, body) = h.join().expect("thread");
        if head.starts_with("HTTP/1.1 200") {
            ok += 1;
        } else {
            eprintln!("not served: {} {body}", head.lines().next().unwrap_or(""));
        }
    }
    assert_eq!(ok, 100, "none refused by --queue-depth 2");
    assert_eq!(demand(&r), Some(0.0));
    // The agent leaves: the model is holdable again at once.
    agent.kill9();
    wait_until(
        Duration::from_secs(10),
        || healthy_agents(r.http, "m") == 0,
        "agent gone",
    );
    let s = send(r.http, "/v1/chat/completions", &chat_body("m", false), "");
    wait_until(
        Duration::from_secs(5),
        || demand(&r) == Some(1.0),
        "held again",
    );
    drop(s);
}

/// Seed 2: "With --queue-depth 0 there is no queue: a released request
/// that finds no free slot moves to the next fallback step or fails at
/// once." Six held requests onto one slot: one is served, the others are
/// refused at once instead of queueing for it.
#[test]
fn queue_depth_zero_means_no_queue_after_a_wake() {
    let dir = tmpdir("hold-noqueue");
    let r = site_router(&dir, &["--wake-keepalive", "0", "--queue-depth", "0"], &[]);
    push_map(&r, "30s");
    let handles = chats_in_background(r.http, 6);
    wait_until(
        Duration::from_secs(10),
        || demand(&r) == Some(6.0),
        "6 held",
    );
    let (_sim, port) = start_sim(&dir, "m", &["--ttft", "400ms"]);
    let _a = start_agent(&dir, &r, port, "a.key", &["--capacity", "1"]);
    let mut served = 0;
    let mut refused = Vec::new();
    for h in handles {
        let (head, body) = h.join().expect("thread");
        if head.starts_with("HTTP/1.1 200") {
            served += 1;
        } else {
            refused.push(format!("{} {body}", head.lines().next().unwrap_or("")));
        }
    }
    assert!(served >= 1, "the free slot serves one: {refused:?}");
    assert!(
        refused.len() >= 3,
        "no queue: released requests that find no slot are refused ({served} served)"
    );
    assert!(
        refused
            .iter()
            .all(|r| r.contains(" 503 ") || r.contains(" 429 ")),
        "{refused:?}"
    );
    wait_until(
        Duration::from_secs(5),
        || demand(&r) == Some(0.0),
        "nothing left counted",
    );
}

#[test]
fn sigterm_answers_held_requests_and_a_restart_forgets_the_map() {
    let dir = tmpdir("hold-term");
    let mut r = site_router(&dir, &["--wake-keepalive", "0"], &[]);
    push_map(&r, "60s");
    let s = send(r.http, "/v1/chat/completions", &chat_body("m", false), "");
    wait_until(Duration::from_secs(5), || demand(&r) == Some(1.0), "held");
    sigterm(&mut r.proc);
    let (head, body) = read_all(s);
    assert!(
        head.starts_with("HTTP/1.1 503"),
        "answered, not dropped: {head}"
    );
    assert!(
        body.contains("model_waking") && body.contains("shutting down"),
        "{body}"
    );
    drop(r);
    // A restarted router has no map: no series, nothing held.
    let r = site_router(&dir, &["--wake-keepalive", "0"], &[]);
    assert_eq!(demand(&r), None, "no series without a map");
    let (st, _, _) = Req::chat("m").send(r.http).map(Resp::triple).expect("404");
    assert_eq!(st, 404, "fails as before until the map is pushed again");
}

#[test]
fn a_map_that_drops_the_placement_fails_held_requests_as_before() {
    let dir = tmpdir("hold-unplaced");
    let r = site_router(&dir, &["--wake-keepalive", "0"], &[]);
    push_map(&r, "60s");
    let s = send(r.http, "/v1/chat/completions", &chat_body("m", false), "");
    wait_until(Duration::from_secs(5), || demand(&r) == Some(1.0), "held");
    let body = format!(
        r#"{{"version":"2","sites":[{{"site_id":"a","base_url":"http://127.0.0.1:{}"}}],"placements":[]}}"#,
        r.http
    );
    let (st, _) = Req::new("PUT", "/admin/sibling-map")
        .body(body.as_bytes())
        .raw_headers(&format!("Authorization: Bearer {ADMIN}\r\n"))
        .send(r.http)
        .map(Resp::pair)
        .expect("push");
    assert_eq!(st, 200);
    let (head, _) = read_all(s);
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    assert_eq!(demand(&r), None, "the series goes with the placement");
    assert_eq!(outcome(&r, "unplaced"), 1.0);
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

/// Issue 28 #5: the wait room and the wake are per (model, kind). An
/// embedding agent registered under the name of a chat model held at
/// zero does not release the held chat request into an error: it stays
/// held (and counted) until a chat agent registers, and is served then.
#[test]
fn an_agent_of_another_kind_does_not_wake_a_held_request() {
    let dir = tmpdir("hold-kind");
    let r = site_router(&dir, &["--wake-keepalive", "0"], &[]);
    push_map(&r, "20s");
    let s = send(r.http, "/v1/chat/completions", &chat_body("m", false), "");
    wait_until(Duration::from_secs(5), || demand(&r) == Some(1.0), "held");
    let (_se, pe) = start_sim(&dir, "m", &[]);
    let _e = start_agent(&dir, &r, pe, "e.key", &["--capability", "embedding"]);
    wait_agents(r.http, "m", 1);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        demand(&r),
        Some(1.0),
        "still held after the embedding agent"
    );
    assert_eq!(outcome(&r, "woken"), 0.0);
    // A new chat request is held too, not sent to the embedding agent.
    let s2 = send(r.http, "/v1/chat/completions", &chat_body("m", false), "");
    wait_until(
        Duration::from_secs(5),
        || demand(&r) == Some(2.0),
        "second held",
    );
    let (_sc, pc) = start_sim(&dir, "m", &[]);
    let _c = start_agent(&dir, &r, pc, "c.key", &[]);
    for s in [s, s2] {
        let (head, body) = read_all(s);
        assert!(head.starts_with("HTTP/1.1 200"), "{head} {body}");
        assert!(body.contains("chat.completion"), "{body}");
    }
    assert_eq!(outcome(&r, "woken"), 2.0);
}

/// Issue 28 #2: the seed holds a request when no *healthy* agent serves
/// the model here, not only when none is registered. The agent's backend
/// goes down (the agent stays registered, reporting it unhealthy): a
/// request is held, counted in the demand, and served when the backend
/// comes back and the agent recovers.
#[test]
fn a_model_whose_agents_are_all_unhealthy_is_held_and_released_on_recovery() {
    let dir = tmpdir("hold-unhealthy");
    let r = site_router(
        &dir,
        &["--wake-keepalive", "0", "--heartbeat-interval", "200ms"],
        &[],
    );
    push_map(&r, "30s");
    let (mut sim, port) = start_sim(&dir, "m", &[]);
    let _a = start_agent(
        &dir,
        &r,
        port,
        "a.key",
        &["--hardware-sample-interval", "100ms"],
    );
    wait_agents(r.http, "m", 1);
    sim.kill9();
    wait_until(
        Duration::from_secs(10),
        || healthy_agents(r.http, "m") == 0,
        "the agent reports its backend down",
    );
    let s = send(r.http, "/v1/chat/completions", &chat_body("m", false), "");
    wait_until(
        Duration::from_secs(5),
        || demand(&r) == Some(1.0),
        "held, not refused with 503",
    );
    let ps = port.to_string();
    let _sim2 = spawn("hivenet-sim", &["--port", &ps, "--model", "m"], &dir, &[]);
    let (head, body) = read_all(s);
    assert!(head.starts_with("HTTP/1.1 200"), "{head} {body}");
    assert!(body.contains("chat.completion"), "{body}");
    assert_eq!(outcome(&r, "woken"), 1.0);
}

/// Place `e` (embedding) and `rr` (rerank) here with scale_from_zero.
fn push_kinds(r: &Router) {
    push_placements(
        r,
        "2",
        &[
            at_zero("e", "embedding", "20s"),
            at_zero("rr", "rerank", "20s"),
        ],
    );
}

/// Issue 28 (missing tests): every inference endpoint is held by the
/// placement kind that matches it (seed 2): embeddings by an `embedding`
/// placement, rerank by a `rerank` one, each released by an agent of its
/// capability and served; a chat request for the embedding model is not
/// held (no chat placement).
#[test]
fn embedding_and_rerank_requests_are_held_and_served() {
    let dir = tmpdir("hold-kinds");
    let r = site_router(&dir, &["--wake-keepalive", "0"], &[]);
    push_kinds(&r);
    let held = |model: &str| {
        metric(
            r.metrics,
            &format!("hivenet_pending_demand{{model=\"{model}\"}}"),
        )
    };
    let e = send(
        r.http,
        "/v1/embeddings",
        r#"{"model":"e","input":"hello"}"#,
        "",
    );
    let rr = send(
        r.http,
        "/v1/rerank",
        r#"{"model":"rr","query":"q","documents":["a","b"]}"#,
        "",
    );
    wait_until(
        Duration::from_secs(5),
        || held("e") == Some(1.0) && held("rr") == Some(1.0),
        "both held",
    );
    let (st, _) = Req::post("/v1/chat/completions", chat_body("e", false))
        .send(r.http)
        .map(Resp::pair)
        .expect("chat");
    assert_eq!(st, 404, "no chat placement: not held");
    let (_se, pe) = start_sim(&dir, "e", &[]);
    let _ae = start_agent(&dir, &r, pe, "e.key", &["--capability", "embedding"]);
    let (_sr, pr) = start_sim(&dir, "rr", &[]);
    let _ar = start_agent(&dir, &r, pr, "rr.key", &["--capability", "reranker"]);
    let (head, body) = read_all(e);
    assert!(head.starts_with("HTTP/1.1 200"), "{head} {body}");
    assert!(body.contains("embedding"), "{body}");
    let (head, body) = read_all(rr);
    assert!(head.starts_with("HTTP/1.1 200"), "{head} {body}");
    assert!(body.contains("results"), "{body}");
    assert_eq!(held("e"), Some(0.0));
    assert_eq!(held("rr"), Some(0.0));
}

/// Issue 28 (missing tests): the hold's flags are refused at start when
/// they are not greater than 0 (seed 2), with one line naming the flag.
#[test]
fn hold_flags_out_of_range_stop_the_start() {
    let dir = tmpdir("hold-flags");
    for (flag, value) in [
        ("--wake-hold-budget", "0s"),
        ("--wake-hold-max-total", "0"),
        ("--wake-hold-max-per-model", "0"),
        ("--wake-hold-max-per-key", "0"),
        ("--wake-keepalive", "-1s"),
    ] {
        // Spawned and bounded: a router that starts anyway fails the
        // test instead of hanging it.
        let child = std::process::Command::new(bin("hivenet-router"))
            .args(["--site-id", "a", "--p2p-port", "0", flag, value])
            .env("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN)
            .current_dir(&dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run");
        let (code, err) = exit_within(child, Duration::from_secs(10));
        assert_eq!(code, Some(2), "{flag} {value}: started anyway? {err}");
        assert!(err.contains(flag), "{flag} {value}: {err}");
    }
}

/// Issue 28 (missing tests): a held request that expires and one whose
/// client leaves each leave one audit line with the model and the logical
/// status (503 model_waking, 499), not the 200 sent on the wire.
#[test]
fn audit_lines_of_held_requests_carry_the_model_and_the_logical_status() {
    let dir = tmpdir("hold-audit");
    let log = dir.join("audit.jsonl");
    let log_s = log.to_string_lossy().to_string();
    let r = site_router(
        &dir,
        &["--wake-keepalive", "200ms"],
        &[("HIVENET_ROUTER_AUDIT_LOG_PATH", &log_s)],
    );
    push_map(&r, "1s");
    let expired = send(r.http, "/v1/chat/completions", &chat_body("m", false), "");
    let gone = send(r.http, "/v1/chat/completions", &chat_body("m", false), "");
    wait_until(Duration::from_secs(5), || demand(&r) == Some(2.0), "held");
    drop(gone);
    let (head, body) = read_all(expired);
    assert!(head.starts_with("HTTP/1.1 200"), "committed: {head}");
    assert!(body.contains("model_waking"), "{body}");
    let lines = || -> Vec<serde_json::Value> {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    // The admin push has a line too: wait for the two held requests'.
    let has = |status: u64| lines().iter().any(|l| l["status_code"] == status);
    wait_until(
        Duration::from_secs(5),
        || has(503) && has(499),
        "the audit lines of both held requests",
    );
    let all = lines();
    let waking = all
        .iter()
        .find(|l| l["status_code"] == 503)
        .unwrap_or_else(|| panic!("a 503 line: {all:?}"));
    assert_eq!(waking["model"], "m");
    assert_eq!(waking["error_code"], "model_waking");
    let left = all
        .iter()
        .find(|l| l["status_code"] == 499)
        .unwrap_or_else(|| panic!("a 499 line: {all:?}"));
    assert_eq!(left["model"], "m");
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

/// Issue 28 (missing test), seed 2 "After the wake": the admission gate
/// lets a released request wait for room until its hold budget ends, even
/// with `HIVENET_ROUTER_ADMIT_PARK_TIMEOUT=0`. `max_inflight: 1` and three
/// held requests: all three are served one after another, none refused;
/// a request that was never held, sent meanwhile, is refused at once (429)
/// as the park timeout of 0 says.
#[test]
fn released_requests_wait_for_admission_room_until_the_hold_budget() {
    let dir = tmpdir("hold-admit");
    let pf = dir.join("policy.yaml");
    std::fs::write(
        &pf,
        "max_inflight: 1\nrouting_policy:\n  strategy: least-loaded\n",
    )
    .expect("policy");
    let pfs = pf.to_string_lossy().to_string();
    let r = site_router(
        &dir,
        &["--wake-keepalive", "0", "--policy-file", &pfs],
        &[("HIVENET_ROUTER_ADMIT_PARK_TIMEOUT", "0")],
    );
    push_map(&r, "30s");
    let held = chats_in_background(r.http, 3);
    wait_until(Duration::from_secs(5), || demand(&r) == Some(3.0), "held");
    let (_sim, port) = start_sim(&dir, "m", &["--ttft", "700ms"]);
    let _a = start_agent(&dir, &r, port, "a.key", &["--capacity", "4"]);
    wait_agents(r.http, "m", 1);
    // One of the released requests holds the only admission place now.
    std::thread::sleep(Duration::from_millis(200));
    let (st, _, body) = Req::post("/v1/chat/completions", chat_body("m", false))
        .send(r.http)
        .map(Resp::triple)
        .expect("fresh");
    assert_eq!(st, 429, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("concurrency_limit_exceeded"));
    for h in held {
        let (head, body) = h.join().expect("thread");
        assert!(head.starts_with("HTTP/1.1 200"), "{head} {body}");
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
