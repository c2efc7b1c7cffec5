//! A client that disconnects while its request waits in the capacity queue
//! leaves the queue at once and its request never reaches a backend; live
//! requests keep their places (issue 9, item 2).

mod common;
use common::*;
use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn queue_depth(metrics: u16) -> f64 {
    metric(metrics, "hivenet_queue_depth{model=\"dw-model\"}").unwrap_or(-1.0)
}

fn run(driver: &str) {
    let dir = tmpdir(&format!("dead-waiters-{driver}"));
    let r = start_router(
        &dir,
        &[
            "--shards",
            "1",
            "--request-timeout",
            "20s",
            "--driver",
            driver,
        ],
        &[],
    );
    // One slot, held by a 3 s stream.
    let slow = ["--ttft", "5ms", "--itl", "100ms", "--output-tokens", "30"];
    let (_s, port) = start_sim(&dir, "dw-model", &slow);
    let _a = start_agent(&dir, &r, port, "dw.key", &["--capacity", "1"]);
    wait_agents(r.http, "dw-model", 1);
    let http = r.http;
    let holder = hold_slot(http, "dw-model");
    std::thread::sleep(Duration::from_millis(300));
    // 30 clients (the whole --queue-depth) queue, then hang up.
    let body = r#"{"model":"dw-model","messages":[]}"#;
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut dead: Vec<TcpStream> = (0..30)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", http)).expect("connect");
            s.write_all(req.as_bytes()).expect("send");
            s
        })
        .collect();
    wait_until(
        Duration::from_secs(5),
        || queue_depth(r.metrics) == 30.0,
        "30 waiters queued",
    );
    let t = Instant::now();
    dead.clear();
    wait_until(
        Duration::from_secs(2),
        || queue_depth(r.metrics) == 0.0,
        "dead waiters left the queue",
    );
    let left_after = t.elapsed();
    assert!(
        left_after < Duration::from_millis(500),
        "left the queue after {left_after:?}"
    );
    // A live request now queues (no 503 no_capacity) and is served once
    // the holder ends.
    let (st, b) = Req::post("/v1/chat/completions", body)
        .send(http)
        .map(Resp::pair)
        .expect("live request");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(holder.join().expect("holder").expect("stream"), 200);
    // The backend served the holder and the live request, none of the dead.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        sim_completions(port),
        2.0,
        "no dead request reached the backend"
    );
}

#[test]
fn dead_waiters_leave_the_queue_io_uring_or_default() {
    run("auto");
}

#[test]
fn dead_waiters_leave_the_queue_epoll() {
    run("epoll");
}

/// A waiting client that pipelines its next request is alive: both
/// requests are answered in order on the same connection.
#[test]
fn a_pipelined_request_during_a_wait_is_kept() {
    let dir = tmpdir("pipelined-wait");
    let r = start_router(&dir, &["--shards", "1", "--request-timeout", "20s"], &[]);
    let slow = ["--ttft", "5ms", "--itl", "100ms", "--output-tokens", "10"];
    let (_s, port) = start_sim(&dir, "dw-model", &slow);
    let _a = start_agent(&dir, &r, port, "pw.key", &["--capacity", "1"]);
    wait_agents(r.http, "dw-model", 1);
    let http = r.http;
    let holder = hold_slot(http, "dw-model");
    std::thread::sleep(Duration::from_millis(200));
    let body = r#"{"model":"dw-model","messages":[]}"#;
    let one = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let two = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut s = TcpStream::connect(("127.0.0.1", http)).expect("connect");
    s.write_all(one.as_bytes()).expect("first");
    wait_until(
        Duration::from_secs(3),
        || queue_depth(r.metrics) == 1.0,
        "first request queued",
    );
    s.write_all(two.as_bytes())
        .expect("second, while the first waits");
    s.set_read_timeout(Some(Duration::from_secs(15)))
        .expect("timeout");
    let mut all = Vec::new();
    let _ = std::io::Read::read_to_end(&mut s, &mut all);
    let text = String::from_utf8_lossy(&all);
    assert_eq!(text.matches("HTTP/1.1 200").count(), 2, "{text}");
    assert_eq!(holder.join().expect("holder").expect("stream"), 200);
}
