//! `/admin/registration-stream`: SSE events for registrations and removals.

mod common;
use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

fn read_until(s: &mut TcpStream, got: &mut Vec<u8>, needle: &str) {
    let mut tmp = [0u8; 4096];
    while !String::from_utf8_lossy(got).contains(needle) {
        let n = s.read(&mut tmp).expect("read");
        assert!(
            n > 0,
            "stream closed before {needle:?}: {}",
            String::from_utf8_lossy(got)
        );
        got.extend_from_slice(&tmp[..n]);
    }
}

#[test]
fn registrations_and_removals_are_streamed() {
    let dir = tmpdir("feed");
    let r = start_router(&dir, &["--shards", "2"], &[]);
    let mut s = TcpStream::connect(("127.0.0.1", r.http)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    write!(s, "GET /admin/registration-stream HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {ADMIN_KEY}\r\n\r\n").expect("write");
    let mut got = Vec::new();
    read_until(&mut s, &mut got, "\r\n\r\n");
    let head = String::from_utf8_lossy(&got).to_string();
    assert!(
        head.starts_with("HTTP/1.1 200") && head.contains("text/event-stream"),
        "{head}"
    );
    let (_sim, port) = start_sim(&dir, "feed-model", &[]);
    let mut a = start_agent(&dir, &r, port, "f.key", &[]);
    read_until(&mut s, &mut got, "\"event_type\":\"registered\"");
    let text = String::from_utf8_lossy(&got).to_string();
    assert!(text.contains("\"agent_id\":\"12D3KooW"), "{text}");
    assert!(text.contains("\"timestamp\":\"20"), "{text}");
    a.kill9();
    read_until(&mut s, &mut got, "\"event_type\":\"unregistered\"");
    // Without a key: 401.
    let (st, _) = get(r.http, "/admin/registration-stream").expect("no key");
    assert_eq!(st, 401);
}
