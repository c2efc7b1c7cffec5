//! One test per HTTP/1.1 framing rule, with raw bytes on a socket against
//! a real router process.

mod common;
use common::*;
use std::time::Duration;

fn router() -> (Router, std::path::PathBuf) {
    let dir = tmpdir("framing");
    let r = start_router(
        &dir,
        &[
            "--shards",
            "1",
            "--header-timeout",
            "1s",
            "--body-timeout",
            "1s",
        ],
        &[("HIVENET_ROUTER_MAX_REQUEST_BYTES", "1000")],
    );
    (r, dir)
}

const W: Duration = Duration::from_secs(3);

/// Send `bytes`, expect `status`, and a closed connection.
fn rejects(bytes: &[u8], status: u16) -> String {
    let (r, _d) = router();
    let resp = raw(r.http, bytes, W);
    let text = String::from_utf8_lossy(&resp).to_string();
    assert_eq!(status_of(&resp), status, "{text}");
    assert!(
        text.to_ascii_lowercase().contains("connection: close"),
        "must close: {text}"
    );
    text
}

#[test]
fn content_length_with_transfer_encoding_is_400() {
    rejects(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}", 400);
}

#[test]
fn transfer_encoding_other_than_chunked_is_400() {
    rejects(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
        400,
    );
    rejects(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, chunked\r\n\r\n", 400);
}

#[test]
fn duplicate_content_length_is_400() {
    rejects(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}", 400);
}

#[test]
fn invalid_content_length_is_400() {
    rejects(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2x\r\n\r\n{}",
        400,
    );
}

#[test]
fn obsolete_line_folding_is_400() {
    rejects(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-A: a\r\n folded\r\nContent-Length: 2\r\n\r\n{}", 400);
}

#[test]
fn declared_body_over_the_limit_is_413_before_reading() {
    let text = rejects(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n",
        413,
    );
    assert!(
        text.contains("request body too large: limit is 1000 bytes"),
        "{text}"
    );
}

#[test]
fn chunked_body_over_the_limit_is_413() {
    let text = rejects(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n7d0\r\n", 413);
    assert!(text.contains("request_invalid"), "{text}");
}

#[test]
fn header_section_too_large_is_431() {
    let (r, _d) = router();
    let mut req = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ".to_vec();
    req.extend(std::iter::repeat_n(b'a', 70 * 1024));
    req.extend_from_slice(b"\r\n\r\n");
    assert_eq!(status_of(&raw(r.http, &req, W)), 431);
}

#[test]
fn too_many_headers_is_431() {
    let (r, _d) = router();
    let mut req = String::from("GET /health HTTP/1.1\r\nHost: x\r\n");
    for i in 0..120 {
        req.push_str(&format!("X-H{i}: v\r\n"));
    }
    req.push_str("\r\n");
    assert_eq!(status_of(&raw(r.http, req.as_bytes(), W)), 431);
}

#[test]
fn slow_header_times_out_with_408() {
    let (r, _d) = router();
    let resp = raw(
        r.http,
        b"GET /health HTTP/1.1\r\nHost: x\r\n",
        Duration::from_secs(4),
    );
    assert_eq!(status_of(&resp), 408, "{}", String::from_utf8_lossy(&resp));
}

#[test]
fn slow_body_times_out_with_408() {
    let (r, _d) = router();
    let resp = raw(
        r.http,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\"",
        Duration::from_secs(4),
    );
    assert_eq!(status_of(&resp), 408, "{}", String::from_utf8_lossy(&resp));
}

#[test]
fn keep_alive_and_pipelining() {
    let (r, _d) = router();
    let two = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    let resp = String::from_utf8_lossy(&raw(r.http, two, W)).to_string();
    assert_eq!(resp.matches("HTTP/1.1 200 OK").count(), 2, "{resp}");
}

#[test]
fn chunked_request_body_is_read() {
    let (r, _d) = router();
    // Unknown model proves the chunked body was decoded and probed.
    let req = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n6\r\n{\"mode\r\n9\r\nl\":\"zzz\"}\r\n0\r\n\r\n";
    let resp = String::from_utf8_lossy(&raw(r.http, req, W)).to_string();
    assert!(resp.starts_with("HTTP/1.1 404"), "{resp}");
    assert!(resp.contains("model_not_found"), "{resp}");
}

#[test]
fn expect_100_continue() {
    let (r, _d) = router();
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", r.http)).expect("connect");
    s.set_read_timeout(Some(W)).expect("t");
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 15\r\nConnection: close\r\n\r\n").expect("w");
    let mut buf = [0u8; 256];
    let n = s.read(&mut buf).expect("read 100");
    // The whole interim response, CRLF line ends included.
    assert_eq!(
        String::from_utf8_lossy(&buf[..n]),
        "HTTP/1.1 100 Continue\r\n\r\n"
    );
    s.write_all(b"{\"model\":\"nop\"}").expect("body");
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert_eq!(status_of(&rest), 404);
}

#[test]
fn client_errors_use_the_envelope() {
    let (r, _d) = router();
    let p = r.http;
    let (s, b) = Req::post("/v1/chat/completions", "not json")
        .send(p)
        .map(Resp::pair)
        .expect("req");
    assert_eq!(s, 400);
    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
    assert_eq!(v["error"]["code"], "request_invalid");
    let (s, b) = Req::post("/v1/chat/completions", r#"{"messages":[]}"#)
        .send(p)
        .map(Resp::pair)
        .expect("req");
    assert_eq!(s, 400);
    assert!(String::from_utf8_lossy(&b).contains("model field is required"));
    let (s, b) = Req::post("/v1/embeddings", r#"{"model":"ghost-model","input":"x"}"#)
        .send(p)
        .map(Resp::pair)
        .expect("req");
    assert_eq!(s, 404);
    assert!(String::from_utf8_lossy(&b).contains("model_not_found"));
    let (s, _) = Req::post("/v1/nope", "{}")
        .send(p)
        .map(Resp::pair)
        .expect("req");
    assert_eq!(s, 404);
    let (s, b) = Req::get("/v1/chat/completions")
        .send(p)
        .map(Resp::pair)
        .expect("req");
    assert_eq!(s, 405);
    assert!(String::from_utf8_lossy(&b).contains("method_not_allowed"));
    let (s, b) = Req::get("/v1/models/ghost-model")
        .send(p)
        .map(Resp::pair)
        .expect("req");
    assert_eq!(s, 404);
    assert!(String::from_utf8_lossy(&b).contains("No agents registered for model: ghost-model"));
    // No metric series and no directory entry for the attacker-chosen name.
    assert!(!metrics_text(r.metrics).contains("ghost-model"));
}

#[test]
fn request_id_is_echoed_or_generated() {
    let (r, _d) = router();
    let uuid = "123E4567-E89B-12D3-A456-426614174000";
    let resp = String::from_utf8_lossy(&raw(
        r.http,
        format!("GET /v1/models/none HTTP/1.1\r\nHost: x\r\nX-Request-ID: {uuid}\r\nConnection: close\r\n\r\n").as_bytes(),
        W,
    ))
    .to_string();
    assert!(
        resp.contains(&format!("X-Request-ID: {uuid}")),
        "a UUID is echoed verbatim: {resp}"
    );
    let resp = String::from_utf8_lossy(&raw(
        r.http,
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-ID: not-a-uuid\r\nConnection: close\r\n\r\n",
        W,
    ))
    .to_string();
    let id = resp
        .lines()
        .find_map(|l| l.strip_prefix("X-Request-ID: "))
        .expect("generated id")
        .to_string();
    assert_ne!(id, "not-a-uuid");
    assert_eq!(id.len(), 36);
    assert_eq!(&id[14..15], "4", "a v4 UUID: {id}");
    // Framing errors carry one too.
    let resp = String::from_utf8_lossy(&raw(
        r.http,
        b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        W,
    ))
    .to_string();
    assert!(resp.contains("X-Request-ID: "), "{resp}");
}

#[test]
fn bare_lf_cannot_desync_pipelined_requests() {
    let (r, _d) = router();
    // Three pipelined messages, the second with bare LF line ends: the
    // first is answered, the second refused with 400, the connection closed
    // (the third is never read as a request of its own).
    let resp = raw(
        r.http,
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\nHost: x\n\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
        W,
    );
    let text = String::from_utf8_lossy(&resp).to_string();
    assert_eq!(text.matches("HTTP/1.1 ").count(), 2, "{text}");
    let second = text
        .rfind("HTTP/1.1 400")
        .expect("the bare-LF message is refused");
    assert!(
        text[second..]
            .to_ascii_lowercase()
            .contains("connection: close"),
        "{text}"
    );
    assert!(text[second..].contains("request_invalid"), "{text}");
    // A bare LF in a chunk-size line and a leading space before a size.
    rejects(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2;a\nb\r\n{}\r\n0\r\n\r\n",
        400,
    );
    rejects(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n 2\r\n{}\r\n0\r\n\r\n",
        400,
    );
}

#[test]
fn host_is_required_once_and_absolute_form_is_accepted() {
    rejects(b"GET /health HTTP/1.1\r\n\r\n", 400);
    rejects(b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400);
    let (r, _d) = router();
    let resp = raw(
        r.http,
        b"GET http://router.example:8080/health HTTP/1.1\r\nHost: router.example\r\nConnection: close\r\n\r\n",
        W,
    );
    assert_eq!(status_of(&resp), 200, "{}", String::from_utf8_lossy(&resp));
    // HTTP/1.0 may leave Host out.
    let resp = raw(r.http, b"GET /health HTTP/1.0\r\n\r\n", W);
    assert_eq!(status_of(&resp), 200);
}

#[test]
fn the_header_limit_is_the_same_for_router_and_agent() {
    let dir = tmpdir("header-limit");
    let r = start_router(&dir, &["--shards", "1"], &[]);
    let (_s, port) = start_sim(&dir, "hl-model", &[]);
    let _a = start_agent(&dir, &r, port, "hl.key", &[]);
    wait_agents(r.http, "hl-model", 1);
    let body = r#"{"model":"hl-model","messages":[]}"#;
    let with = |n: usize| {
        // Host, Content-Length and Connection, plus filler up to n fields.
        let mut s = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n",
            body.len()
        );
        for i in 0..n - 3 {
            s.push_str(&format!("X-F{i}: v\r\n"));
        }
        s.push_str("\r\n");
        s.push_str(body);
        raw(r.http, s.as_bytes(), W)
    };
    // At the limit: forwarded (the router's own X-Request-ID on top is fine).
    let resp = with(100);
    let text = String::from_utf8_lossy(&resp);
    assert_eq!(status_of(&resp), 200, "{text}");
    // Over it: the router answers 431, in the envelope, no debug text.
    let resp = with(101);
    let text = String::from_utf8_lossy(&resp);
    assert_eq!(status_of(&resp), 431, "{text}");
    assert!(!text.contains("TooLarge("), "{text}");
}

/// A refused request whose body is still arriving when the router answers
/// (413 before reading: declared over the limit) must reach the client as
/// the response and a clean end, not a reset: the router closes the way
/// nginx does (lingering close). Without it, closing with body bytes
/// unread made the kernel send RST, and the client's read failed with
/// ECONNRESET (sometimes before the response was read).
#[test]
fn refused_request_with_a_body_in_flight_ends_cleanly() {
    use std::io::{Read, Write};
    let (r, _d) = router();
    for round in 0..5 {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", r.http)).expect("connect");
        s.set_read_timeout(Some(W)).expect("timeout");
        let mut w = s.try_clone().expect("clone");
        let body = vec![b'x'; 4 << 20];
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        // The body follows the head at once; the router answers from the
        // head alone, with most of the body still in flight.
        let writer = std::thread::spawn(move || {
            let _ = w.write_all(head.as_bytes());
            let _ = w.write_all(&body);
        });
        let mut out = Vec::new();
        let res = s.read_to_end(&mut out);
        let text = String::from_utf8_lossy(&out[..out.len().min(400)]).to_string();
        assert!(res.is_ok(), "round {round}: {res:?} after {text:?}");
        assert_eq!(status_of(&out), 413, "{text}");
        drop(s);
        let _ = writer.join();
    }
}
