//! The hold-at-zero tests' shared request builder: a router with a site
//! map, placements at zero, raw requests and their timed reads, the
//! pending-demand and outcome series.

use super::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Instant;

pub const ADMIN: &str = "test-admin-key";

pub fn site_router(dir: &std::path::Path, extra: &[&str], env: &[(&str, &str)]) -> Router {
    let mut args = vec!["--shards", "2", "--site-id", "a"];
    args.extend_from_slice(extra);
    let mut e = vec![("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN)];
    e.extend_from_slice(env);
    start_router(dir, &args, &e)
}

/// Push a map of site `a` (this router) with `placements` (JSON objects).
pub fn push_placements(r: &Router, version: &str, placements: &[String]) {
    let body = format!(
        r#"{{"version":"{version}","sites":[{{"site_id":"a","base_url":"http://127.0.0.1:{}"}}],"placements":[{}]}}"#,
        r.http,
        placements.join(",")
    );
    let (st, b) = Req::new("PUT", "/admin/sibling-map")
        .body(body.as_bytes())
        .raw_headers(&format!("Authorization: Bearer {ADMIN}\r\n"))
        .send(r.http)
        .map(Resp::pair)
        .expect("push");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
}

/// A placement of `model` (`kind`) on site `a` with scale_from_zero.
pub fn at_zero(model: &str, kind: &str, budget: &str) -> String {
    format!(
        r#"{{"site_id":"a","model":"{model}","kind":"{kind}","scale_from_zero":true,"hold_budget":"{budget}"}}"#
    )
}

/// Place `m` (chat) here with scale_from_zero.
pub fn push_map(r: &Router, budget: &str) {
    push_placements(r, "1", &[at_zero("m", "chat", budget)]);
}

pub fn demand(r: &Router) -> Option<f64> {
    metric(r.metrics, "hivenet_pending_demand{model=\"m\"}")
}

pub fn outcome(r: &Router, o: &str) -> f64 {
    metric(
        r.metrics,
        &format!("hivenet_wake_holds_total{{model=\"m\",outcome=\"{o}\"}}"),
    )
    .unwrap_or(0.0)
}

/// Send a request on a raw socket (the caller reads the answer as it comes).
pub fn send(http: u16, path: &str, body: &str, extra: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", http)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).ok();
    s.write_all(
        format!(
            "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .expect("write");
    s
}

pub fn read_all(mut s: TcpStream) -> (String, String) {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    split_response(&out)
}

/// Head and (de-chunked) body of a whole response.
pub fn split_response(out: &[u8]) -> (String, String) {
    let split = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| p + 4)
        .unwrap_or(out.len());
    let head = String::from_utf8_lossy(&out[..split]).to_string();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(&out[split..])
    } else {
        out[split..].to_vec()
    };
    (head, String::from_utf8_lossy(&body).to_string())
}

/// `n` non-streamed chats for `m`, each on its own connection and thread;
/// each handle gives the whole answer (head, de-chunked body).
pub fn chats_in_background(http: u16, n: usize) -> Vec<std::thread::JoinHandle<(String, String)>> {
    (0..n)
        .map(|_| {
            std::thread::spawn(move || {
                read_all(send(
                    http,
                    "/v1/chat/completions",
                    &chat_body("m", false),
                    "",
                ))
            })
        })
        .collect()
}

/// Every read of a response with the time it arrived.
pub fn read_timed(mut s: TcpStream) -> Vec<(Instant, Vec<u8>)> {
    let mut reads = Vec::new();
    let mut buf = [0u8; 65536];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        reads.push((Instant::now(), buf[..n].to_vec()));
    }
    reads
}

/// Place `e` (embedding) and `rr` (rerank) here with scale_from_zero.
pub fn push_kinds(r: &Router) {
    push_placements(
        r,
        "2",
        &[
            at_zero("e", "embedding", "20s"),
            at_zero("rr", "rerank", "20s"),
        ],
    );
}

/// Place `model` (chat) on site `a` of the router at `http` with
/// scale_from_zero, held up to `budget`.
pub fn push_at_zero(http: u16, model: &str, budget: &str) {
    let body = format!(
        r#"{{"version":"1","sites":[{{"site_id":"a","base_url":"http://127.0.0.1:{http}"}}],"placements":[{}]}}"#,
        at_zero(model, "chat", budget)
    );
    let (st, b) = Req::new("PUT", "/admin/sibling-map")
        .body(body.as_bytes())
        .bearer(ADMIN)
        .send(http)
        .map(Resp::pair)
        .expect("push");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
}

/// One chat on its own connection to `port` (`key`: its bearer); the
/// whole answer (head, de-chunked body).
pub fn chat_on(
    port: u16,
    key: Option<&str>,
    model: &str,
    stream: bool,
    tokens: u32,
) -> std::io::Result<(String, String)> {
    let body = format!(
        r#"{{"model":"{model}","stream":{stream},"max_tokens":{tokens},"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    s.write_all(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    Ok(split_response(&out))
}

/// A streamed answer is whole: at least `tokens` content events and the end.
pub fn whole_stream(body: &str, tokens: usize) -> bool {
    let n = body
        .lines()
        .filter(|l| l.starts_with("data: {") && l.contains("\"content\""))
        .count();
    body.contains("data: [DONE]") && n >= tokens
}
