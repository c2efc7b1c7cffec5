//! Admin authentication end to end: the key (with or without `Bearer`),
//! refused before any body is read.

mod common;
use common::*;
use std::process::Command;
use std::time::Duration;

#[test]
fn admin_authentication() {
    let dir = tmpdir("admin");
    let r = start_router(&dir, &["--shards", "1"], &[]);
    let (st, b) = Req::get("/admin/routing-table")
        .send(r.http)
        .map(Resp::pair)
        .expect("no key");
    assert_eq!(st, 401);
    assert!(String::from_utf8_lossy(&b).contains(r#""code":"unauthorized""#));
    let raw_resp = raw(r.http, b"GET /admin/routing-table HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\nConnection: close\r\n\r\n", Duration::from_secs(3));
    let text = String::from_utf8_lossy(&raw_resp);
    assert!(text.starts_with("HTTP/1.1 401"), "{text}");
    assert!(
        text.contains(r#"WWW-Authenticate: Bearer realm="hivenet-router""#),
        "{text}"
    );
    let (st, _) = Req::get("/admin/routing-table")
        .bearer(ADMIN_KEY)
        .send(r.http)
        .map(Resp::pair)
        .expect("right key");
    assert_eq!(st, 200);
    let (st, b) = Req::get("/admin/health")
        .bearer(ADMIN_KEY)
        .send(r.http)
        .map(Resp::pair)
        .expect("health");
    assert_eq!(st, 200);
    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
    assert_eq!(v["status"], "degraded", "no agent yet: {v}");
    assert_eq!(v["total_agents"], 0);
    let (st, _) = Req::get("/admin/models/none")
        .bearer(ADMIN_KEY)
        .send(r.http)
        .map(Resp::pair)
        .expect("model");
    assert_eq!(st, 404);
    let (st, _) = Req::get("/admin/health")
        .send(r.http)
        .map(Resp::pair)
        .expect("no key");
    assert_eq!(st, 401);
    // Without keys and without the insecure opt-in, the router refuses to start.
    let out = Command::new(bin("hivenet-router"))
        .args([
            "--http-port",
            "127.0.0.1:0",
            "--metrics-port",
            "127.0.0.1:0",
            "--p2p-port",
            "0",
        ])
        .env_remove("HIVENET_ROUTER_ADMIN_API_KEYS")
        .env_remove("HIVENET_ROUTER_ALLOW_INSECURE_ADMIN")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("HIVENET_ROUTER_ADMIN_API_KEYS"));
}

/// The admin key may come without `Bearer` (documented compatibility with
/// the Go router's clients); any other scheme or a wrong key is refused.
#[test]
fn admin_key_with_or_without_bearer() {
    let dir = tmpdir("admin-bearer");
    let r = start_router(&dir, &["--shards", "1"], &[]);
    for (header, want) in [
        (format!("Authorization: Bearer {ADMIN_KEY}\r\n"), 200),
        (format!("Authorization: {ADMIN_KEY}\r\n"), 200),
        (format!("Authorization: Basic {ADMIN_KEY}\r\n"), 401),
        ("Authorization: Bearer wrong\r\n".to_string(), 401),
    ] {
        let (st, _) = Req::new("GET", "/admin/health")
            .body(b"")
            .raw_headers(&header)
            .send(r.http)
            .map(Resp::pair)
            .expect("admin");
        assert_eq!(st, want, "{header}");
    }
}

/// The admin key is checked before an admin body is read: a client
/// without the key that declares a large body and sends none is answered
/// 401 at once (not left holding a body read open until the body timeout).
#[test]
fn admin_key_is_checked_before_the_body() {
    let dir = tmpdir("admin-before-body");
    let r = start_router(&dir, &["--shards", "1", "--body-timeout", "20s"], &[]);
    let t = std::time::Instant::now();
    let resp = raw(
        r.http,
        b"PUT /admin/policy HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000\r\n\r\n",
        Duration::from_secs(10),
    );
    assert_eq!(status_of(&resp), 401, "{}", String::from_utf8_lossy(&resp));
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "answered after {:?}",
        t.elapsed()
    );
    let text = String::from_utf8_lossy(&resp).to_ascii_lowercase();
    assert!(
        text.contains("connection: close"),
        "the unread body closes the connection: {text}"
    );
}

/// Issue 29 #13: admin routes carry no CORS headers and refuse a browser
/// request from another origin, even in insecure admin mode (a page
/// elsewhere could otherwise reset the metrics); client routes keep CORS.
#[test]
fn admin_routes_refuse_foreign_origins_and_carry_no_cors() {
    let dir = tmpdir("admin-cors");
    let r = start_router(
        &dir,
        &["--shards", "1"],
        &[
            ("HIVENET_ROUTER_ALLOW_INSECURE_ADMIN", "true"),
            ("HIVENET_ROUTER_ADMIN_API_KEYS", ""),
        ],
    );
    let send = |req: String| {
        String::from_utf8_lossy(&raw(r.http, req.as_bytes(), Duration::from_secs(3))).into_owned()
    };
    let foreign = send("POST /admin/metrics/reset HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: https://evil.example\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".into());
    assert!(foreign.starts_with("HTTP/1.1 403"), "{foreign}");
    assert!(
        foreign.contains("cross-origin admin requests are refused"),
        "{foreign}"
    );
    assert!(
        !foreign.contains("Access-Control-Allow-Origin"),
        "{foreign}"
    );
    let host = format!("127.0.0.1:{}", r.http);
    let same = send(format!("POST /admin/metrics/reset HTTP/1.1\r\nHost: {host}\r\nOrigin: http://{host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"));
    assert!(same.starts_with("HTTP/1.1 200"), "{same}");
    assert!(!same.contains("Access-Control-Allow-Origin"), "{same}");
    let preflight = send(
        "OPTIONS /admin/metrics/reset HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".into(),
    );
    assert!(
        !preflight.contains("Access-Control-Allow-Origin"),
        "{preflight}"
    );
    let client = send("OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: https://app.example\r\nConnection: close\r\n\r\n".into());
    assert!(
        client.contains("Access-Control-Allow-Origin: *"),
        "{client}"
    );
}
