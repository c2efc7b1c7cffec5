//! Capability routing: embeddings and rerank go to agents that declared
//! them; a capability mismatch is a 404 naming the capability, not a hang.

mod common;
use common::*;

#[test]
fn embeddings_rerank_and_mismatch() {
    let dir = tmpdir("capability");
    let r = start_router(&dir, &["--shards", "2"], &[]);
    let (_se, pe) = start_sim(&dir, "embed-model", &[]);
    let (_sr, pr) = start_sim(&dir, "rerank-model", &[]);
    let _ae = start_agent(
        &dir,
        &r,
        pe,
        "e.key",
        &["--capability", "embedding", "--engine", "infinity"],
    );
    let _ar = start_agent(&dir, &r, pr, "r.key", &["--capability", "reranker"]);
    wait_agents(r.http, "embed-model", 1);
    wait_agents(r.http, "rerank-model", 1);

    let (st, b) = Req::post(
        "/v1/embeddings",
        r#"{"model":"embed-model","input":["a","b"]}"#,
    )
    .send(r.http)
    .map(Resp::pair)
    .expect("req");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
    assert_eq!(v["data"].as_array().map(Vec::len), Some(2));

    let (st, b) = Req::post(
        "/v1/rerank",
        r#"{"model":"rerank-model","query":"red fox","documents":["blue sky","red fox"]}"#,
    )
    .send(r.http)
    .map(Resp::pair)
    .expect("req");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
    assert_eq!(v["results"][0]["index"], 1);

    let (st, b) = Req::post(
        "/v1/chat/completions",
        r#"{"model":"embed-model","messages":[]}"#,
    )
    .send(r.http)
    .map(Resp::pair)
    .expect("req");
    assert_eq!(st, 404, "{}", String::from_utf8_lossy(&b));
    assert!(String::from_utf8_lossy(&b).contains("capability llm"));
    let (st, b) = Req::post(
        "/v1/messages/count_tokens",
        r#"{"model":"rerank-model","messages":[]}"#,
    )
    .send(r.http)
    .map(Resp::pair)
    .expect("req");
    // Issue 28 #10: a clear 404 naming the capability, not the spec's
    // 503 "all policy steps exhausted".
    assert_eq!(st, 404);
    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
    assert_eq!(
        v["error"]["code"], "model_not_found",
        "capability mismatch code: {v}"
    );
    let msg = v["error"]["message"].as_str().unwrap_or("");
    assert!(msg.contains("capability"), "names the capability: {v}");
    let (st, b) = Req::get("/v1/models/embed-model")
        .send(r.http)
        .map(Resp::pair)
        .expect("req");
    assert_eq!(st, 200);
    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
    assert_eq!(v["capability"], "embedding");
    assert_eq!(v["agents"]["list"][0]["engine"], "infinity");
    let (st, b) = Req::get("/admin/models/embed-model")
        .bearer(ADMIN_KEY)
        .send(r.http)
        .map(Resp::pair)
        .expect("admin detail");
    assert_eq!(st, 200);
    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
    assert_eq!(v["agents"]["total"], 1);
    let (st, b) = Req::get("/admin/health")
        .bearer(ADMIN_KEY)
        .send(r.http)
        .map(Resp::pair)
        .expect("admin health");
    assert_eq!(st, 200);
    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
    assert_eq!(v["status"], "healthy");
    assert_eq!(v["healthy_agents"], 2);
}

#[test]
fn large_response_streams_through() {
    let dir = tmpdir("large");
    let r = start_router(&dir, &["--shards", "1"], &[]);
    let (_s, port) = start_sim(&dir, "big-embed", &[]);
    let _a = start_agent(&dir, &r, port, "big.key", &["--capability", "embedding"]);
    wait_agents(r.http, "big-embed", 1);
    // About 8 MiB of JSON back: above the router's 4 MiB buffering bound.
    let inputs: Vec<String> = (0..60_000).map(|i| format!("w{i}")).collect();
    let body = serde_json::json!({"model": "big-embed", "input": inputs}).to_string();
    let (st, b) = Req::post("/v1/embeddings", &body)
        .send(r.http)
        .map(Resp::pair)
        .expect("req");
    assert_eq!(st, 200);
    assert!(b.len() > 4 * 1024 * 1024, "{} bytes", b.len());
    let v: serde_json::Value = serde_json::from_slice(&b).expect("complete JSON");
    assert_eq!(v["data"].as_array().map(Vec::len), Some(60_000));
}
