//! An agent killed in the middle of a stream, continuation off: the
//! client's stream ends with an error (no terminating chunk), the agent leaves routing at once,
//! and no capacity slot leaks.

mod common;
use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn active_total(metrics: u16) -> f64 {
    metrics_text(metrics)
        .lines()
        .filter(|l| l.starts_with("hivenet_agent_active_requests{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn run(driver: &str) {
    let dir = tmpdir(&format!("loss-{driver}"));
    // Continuation off: this is the cut itself (tests/stream_continuity.rs
    // has the stream going on on the other agent).
    let router = start_router(
        &dir,
        &[
            "--shards",
            "2",
            "--driver",
            driver,
            "--stream-migrations",
            "0",
        ],
        &[],
    );
    let slow = ["--ttft", "10ms", "--itl", "100ms", "--output-tokens", "100"];
    let (_s1, p1) = start_sim(&dir, "m", &slow);
    let (_s2, p2) = start_sim(&dir, "m", &slow);
    let mut a1 = start_agent(&dir, &router, p1, "a1.key", &[]);
    let mut a2 = start_agent(&dir, &router, p2, "a2.key", &[]);
    wait_agents(router.http, "m", 2);

    let body = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let mut s = TcpStream::connect(("127.0.0.1", router.http)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut got = Vec::new();
    let mut tmp = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = s.read(&mut tmp).expect("first event");
        assert!(n > 0);
        got.extend_from_slice(&tmp[..n]);
    }
    assert!(String::from_utf8_lossy(&got).contains("X-Accel-Buffering: no"));
    // Which agent is serving? The one whose active gauge is 1.
    let text = metrics_text(router.metrics);
    let serving_line = text
        .lines()
        .find(|l| l.starts_with("hivenet_agent_active_requests{") && l.ends_with(" 1"))
        .expect("one agent active")
        .to_string();
    let a1_peer = peer_in_log(&a1);
    assert!(
        a1_peer.starts_with("12D3KooW"),
        "peer id from the agent log: {}",
        a1.log_text()
    );
    let a1_serving = serving_line.contains(&a1_peer);
    let killed_at = Instant::now();
    let victim = if a1_serving { &mut a1 } else { &mut a2 };
    let victim_peer = peer_in_log(victim);
    victim.kill9();
    // The client's stream must end without the last chunk.
    let clean_end = read_stream_end(&mut s, &mut got);
    assert!(!clean_end, "a cut stream must not look complete");
    assert!(!String::from_utf8_lossy(&got).contains("[DONE]"));
    // Gone from routing at once.
    wait_until(
        Duration::from_secs(2),
        || healthy_agents(router.http, "m") == 1,
        "agent removal",
    );
    assert!(killed_at.elapsed() < Duration::from_secs(5));
    // Every series of the removed agent is gone with it; the cut is
    // counted as a connection reset of the model (spec 06).
    let m = metrics_text(router.metrics);
    assert!(
        m.contains("hivenet_agent_connection_resets_total{model=\"m\",reason=\"stream_cut\"} 1"),
        "{m}"
    );
    assert!(
        !victim_peer.is_empty() && !m.contains(&victim_peer),
        "series of {victim_peer} left:\n{m}"
    );
    // No slot leak.
    wait_until(
        Duration::from_secs(2),
        || active_total(router.metrics) == 0.0,
        "slots released",
    );
    // The survivor still serves.
    let (st, b) = Req::post(
        "/v1/chat/completions",
        r#"{"model":"m","max_tokens":2,"messages":[]}"#,
    )
    .send(router.http)
    .map(Resp::pair)
    .expect("req");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
}

#[test]
fn agent_killed_mid_stream_io_uring_or_default() {
    run("auto");
}

#[test]
fn agent_killed_mid_stream_epoll() {
    run("epoll");
}
