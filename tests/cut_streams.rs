//! Issue 51 #10: a stream cut mid-answer and not continued was free and
//! mis-audited (the client got 200 and text; the tenant was charged 0;
//! the audit line said status 0 with 0 tokens). Now it is charged for
//! what was delivered and audited with the status the client saw and the
//! tokens relayed.

mod common;
use common::*;
use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

const KEY: &str = "sk-cut-tenant";

#[test]
fn a_cut_stream_is_charged_and_audited_for_what_was_delivered() {
    cut_is_charged("cut-stream", "0");
}

/// The same when a continuation was possible but no agent could take it
/// (the machine's cut, `outcome="no_agent"`).
#[test]
fn a_stream_no_continuation_could_save_is_charged_the_same() {
    cut_is_charged("cut-no-agent", "1");
}

fn cut_is_charged(tag: &str, migrations: &str) {
    let dir = tmpdir(tag);
    std::fs::write(
        dir.join("auth.yaml"),
        format!(
            "api:\n  mode: api-key\n  keys:\n    - key_hash: \"{}\"\n      metadata: {{name: k, owner: acme}}\n      quota: {{tokens_per_day: 1000000}}\n",
            sha256_hex(KEY)
        ),
    )
    .expect("auth");
    let audit = dir.join("audit.jsonl");
    let audit_s = audit.to_string_lossy().to_string();
    let r = start_router(
        &dir,
        &[
            "--shards",
            "1",
            "--auth-config-file",
            "auth.yaml",
            "--stream-migrations",
            migrations,
        ],
        &[("HIVENET_ROUTER_AUDIT_LOG_PATH", &audit_s)],
    );
    // Every streamed answer dies mid-way (the connection closed without
    // the stream's end) after a uniform 1..40 of its 40 tokens.
    let (_s, port) = start_sim(
        &dir,
        "m",
        &["--output-tokens", "40", "--itl", "2ms", "--abort-rate", "1"],
    );
    let _a = start_agent(&dir, &r, port, "a.key", &[]);
    wait_until(
        Duration::from_secs(30),
        || routing_table(r.http)["total"] == 1,
        "agent",
    );
    let body = r#"{"model":"m","stream":true,"max_tokens":100,"messages":[{"role":"user","content":"hello there"}]}"#;
    let mut s = TcpStream::connect(("127.0.0.1", r.http)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut got = Vec::new();
    let clean = read_stream_end(&mut s, &mut got);
    let text = String::from_utf8_lossy(&got).to_string();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(!clean, "the stream was cut:\n{text}");
    let delivered = text
        .lines()
        .filter(|l| {
            l.starts_with("data: {")
                && l.contains("\"content\":\"")
                && !l.contains("\"content\":\"\"")
        })
        .count() as u64;
    assert!(delivered >= 1, "some text reached the client:\n{text}");
    wait_until(
        Duration::from_secs(5),
        || {
            std::fs::read_to_string(&audit)
                .unwrap_or_default()
                .contains("/v1/chat/completions")
        },
        "the audit line",
    );
    let line = std::fs::read_to_string(&audit).expect("audit");
    let v: serde_json::Value = line
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .find(|v: &serde_json::Value| v["path"] == "/v1/chat/completions")
        .expect("audit line");
    assert_eq!(v["status_code"], 200, "the status the client saw: {v}");
    assert_eq!(v["output_tokens"], delivered, "the tokens relayed: {v}");
    let input = v["input_tokens"].as_u64().unwrap_or(0);
    assert!(input > 0, "the prompt was processed: {v}");
    wait_until(
        Duration::from_secs(5),
        || {
            metric(
                r.metrics,
                "hivenet_tenant_tokens_used_today{tenant_id=\"acme\",model=\"\"}",
            )
            .map(|u| u as u64)
                == Some(input + delivered)
        },
        "the tenant charged for what was delivered",
    );
}
