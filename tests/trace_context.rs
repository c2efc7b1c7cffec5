//! W3C trace context end to end: a client's `traceparent`, `tracestate`
//! and `baggage` reach the backend through router and agent unchanged; a
//! request without one (or with an invalid one) gets a trace started by
//! the router; every response carries the `traceparent` and the audit
//! line its trace ID. The simulator records what it received. (Tracing
//! off, the default; with the OTLP export on: `tests/traces.rs`.)

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

/// What the simulator saw for the request with this `X-Request-ID`.
fn seen_by_backend(sim: u16, request_id: &str) -> Value {
    let (st, body) = Req::get("/sim/trace_headers")
        .send(sim)
        .map(Resp::pair)
        .expect("trace headers");
    assert_eq!(st, 200);
    let all: Vec<Value> = serde_json::from_slice(&body).expect("json");
    all.into_iter()
        .find(|v| v["x_request_id"] == request_id)
        .unwrap_or_else(|| panic!("backend never saw request {request_id}"))
}

fn chat_with(http: u16, stream: bool, extra: &str) -> (u16, String, Vec<u8>) {
    Req::new("POST", "/v1/chat/completions")
        .body(chat_body("m", stream).as_bytes())
        .raw_headers(extra)
        .send(http)
        .map(Resp::triple)
        .expect("chat")
}

/// A `traceparent` value's trace ID (and that it is well formed).
fn trace_id_of(tp: &str) -> String {
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!(parts[0], "00", "{tp}");
    assert_eq!(parts[1].len(), 32, "{tp}");
    assert_eq!(parts[2].len(), 16, "{tp}");
    assert!(parts[1].bytes().all(|b| b.is_ascii_hexdigit()) && parts[1] != "0".repeat(32));
    parts[1].to_string()
}

#[test]
fn trace_context_reaches_the_backend_and_comes_back() {
    let dir = tmpdir("trace-context");
    let log = dir.join("audit.jsonl");
    let log_s = log.to_string_lossy().to_string();
    let r = start_router(
        &dir,
        &["--shards", "1"],
        &[("HIVENET_ROUTER_AUDIT_LOG_PATH", &log_s)],
    );
    // Without OTEL_EXPORTER_OTLP_ENDPOINT the router exports nothing and
    // passes the client's context on as it came (with it, its own spans
    // join the trace: tests/traces.rs).
    assert!(!r.proc.log_text().contains("OTLP trace export on"));
    let (_sim, sim) = start_sim(&dir, "m", &["--record-traces"]);
    let _agent = start_agent(&dir, &r, sim, "a.key", &[]);
    wait_agents(r.http, "m", 1);

    // 1. The client's context, streaming and not: passed on unchanged,
    //    echoed in the response, in the audit line.
    for (i, stream) in [false, true].into_iter().enumerate() {
        let rid = format!("123e4567-e89b-42d3-a456-42661417400{i}");
        let extra = format!(
            "X-Request-ID: {rid}\r\ntraceparent: {PARENT}\r\ntracestate: congo=t61rcWkgMzE,rojo=00f067aa0ba902b7\r\nbaggage: userId=alice\r\n"
        );
        let (st, head, _) = chat_with(r.http, stream, &extra);
        assert_eq!(st, 200, "{head}");
        assert_eq!(header_of(&head, "traceparent").as_deref(), Some(PARENT));
        let seen = seen_by_backend(sim, &rid);
        assert_eq!(seen["traceparent"], serde_json::json!([PARENT]), "{seen}");
        assert_eq!(
            seen["tracestate"],
            serde_json::json!(["congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"])
        );
        assert_eq!(seen["baggage"], serde_json::json!(["userId=alice"]));
    }

    // 2. No context: the router starts one (sampled), the backend gets
    //    it, the response carries the same, each request its own.
    let mut started = Vec::new();
    for i in 0..2 {
        let rid = format!("223e4567-e89b-42d3-a456-42661417400{i}");
        let (st, head, _) = chat_with(r.http, false, &format!("X-Request-ID: {rid}\r\n"));
        assert_eq!(st, 200);
        let tp = header_of(&head, "traceparent").expect("traceparent on the response");
        assert!(tp.ends_with("-01"), "a started trace is sampled: {tp}");
        let seen = seen_by_backend(sim, &rid);
        assert_eq!(seen["traceparent"], serde_json::json!([tp]), "{seen}");
        started.push(trace_id_of(&tp));
    }
    assert_ne!(started[0], started[1], "each request starts its own trace");

    // 3. An invalid traceparent (upper-case hex) is replaced and its
    //    tracestate dropped; the backend never sees the client's values.
    let rid = "323e4567-e89b-42d3-a456-426614174000";
    let bad = PARENT.to_uppercase();
    let (st, head, _) = chat_with(
        r.http,
        false,
        &format!("X-Request-ID: {rid}\r\ntraceparent: {bad}\r\ntracestate: congo=x\r\n"),
    );
    assert_eq!(st, 200);
    let tp = header_of(&head, "traceparent").expect("traceparent");
    assert_ne!(tp, bad.to_ascii_lowercase());
    let seen = seen_by_backend(sim, rid);
    assert_eq!(seen["traceparent"], serde_json::json!([tp]));
    assert_eq!(seen["tracestate"], serde_json::json!([]), "{seen}");
    let bad_replaced = trace_id_of(&tp);

    // 4. Errors carry it too: an unknown model (404) keeps the client's.
    let (st, head, _) = Req::new("POST", "/v1/chat/completions")
        .body(chat_body("nope", false).as_bytes())
        .raw_headers(&format!("traceparent: {PARENT}\r\n"))
        .send(r.http)
        .map(Resp::triple)
        .expect("404");
    assert_eq!(st, 404);
    assert_eq!(header_of(&head, "traceparent").as_deref(), Some(PARENT));

    // 5. The audit line of each request has its trace ID.
    let ids: Vec<(String, String)> = {
        let mut out = Vec::new();
        wait_until(
            Duration::from_secs(5),
            || {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                out = text
                    .lines()
                    .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                    .map(|v| {
                        (
                            v["request_id"].as_str().unwrap_or("").to_string(),
                            v["trace_id"].as_str().unwrap_or("").to_string(),
                        )
                    })
                    .collect();
                // Every request this test sent, whatever else the
                // audit holds (six lines could be reached before the
                // last of them was written).
                [
                    "123e4567-e89b-42d3-a456-426614174000",
                    "123e4567-e89b-42d3-a456-426614174001",
                    "223e4567-e89b-42d3-a456-426614174000",
                    "223e4567-e89b-42d3-a456-426614174001",
                    rid,
                ]
                .iter()
                .all(|want| out.iter().any(|(r, _)| r == want))
            },
            "the audit lines of the test's requests",
        );
        out
    };
    let trace_of = |rid: &str| {
        ids.iter()
            .find(|(r, _)| r == rid)
            .map(|(_, t)| t.clone())
            .unwrap_or_else(|| panic!("no audit line for {rid}: {ids:?}"))
    };
    assert_eq!(trace_of("123e4567-e89b-42d3-a456-426614174000"), TRACE_ID);
    assert_eq!(trace_of("123e4567-e89b-42d3-a456-426614174001"), TRACE_ID);
    assert_eq!(trace_of("223e4567-e89b-42d3-a456-426614174000"), started[0]);
    assert_eq!(trace_of("223e4567-e89b-42d3-a456-426614174001"), started[1]);
    assert_eq!(trace_of(rid), bad_replaced);
    assert!(
        ids.iter().any(|(_, t)| t == TRACE_ID) && ids.iter().all(|(_, t)| t.len() == 32),
        "every audit line has a trace ID: {ids:?}"
    );
}
