//! Admission end to end against real routers, agents and simulated
//! backends: B2 occupancy (`max_inflight` parks then refuses, a second
//! replica doubles the room and wakes parked requests, a client leaving
//! while parked frees its place at once), B3 `shed_if` on KV-cache use
//! that the simulator changes at run time, B1 request caps, and B4 ITPM /
//! OTPM per key with two keys that do not affect each other.

mod common;
use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn policy_router(dir: &std::path::Path, policy: &str, env: &[(&str, &str)]) -> Router {
    std::fs::write(dir.join("policy.yaml"), policy).expect("policy");
    start_router(dir, &["--shards", "1", "--policy-file", "policy.yaml"], env)
}

fn chat_body_text(model: &str, text: &str, extra: &str) -> String {
    format!(r#"{{"model":"{model}"{extra},"messages":[{{"role":"user","content":"{text}"}}]}}"#)
}

/// Fire `n` chats at once; returns (status, head, body) of each.
fn concurrent(http: u16, model: &str, n: usize) -> Vec<(u16, String, Vec<u8>)> {
    let handles: Vec<_> = (0..n)
        .map(|_| {
            let body = chat_body(model, false);
            std::thread::spawn(move || {
                Req::new("POST", "/v1/chat/completions")
                    .body(body.as_bytes())
                    .raw_headers("")
                    .send(http)
                    .map(Resp::triple)
                    .expect("answered")
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("thread"))
        .collect()
}

fn gauge(r: &Router, name: &str, model: &str) -> Option<f64> {
    metric(r.metrics, &format!("{name}{{model=\"{model}\"}}"))
}

fn rejections(r: &Router, reason: &str, model: &str) -> f64 {
    metric(
        r.metrics,
        &format!("hivenet_admission_rejections_total{{reason=\"{reason}\",model=\"{model}\"}}"),
    )
    .unwrap_or(0.0)
}

#[test]
fn max_inflight_parks_then_refuses_and_a_second_replica_doubles_the_room() {
    let dir = tmpdir("adm-inflight");
    let r = policy_router(
        &dir,
        "models: [m]\nmax_inflight: 2\nrouting_policy:\n  strategy: least-loaded\n",
        &[("HIVENET_ROUTER_ADMIT_PARK_TIMEOUT", "300ms")],
    );
    let (_s1, p1) = start_sim(&dir, "m", &["--ttft", "1500ms"]);
    let _a1 = start_agent(&dir, &r, p1, "a1.key", &[]);
    wait_agents(r.http, "m", 1);

    let out = concurrent(r.http, "m", 10);
    let ok = out.iter().filter(|x| x.0 == 200).count();
    let refused: Vec<_> = out.iter().filter(|x| x.0 == 429).collect();
    assert_eq!(ok, 2, "max_inflight 2 x 1 replica");
    assert_eq!(refused.len(), 8, "the rest parked, then refused: none lost");
    for (_, head, body) in &refused {
        let b = String::from_utf8_lossy(body);
        assert!(b.contains("concurrency_limit_exceeded"), "{b}");
        assert!(b.contains("server at capacity for this model"), "{b}");
        assert_eq!(header_of(head, "retry-after").as_deref(), Some("1"));
    }
    assert_eq!(rejections(&r, "b2", "m"), 8.0);
    assert_eq!(gauge(&r, "hivenet_admission_max_inflight", "m"), Some(2.0));
    assert_eq!(
        gauge(&r, "hivenet_admission_inflight_requests", "m"),
        Some(0.0)
    );

    let (_s2, p2) = start_sim(&dir, "m", &["--ttft", "1500ms"]);
    let _a2 = start_agent(&dir, &r, p2, "a2.key", &[]);
    wait_agents(r.http, "m", 2);
    let out = concurrent(r.http, "m", 10);
    let ok = out.iter().filter(|x| x.0 == 200).count();
    assert_eq!(ok, 4, "two replicas: room for four");
    assert_eq!(out.iter().filter(|x| x.0 == 429).count(), 6);
    assert_eq!(gauge(&r, "hivenet_admission_max_inflight", "m"), Some(4.0));
}

#[test]
fn parked_requests_are_served_in_order_when_room_frees_or_a_replica_joins() {
    let dir = tmpdir("adm-park");
    let r = policy_router(
        &dir,
        "max_inflight: 1\nrouting_policy:\n  strategy: least-loaded\n",
        &[("HIVENET_ROUTER_ADMIT_PARK_TIMEOUT", "20s")],
    );
    let (_s1, p1) = start_sim(&dir, "m", &["--ttft", "700ms"]);
    let _a1 = start_agent(&dir, &r, p1, "a1.key", &[]);
    wait_agents(r.http, "m", 1);
    // Three at once with room for one: each waits its turn, all served.
    let t0 = Instant::now();
    let out = concurrent(r.http, "m", 3);
    assert!(out.iter().all(|x| x.0 == 200), "all served after parking");
    assert!(
        t0.elapsed() >= Duration::from_millis(2000),
        "one at a time: {:?}",
        t0.elapsed()
    );
    assert_eq!(rejections(&r, "b2", "m"), 0.0);
}

#[test]
fn a_replica_registering_admits_a_parked_request() {
    let dir = tmpdir("adm-join");
    let r = policy_router(
        &dir,
        "max_inflight: 1\nrouting_policy:\n  strategy: least-loaded\n",
        &[("HIVENET_ROUTER_ADMIT_PARK_TIMEOUT", "20s")],
    );
    let (_s1, p1) = start_sim(&dir, "m", &["--ttft", "6s"]);
    let (_s2, p2) = start_sim(&dir, "m", &["--ttft", "6s"]);
    let _a1 = start_agent(&dir, &r, p1, "a1.key", &[]);
    wait_agents(r.http, "m", 1);
    let send = move || Req::chat("m").send(r.http).map(Resp::triple);
    let long = std::thread::spawn(send);
    wait_until(
        Duration::from_secs(5),
        || gauge(&r, "hivenet_admission_inflight_requests", "m") == Some(1.0),
        "the long request holds the room",
    );
    let parked = std::thread::spawn(send);
    wait_until(
        Duration::from_secs(5),
        || gauge(&r, "hivenet_admission_parked_requests", "m") == Some(1.0),
        "the second request parks",
    );
    let _a2 = start_agent(&dir, &r, p2, "a2.key", &[]);
    wait_until(
        Duration::from_secs(5),
        || gauge(&r, "hivenet_admission_parked_requests", "m") == Some(0.0),
        "a registration re-checks the room",
    );
    assert_eq!(
        gauge(&r, "hivenet_admission_inflight_requests", "m"),
        Some(2.0),
        "admitted while the first one still runs"
    );
    assert_eq!(parked.join().expect("thread").expect("answered").0, 200);
    assert_eq!(long.join().expect("thread").expect("answered").0, 200);
}

#[test]
fn a_client_leaving_while_parked_or_streaming_frees_its_room_at_once() {
    let dir = tmpdir("adm-gone");
    let r = policy_router(
        &dir,
        "max_inflight: 1\nadmit_budget_tokens: 100000\nrouting_policy:\n  strategy: least-loaded\n",
        &[("HIVENET_ROUTER_ADMIT_PARK_TIMEOUT", "30s")],
    );
    let (_s, p) = start_sim(
        &dir,
        "m",
        &["--ttft", "50ms", "--itl", "150ms", "--output-tokens", "60"],
    );
    let _a = start_agent(&dir, &r, p, "a.key", &[]);
    wait_agents(r.http, "m", 1);
    // A stream without max_tokens holds the room and grows as it streams.
    let body = chat_body_text("m", "tell me a long story", r#","stream":true"#);
    let mut holder = TcpStream::connect(("127.0.0.1", r.http)).expect("connect");
    holder
        .write_all(
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .expect("write");
    let mut first = [0u8; 256];
    holder.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let n = holder.read(&mut first).expect("first bytes");
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    let start_occ = gauge(&r, "hivenet_admission_occupancy_tokens", "m").unwrap_or(0.0);
    assert!(start_occ > 0.0, "the stream reserves its input estimate");
    wait_until(
        Duration::from_secs(8),
        || gauge(&r, "hivenet_admission_occupancy_tokens", "m").unwrap_or(0.0) > start_occ,
        "an undeclared stream's reservation grows with its content",
    );
    // A second request parks behind it.
    let body2 = chat_body("m", false);
    let mut waiter = TcpStream::connect(("127.0.0.1", r.http)).expect("connect");
    waiter
        .write_all(
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body2}",
                body2.len()
            )
            .as_bytes(),
        )
        .expect("write");
    wait_until(
        Duration::from_secs(5),
        || gauge(&r, "hivenet_admission_parked_requests", "m") == Some(1.0),
        "parked",
    );
    // It leaves: its place is freed at once.
    drop(waiter);
    let t = Instant::now();
    wait_until(
        Duration::from_secs(5),
        || gauge(&r, "hivenet_admission_parked_requests", "m") == Some(0.0),
        "the departed waiter's place",
    );
    let parked_gone = t.elapsed();
    // The streaming client leaves: its reservation goes with the next chunk.
    drop(holder);
    let t = Instant::now();
    wait_until(
        Duration::from_secs(5),
        || {
            gauge(&r, "hivenet_admission_inflight_requests", "m") == Some(0.0)
                && gauge(&r, "hivenet_admission_occupancy_tokens", "m") == Some(0.0)
        },
        "the departed stream's reservation",
    );
    let stream_gone = t.elapsed();
    eprintln!("freed: parked {parked_gone:?}, streaming {stream_gone:?}");
    assert!(
        parked_gone <= Duration::from_millis(100),
        "parked place freed within 100 ms: {parked_gone:?}"
    );
    // Found when the next chunk (150 ms apart) fails to reach the client;
    // the bound leaves room for a loaded machine.
    assert!(
        stream_gone <= Duration::from_millis(1000),
        "stream reservation freed at the next chunk: {stream_gone:?}"
    );
    assert_eq!(
        Req::chat("m")
            .send(r.http)
            .map(Resp::triple)
            .expect("after")
            .0,
        200,
        "the room is free again"
    );
}

#[test]
fn shed_if_sheds_under_kv_pressure_and_stops_when_it_drops() {
    let dir = tmpdir("adm-shed");
    let r = policy_router(
        &dir,
        "shed_if:\n  kv_cache_utilization: {gt: 0.9}\nrouting_policy:\n  strategy: least-loaded\n",
        &[],
    );
    let (_s, p) = start_sim(&dir, "m", &["--kv-cache-usage", "0.95"]);
    let _a = start_agent(&dir, &r, p, "a.key", &["--engine-sample-interval", "100ms"]);
    wait_agents(r.http, "m", 1);
    let kv = |want: f64| {
        move || {
            routing_table(r.http)["agents"]
                .as_array()
                .and_then(|a| a.first().cloned())
                .and_then(|a| a["engine"]["kv_cache_utilization"].as_f64())
                == Some(want)
        }
    };
    wait_until(Duration::from_secs(10), kv(0.95), "kv 0.95 reported");
    let (st, head, body) = Req::chat("m").send(r.http).map(Resp::triple).expect("shed");
    let b = String::from_utf8_lossy(&body);
    assert_eq!(st, 429, "{b}");
    assert!(
        b.contains("concurrency_limit_exceeded") && b.contains("under high load"),
        "{b}"
    );
    assert_eq!(header_of(&head, "retry-after").as_deref(), Some("1"));
    assert_eq!(rejections(&r, "b3", "m"), 1.0);
    // Embeddings are exempt from admission.
    let (st, _) = Req::post("/v1/embeddings", r#"{"model":"m","input":"x"}"#)
        .send(r.http)
        .map(Resp::pair)
        .expect("emb");
    assert_ne!(st, 429, "embeddings never shed");

    let (st, _) = Req::new("PUT", "/sim/kv_cache_usage")
        .body(b"0.2")
        .send(p)
        .map(Resp::pair)
        .expect("set kv");
    assert_eq!(st, 200);
    wait_until(Duration::from_secs(10), kv(0.2), "kv 0.2 reported");
    let (st, _, body) = Req::chat("m")
        .send(r.http)
        .map(Resp::triple)
        .expect("served");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
}

#[test]
fn b1_caps_refuse_long_prompts_and_too_many_images() {
    let dir = tmpdir("adm-b1");
    let r = policy_router(
        &dir,
        "max_input_tokens: 50\nimages_max: 1\nrouting_policy:\n  strategy: least-loaded\n",
        &[],
    );
    let (_s, p) = start_sim(&dir, "m", &[]);
    let _a = start_agent(&dir, &r, p, "a.key", &[]);
    wait_agents(r.http, "m", 1);
    let long = "x".repeat(1000);
    let (st, head, body) = Req::new("POST", "/v1/chat/completions")
        .body(chat_body_text("m", &long, "").as_bytes())
        .raw_headers("")
        .send(r.http)
        .map(Resp::triple)
        .expect("long");
    let b = String::from_utf8_lossy(&body);
    assert_eq!(st, 400, "{b}");
    assert!(b.contains("input_too_long"), "{b}");
    assert!(
        b.contains("input is 313 tokens, over the model limit of 50"),
        "{b}"
    );
    assert_eq!(header_of(&head, "retry-after"), None, "B1 is not retried");
    let img = r#"{"type":"image_url","image_url":{"url":"data:x"}}"#;
    let two = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"look"}},{img},{img}]}}]}}"#
    );
    let (st, _, body) = Req::new("POST", "/v1/chat/completions")
        .body(two.as_bytes())
        .raw_headers("")
        .send(r.http)
        .map(Resp::triple)
        .expect("images");
    let b = String::from_utf8_lossy(&body);
    assert_eq!(st, 400, "{b}");
    assert!(
        b.contains("request carries 2 images, over the model limit of 1"),
        "{b}"
    );
    assert_eq!(
        Req::chat("m")
            .send(r.http)
            .map(Resp::triple)
            .expect("short")
            .0,
        200
    );
    // count_tokens is exempt.
    let (st, _, _) = Req::new("POST", "/v1/messages/count_tokens")
        .body(chat_body_text("m", &long, "").as_bytes())
        .raw_headers("")
        .send(r.http)
        .map(Resp::triple)
        .expect("count");
    assert_ne!(st, 400, "count_tokens skips B1");
    assert_eq!(rejections(&r, "b1", "m"), 2.0);
}

#[test]
fn serverless_itpm_and_otpm_are_per_key() {
    let dir = tmpdir("adm-b4");
    let mut yaml = String::from("api:\n  mode: api-key\n  keys:\n");
    for (key, quota) in [
        ("sk-in-a", "{input_tokens_per_minute: 100}"),
        ("sk-in-b", "{input_tokens_per_minute: 100}"),
        ("sk-out-c", "{output_tokens_per_minute: 20}"),
        ("sk-out-d", "{output_tokens_per_minute: 20}"),
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
    let r = start_router(
        &dir,
        &[
            "--shards",
            "1",
            "--policy-file",
            "policy.yaml",
            "--auth-config-file",
            "auth.yaml",
        ],
        &[],
    );
    let (_s, p) = start_sim(&dir, "m", &["--output-tokens", "16"]);
    let _a = start_agent(&dir, &r, p, "a.key", &[]);
    wait_until(
        Duration::from_secs(30),
        || {
            Req::get("/v1/models/m")
                .bearer("sk-in-a")
                .send(r.http)
                .map(Resp::pair)
                .map(|x| x.0 == 200)
                .unwrap_or(false)
        },
        "agent",
    );
    // 320 text bytes: a cold estimate of 100 input tokens, the whole minute.
    let big = chat_body_text("m", &"y".repeat(320), r#","max_tokens":4"#);
    let send = |key: &str, body: &str| {
        Req::new("POST", "/v1/chat/completions")
            .body(body.as_bytes())
            .raw_headers(&format!("Authorization: Bearer {key}\r\n"))
            .send(r.http)
            .map(Resp::triple)
            .expect("chat")
    };
    assert_eq!(send("sk-in-a", &big).0, 200);
    let (st, head, body) = send("sk-in-a", &big);
    let b = String::from_utf8_lossy(&body);
    assert_eq!(st, 429, "{b}");
    assert!(
        b.contains("rate_limit_exceeded") && b.contains("input token rate exceeded"),
        "{b}"
    );
    assert_eq!(header_of(&head, "retry-after").as_deref(), Some("1"));
    assert_eq!(
        send("sk-in-b", &big).0,
        200,
        "another key has its own bucket"
    );

    let small = chat_body_text("m", "hi", r#","max_tokens":16"#);
    assert_eq!(send("sk-out-c", &small).0, 200, "20 - 16 = 4 left");
    assert_eq!(send("sk-out-c", &small).0, 200, "one token left is enough");
    let (st, _, body) = send("sk-out-c", &small);
    let b = String::from_utf8_lossy(&body);
    assert_eq!(st, 429, "{b}");
    assert!(b.contains("output token rate exceeded"), "{b}");
    assert_eq!(send("sk-out-d", &small).0, 200, "d is not c");
    assert_eq!(rejections(&r, "b4_itpm", "m"), 1.0);
    assert_eq!(rejections(&r, "b4_otpm", "m"), 1.0);
}

#[test]
fn a_serverless_policy_whose_input_cap_no_key_can_pay_is_refused_at_start() {
    let dir = tmpdir("adm-cross");
    std::fs::write(
        dir.join("auth.yaml"),
        format!(
            "api:\n  mode: api-key\n  keys:\n    - key_hash: \"{}\"\n      metadata: {{name: small, owner: t}}\n      quota: {{input_tokens_per_minute: 1000}}\n",
            sha256_hex("sk-small")
        ),
    )
    .expect("auth");
    std::fs::write(
        dir.join("policy.yaml"),
        "mode: serverless\nmax_input_tokens: 4096\nrouting_policy:\n  strategy: least-loaded\n",
    )
    .expect("policy");
    let out = std::process::Command::new(bin("hivenet-router"))
        .current_dir(&dir)
        .env("HIVENET_ROUTER_ALLOW_INSECURE_ADMIN", "true")
        .args([
            "--policy-file",
            "policy.yaml",
            "--auth-config-file",
            "auth.yaml",
            "--http-port",
            &format!("127.0.0.1:{}", free_port()),
            "--metrics-port",
            &format!("127.0.0.1:{}", free_port()),
            "--p2p-port",
            &free_port().to_string(),
        ])
        .output()
        .expect("run");
    assert!(!out.status.success(), "refused at start");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("\"small\"") && err.contains("max_input_tokens 4096"),
        "{err}"
    );
}

#[test]
fn reservations_are_released_on_errors_timeouts_and_later_refusals() {
    let dir = tmpdir("adm-release");
    std::fs::write(
        dir.join("auth.yaml"),
        format!(
            "api:\n  mode: api-key\n  keys:\n    - key_hash: \"{}\"\n      metadata: {{name: k, owner: t}}\n      quota: {{tokens_per_day: 30}}\n",
            sha256_hex("sk-day")
        ),
    )
    .expect("auth");
    std::fs::write(
        dir.join("policy.yaml"),
        "max_inflight: 1\nadmit_budget_tokens: 100000\nrouting_policy:\n  strategy: least-loaded\n",
    )
    .expect("policy");
    let r = start_router(
        &dir,
        &[
            "--shards",
            "1",
            "--policy-file",
            "policy.yaml",
            "--auth-config-file",
            "auth.yaml",
            "--request-timeout",
            "1s",
        ],
        &[("HIVENET_ROUTER_ALLOW_INSECURE_ADMIN", "true")],
    );
    let (_bad, pb) = start_sim(&dir, "broken", &["--error-rate", "1"]);
    let (_slow, ps) = start_sim(&dir, "slow", &["--ttft", "3s"]);
    let (_ok, po) = start_sim(&dir, "m", &[]);
    let _a = start_agent(&dir, &r, pb, "b.key", &[]);
    let _b = start_agent(&dir, &r, ps, "s.key", &[]);
    let _c = start_agent(&dir, &r, po, "o.key", &[]);
    for m in ["broken", "slow", "m"] {
        wait_until(
            Duration::from_secs(30),
            || {
                Req::get(&format!("/v1/models/{m}"))
                    .bearer("sk-day")
                    .send(r.http)
                    .map(Resp::pair)
                    .map(|x| x.0 == 200)
                    .unwrap_or(false)
            },
            m,
        );
    }
    let send = |model: &str, max: u32| {
        let body = chat_body_text(model, "hi", &format!(r#","max_tokens":{max}"#));
        Req::new("POST", "/v1/chat/completions")
            .body(body.as_bytes())
            .raw_headers("Authorization: Bearer sk-day\r\n")
            .send(r.http)
            .map(Resp::triple)
            .expect("answered")
            .0
    };
    let idle = |model: &str| {
        gauge(&r, "hivenet_admission_inflight_requests", model) == Some(0.0)
            && gauge(&r, "hivenet_admission_occupancy_tokens", model) == Some(0.0)
    };
    // Backend error: its 500 is a backend_error (502) after the agent's
    // classifier (spec 03 §8); the room comes back (max_inflight 1 would
    // refuse the second one otherwise).
    for _ in 0..2 {
        assert_eq!(send("broken", 4), 502);
    }
    assert!(idle("broken"), "released after errors");
    // Request timeout while the backend thinks.
    assert_eq!(send("slow", 4), 504);
    assert!(idle("slow"), "released after a timeout");
    // Admitted, then refused by the daily budget (30 tokens): the
    // reservation taken by B2 goes back.
    assert_eq!(send("m", 100), 429);
    assert!(idle("m"), "released after a later refusal");
    assert_eq!(send("m", 4), 200);
    assert!(idle("m"), "released after success");
}
