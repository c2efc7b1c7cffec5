//! Provider fallback (spec 04 §7, issue 28 #11) against a real server:
//! llama.cpp's llama-server speaks both the OpenAI and the Anthropic API,
//! so it stands in for both providers (base URL overrides). The local
//! agents' backends answer 503 to everything, so every local step is
//! exhausted and the policy's `fallback_provider` answers instead:
//! whole and streamed, in the client's own API whatever the provider's,
//! stamped `processed_by`, its usage counted for the tenant's quota, its
//! calls and failures counted. A policy whose provider has no key is
//! refused at start and on PUT.

mod common;
use common::llama::*;
use common::*;
use std::time::Duration;

const KEY: &str = "sk-fallback-tenant";

fn sse_data(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[test]
fn exhausted_requests_go_to_the_provider_in_the_clients_api() {
    let dir = tmpdir("provider");
    let lport = free_port();
    let _llama = start_llama(&dir, lport, &[]);
    let base = format!("http://127.0.0.1:{lport}");
    let pdir = dir.join("policies");
    std::fs::create_dir_all(&pdir).expect("dir");
    std::fs::write(
        pdir.join("_default.yaml"),
        "routing_policy:\n  strategy: least-loaded\nfallback_provider:\n  engine: openai\n  model: smol-openai\n",
    )
    .expect("global");
    std::fs::write(
        pdir.join("via-anthropic.yaml"),
        "models: [busy-b]\nrouting_policy:\n  strategy: least-loaded\nfallback_provider:\n  engine: anthropic\n  model: smol-anthropic\n",
    )
    .expect("named");
    std::fs::write(
        dir.join("auth.yaml"),
        format!(
            "api:\n  mode: api-key\n  keys:\n    - key_hash: \"{}\"\n      metadata: {{name: k, owner: acme}}\n      quota: {{tokens_per_day: 1000000}}\n",
            sha256_hex(KEY)
        ),
    )
    .expect("auth");
    let r = start_router(
        &dir,
        &[
            "--shards",
            "1",
            "--policy-model-dir",
            pdir.to_str().expect("utf-8"),
            "--auth-config-file",
            "auth.yaml",
        ],
        &[
            ("HIVENET_ROUTER_OPENAI_API_KEY", "sk-provider-o"),
            ("HIVENET_ROUTER_OPENAI_BASE_URL", &base),
            ("HIVENET_ROUTER_ANTHROPIC_API_KEY", "sk-provider-a"),
            ("HIVENET_ROUTER_ANTHROPIC_BASE_URL", &base),
        ],
    );
    let busy = ["--error-rate", "1", "--error-status", "503"];
    let (_sa, pa) = start_sim(&dir, "busy-a", &busy);
    let (_sb, pb) = start_sim(&dir, "busy-b", &busy);
    let _aa = start_agent(&dir, &r, pa, "a.key", &[]);
    let _ab = start_agent(&dir, &r, pb, "b.key", &[]);
    // /v1/models needs the key here.
    wait_until(
        Duration::from_secs(30),
        || {
            let Ok(resp) = Req::get("/v1/models").bearer(KEY).send(r.http) else {
                return false;
            };
            let v = resp.json();
            ["busy-a", "busy-b"].iter().all(|m| {
                v["data"].as_array().is_some_and(|a| {
                    a.iter()
                        .any(|x| x["id"] == *m && x["agents"]["healthy"] == 1)
                })
            })
        },
        "both agents",
    );

    let chat = |model: &str, stream: bool| {
        serde_json::json!({"model": model, "temperature": 0, "max_tokens": 8, "stream": stream,
            "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say hi."}]})
        .to_string()
    };
    let messages = |model: &str, stream: bool| {
        serde_json::json!({"model": model, "temperature": 0, "max_tokens": 8, "stream": stream,
            "system": "Be terse.", "messages": [{"role": "user", "content": "Say hi."}]})
        .to_string()
    };
    let send = |path: &str, body: String| {
        Req::post(path, body)
            .bearer(KEY)
            .header("anthropic-version", "2023-06-01")
            .send(r.http)
            .expect("request")
    };
    let mut input_seen = 0u64;

    // Chat through OpenAI (same API), whole: the provider's completion,
    // stamped, with its usage (never the empty 200 of 08 A1).
    let resp = send("/v1/chat/completions", chat("busy-a", false));
    assert_eq!(resp.status, 200, "{}", resp.text());
    let v = resp.json();
    assert_eq!(v["processed_by"], "provider:openai", "{v}");
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .is_some_and(|s| !s.is_empty()),
        "{v}"
    );
    input_seen += v["usage"]["prompt_tokens"].as_u64().expect("usage");

    // Streamed: chunks as they come, the usage chunk (asked for by the
    // router), then [DONE].
    let resp = send("/v1/chat/completions", chat("busy-a", true));
    assert_eq!(resp.status, 200, "{}", resp.text());
    let text = resp.text();
    assert!(text.contains("data: [DONE]"), "{text}");
    let events = sse_data(&text);
    let content: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!content.is_empty(), "{text}");
    let usage = events
        .iter()
        .rfind(|e| e["usage"].is_object())
        .expect("usage chunk");
    input_seen += usage["usage"]["prompt_tokens"]
        .as_u64()
        .expect("prompt_tokens");

    // Messages through OpenAI (translated), whole and streamed.
    let resp = send("/v1/messages", messages("busy-a", false));
    assert_eq!(resp.status, 200, "{}", resp.text());
    let v = resp.json();
    assert_eq!(
        (v["type"].as_str(), v["content"][0]["type"].as_str()),
        (Some("message"), Some("text")),
        "{v}"
    );
    assert_eq!(v["processed_by"], "provider:openai");
    input_seen += v["usage"]["input_tokens"].as_u64().expect("usage");
    let resp = send("/v1/messages", messages("busy-a", true));
    let text = resp.text();
    assert_eq!(resp.status, 200, "{text}");
    let names: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(names.first(), Some(&"message_start"), "{text}");
    assert_eq!(names.last(), Some(&"message_stop"), "{text}");
    assert!(names.contains(&"content_block_delta"), "{text}");

    // Chat through Anthropic (translated both ways), whole and streamed;
    // messages through Anthropic pass through.
    let resp = send("/v1/chat/completions", chat("busy-b", false));
    assert_eq!(resp.status, 200, "{}", resp.text());
    let v = resp.json();
    assert_eq!(v["object"], "chat.completion", "{v}");
    assert_eq!(v["processed_by"], "provider:anthropic");
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .is_some_and(|s| !s.is_empty()),
        "{v}"
    );
    let resp = send("/v1/chat/completions", chat("busy-b", true));
    let text = resp.text();
    assert_eq!(resp.status, 200, "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let events = sse_data(&text);
    assert!(
        events.iter().any(|e| e["choices"][0]["delta"]["content"]
            .as_str()
            .is_some_and(|s| !s.is_empty())),
        "{text}"
    );
    assert!(
        events
            .iter()
            .any(|e| e["choices"][0]["finish_reason"].is_string()),
        "{text}"
    );
    let resp = send("/v1/messages", messages("busy-b", true));
    let text = resp.text();
    assert_eq!(resp.status, 200, "{text}");
    assert!(text.contains("event: message_stop"), "{text}");

    // Failures: the provider's own error (a prompt over its 2048-token
    // context) and a request it cannot take (no non-system message) are
    // 502 backend_error naming the provider.
    let long = "word ".repeat(4000);
    let over = serde_json::json!({"model": "busy-a", "max_tokens": 4,
        "messages": [{"role": "user", "content": long}]})
    .to_string();
    let resp = send("/v1/chat/completions", over);
    let v = resp.json();
    assert_eq!(resp.status, 502, "{v}");
    assert_eq!(v["error"]["code"], "backend_error", "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or("");
    assert!(msg.starts_with("provider openai: HTTP 400"), "{msg}");
    let only_system =
        serde_json::json!({"model": "busy-b", "messages": [{"role": "system", "content": "x"}]})
            .to_string();
    let resp = send("/v1/chat/completions", only_system);
    assert_eq!(resp.status, 502, "{}", resp.text());
    assert!(
        resp.text().contains("provider anthropic"),
        "{}",
        resp.text()
    );

    // Counted: fallbacks per model, client calls per provider and status,
    // the tenant's tokens (the quota saw the provider's usage).
    let m = metrics_text(r.metrics);
    let value = |prefix: &str| -> f64 {
        m.lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert_eq!(
        value("hivenet_policy_provider_fallback_total{model=\"busy-a\"}"),
        5.0,
        "{m}"
    );
    assert_eq!(
        value("hivenet_policy_provider_fallback_total{model=\"busy-b\"}"),
        4.0,
        "{m}"
    );
    assert_eq!(
        value(
            "http_client_request_duration_seconds_count{provider=\"openai\",status_code=\"200\"}"
        ),
        4.0,
        "{m}"
    );
    assert_eq!(
        value(
            "http_client_request_duration_seconds_count{provider=\"openai\",status_code=\"400\"}"
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        value("http_client_request_duration_seconds_count{provider=\"anthropic\",status_code=\"200\"}"),
        3.0,
        "{m}"
    );
    assert!(
        m.lines()
            .any(|l| l.starts_with("hivenet_routing_requests_routed_total{")
                && l.contains("region=\"cloud\"")
                && l.contains("engine=\"openai\"")),
        "{m}"
    );
    let used = value("hivenet_tenant_tokens_used_today{tenant_id=\"acme\"");
    assert!(
        used >= input_seen as f64,
        "tokens used today {used} < input seen {input_seen}: {m}"
    );
}

/// A policy naming a provider whose key is not set is refused at start
/// and on PUT (spec 04 §7).
#[test]
fn a_provider_without_a_key_is_refused() {
    let dir = tmpdir("provider-nokey");
    std::fs::write(
        dir.join("policy.yaml"),
        "routing_policy:\n  strategy: least-loaded\nfallback_provider:\n  engine: anthropic\n  model: c\n",
    )
    .expect("policy");
    let child = std::process::Command::new(bin("hivenet-router"))
        .current_dir(&dir)
        .env_remove("HIVENET_ROUTER_ANTHROPIC_API_KEY")
        .env("HIVENET_ROUTER_ALLOW_INSECURE_ADMIN", "true")
        .args([
            "--policy-file",
            "policy.yaml",
            "--http-port",
            &format!("127.0.0.1:{}", free_port()),
            "--metrics-port",
            &format!("127.0.0.1:{}", free_port()),
            "--p2p-port",
            &free_port().to_string(),
        ])
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let (code, err) = exit_within(child, Duration::from_secs(20));
    assert!(
        code.is_some_and(|c| c != 0),
        "refused at start: {code:?} {err}"
    );
    assert!(err.contains("HIVENET_ROUTER_ANTHROPIC_API_KEY"), "{err}");

    let r = start_router(&dir, &[], &[]);
    let (st, b) = Req::new("PUT", "/admin/policy")
        .body(
            b"routing_policy:\n  strategy: least-loaded\nfallback_provider:\n  engine: openai\n  model: g\n"
                .as_slice(),
        )
        .bearer(ADMIN_KEY)
        .send(r.http)
        .map(Resp::pair)
        .expect("put");
    let text = String::from_utf8_lossy(&b);
    assert_eq!(st, 400, "{text}");
    assert!(text.contains("HIVENET_ROUTER_OPENAI_API_KEY"), "{text}");
}

/// HTTPS to the provider: trusted through HIVENET_ROUTER_PROVIDER_CA_FILE
/// it answers; with the public roots only, the same server's certificate
/// is refused (502 naming TLS), never sent a request in clear.
#[test]
fn https_providers_are_verified() {
    let dir = tmpdir("provider-tls");
    let lport = free_port();
    let _llama = start_llama(&dir, lport, &[]);
    let (ca, cert, key) = make_certs(&dir);
    let tport = free_port();
    let proxy = std::process::Command::new("python3")
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/tls_proxy.py"))
        .args([&tport.to_string(), &lport.to_string()])
        .arg(&cert)
        .arg(&key)
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("python3 tls_proxy.py");
    let _proxy = Proc {
        child: proxy,
        name: "tls-proxy".into(),
        log: dir.join("proxy.log"),
    };
    wait_until(
        Duration::from_secs(10),
        || std::net::TcpStream::connect(("127.0.0.1", tport)).is_ok(),
        "TLS proxy up",
    );
    std::fs::write(
        dir.join("policy.yaml"),
        "routing_policy:\n  strategy: least-loaded\nfallback_provider:\n  engine: openai\n  model: smol\n",
    )
    .expect("policy");
    let base = format!("https://localhost:{tport}");
    let ca_s = ca.to_string_lossy().to_string();
    let chat = serde_json::json!({"model": "busy", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi."}]})
    .to_string();
    for (trusted, env_ca) in [(true, Some(ca_s.as_str())), (false, None)] {
        let mut env = vec![
            ("HIVENET_ROUTER_OPENAI_API_KEY", "sk-o"),
            ("HIVENET_ROUTER_OPENAI_BASE_URL", base.as_str()),
        ];
        if let Some(c) = env_ca {
            env.push(("HIVENET_ROUTER_PROVIDER_CA_FILE", c));
        }
        let r = start_router(&dir, &["--policy-file", "policy.yaml"], &env);
        let (_s, p) = start_sim(
            &dir,
            "busy",
            &["--error-rate", "1", "--error-status", "503"],
        );
        let _a = start_agent(&dir, &r, p, if trusted { "t.key" } else { "u.key" }, &[]);
        wait_agents(r.http, "busy", 1);
        let resp = Req::post("/v1/chat/completions", chat.clone())
            .send(r.http)
            .expect("chat");
        if trusted {
            assert_eq!(resp.status, 200, "{}", resp.text());
            assert_eq!(resp.json()["processed_by"], "provider:openai");
        } else {
            assert_eq!(resp.status, 502, "{}", resp.text());
            let msg = resp.json()["error"]["message"]
                .as_str()
                .unwrap_or("")
                .to_string();
            assert!(msg.contains("TLS with localhost"), "{msg}");
        }
    }
}
