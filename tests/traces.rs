//! Issue 53: every request's decision, exported as OpenTelemetry traces to
//! a real OTLP receiver (Arize Phoenix, read back through its REST API):
//! one trace per request joining the client's span, the router's (the
//! request, each attempt with the decision that chose its agent), the
//! agent's (its request, its backend call) and the engine's (the
//! simulator's `--otlp-traces-endpoint` span, as vLLM exports one); a
//! held-and-woken request, a redirected one, a continued stream and a
//! provider fallback each explained by their own span or attributes. A
//! receiver frozen or killed under load drops and counts spans and fails
//! no request.

mod common;
use common::hold::{push_placements, ADMIN};
use common::phoenix::*;
use common::*;
use serde_json::Value;
use std::time::Duration;

const CLIENT_PARENT: &str = "00f067aa0ba902b7";

fn otel(p: &Phoenix) -> Vec<(&'static str, String)> {
    vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", p.endpoint()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
        // Every trace by the head sampler: the tail rules are unit-tested.
        ("OTEL_TRACES_SAMPLER", "parentbased_always_on".into()),
    ]
}

fn envs<'a>(v: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    v.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// A fresh trace ID, lower-case hex.
fn trace_id(n: u64) -> String {
    format!("{:016x}{:016x}", 0x4bf9_2f35_77b3_4da6u64, n + 1)
}

fn traceparent(tid: &str) -> String {
    format!("traceparent: 00-{tid}-{CLIENT_PARENT}-01\r\n")
}

fn attr<'a>(s: &'a Value, key: &str) -> &'a Value {
    &s["attributes"][key]
}

/// A chat request with the client's trace: (status, head, body).
fn chat(http: u16, tid: &str, stream: bool) -> (u16, String, Vec<u8>) {
    Req::new("POST", "/v1/chat/completions")
        .body(chat_body("m", stream).as_bytes())
        .raw_headers(&traceparent(tid))
        .send(http)
        .map(Resp::triple)
        .expect("chat")
}

#[test]
fn each_decision_is_one_trace_from_client_to_engine() {
    let dir = tmpdir("traces");
    let phoenix = start_phoenix(&dir);
    let env = otel(&phoenix);
    let engine_url = format!("{}/v1/traces", phoenix.endpoint());

    // 1. Served: client -> router -> attempt -> agent -> backend -> engine.
    let r = start_router(
        &dir,
        &["--shards", "1"],
        &[&[("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN)][..], &envs(&env)].concat(),
    );
    let (_sim, port) = start_sim(&dir, "m", &["--otlp-traces-endpoint", &engine_url]);
    let _agent = agent_to_env(&dir, r.p2p, port, "a.key", &[], &envs(&env));
    wait_agents(r.http, "m", 1);
    let tid = trace_id(1);
    let (st, head, body) = chat(r.http, &tid, false);
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let spans = phoenix.wait_trace(&tid, "served", |s| s.len() >= 5);
    let root = span(&spans, "POST /v1/chat/completions");
    assert_eq!(
        root["parent_id"], CLIENT_PARENT,
        "the client's span is its parent"
    );
    assert_eq!(attr(root, "gen_ai.request.model"), "m");
    assert_eq!(attr(root, "http.response.status_code"), 200);
    assert!(
        attr(root, "gen_ai.usage.input_tokens").as_u64() > Some(0),
        "{root}"
    );
    assert!(
        attr(root, "gen_ai.usage.output_tokens").as_u64() > Some(0),
        "{root}"
    );
    assert_eq!(attr(root, "hivenet.tenant"), "default");
    // The response names the router's span as the trace's parent.
    let tp = header_of(&head, "traceparent").expect("traceparent");
    assert_eq!(
        tp,
        format!(
            "00-{tid}-{}-01",
            root["context"]["span_id"].as_str().unwrap_or("?")
        )
    );
    let attempt = span(&spans, "hivenet.attempt");
    assert!(child_of(attempt, root), "{attempt}");
    assert_eq!(attr(attempt, "hivenet.decision.step"), "routing_policy");
    assert!(
        attr(attempt, "hivenet.decision.trail").is_string(),
        "{attempt}"
    );
    let peer = attr(attempt, "hivenet.agent.peer_id")
        .as_str()
        .unwrap_or("?");
    assert_eq!(
        attr(attempt, "hivenet.decision.verdicts"),
        format!("{}: eligible", &peer[peer.len() - 8..]).as_str(),
        "{attempt}"
    );
    assert!(attr(attempt, "hivenet.agent.peer_id")
        .as_str()
        .is_some_and(|p| p.starts_with("12D3")));
    assert!(
        attr(attempt, "hivenet.srtt_sample_ms").as_f64() > Some(0.0),
        "{attempt}"
    );
    assert_eq!(attr(attempt, "http.response.status_code"), 200);
    // The tenant's share of the model's running requests (this one).
    assert_eq!(attr(attempt, "hivenet.queue.tenant_running"), 1);
    assert_eq!(attr(attempt, "hivenet.queue.model_running"), 1);
    assert_eq!(attr(attempt, "hivenet.queue.tenants_running"), 1);
    let agent = span(&spans, "agent POST /v1/chat/completions");
    assert!(
        child_of(agent, attempt),
        "the agent's span is the attempt's child: {agent}"
    );
    let backend = span(&spans, "backend POST /v1/chat/completions");
    assert!(child_of(backend, agent), "{backend}");
    assert_eq!(attr(backend, "http.response.status_code"), 200);
    assert!(attr(backend, "hivenet.backend.time_to_head_ms").as_f64() > Some(0.0));
    let engine = span(&spans, "llm_request");
    assert!(
        child_of(engine, backend),
        "the engine's span joins: {engine}"
    );
    assert_eq!(spans.len(), 5, "one trace, five spans: {spans:#?}");

    // 2. A stream continued on another agent after its engine died.
    let (_bad, pb) = start_sim(
        &dir,
        "m",
        &["--abort-rate", "1", "--output-tokens", "40", "--itl", "1ms"],
    );
    let _a2 = agent_to_env(&dir, r.p2p, pb, "b.key", &[], &envs(&env));
    wait_agents(r.http, "m", 2);
    let mut continued = None;
    for i in 0..12 {
        let tid = trace_id(100 + i);
        let (st, _, _) = chat(r.http, &tid, true);
        assert_eq!(st, 200);
        let spans = phoenix.wait_trace(&tid, "stream", |s| {
            s.iter().any(|x| x["name"] == "POST /v1/chat/completions")
        });
        if spans.iter().any(|s| s["name"] == "hivenet.continuation") {
            continued = Some(spans);
            break;
        }
    }
    let spans = continued.expect("one of 12 streams landed on the dying engine and was continued");
    let root = span(&spans, "POST /v1/chat/completions");
    let cont = span(&spans, "hivenet.continuation");
    assert!(child_of(cont, root));
    assert!(
        attr(cont, "hivenet.continuation.break")
            .as_str()
            .is_some_and(|b| !b.is_empty()),
        "{cont}"
    );
    assert!(attr(root, "hivenet.continued_from").is_string(), "{root}");
    let failed = spans
        .iter()
        .find(|s| s["name"] == "hivenet.attempt" && s["status_code"] == "ERROR")
        .expect("the broken attempt, failed");
    assert!(child_of(failed, root));

    // 3. Held at zero, woken when an agent registers.
    let hdir = dir.join("held");
    std::fs::create_dir_all(&hdir).expect("dir");
    let h = start_router(
        &hdir,
        &["--shards", "2", "--site-id", "a"],
        &[&[("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN)][..], &envs(&env)].concat(),
    );
    push_placements(&h, "1", &[common::hold::at_zero("m", "chat", "30s")]);
    let tid = trace_id(200);
    let hport = h.http;
    let tid2 = tid.clone();
    let held = std::thread::spawn(move || chat(hport, &tid2, false));
    wait_until(
        Duration::from_secs(5),
        || common::hold::demand(&h) == Some(1.0),
        "held",
    );
    let _a3 = agent_to_env(&dir, h.p2p, port, "c.key", &[], &envs(&env));
    let (st, _, body) = held.join().expect("held client");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let spans = phoenix.wait_trace(&tid, "held", |s| s.len() >= 6);
    let root = span(&spans, "POST /v1/chat/completions");
    let hold = span(&spans, "hivenet.hold");
    assert!(child_of(hold, root));
    assert_eq!(attr(hold, "hivenet.hold.outcome"), "woken");
    assert_eq!(attr(hold, "hivenet.hold.budget_ms"), 30000.0);
    let attempt = span(&spans, "hivenet.attempt");
    assert!(
        attempt["start_time"].as_str() >= hold["end_time"].as_str(),
        "sent after the wake: {hold} {attempt}"
    );

    // 4. Redirected to a warm sibling site.
    let now = shards::logic::system::timefmt::rfc3339_nanos(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        0,
    );
    let map = format!(
        r#"{{"version":"2","hints_generated_at":"{now}","sites":[{{"site_id":"a","base_url":"http://127.0.0.1:{}"}},{{"site_id":"b","base_url":"http://127.0.0.1:{}"}}],"placements":[{{"site_id":"b","model":"r","kind":"chat","warm":true}}]}}"#,
        h.http, r.http
    );
    let (st, b) = Req::new("PUT", "/admin/sibling-map")
        .body(map.as_bytes())
        .bearer(ADMIN)
        .send(h.http)
        .map(Resp::pair)
        .expect("map");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let tid = trace_id(300);
    let (st, _, _) = Req::new("POST", "/v1/chat/completions")
        .body(chat_body("r", false).as_bytes())
        .raw_headers(&traceparent(&tid))
        .send(h.http)
        .map(Resp::triple)
        .expect("redirected");
    assert_eq!(st, 307);
    let spans = phoenix.wait_trace(&tid, "redirected", |s| !s.is_empty());
    let root = span(&spans, "POST /v1/chat/completions");
    assert_eq!(attr(root, "hivenet.redirect.site"), "b");
    assert_eq!(attr(root, "http.response.status_code"), 307);

    // 5. The policy's fallback provider (a simulator speaks its API).
    let (_prov, pp) = start_sim(&dir, "smol", &[]);
    let pdir = dir.join("policies");
    std::fs::create_dir_all(&pdir).expect("dir");
    std::fs::write(
        pdir.join("_default.yaml"),
        "routing_policy:\n  strategy: least-loaded\nfallback_provider:\n  engine: openai\n  model: smol\n",
    )
    .expect("policy");
    let pdir_s = pdir.to_string_lossy().to_string();
    let base = format!("http://127.0.0.1:{pp}");
    std::fs::create_dir_all(dir.join("fallback")).expect("dir");
    std::fs::write(
        dir.join("fallback/auth.yaml"),
        format!(
            "api:\n  mode: api-key\n  keys:\n    - key_hash: \"{}\"\n      metadata: {{name: open, owner: acme}}\n    - key_hash: \"{}\"\n      metadata: {{name: tiny, owner: tiny}}\n      quota: {{tokens_per_day: 5}}\n",
            sha256_hex("sk-open"),
            sha256_hex("sk-tiny")
        ),
    )
    .expect("auth");
    let fdir = dir.join("fallback");
    std::fs::create_dir_all(&fdir).expect("dir");
    let f = start_router(
        &fdir,
        &[
            "--shards",
            "1",
            "--policy-model-dir",
            &pdir_s,
            "--auth-config-file",
            "auth.yaml",
        ],
        &[
            &[
                ("HIVENET_ROUTER_OPENAI_API_KEY", "sk-provider"),
                ("HIVENET_ROUTER_OPENAI_BASE_URL", base.as_str()),
            ][..],
            &envs(&env),
        ]
        .concat(),
    );
    let (_busy, bp) = start_sim(&dir, "m", &["--error-rate", "1", "--error-status", "503"]);
    let _a4 = agent_to_env(&dir, f.p2p, bp, "d.key", &[], &envs(&env));
    wait_until(
        Duration::from_secs(30),
        || routing_table(f.http)["total"] == 1,
        "the agent registered",
    );
    let keyed = |tid: &str, key: &str| {
        Req::new("POST", "/v1/chat/completions")
            .body(chat_body("m", false).as_bytes())
            .raw_headers(&format!(
                "{}Authorization: Bearer {key}\r\n",
                traceparent(tid)
            ))
            .send(f.http)
            .map(Resp::triple)
            .expect("chat")
    };
    let tid = trace_id(400);
    let (st, _, body) = keyed(&tid, "sk-open");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let spans = phoenix.wait_trace(&tid, "provider", |s| {
        s.iter().any(|x| x["name"] == "hivenet.provider")
            && s.iter().any(|x| x["name"] == "POST /v1/chat/completions")
    });
    let root = span(&spans, "POST /v1/chat/completions");
    let prov = span(&spans, "hivenet.provider");
    assert!(child_of(prov, root));
    assert_eq!(attr(prov, "hivenet.provider.name"), "openai");
    assert_eq!(attr(prov, "http.response.status_code"), 200);
    assert!(
        spans
            .iter()
            .any(|s| s["name"] == "hivenet.attempt" && s["status_code"] == "ERROR"),
        "the local attempts that failed first: {spans:#?}"
    );
    assert_eq!(attr(root, "hivenet.tenant"), "acme");
    // A quota refusal names its rule.
    let tid = trace_id(450);
    let (st, _, body) = keyed(&tid, "sk-tiny");
    assert_eq!(st, 429, "{}", String::from_utf8_lossy(&body));
    let spans = phoenix.wait_trace(&tid, "quota", |s| !s.is_empty());
    let root = span(&spans, "POST /v1/chat/completions");
    assert_eq!(attr(root, "hivenet.refusal"), "tokens_per_day");
    assert_eq!(attr(root, "http.response.status_code"), 429);
    assert!(attr(root, "hivenet.refusal.message")
        .as_str()
        .is_some_and(|m| !m.is_empty()));

    // 6. The receiver frozen, then killed, under load: every request is
    // served, the spans are dropped and counted.
    let dropped = |m: u16| -> f64 {
        ["queue_full", "export_failed"]
            .iter()
            .map(|r| {
                metric(
                    m,
                    &format!("hivenet_trace_spans_dropped_total{{reason=\"{r}\"}}"),
                )
                .unwrap_or(0.0)
            })
            .sum()
    };
    let exported_before = metric(r.metrics, "hivenet_trace_spans_exported_total").unwrap_or(0.0);
    assert!(exported_before > 0.0, "spans were exported");
    let before = dropped(r.metrics);
    signal(&phoenix.proc, "STOP");
    for i in 0..40 {
        let (st, _, b) = chat(r.http, &trace_id(500 + i), false);
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    }
    signal(&phoenix.proc, "KILL");
    signal(&phoenix.proc, "CONT");
    for i in 0..40 {
        let (st, _, b) = chat(r.http, &trace_id(600 + i), false);
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    }
    wait_until(
        Duration::from_secs(30),
        || dropped(r.metrics) > before,
        "spans dropped and counted",
    );
}
