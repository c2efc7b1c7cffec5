//! Hold at zero, which agent wakes which request, on real processes: the
//! wait room is per (model, kind), so an agent of another kind does not
//! release a held chat request; embeddings and rerank are held by their
//! own placements; a model whose agents are all unhealthy is held and
//! released on recovery.

mod common;
use common::hold::*;
use common::*;
use std::time::Duration;

/// Issue 28 #5: the wait room and the wake are per (model, kind). An
/// embedding agent registered under the name of a chat model held at
/// zero does not release the held chat request into an error: it stays
/// held (and counted) until a chat agent registers, and is served then.
#[test]
fn an_agent_of_another_kind_does_not_wake_a_held_request() {
    let dir = tmpdir("hold-kind");
    let r = site_router(&dir, &["--wake-keepalive", "0"], &[]);
    push_map(&r, "20s");
    let s = send(r.http, "/v1/chat/completions", &chat_body("m", false), "");
    wait_until(Duration::from_secs(5), || demand(&r) == Some(1.0), "held");
    let (_se, pe) = start_sim(&dir, "m", &[]);
    let _e = start_agent(&dir, &r, pe, "e.key", &["--capability", "embedding"]);
    wait_agents(r.http, "m", 1);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        demand(&r),
        Some(1.0),
        "still held after the embedding agent"
    );
    assert_eq!(outcome(&r, "woken"), 0.0);
    // A new chat request is held too, not sent to the embedding agent.
    let s2 = send(r.http, "/v1/chat/completions", &chat_body("m", false), "");
    wait_until(
        Duration::from_secs(5),
        || demand(&r) == Some(2.0),
        "second held",
    );
    let (_sc, pc) = start_sim(&dir, "m", &[]);
    let _c = start_agent(&dir, &r, pc, "c.key", &[]);
    for s in [s, s2] {
        let (head, body) = read_all(s);
        assert!(head.starts_with("HTTP/1.1 200"), "{head} {body}");
        assert!(body.contains("chat.completion"), "{body}");
    }
    assert_eq!(outcome(&r, "woken"), 2.0);
}

/// Issue 28 #2: the seed holds a request when no *healthy* agent serves
/// the model here, not only when none is registered. The agent's backend
/// goes down (the agent stays registered, reporting it unhealthy): a
/// request is held, counted in the demand, and served when the backend
/// comes back and the agent recovers.
#[test]
fn a_model_whose_agents_are_all_unhealthy_is_held_and_released_on_recovery() {
    let dir = tmpdir("hold-unhealthy");
    let r = site_router(
        &dir,
        &["--wake-keepalive", "0", "--heartbeat-interval", "200ms"],
        &[],
    );
    push_map(&r, "30s");
    let (mut sim, port) = start_sim(&dir, "m", &[]);
    let _a = start_agent(
        &dir,
        &r,
        port,
        "a.key",
        &["--hardware-sample-interval", "100ms"],
    );
    wait_agents(r.http, "m", 1);
    sim.kill9();
    wait_until(
        Duration::from_secs(10),
        || healthy_agents(r.http, "m") == 0,
        "the agent reports its backend down",
    );
    let s = send(r.http, "/v1/chat/completions", &chat_body("m", false), "");
    wait_until(
        Duration::from_secs(5),
        || demand(&r) == Some(1.0),
        "held, not refused with 503",
    );
    let ps = port.to_string();
    let _sim2 = spawn("hivenet-sim", &["--port", &ps, "--model", "m"], &dir, &[]);
    let (head, body) = read_all(s);
    assert!(head.starts_with("HTTP/1.1 200"), "{head} {body}");
    assert!(body.contains("chat.completion"), "{body}");
    assert_eq!(outcome(&r, "woken"), 1.0);
}

/// Issue 28 (missing tests): every inference endpoint is held by the
/// placement kind that matches it (seed 2): embeddings by an `embedding`
/// placement, rerank by a `rerank` one, each released by an agent of its
/// capability and served; a chat request for the embedding model is not
/// held (no chat placement).
#[test]
fn embedding_and_rerank_requests_are_held_and_served() {
    let dir = tmpdir("hold-kinds");
    let r = site_router(&dir, &["--wake-keepalive", "0"], &[]);
    push_kinds(&r);
    let held = |model: &str| {
        metric(
            r.metrics,
            &format!("hivenet_pending_demand{{model=\"{model}\"}}"),
        )
    };
    let e = send(
        r.http,
        "/v1/embeddings",
        r#"{"model":"e","input":"hello"}"#,
        "",
    );
    let rr = send(
        r.http,
        "/v1/rerank",
        r#"{"model":"rr","query":"q","documents":["a","b"]}"#,
        "",
    );
    wait_until(
        Duration::from_secs(5),
        || held("e") == Some(1.0) && held("rr") == Some(1.0),
        "both held",
    );
    let (st, _) = Req::post("/v1/chat/completions", chat_body("e", false))
        .send(r.http)
        .map(Resp::pair)
        .expect("chat");
    assert_eq!(st, 404, "no chat placement: not held");
    let (_se, pe) = start_sim(&dir, "e", &[]);
    let _ae = start_agent(&dir, &r, pe, "e.key", &["--capability", "embedding"]);
    let (_sr, pr) = start_sim(&dir, "rr", &[]);
    let _ar = start_agent(&dir, &r, pr, "rr.key", &["--capability", "reranker"]);
    let (head, body) = read_all(e);
    assert!(head.starts_with("HTTP/1.1 200"), "{head} {body}");
    assert!(body.contains("embedding"), "{body}");
    let (head, body) = read_all(rr);
    assert!(head.starts_with("HTTP/1.1 200"), "{head} {body}");
    assert!(body.contains("results"), "{body}");
    assert_eq!(held("e"), Some(0.0));
    assert_eq!(held("rr"), Some(0.0));
}

/// Issue 52: a Responses turn for a model at zero is held (kind `chat`),
/// with keepalive bytes, and served when an agent registers: the client
/// gets the router's response ID after the keepalives, and the turn is
/// kept (the next one continues it).
#[test]
fn a_responses_turn_is_held_and_served_with_the_routers_id() {
    let dir = tmpdir("hold-responses");
    let r = site_router(&dir, &["--wake-keepalive", "200ms"], &[]);
    push_map(&r, "20s");
    let body = r#"{"model":"m","input":"hello","max_output_tokens":3}"#;
    let s = send(r.http, "/v1/responses", body, "");
    wait_until(Duration::from_secs(5), || demand(&r) == Some(1.0), "held");
    std::thread::sleep(Duration::from_millis(600));
    let (_sc, pc) = start_sim(&dir, "m", &[]);
    let _c = start_agent(&dir, &r, pc, "c.key", &[]);
    let (head, body) = read_all(s);
    assert!(head.starts_with("HTTP/1.1 200"), "{head} {body}");
    let v: serde_json::Value = serde_json::from_str(body.trim()).expect("one JSON answer");
    let id = v["id"].as_str().expect("id");
    assert!(
        id.starts_with("resp_") && !id.starts_with("resp_sim"),
        "{v}"
    );
    assert_eq!(outcome(&r, "woken"), 1.0);
    let next = format!(r#"{{"model":"m","input":"again","previous_response_id":"{id}"}}"#);
    let (st, out) = Req::post("/v1/responses", next)
        .send(r.http)
        .expect("next")
        .pair();
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&out));
}
