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
