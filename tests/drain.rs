//! SIGTERM drains: a stream in flight when the signal arrives completes
//! (with its terminating chunk), then the router exits 0.

mod common;
use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

#[test]
fn sigterm_lets_an_in_flight_stream_finish() {
    let dir = tmpdir("drain");
    let mut r = start_router(&dir, &["--shards", "1", "--drain-timeout", "10s"], &[]);
    let (_s, port) = start_sim(
        &dir,
        "d-model",
        &["--ttft", "5ms", "--itl", "50ms", "--output-tokens", "20"],
    );
    let _a = start_agent(&dir, &r, port, "d.key", &[]);
    wait_agents(r.http, "d-model", 1);
    let body = r#"{"model":"d-model","stream":true,"messages":[]}"#;
    let mut s = TcpStream::connect(("127.0.0.1", r.http)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}", body.len()).expect("write");
    let mut got = Vec::new();
    let mut tmp = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = s.read(&mut tmp).expect("first event");
        assert!(n > 0);
        got.extend_from_slice(&tmp[..n]);
    }
    let _ = Command::new("kill")
        .args(["-TERM", &r.proc.child.id().to_string()])
        .status();
    loop {
        match s.read(&mut tmp) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&tmp[..n]),
            Err(e) => panic!("stream failed during the drain: {e}"),
        }
    }
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.contains("[DONE]") && got.ends_with(b"0\r\n\r\n"),
        "complete stream: {text}"
    );
    let st = r.proc.child.wait().expect("exit");
    assert!(st.success(), "{st:?}");
    assert!(r.proc.log_text().contains("history persisted"));
}

/// A stopping router answers a keep-alive client's next request with
/// `Connection: close` and closes it: the client's next connection goes
/// to a router that takes clients (a rolling replacement's Service), and
/// a closed-loop client cannot keep the stopping one busy to the end.
#[test]
fn a_draining_router_closes_keep_alive_connections_after_their_next_answer() {
    let dir = tmpdir("drain-keepalive");
    let mut r = start_router(&dir, &["--shards", "1", "--drain-timeout", "20s"], &[]);
    let (_s, port) = start_sim(
        &dir,
        "d-model",
        &["--itl", "100ms", "--output-tokens", "40"],
    );
    let _a = start_agent(&dir, &r, port, "d.key", &[]);
    wait_agents(r.http, "d-model", 1);
    let short = r#"{"model":"d-model","max_tokens":2,"messages":[]}"#;
    let ask = |s: &mut TcpStream| {
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{short}",
            short.len()
        )
        .expect("write");
    };
    let mut keep = TcpStream::connect(("127.0.0.1", r.http)).expect("connect");
    keep.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut buf = Vec::new();
    ask(&mut keep);
    assert_eq!(read_response(&mut keep, &mut buf).0, 200);
    // A stream keeps the router draining for 4 s.
    let body = r#"{"model":"d-model","stream":true,"messages":[]}"#;
    let mut s = TcpStream::connect(("127.0.0.1", r.http)).expect("connect");
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}", body.len()).expect("write");
    std::thread::sleep(Duration::from_millis(500));
    let _ = Command::new("kill")
        .args(["-TERM", &r.proc.child.id().to_string()])
        .status();
    std::thread::sleep(Duration::from_millis(300));
    // Served, and told to go.
    ask(&mut keep);
    let mut raw = Vec::new();
    let mut tmp = [0u8; 4096];
    loop {
        match keep.read(&mut tmp) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&tmp[..n]),
            Err(e) => panic!(
                "no close after the answer: {e}\n{}",
                String::from_utf8_lossy(&raw)
            ),
        }
    }
    let text = String::from_utf8_lossy(&raw).to_ascii_lowercase();
    assert!(text.starts_with("http/1.1 200"), "{text}");
    assert!(text.contains("connection: close"), "{text}");
    let st = r.proc.child.wait().expect("exit");
    assert!(st.success(), "{st:?}");
}
