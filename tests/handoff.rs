//! Two shards, two models, one keep-alive connection: each request runs on
//! its model's shard, the connection is handed over when the model
//! changes, and per-shard counters (exported as metrics) show it.

mod common;
use common::*;
use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

#[test]
fn keep_alive_connection_follows_its_model() {
    let dir = tmpdir("handoff");
    let router = start_router(&dir, &["--shards", "2"], &[]);
    let (_sa, pa) = start_sim(&dir, "model-a", &[]);
    let (_sb, pb) = start_sim(&dir, "model-b", &[]);
    let _aa = start_agent(&dir, &router, pa, "a.key", &[]);
    let _ab = start_agent(&dir, &router, pb, "b.key", &[]);
    wait_agents(router.http, "model-a", 1);
    wait_agents(router.http, "model-b", 1);

    let mut s = TcpStream::connect(("127.0.0.1", router.http)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let mut buf = Vec::new();
    for model in ["model-a", "model-b", "model-a", "model-b"] {
        let body =
            format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}"#);
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).expect("write");
        let (status, body) = read_response(&mut s, &mut buf);
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["model"], model, "answered by the right backend");
    }
    let m = metrics_text(router.metrics);
    let served = |shard: &str| {
        metric(
            router.metrics,
            &format!("hivenet_shard_requests_total{{shard=\"{shard}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert!(
        served("0") >= 2.0 && served("1") >= 2.0,
        "each shard served its model's requests:\n{m}"
    );
    let out0 = metric(
        router.metrics,
        "hivenet_shard_handoffs_total{shard=\"0\",direction=\"out\"}",
    )
    .unwrap_or(0.0);
    let out1 = metric(
        router.metrics,
        "hivenet_shard_handoffs_total{shard=\"1\",direction=\"out\"}",
    )
    .unwrap_or(0.0);
    assert!(out0 + out1 >= 3.0, "a hand-off per model change:\n{m}");
}

#[test]
fn pipelined_requests_for_two_models_cross_shards_in_order() {
    let dir = tmpdir("pipeline");
    let router = start_router(&dir, &["--shards", "2"], &[]);
    let (_sa, pa) = start_sim(&dir, "pipe-a", &[]);
    let (_sb, pb) = start_sim(&dir, "pipe-b", &[]);
    let _aa = start_agent(&dir, &router, pa, "a.key", &[]);
    let _ab = start_agent(&dir, &router, pb, "b.key", &[]);
    wait_agents(router.http, "pipe-a", 1);
    wait_agents(router.http, "pipe-b", 1);
    let mut s = TcpStream::connect(("127.0.0.1", router.http)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    // Three requests in one write: the bytes after the first travel with
    // the hand-off and are served by the right shards, in order.
    let mut all = Vec::new();
    for model in ["pipe-a", "pipe-b", "pipe-a"] {
        let body = format!(r#"{{"model":"{model}","messages":[]}}"#);
        all.extend_from_slice(
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        );
    }
    s.write_all(&all).expect("write");
    let mut buf = Vec::new();
    for model in ["pipe-a", "pipe-b", "pipe-a"] {
        let (status, body) = read_response(&mut s, &mut buf);
        assert_eq!(status, 200);
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["model"], model);
    }
}
