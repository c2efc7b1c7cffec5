//! Issue 56: provider fallback in its main cases (spec 04 §7). A model
//! with no agent here goes to the policy's `fallback_provider` (it got
//! 404 before dispatch); a request held at zero longer than
//! `--request-timeout`, then released and exhausted, goes there too (its
//! deadline restarts at routing); the provider call of a released request
//! keeps its keepalives and watches its client; `GET /admin/policy` shows
//! the provider. The provider here is the simulator, which speaks the
//! OpenAI API (the real-provider tests are in tests/provider_fallback.rs).

mod common;
use common::hold::*;
use common::*;
use std::time::{Duration, Instant};

const POLICY: &str =
    "routing_policy:\n  strategy: least-loaded\nfallback_provider:\n  engine: openai\n  model: prov-model\n";

/// A router with the global policy naming the simulator on `provider` as
/// its OpenAI fallback provider.
fn router_with_provider(dir: &std::path::Path, provider: u16, extra: &[&str]) -> Router {
    std::fs::write(dir.join("policy.yaml"), POLICY).expect("policy");
    let base = format!("http://127.0.0.1:{provider}");
    let audit = dir.join("audit.jsonl").to_string_lossy().to_string();
    let mut args = vec!["--policy-file", "policy.yaml"];
    args.extend_from_slice(extra);
    site_router(
        dir,
        &args,
        &[
            ("HIVENET_ROUTER_OPENAI_API_KEY", "sk-provider"),
            ("HIVENET_ROUTER_OPENAI_BASE_URL", &base),
            ("HIVENET_ROUTER_AUDIT_LOG_PATH", &audit),
        ],
    )
}

#[test]
fn a_model_with_no_agent_goes_to_the_provider() {
    let dir = tmpdir("provider-no-agent");
    let (_prov, pport) = start_sim(&dir, "prov-model", &[]);
    let r = router_with_provider(&dir, pport, &[]);
    let body = r#"{"model":"ghost","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#;
    let resp = Req::post("/v1/chat/completions", body)
        .send(r.http)
        .expect("chat");
    assert_eq!(resp.status, 200, "{}", resp.text());
    let v = resp.json();
    assert_eq!(v["processed_by"], "provider:openai", "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    // The Anthropic API, translated both ways.
    let resp = Req::post("/v1/messages", body)
        .header("anthropic-version", "2023-06-01")
        .send(r.http)
        .expect("messages");
    assert_eq!(resp.status, 200, "{}", resp.text());
    let v = resp.json();
    assert_eq!(v["type"], "message", "{v}");
    assert_eq!(v["processed_by"], "provider:openai", "{v}");
    // Not an LLM API: still the 404.
    let (st, b) = Req::post("/v1/embeddings", r#"{"model":"ghost","input":"x"}"#)
        .send(r.http)
        .expect("embeddings")
        .pair();
    assert_eq!(st, 404, "{}", String::from_utf8_lossy(&b));
    assert_eq!(sim_completions(pport), 2.0, "two provider calls");
    assert_eq!(
        metric(
            r.metrics,
            "hivenet_policy_provider_fallback_total{model=\"ghost\"}"
        ),
        Some(2.0)
    );
    // The policy as the admin API shows it names its provider.
    let (st, b) = Req::get("/admin/policy")
        .bearer(ADMIN)
        .send(r.http)
        .expect("policy")
        .pair();
    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
    assert_eq!(st, 200);
    assert_eq!(
        v["fallback_provider"],
        serde_json::json!({"engine": "openai", "model": "prov-model"}),
        "{v}"
    );
}

/// Held for 4 s (longer than the 3 s `--request-timeout`), released onto an agent whose
/// engine answers 503 to everything: exhausted, so the provider (not the
/// 504 of a deadline counted from arrival), and the keepalives go on
/// through the provider's 1.5 s answer.
#[test]
fn a_released_request_past_the_request_timeout_goes_to_the_provider_with_keepalives() {
    let dir = tmpdir("provider-released");
    let (_prov, pport) = start_sim(&dir, "prov-model", &["--ttft", "1500ms"]);
    let r = router_with_provider(
        &dir,
        pport,
        &["--wake-keepalive", "300ms", "--request-timeout", "3s"],
    );
    push_map(&r, "30s");
    let s = send(r.http, "/v1/chat/completions", &chat_body("m", false), "");
    let whole = std::thread::spawn(move || read_timed(s));
    wait_until(Duration::from_secs(5), || demand(&r) == Some(1.0), "held");
    std::thread::sleep(Duration::from_millis(4000));
    let (_busy, bport) = start_sim(&dir, "m", &["--error-rate", "1", "--error-status", "503"]);
    let _a = start_agent(&dir, &r, bport, "a.key", &[]);
    let reads = whole.join().expect("reader");
    let all: Vec<u8> = reads.iter().flat_map(|(_, d)| d.clone()).collect();
    let (head, body) = split_response(&all);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}\n{body}");
    let v: serde_json::Value = serde_json::from_str(body.trim()).expect("JSON after the spaces");
    assert_eq!(v["processed_by"], "provider:openai", "{v}");
    let beats: Vec<Instant> = reads
        .iter()
        .filter(|(_, d)| d.contains(&b' ') && !d.contains(&b'{'))
        .map(|(t, _)| *t)
        .collect();
    let (answered, _) = reads.last().expect("reads");
    let late = beats
        .iter()
        .filter(|t| **t + Duration::from_millis(1200) > *answered)
        .count();
    assert!(
        late >= 3,
        "keepalives through the provider's answer: {late} in its last 1.2 s"
    );
}

/// A released request's client leaves while the provider works: the call
/// is dropped at once (audited 499), not finished for nobody 5 s later.
#[test]
fn a_client_leaving_during_the_provider_call_ends_it() {
    let dir = tmpdir("provider-gone");
    let (_prov, pport) = start_sim(&dir, "prov-model", &["--ttft", "8s"]);
    let r = router_with_provider(&dir, pport, &["--wake-keepalive", "300ms"]);
    push_map(&r, "30s");
    let s = send(r.http, "/v1/chat/completions", &chat_body("m", false), "");
    wait_until(Duration::from_secs(5), || demand(&r) == Some(1.0), "held");
    let (_busy, bport) = start_sim(&dir, "m", &["--error-rate", "1", "--error-status", "503"]);
    let _a = start_agent(&dir, &r, bport, "a.key", &[]);
    wait_until(
        Duration::from_secs(10),
        || demand(&r) == Some(0.0),
        "released to the agent, then the provider",
    );
    std::thread::sleep(Duration::from_millis(500));
    drop(s);
    let left = Instant::now();
    let audit = dir.join("audit.jsonl");
    wait_until(
        Duration::from_secs(4),
        || {
            std::fs::read_to_string(&audit)
                .unwrap_or_default()
                .lines()
                .any(|l| l.contains("\"status_code\":499"))
        },
        "the provider call ends with its client (audited 499)",
    );
    assert!(left.elapsed() < Duration::from_secs(5));
}
