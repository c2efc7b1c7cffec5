//! Issue 56: streams of any length. No timeout bounds a whole exchange
//! that is making progress, on the agent or on the router: a head
//! deadline before the answer starts (`--http-timeout` on the agent,
//! `--request-timeout` on the router), an idle deadline between bytes
//! after it (`--stream-write-timeout`, `--stream-idle-timeout`). A
//! continuation's budget counts from the break, so a stream of any age
//! whose agent dies or drains goes on elsewhere.
//!
//! Every timeout is scaled down (1 s) and every stream is 5x longer
//! (50 tokens, 100 ms apart).

mod common;
use common::*;
use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Each timeout of router and agent: a fifth of the streams below.
const T: &str = "1s";
/// The simulator's pace: 50 tokens 100 ms apart, 5 s in all.
const SIM: [&str; 4] = ["--output-tokens", "50", "--itl", "100ms"];
const ROUTER: [&str; 4] = ["--request-timeout", T, "--stream-idle-timeout", T];
const AGENT: [&str; 4] = ["--http-timeout", T, "--stream-write-timeout", T];

/// The simulator's words, in order (bench/src/sim.rs `WORDS`).
const WORDS: [&str; 16] = [
    "The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".", " Hivenet",
    " routes", " every", " token", " home", ".",
];

fn expected(n: usize) -> String {
    (0..n).map(|i| WORDS[i % WORDS.len()]).collect()
}

/// Send one request; (status, dechunked body, clean end, time taken).
fn send(http: u16, path: &str, body: &str) -> (u16, String, bool, Duration) {
    let t0 = Instant::now();
    let mut s = TcpStream::connect(("127.0.0.1", http)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut got = Vec::new();
    let clean = read_stream_end(&mut s, &mut got);
    let head_end = got
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(got.len(), |i| i + 4);
    let chunked = String::from_utf8_lossy(&got[..head_end])
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(&got[head_end..])
    } else {
        got[head_end..].to_vec()
    };
    let body = String::from_utf8_lossy(&body).to_string();
    (status_of(&got), body, clean, t0.elapsed())
}

/// The text of an OpenAI or Anthropic event stream.
fn streamed_text(body: &str) -> String {
    let mut text = String::new();
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        let Ok(e) = serde_json::from_str::<serde_json::Value>(data) else {
            continue;
        };
        if let Some(t) = e["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
        if let Some(t) = e["delta"]["text"].as_str() {
            text.push_str(t);
        }
    }
    text
}

fn chat(stream: bool) -> String {
    format!(
        r#"{{"model":"m","stream":{stream},"max_tokens":100,"messages":[{{"role":"user","content":"tell me a long story"}}]}}"#
    )
}

fn messages() -> String {
    r#"{"model":"m","stream":true,"max_tokens":100,"messages":[{"role":"user","content":"tell me a long story"}]}"#.to_string()
}

/// A stream 5x longer than every configured timeout arrives whole, on
/// both APIs; the old agent cut every stream at `--http-timeout`.
#[test]
fn a_stream_five_times_longer_than_every_timeout_arrives_whole() {
    let dir = tmpdir("long-stream");
    let router = start_router(&dir, &[&["--shards", "1"][..], &ROUTER].concat(), &[]);
    let (_sim, port) = start_sim(&dir, "m", &SIM);
    let _agent = start_agent(&dir, &router, port, "a.key", &AGENT);
    wait_agents(router.http, "m", 1);
    let want = expected(50);
    for (path, body) in [
        ("/v1/chat/completions", chat(true)),
        ("/v1/messages", messages()),
    ] {
        let (status, got, clean, took) = send(router.http, path, &body);
        assert_eq!(status, 200, "{path}: {got}");
        assert!(clean, "{path}: the stream was cut after {took:?}:\n{got}");
        assert_eq!(streamed_text(&got), want, "{path}: the whole text\n{got}");
        assert!(
            took >= Duration::from_secs(4),
            "{path}: the stream must really last 5x the timeouts ({took:?})"
        );
    }
}

/// A non-streamed answer 5x longer than every timeout arrives whole on
/// both APIs: it gives no byte before it is whole, so the agent waits
/// past `--http-timeout` while the engine's work counter moves and tells
/// the router with interim `102` heads, which restart `--request-timeout`.
/// Before, the agent answered 504 after 1 s (and the router cut at 1 s).
#[test]
fn a_non_streamed_answer_five_times_longer_than_every_timeout_arrives_whole() {
    let dir = tmpdir("long-whole");
    let router = start_router(&dir, &[&["--shards", "1"][..], &ROUTER].concat(), &[]);
    let (_sim, port) = start_sim(&dir, "m", &SIM);
    let _agent = start_agent(&dir, &router, port, "a.key", &AGENT);
    wait_agents(router.http, "m", 1);
    let want = expected(50);
    let whole = r#"{"model":"m","stream":false,"max_tokens":100,"messages":[{"role":"user","content":"tell me a long story"}]}"#;
    for path in ["/v1/chat/completions", "/v1/messages"] {
        let (status, got, _, took) = send(router.http, path, whole);
        assert_eq!(status, 200, "{path} after {took:?}: {got}");
        let v: serde_json::Value = serde_json::from_str(got.trim()).expect("one JSON answer");
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .or(v["content"][0]["text"].as_str())
            .unwrap_or_default();
        assert_eq!(text, want, "{path}: the whole text\n{got}");
        assert!(
            took >= Duration::from_secs(4),
            "{path}: the answer must really take 5x the timeouts ({took:?})"
        );
    }
}

/// The head deadline still holds: a backend that does not start its
/// answer within `--http-timeout` gets the spec's 504, not a hang.
#[test]
fn a_backend_that_never_starts_its_answer_is_a_504_within_the_head_deadline() {
    let dir = tmpdir("head-deadline");
    let router = start_router(&dir, &["--shards", "1", "--request-timeout", "20s"], &[]);
    let (_sim, port) = start_sim(&dir, "m", &["--ttft", "30s"]);
    let _agent = start_agent(
        &dir,
        &router,
        port,
        "a.key",
        &["--http-timeout", "500ms", "--warmup", "off"],
    );
    wait_agents(router.http, "m", 1);
    let t0 = Instant::now();
    let (status, body) = Req::chat("m").send(router.http).expect("send").pair();
    let text = String::from_utf8_lossy(&body).to_string();
    assert_eq!(status, 504, "{text}");
    assert!(text.contains("--http-timeout"), "{text}");
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "answered by the agent's head deadline, not the router's ({:?})",
        t0.elapsed()
    );
}

/// A backend that answers its health check, then starts every stream with
/// three events and goes silent for a minute (a hung engine).
fn silent_backend() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            std::thread::spawn(move || {
                let mut s = s;
                let mut buf = [0u8; 65536];
                let Ok(n) = std::io::Read::read(&mut s, &mut buf) else {
                    return;
                };
                if !buf[..n].starts_with(b"POST") {
                    let _ = s.write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                    );
                    return;
                }
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n");
                for w in ["The", " quick", " brown"] {
                    let ev = format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{w}\"}}}}]}}\n\n");
                    let _ = write!(s, "{:x}\r\n{ev}\r\n", ev.len());
                }
                std::thread::sleep(Duration::from_secs(60));
            });
        }
    });
    port
}

/// The idle deadline holds: a stream that goes silent longer than
/// `--stream-write-timeout` is cut (and with no other agent, not
/// continued), not held open until the router's own idle deadline.
#[test]
fn a_stream_silent_past_the_idle_deadline_is_cut() {
    let dir = tmpdir("idle-deadline");
    let router = start_router(
        &dir,
        &["--shards", "1", "--stream-idle-timeout", "60s"],
        &[],
    );
    let port = silent_backend();
    let health = format!("http://127.0.0.1:{port}/health");
    let _agent = start_agent(
        &dir,
        &router,
        port,
        "a.key",
        &[
            "--engine",
            "custom",
            "--model",
            "m",
            "--health-url",
            &health,
            "--stream-write-timeout",
            "1s",
        ],
    );
    wait_agents(router.http, "m", 1);
    let (status, got, clean, took) = send(router.http, "/v1/chat/completions", &chat(true));
    assert_eq!(status, 200, "{got}");
    assert_eq!(streamed_text(&got), "The quick brown", "{got}");
    assert!(!clean, "a silent stream must be cut:\n{got}");
    assert!(
        took < Duration::from_secs(30),
        "cut by the agent's 1 s idle deadline, not the router's 60 s ({took:?})"
    );
}

/// Start a 5 s stream on the only agent, link a second, then end the
/// first with `end` 2.5 s in (far past the 1 s request deadline): the
/// client gets the whole answer, continued on the second.
fn continued_after_the_deadline(tag: &str, end: impl FnOnce(&mut Proc)) {
    let dir = tmpdir(tag);
    let router = start_router(&dir, &[&["--shards", "1"][..], &ROUTER].concat(), &[]);
    let (_s1, p1) = start_sim(&dir, "m", &SIM);
    let (_s2, p2) = start_sim(&dir, "m", &SIM);
    let mut first = start_agent(
        &dir,
        &router,
        p1,
        "a1.key",
        &[&AGENT[..], &["--drain-timeout", "1s"]].concat(),
    );
    wait_agents(router.http, "m", 1);
    let http = router.http;
    let client = std::thread::spawn(move || send(http, "/v1/chat/completions", &chat(true)));
    let t0 = Instant::now();
    let _second = start_agent(&dir, &router, p2, "a2.key", &AGENT);
    wait_agents(router.http, "m", 2);
    std::thread::sleep(Duration::from_millis(2500).saturating_sub(t0.elapsed()));
    end(&mut first);
    let (status, got, clean, took) = client.join().expect("client");
    assert_eq!(status, 200, "{got}");
    assert!(clean, "{tag}: cut after {took:?}:\n{got}");
    assert_eq!(
        streamed_text(&got),
        expected(50),
        "{tag}: whole text\n{got}"
    );
    let m = metrics_text(router.metrics);
    assert!(
        m.contains("hivenet_stream_migrations_total{model=\"m\",outcome=\"continued\"} 1"),
        "{tag}: counted as continued:\n{m}"
    );
}

#[test]
fn a_stream_whose_agent_dies_after_the_request_deadline_is_continued() {
    continued_after_the_deadline("late-kill", |a| a.kill9());
}

#[test]
fn an_agent_drained_while_streaming_a_long_answer_cuts_nothing() {
    continued_after_the_deadline("late-drain", |a| signal(a, "TERM"));
}
