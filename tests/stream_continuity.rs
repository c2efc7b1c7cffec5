//! Issue 33: a stream whose agent dies mid-answer goes on on another
//! agent, and the client sees one whole stream: the same text as an
//! uninterrupted answer, byte for byte, one role delta, one ID, one usage
//! that counts both parts, a clean end. What cannot be continued is cut
//! as before.

mod common;
use common::*;
use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

/// The simulator's words, in order (bench/src/sim.rs `WORDS`).
const WORDS: [&str; 16] = [
    "The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".", " Hivenet",
    " routes", " every", " token", " home", ".",
];

fn expected(n: usize) -> String {
    (0..n).map(|i| WORDS[i % WORDS.len()]).collect()
}

/// A whole streamed response: (raw bytes, body dechunked, clean end).
fn stream(http: u16, path: &str, body: &str) -> (String, String, bool) {
    let mut s = TcpStream::connect(("127.0.0.1", http)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut got = Vec::new();
    let clean = read_stream_end(&mut s, &mut got);
    let head_end = got
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(got.len(), |i| i + 4);
    let body = String::from_utf8_lossy(&dechunk(&got[head_end..])).to_string();
    (String::from_utf8_lossy(&got).to_string(), body, clean)
}

fn events(body: &str) -> Vec<serde_json::Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect()
}

/// The text, role deltas, IDs and usage of an OpenAI stream.
fn openai_parts(body: &str) -> (String, usize, Vec<String>, Option<serde_json::Value>) {
    let mut text = String::new();
    let (mut roles, mut ids, mut usage) = (0, Vec::new(), None);
    for e in events(body) {
        if let Some(id) = e["id"].as_str() {
            if !ids.iter().any(|i| i == id) {
                ids.push(id.to_string());
            }
        }
        let d = &e["choices"][0]["delta"];
        if d.get("role").is_some() {
            roles += 1;
        }
        if let Some(t) = d["content"].as_str() {
            text.push_str(t);
        }
        if e["usage"].is_object() {
            usage = Some(e["usage"].clone());
        }
    }
    (text, roles, ids, usage)
}

fn migrations(metrics: u16, outcome: &str) -> f64 {
    metric(
        metrics,
        &format!("hivenet_stream_migrations_total{{model=\"m\",outcome=\"{outcome}\"}}"),
    )
    .unwrap_or(0.0)
}

/// Two engines: one dies in the middle of every streamed answer (the
/// simulator's `--abort-rate 1`: the connection closed without the
/// stream's end), one never does. Every answer is whole, whichever the
/// request landed on, and every answer that broke was continued.
#[test]
fn an_engine_dying_mid_stream_is_continued_byte_exact() {
    let dir = tmpdir("cont-engine");
    let audit = dir.join("audit.jsonl");
    let audit_s = audit.to_string_lossy().to_string();
    let router = start_router(
        &dir,
        &["--shards", "2"],
        &[("HIVENET_ROUTER_AUDIT_LOG_PATH", &audit_s)],
    );
    let opts = ["--output-tokens", "40", "--itl", "1ms"];
    let (_bad, pb) = start_sim(&dir, "m", &[&opts[..], &["--abort-rate", "1"]].concat());
    let (_good, pg) = start_sim(&dir, "m", &opts);
    let _a1 = start_agent(&dir, &router, pb, "bad.key", &[]);
    let _a2 = start_agent(&dir, &router, pg, "good.key", &[]);
    wait_agents(router.http, "m", 2);
    let want = expected(40);
    let n = 12;
    for i in 0..n {
        let body = format!(
            r#"{{"model":"m","stream":true,"stream_options":{{"include_usage":true}},"max_tokens":100,"messages":[{{"role":"user","content":"hello {i}"}}]}}"#
        );
        let (raw, body, clean) = stream(router.http, "/v1/chat/completions", &body);
        assert!(clean, "request {i}: no clean end:\n{raw}");
        let (text, roles, ids, usage) = openai_parts(&body);
        assert_eq!(text, want, "request {i}: text\n{body}");
        assert_eq!(roles, 1, "request {i}: one role delta\n{body}");
        assert_eq!(ids.len(), 1, "request {i}: one ID {ids:?}");
        let u = usage.unwrap_or_else(|| panic!("request {i}: a usage event\n{body}"));
        assert_eq!(u["completion_tokens"], 40, "request {i}: {u}");
        let (p, c, t) = (
            u["prompt_tokens"].as_u64().unwrap_or(0),
            u["completion_tokens"].as_u64().unwrap_or(0),
            u["total_tokens"].as_u64().unwrap_or(0),
        );
        assert_eq!(p + c, t, "request {i}: {u}");
        assert_eq!(body.matches("[DONE]").count(), 1, "{body}");
        assert!(!body.contains("event: error"), "{body}");
        // Anthropic's shape too.
        let body = format!(
            r#"{{"model":"m","stream":true,"max_tokens":100,"messages":[{{"role":"user","content":"hi {i}"}}]}}"#
        );
        let (raw, body, clean) = stream(router.http, "/v1/messages", &body);
        assert!(clean, "messages {i}: no clean end:\n{raw}");
        let mut text = String::new();
        let (mut starts, mut out_tokens) = (0, None);
        for e in events(&body) {
            match e["type"].as_str() {
                Some("message_start") => starts += 1,
                Some("content_block_delta") => {
                    text.push_str(e["delta"]["text"].as_str().unwrap_or(""))
                }
                Some("message_delta") => out_tokens = e["usage"]["output_tokens"].as_u64(),
                _ => {}
            }
        }
        assert_eq!(text, want, "messages {i}\n{body}");
        assert_eq!(starts, 1, "one message_start\n{body}");
        assert_eq!(out_tokens, Some(40), "{body}");
        assert_eq!(body.matches("event: message_stop").count(), 1, "{body}");
    }
    // Every answer that landed on the dying engine broke and was continued.
    let broke = metric(
        router.metrics,
        "hivenet_agent_connection_resets_total{model=\"m\",reason=\"stream_cut\"}",
    )
    .unwrap_or(0.0);
    let continued = migrations(router.metrics, "continued");
    assert!(broke >= 1.0, "some answers landed on the dying engine");
    assert_eq!(continued, broke, "{}", metrics_text(router.metrics));
    // The audit line says where.
    wait_until(
        Duration::from_secs(5),
        || {
            std::fs::read_to_string(&audit)
                .unwrap_or_default()
                .contains("\"continued_from\":[\"12D3KooW")
        },
        "an audit line with continued_from",
    );
}

/// An agent killed mid-stream (its process gone, the link with it): the
/// stream goes on on the other agent.
#[test]
fn a_killed_agents_stream_continues_on_another() {
    let dir = tmpdir("cont-kill");
    let router = start_router(&dir, &["--shards", "2"], &[]);
    let slow = ["--ttft", "10ms", "--itl", "50ms", "--output-tokens", "60"];
    let (_s1, p1) = start_sim(&dir, "m", &slow);
    let (_s2, p2) = start_sim(&dir, "m", &slow);
    let mut a1 = start_agent(&dir, &router, p1, "a1.key", &[]);
    let mut a2 = start_agent(&dir, &router, p2, "a2.key", &[]);
    wait_agents(router.http, "m", 2);
    let body = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let http = router.http;
    let client = std::thread::spawn(move || stream(http, "/v1/chat/completions", body));
    // Kill the serving agent once a few tokens went out.
    let a1_peer = peer_in_log(&a1);
    let mut serving = String::new();
    wait_until(
        Duration::from_secs(10),
        || {
            serving = metrics_text(router.metrics)
                .lines()
                .find(|l| l.starts_with("hivenet_agent_active_requests{") && l.ends_with(" 1"))
                .unwrap_or("")
                .to_string();
            !serving.is_empty()
        },
        "one agent serving",
    );
    std::thread::sleep(Duration::from_millis(500));
    if serving.contains(&a1_peer) {
        a1.kill9();
    } else {
        a2.kill9();
    }
    let (raw, body, clean) = client.join().expect("client");
    assert!(clean, "no clean end:\n{raw}");
    let (text, roles, ids, _) = openai_parts(&body);
    assert_eq!(text, expected(60), "{body}");
    assert_eq!((roles, ids.len()), (1, 1), "{body}");
    assert_eq!(migrations(router.metrics, "continued"), 1.0);
}

/// What cannot be continued is cut as before: a request with tools, an
/// agent alone, and `--stream-migrations 0`.
#[test]
fn what_cannot_be_continued_is_cut_as_before() {
    let dir = tmpdir("cont-refused");
    let router = start_router(&dir, &["--shards", "1"], &[]);
    let opts = ["--output-tokens", "30", "--itl", "1ms", "--abort-rate", "1"];
    let (_bad, pb) = start_sim(&dir, "m", &opts);
    let _a1 = start_agent(&dir, &router, pb, "bad.key", &[]);
    wait_agents(router.http, "m", 1);
    let cut = |body: &str| {
        let (raw, body, clean) = stream(router.http, "/v1/chat/completions", body);
        assert!(!clean, "a cut stream must not look complete:\n{raw}");
        assert!(body.contains("event: error"), "{body}");
        assert!(!body.contains("[DONE]"), "{body}");
    };
    cut(
        r#"{"model":"m","stream":true,"tools":[{"type":"function","function":{"name":"f"}}],"messages":[{"role":"user","content":"x"}]}"#,
    );
    assert_eq!(migrations(router.metrics, "tools"), 1.0);
    // No other agent.
    cut(r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}"#);
    assert_eq!(migrations(router.metrics, "no_agent"), 1.0);

    // Disabled: cut, and nothing counted.
    let dir = tmpdir("cont-off");
    let router0 = start_router(&dir, &["--shards", "1", "--stream-migrations", "0"], &[]);
    let (_bad2, pb2) = start_sim(&dir, "m", &opts);
    let (_good, pg) = start_sim(&dir, "m", &["--output-tokens", "30"]);
    let _b1 = start_agent(&dir, &router0, pb2, "bad2.key", &[]);
    let _b2 = start_agent(&dir, &router0, pg, "good2.key", &[]);
    wait_agents(router0.http, "m", 2);
    let mut cuts = 0;
    for i in 0..8 {
        let b = format!(
            r#"{{"model":"m","stream":true,"messages":[{{"role":"user","content":"x{i}"}}]}}"#
        );
        let (_, body, clean) = stream(router0.http, "/v1/chat/completions", &b);
        if !clean {
            assert!(body.contains("event: error"), "{body}");
            cuts += 1;
        }
    }
    assert!(cuts >= 1, "some requests landed on the dying engine");
    let m = metrics_text(router0.metrics);
    assert!(!m.contains("hivenet_stream_migrations_total{"), "{m}");
}

/// `--stream-migrations` is validated at start.
#[test]
fn a_bad_stream_migrations_flag_is_refused() {
    let dir = tmpdir("cont-flag");
    for bad in ["9", "1.5", "x"] {
        let out = std::process::Command::new(bin("hivenet-router"))
            .args(["--stream-migrations", bad])
            .env("HIVENET_ROUTER_ADMIN_API_KEYS", "admin-key-for-tests")
            .current_dir(&dir)
            .output()
            .expect("run");
        assert!(!out.status.success(), "{bad} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--stream-migrations"), "{bad}: {err}");
    }
}

/// Non-streamed answers are buffered whole before any byte reaches the
/// client: an engine dying in the middle of one costs a retry on another
/// agent, never a short or lost answer.
#[test]
fn a_whole_answer_broken_mid_body_is_sent_again() {
    let dir = tmpdir("cont-whole");
    let router = start_router(&dir, &["--shards", "1"], &[]);
    let opts = ["--output-tokens", "24"];
    let (_bad, pb) = start_sim(&dir, "m", &[&opts[..], &["--abort-rate", "1"]].concat());
    let (_good, pg) = start_sim(&dir, "m", &opts);
    let _a1 = start_agent(&dir, &router, pb, "bad.key", &[]);
    let _a2 = start_agent(&dir, &router, pg, "good.key", &[]);
    wait_agents(router.http, "m", 2);
    for i in 0..10 {
        let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"q{i}"}}]}}"#);
        let r = Req::post("/v1/chat/completions", body)
            .send(router.http)
            .expect("send");
        let (status, text) = (r.status, r.text());
        assert_eq!(status, 200, "request {i}: {text}");
        let v: serde_json::Value = serde_json::from_str(&text).expect("whole JSON");
        assert_eq!(
            v["choices"][0]["message"]["content"],
            expected(24),
            "{text}"
        );
    }
    let broke = metric(
        router.metrics,
        "hivenet_backend_errors_total{model=\"m\",status_code=\"502\"}",
    )
    .unwrap_or(0.0);
    assert!(broke >= 1.0, "{}", metrics_text(router.metrics));
}

fn active_of(metrics: u16, peer: &str) -> f64 {
    metrics_text(metrics)
        .lines()
        .filter(|l| l.starts_with("hivenet_agent_active_requests{") && l.contains(peer))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn exited_ok(p: &mut Proc, limit: Duration) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if let Ok(Some(st)) = p.child.try_wait() {
            return st.success();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Agents drained under load (SIGTERM) cut no stream: the routers send
/// them nothing new at once; one with time to finish finishes its streams
/// itself, one whose --drain-timeout passes first leaves and its streams
/// are continued on another agent. Every client stream is whole.
#[test]
fn agents_drained_under_load_cut_no_stream() {
    let dir = tmpdir("cont-drain");
    let router = start_router(&dir, &["--shards", "2"], &[]);
    let slow = ["--ttft", "5ms", "--itl", "20ms", "--output-tokens", "60"];
    let (_s1, p1) = start_sim(&dir, "m", &slow);
    let (_s2, p2) = start_sim(&dir, "m", &slow);
    let (_s3, p3) = start_sim(&dir, "m", &slow);
    let mut patient = start_agent(
        &dir,
        &router,
        p1,
        "patient.key",
        &["--drain-timeout", "20s"],
    );
    let mut hasty = start_agent(
        &dir,
        &router,
        p2,
        "hasty.key",
        &["--drain-timeout", "200ms"],
    );
    let _stays = start_agent(&dir, &router, p3, "stays.key", &[]);
    wait_agents(router.http, "m", 3);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..6)
        .map(|c| {
            let (http, stop) = (router.http, stop.clone());
            std::thread::spawn(move || {
                let mut done = Vec::new();
                let mut i = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let body = format!(
                        r#"{{"model":"m","stream":true,"messages":[{{"role":"user","content":"c{c} {i}"}}]}}"#
                    );
                    done.push(stream(http, "/v1/chat/completions", &body));
                    i += 1;
                }
                done
            })
        })
        .collect();
    // Each drained agent is serving when it is told to stop.
    for (p, name, limit) in [
        (&mut patient, "patient", Duration::from_secs(10)),
        (&mut hasty, "hasty", Duration::from_secs(5)),
    ] {
        let peer = peer_in_log(p);
        wait_until(
            Duration::from_secs(10),
            || active_of(router.metrics, &peer) >= 1.0,
            &format!("{name} serving"),
        );
        signal(p, "TERM");
        assert!(
            exited_ok(p, limit),
            "{name} left cleanly after its drain:\n{}",
            p.log_text()
        );
        wait_until(
            Duration::from_secs(5),
            || !metrics_text(router.metrics).contains(&peer),
            &format!("{name} gone from the router"),
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut n = 0;
    for c in clients {
        for (raw, body, clean) in c.join().expect("client") {
            assert!(clean, "a stream was cut:\n{raw}");
            let (text, roles, ids, _) = openai_parts(&body);
            assert_eq!(text, expected(60), "{body}");
            assert_eq!((roles, ids.len()), (1, 1), "{body}");
            n += 1;
        }
    }
    assert!(n >= 6, "{n} streams");
    let log = router.proc.log_text();
    assert_eq!(
        log.matches("agent draining: no new requests").count(),
        2,
        "{log}"
    );
    // The hasty one left with streams in flight: they were continued.
    assert!(
        migrations(router.metrics, "continued") >= 1.0,
        "{}",
        metrics_text(router.metrics)
    );
    assert!(
        hasty.log_text().contains("--drain-timeout passed"),
        "{}",
        hasty.log_text()
    );
    assert!(
        patient
            .log_text()
            .contains("drained: every request finished"),
        "{}",
        patient.log_text()
    );
}

/// `POST /admin/agents/{peer_id}/drain`: the router sends the agent nothing
/// new at once; what it still streams after the router's --drain-timeout
/// is cut and continued on another agent; `DELETE` puts it back.
#[test]
fn an_admin_drain_sends_nothing_new_and_continues_what_is_left() {
    let dir = tmpdir("cont-admin-drain");
    let router = start_router(&dir, &["--shards", "2", "--drain-timeout", "300ms"], &[]);
    let slow = ["--ttft", "5ms", "--itl", "20ms", "--output-tokens", "60"];
    let (_s1, p1) = start_sim(&dir, "m", &slow);
    let (_s2, p2) = start_sim(&dir, "m", &slow);
    let a1 = start_agent(&dir, &router, p1, "a1.key", &[]);
    let a2 = start_agent(&dir, &router, p2, "a2.key", &[]);
    wait_agents(router.http, "m", 2);
    let drain = |method: &str, peer: &str| {
        Req::new(method, &format!("/admin/agents/{peer}/drain"))
            .bearer(ADMIN_KEY)
            .send(router.http)
            .map(Resp::pair)
            .expect("admin call")
    };
    let (st, body) = drain("POST", "12D3KooWnotthere");
    assert_eq!(st, 404, "{}", String::from_utf8_lossy(&body));
    let (st, _) = Req::post("/admin/agents/x/drain", "")
        .send(router.http)
        .map(Resp::pair)
        .expect("unauthenticated");
    assert_eq!(st, 401);

    let http = router.http;
    let body = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let client = std::thread::spawn(move || stream(http, "/v1/chat/completions", body));
    let (peer1, peer2) = (peer_in_log(&a1), peer_in_log(&a2));
    let mut serving = String::new();
    wait_until(
        Duration::from_secs(10),
        || {
            for p in [&peer1, &peer2] {
                if active_of(router.metrics, p) >= 1.0 {
                    serving = p.clone();
                    return true;
                }
            }
            false
        },
        "one agent serving",
    );
    let other = if serving == peer1 { &peer2 } else { &peer1 };
    let (st, body) = drain("POST", &serving);
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        (v["draining"].as_bool(), v["in_flight"].as_u64()),
        (Some(true), Some(1)),
        "{v}"
    );
    assert_eq!(healthy_agents(router.http, "m"), 1);
    let table = routing_table(router.http);
    let row = table["agents"]
        .as_array()
        .and_then(|a| a.iter().find(|r| r["peer_id"] == serving.as_str()))
        .cloned()
        .unwrap_or_default();
    assert_eq!(row["status"]["draining"], true, "{table}");
    // Nothing new goes to it.
    for i in 0..6 {
        let b = format!(
            r#"{{"model":"m","max_tokens":2,"messages":[{{"role":"user","content":"n{i}"}}]}}"#
        );
        let (st, _) = Req::post("/v1/chat/completions", b)
            .send(router.http)
            .map(Resp::pair)
            .expect("request");
        assert_eq!(st, 200);
    }
    let served_by = |peer: &str| {
        metric(
            router.metrics,
            &format!("hivenet_agent_requests_success_total{{peer_id=\"{peer}\""),
        )
        .unwrap_or(0.0)
    };
    assert_eq!(
        served_by(&serving),
        0.0,
        "the drained agent got new requests"
    );
    assert!(served_by(other) >= 6.0);
    // Its stream outlived --drain-timeout: cut there, continued on the other.
    let (raw, body, clean) = client.join().expect("client");
    assert!(clean, "{raw}");
    let (text, roles, ids, _) = openai_parts(&body);
    assert_eq!(text, expected(60), "{body}");
    assert_eq!((roles, ids.len()), (1, 1));
    assert_eq!(migrations(router.metrics, "continued"), 1.0);
    // Undrained: routable again.
    let (st, _) = drain("DELETE", &serving);
    assert_eq!(st, 200);
    wait_agents(router.http, "m", 2);
}

/// Every agent that could continue is busy when the stream breaks: the
/// continuation waits for a slot at the head of the queue (before it, it
/// was cut as if there were no agent).
#[test]
fn a_continuation_waits_for_a_busy_agent() {
    let dir = tmpdir("cont-busy");
    let router = start_router(&dir, &["--shards", "1"], &[]);
    let opts = ["--output-tokens", "20", "--itl", "20ms"];
    let (_bad, pb) = start_sim(&dir, "m", &[&opts[..], &["--abort-rate", "1"]].concat());
    let (_good, pg) = start_sim(&dir, "m", &opts);
    let _a1 = start_agent(&dir, &router, pb, "bad.key", &["--capacity", "1"]);
    let _a2 = start_agent(&dir, &router, pg, "good.key", &["--capacity", "1"]);
    wait_agents(router.http, "m", 2);
    for round in 0..3 {
        // Two at once: one on each agent; the dying one breaks while the
        // other is still streaming.
        let http = router.http;
        let both: Vec<_> = (0..2)
            .map(|k| {
                std::thread::spawn(move || {
                    let b = format!(
                        r#"{{"model":"m","stream":true,"messages":[{{"role":"user","content":"r{round} {k}"}}]}}"#
                    );
                    stream(http, "/v1/chat/completions", &b)
                })
            })
            .collect();
        for h in both {
            let (raw, body, clean) = h.join().expect("client");
            assert!(clean, "round {round}: cut:\n{raw}");
            assert_eq!(openai_parts(&body).0, expected(20), "{body}");
        }
    }
    assert!(migrations(router.metrics, "continued") >= 1.0);
    assert_eq!(migrations(router.metrics, "no_agent"), 0.0);
}
