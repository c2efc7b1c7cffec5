//! Warm-up before registering: ollama and sglang agents send one
//! one-token completion to their backend before they register (`--warmup
//! auto`), `--warmup on` does it for any engine, `off` never; the ollama
//! agent discovers its model from `/api/tags` without the `:latest` tag.
//! Also: CORS preflight answers 204 with the CORS headers.

mod common;
use common::*;
use std::time::Duration;

fn warmed(engine: &str, warmup: &str, model: &str) -> (f64, String) {
    let dir = tmpdir(&format!("warm-{engine}-{warmup}"));
    let r = start_router(&dir, &["--shards", "1"], &[]);
    let (_s, port) = start_sim(&dir, model, &[]);
    let a = start_agent(
        &dir,
        &r,
        port,
        "w.key",
        &["--engine", engine, "--warmup", warmup],
    );
    wait_agents(r.http, model, 1);
    let log = a.log_text();
    // The order is checked whenever the warm-up ran; a missing
    // registration line fails (issue 28: it used to skip the check).
    let reg_line = log
        .find("registered with the router")
        .unwrap_or_else(|| panic!("no registration line:\n{log}"));
    if let Some(w) = log.find("warm-up completion succeeded") {
        assert!(w < reg_line, "warm-up before registration:\n{log}");
    }
    (sim_completions(port), log)
}

#[test]
fn sglang_and_ollama_warm_up_before_registering() {
    let (n, log) = warmed("sglang", "auto", "sg-model");
    assert_eq!(n, 1.0, "one warm-up completion:\n{log}");
    assert!(log.contains("warm-up completion succeeded"));
    // Ollama: discovered from /api/tags, ":latest" stripped.
    let (n, log) = warmed("ollama", "auto", "ol-model");
    assert_eq!(n, 1.0, "one warm-up completion:\n{log}");
}

#[test]
fn warmup_on_applies_to_any_engine_and_off_to_none() {
    let (n, log) = warmed("vllm", "on", "vl-on");
    assert_eq!(n, 1.0, "--warmup on warms a vllm backend:\n{log}");
    let (n, log) = warmed("vllm", "auto", "vl-auto");
    assert_eq!(n, 0.0, "vllm needs no warm-up by default:\n{log}");
    let (n, log) = warmed("sglang", "off", "sg-off");
    assert_eq!(n, 0.0, "--warmup off:\n{log}");
}

#[test]
fn cors_preflight_is_204_with_cors_headers() {
    let dir = tmpdir("cors");
    let r = start_router(&dir, &["--shards", "1"], &[]);
    let resp = raw(
        r.http,
        b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: https://app.example\r\nAccess-Control-Request-Method: POST\r\nConnection: close\r\n\r\n",
        Duration::from_secs(3),
    );
    let text = String::from_utf8_lossy(&resp);
    assert_eq!(status_of(&resp), 204, "{text}");
    for h in [
        "Access-Control-Allow-Origin: *",
        "Access-Control-Allow-Methods: POST, GET, OPTIONS",
        "Access-Control-Allow-Headers: Content-Type, Authorization",
    ] {
        assert!(text.contains(h), "{h} missing:\n{text}");
    }
    // Ordinary responses carry them too.
    let resp = raw(
        r.http,
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        Duration::from_secs(3),
    );
    assert!(String::from_utf8_lossy(&resp).contains("Access-Control-Allow-Origin: *"));
}
