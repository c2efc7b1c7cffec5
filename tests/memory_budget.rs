//! Router-wide memory bounds (issue 9, item 1): request bodies buffered by
//! all connections together stay under `--max-buffered-body-bytes` (beyond
//! it: 503 with Retry-After, before the body is read), client connections
//! under `--max-client-connections`; a normal request is served meanwhile.

mod common;
use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Read what the router sent within `wait` (an answer means a refusal here).
fn answer_within(s: &mut TcpStream, wait: Duration) -> String {
    s.set_read_timeout(Some(wait)).expect("timeout");
    let mut got = Vec::new();
    let mut tmp = [0u8; 4096];
    while let Ok(n) = s.read(&mut tmp) {
        if n == 0 {
            break;
        }
        got.extend_from_slice(&tmp[..n]);
    }
    String::from_utf8_lossy(&got).to_string()
}

#[test]
fn stalled_bodies_stay_within_the_budget() {
    let dir = tmpdir("body-budget");
    let budget = 20 * 1024 * 1024;
    let budget_s = budget.to_string();
    let r = start_router(
        &dir,
        &[
            "--shards",
            "1",
            "--max-buffered-body-bytes",
            &budget_s,
            "--body-timeout",
            "60s",
        ],
        &[],
    );
    let (_s, port) = start_sim(&dir, "bb-model", &[]);
    let _a = start_agent(&dir, &r, port, "bb.key", &[]);
    wait_agents(r.http, "bb-model", 1);
    let pid = r.proc.child.id();
    let before = rss_kib(pid);
    let declared: usize = 9 * 1024 * 1024;
    let sent = vec![b'x'; 8 * 1024 * 1024];
    let mut stalled = Vec::new();
    let mut refused = 0;
    for _ in 0..10 {
        let mut s = TcpStream::connect(("127.0.0.1", r.http)).expect("connect");
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {declared}\r\n\r\n"
        )
        .expect("head");
        let answer = answer_within(&mut s, Duration::from_millis(300));
        if answer.is_empty() {
            // Admitted: send 8 of the 9 MiB and stall.
            s.write_all(&sent).expect("body");
            stalled.push(s);
        } else {
            assert_eq!(status_of(answer.as_bytes()), 503, "{answer}");
            assert!(answer.contains("Retry-After: 1"), "{answer}");
            assert!(answer.contains("no_capacity"), "{answer}");
            refused += 1;
        }
    }
    assert_eq!(stalled.len(), 2, "20 MiB hold two 9 MiB bodies");
    assert_eq!(refused, 8);
    wait_until(
        Duration::from_secs(5),
        || metric(r.metrics, "hivenet_buffered_body_bytes") == Some((2 * declared) as f64),
        "the budget holds the two bodies",
    );
    // A normal request is served meanwhile.
    let (st, b) = Req::post(
        "/v1/chat/completions",
        r#"{"model":"bb-model","messages":[]}"#,
    )
    .send(r.http)
    .map(Resp::pair)
    .expect("normal request");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let grown_mib = rss_kib(pid).saturating_sub(before) / 1024;
    assert!(
        grown_mib < 64,
        "RSS grew {grown_mib} MiB for two admitted 9 MiB bodies (ten were attempted)"
    );
    drop(stalled);
    wait_until(
        Duration::from_secs(5),
        || metric(r.metrics, "hivenet_buffered_body_bytes") == Some(0.0),
        "given back when the clients leave",
    );
}

#[test]
fn client_connections_are_capped() {
    let dir = tmpdir("conn-cap");
    let r = start_router(
        &dir,
        &["--shards", "2", "--max-client-connections", "20"],
        &[],
    );
    let mut idle: Vec<TcpStream> = (0..20)
        .map(|_| TcpStream::connect(("127.0.0.1", r.http)).expect("connect"))
        .collect();
    wait_until(
        Duration::from_secs(5),
        || metric(r.metrics, "hivenet_client_connections") == Some(20.0),
        "20 connections held",
    );
    let resp = raw(
        r.http,
        b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n",
        Duration::from_secs(3),
    );
    let text = String::from_utf8_lossy(&resp);
    assert_eq!(status_of(&resp), 503, "{text}");
    assert!(text.contains("Retry-After: 1"), "{text}");
    idle.truncate(15);
    wait_until(
        Duration::from_secs(5),
        || metric(r.metrics, "hivenet_client_connections") == Some(15.0),
        "places given back",
    );
    let (st, _) = Req::get("/health")
        .send(r.http)
        .map(Resp::pair)
        .expect("health");
    assert_eq!(st, 200);
}
