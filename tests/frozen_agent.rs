//! A frozen agent (SIGSTOP) is declared dead after three missed heartbeats
//! and its in-flight streams are cut at once with an error event; a stream
//! that stays silent for `--stream-idle-timeout` is cut the same way
//! (issue 9, item 5).

mod common;
use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

/// Start a stream and read until its first event; returns the socket and
/// what was read.
fn start_stream(http: u16, model: &str) -> (TcpStream, Vec<u8>) {
    let body = format!(r#"{{"model":"{model}","stream":true,"messages":[]}}"#);
    let mut s = TcpStream::connect(("127.0.0.1", http)).expect("connect");
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut got = Vec::new();
    read_until(&mut s, &mut got, "data: ");
    (s, got)
}

/// Read to the end; returns everything and how long it took.
fn read_to_cut(s: &mut TcpStream, got: &mut Vec<u8>) -> Duration {
    let t = Instant::now();
    let mut tmp = [0u8; 4096];
    loop {
        match s.read(&mut tmp) {
            Ok(0) | Err(_) => return t.elapsed(),
            Ok(n) => got.extend_from_slice(&tmp[..n]),
        }
    }
}

#[test]
fn a_frozen_agents_streams_are_cut_when_it_is_declared_dead() {
    let dir = tmpdir("frozen");
    let r = start_router(
        &dir,
        &["--shards", "1", "--heartbeat-interval", "200ms"],
        &[],
    );
    // A 20 s stream.
    let slow = ["--ttft", "5ms", "--itl", "200ms", "--output-tokens", "100"];
    let (_s, port) = start_sim(&dir, "frozen-model", &slow);
    let a = start_agent(&dir, &r, port, "frozen.key", &[]);
    wait_agents(r.http, "frozen-model", 1);
    let (mut s, mut got) = start_stream(r.http, "frozen-model");
    let pid = a.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .expect("stop")
        .success());
    let took = read_to_cut(&mut s, &mut got);
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
    let text = String::from_utf8_lossy(&got).to_string();
    assert!(
        took < Duration::from_secs(4),
        "cut after {took:?} (3 missed 200 ms heartbeats), not at the request timeout"
    );
    assert!(
        text.contains("event: error"),
        "an error event first: {text}"
    );
    assert!(text.contains("declared dead"), "{text}");
    assert!(!text.ends_with("0\r\n\r\n"), "never a clean end: {text}");
    assert!(r.proc.log_text().contains("cut_responses=1"));
}

#[test]
fn a_silent_stream_is_cut_after_the_idle_timeout() {
    let dir = tmpdir("stream-idle");
    let r = start_router(&dir, &["--shards", "1", "--stream-idle-timeout", "1s"], &[]);
    // A gap of 4 s between tokens.
    let slow = ["--ttft", "5ms", "--itl", "4s", "--output-tokens", "5"];
    let (_s, port) = start_sim(&dir, "idle-model", &slow);
    let _a = start_agent(&dir, &r, port, "idle.key", &[]);
    wait_agents(r.http, "idle-model", 1);
    let (mut s, mut got) = start_stream(r.http, "idle-model");
    let took = read_to_cut(&mut s, &mut got);
    let text = String::from_utf8_lossy(&got).to_string();
    assert!(
        took >= Duration::from_millis(800) && took < Duration::from_secs(3),
        "cut after {took:?}"
    );
    assert!(text.contains("event: error"), "{text}");
    assert!(text.contains("--stream-idle-timeout"), "{text}");
    assert!(!text.ends_with("0\r\n\r\n"), "{text}");
}
