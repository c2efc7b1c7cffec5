//! The real engine (issue 27): llama.cpp's llama-server with
//! SmolLM2-135M, installed by `scripts/install-llama.sh` (cached outside
//! the clone; the test runs the script, which takes a second once
//! built), behind a real agent (`--engine llamacpp`) and router.
//!
//! - The model is discovered from the engine and served with both API
//!   shapes, streaming and not, at temperature 0.
//! - Usage is counted exactly as the engine reports it, cached prompt
//!   tokens included (OpenAI `prompt_tokens_details.cached_tokens`,
//!   Anthropic `cache_read_input_tokens` beside `input_tokens`).
//! - SRTT is KNOWN after traffic; the engine's signals that exist reach
//!   the routing table (running and waiting from `/metrics`, KV use from
//!   `/slots`) and those it lacks stay absent.

mod common;
use common::*;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// The engine and model paths the install script prints.
fn install() -> (PathBuf, PathBuf) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(root.join("scripts/install-llama.sh"))
        .output()
        .expect("run scripts/install-llama.sh");
    assert!(
        out.status.success(),
        "scripts/install-llama.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let get = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .map(PathBuf::from)
            .unwrap_or_else(|| panic!("{k} missing in: {text}"))
    };
    (get("LLAMA_SERVER"), get("LLAMA_MODEL"))
}

/// llama-server on `port`: one thread, a 2048-token context, metrics on.
fn start_llama(dir: &std::path::Path, server: &PathBuf, model: &PathBuf, port: u16) -> Proc {
    let log = dir.join(format!("llama-{port}.log"));
    let f = std::fs::File::create(&log).expect("log");
    let f2 = f.try_clone().expect("clone");
    let child = Command::new(server)
        .args(["-m"])
        .arg(model)
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "-t",
            "1",
            "-c",
            "2048",
            "-np",
            "1",
            "--metrics",
        ])
        .stdout(f)
        .stderr(f2)
        .spawn()
        .expect("spawn llama-server");
    let p = Proc {
        child,
        name: "llama-server".into(),
        log,
    };
    wait_until(
        Duration::from_secs(120),
        || {
            Req::get("/health")
                .send(port)
                .map(|r| r.status == 200)
                .unwrap_or(false)
        },
        "llama-server up",
    );
    p
}

fn agent_of(http: u16) -> serde_json::Value {
    routing_table(http)["agents"][0].clone()
}

#[test]
fn both_apis_through_router_and_agent_count_what_the_engine_reports() {
    let (server, model) = install();
    let dir = tmpdir("llama-real");
    let lport = free_port();
    let _llama = start_llama(&dir, &server, &model, lport);
    let r = start_router(&dir, &[], &[]);
    let _agent = start_agent(
        &dir,
        &r,
        lport,
        "a.key",
        &["--engine", "llamacpp", "--warmup", "off"],
    );
    wait_until(
        Duration::from_secs(60),
        || {
            routing_table(r.http)["agents"]
                .as_array()
                .is_some_and(|a| a.len() == 1)
        },
        "agent registered",
    );
    // The model name is the engine's own (discovered from /v1/models).
    let a0 = agent_of(r.http);
    let name = a0["model"]
        .as_str()
        .or_else(|| a0["metadata"]["model"].as_str())
        .expect("model name")
        .to_string();
    let system = "You are a terse assistant. ".repeat(40);
    let chat = |user: &str, stream: bool| {
        serde_json::json!({
            "model": name, "temperature": 0, "max_tokens": 8, "stream": stream,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]
        })
        .to_string()
    };
    let mut engine_input = 0u64;
    let mut engine_cached = 0u64;
    // OpenAI, twice with the same long prefix: the second reads it from
    // the engine's prompt cache.
    for user in ["Say hi.", "Say hello."] {
        let resp = Req::post("/v1/chat/completions", chat(user, false))
            .send(r.http)
            .expect("chat");
        assert_eq!(resp.status, 200, "{}", resp.text());
        let u = &resp.json()["usage"];
        engine_input += u["prompt_tokens"].as_u64().expect("prompt_tokens");
        engine_cached += u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
    }
    assert!(
        engine_cached > 100,
        "the second request hit the prefix cache"
    );
    // Streamed, usage in the last chunk.
    let resp = Req::post("/v1/chat/completions", chat("Say hey.", true))
        .send(r.http)
        .expect("stream");
    assert_eq!(resp.status, 200);
    let text = resp.text();
    let last = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .rfind(|v| v["usage"].is_object())
        .expect("a usage chunk");
    engine_input += last["usage"]["prompt_tokens"].as_u64().expect("prompt");
    engine_cached += last["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    // Anthropic: input_tokens counts only the uncached part.
    let msg = serde_json::json!({
        "model": name, "max_tokens": 8, "temperature": 0, "system": system,
        "messages": [{"role": "user", "content": "Say yo."}]
    })
    .to_string();
    let resp = Req::post("/v1/messages", msg)
        .header("anthropic-version", "2023-06-01")
        .send(r.http)
        .expect("messages");
    assert_eq!(resp.status, 200, "{}", resp.text());
    let u = &resp.json()["usage"];
    let read = u["cache_read_input_tokens"].as_u64().unwrap_or(0);
    assert!(read > 100, "messages hit the prefix cache too: {u}");
    engine_input += u["input_tokens"].as_u64().expect("input") + read;
    engine_cached += read;
    // The router counted exactly that.
    wait_until(
        Duration::from_secs(5),
        || agent_of(r.http)["universal"]["successful_requests_total"] == 4,
        "four successes",
    );
    let a = agent_of(r.http);
    let uni = &a["universal"];
    assert_eq!(uni["input_tokens_total"], engine_input, "{a}");
    assert_eq!(uni["cached_prompt_tokens_total"], engine_cached, "{a}");
    assert_eq!(uni["latency_state"], "KNOWN", "{a}");
    let m = metrics_text(r.metrics);
    assert!(
        m.lines().any(
            |l| l.starts_with("hivenet_agent_cached_prompt_tokens_total{")
                && l.ends_with(&format!(" {engine_cached}"))
        ),
        "{m}"
    );
    // Engine signals: the ones llama-server has, read for real.
    wait_until(
        Duration::from_secs(10),
        || {
            let e = &agent_of(r.http)["engine"];
            e["running_requests"].is_number() && e["kv_cache_utilization"].is_number()
        },
        "engine signals",
    );
    let e = agent_of(r.http)["engine"].clone();
    let kv = e["kv_cache_utilization"].as_f64().unwrap_or(-1.0);
    assert!(kv > 0.0 && kv <= 1.0, "KV use from /slots: {e}");
    assert!(e.get("avg_ttft_seconds").is_none(), "absent, never 0: {e}");
}

/// Bad answers from a real engine: a prompt over the context (`-c 2048`)
/// gets the engine's own 400 and error body, fast, and is not counted
/// against the agent (its failures stay 0, so failure gates stay quiet);
/// a client that leaves mid-stream stops the engine's generation.
#[test]
fn a_clients_error_is_the_clients_and_a_departed_client_stops_generation() {
    use std::io::{Read, Write};
    let (server, model) = install();
    let dir = tmpdir("llama-bad");
    let lport = free_port();
    let _llama = start_llama(&dir, &server, &model, lport);
    let r = start_router(&dir, &[], &[]);
    let _agent = start_agent(
        &dir,
        &r,
        lport,
        "a.key",
        &["--engine", "llamacpp", "--warmup", "off"],
    );
    wait_until(
        Duration::from_secs(60),
        || {
            routing_table(r.http)["agents"]
                .as_array()
                .is_some_and(|a| a.len() == 1)
        },
        "agent registered",
    );
    let name = agent_of(r.http)["metadata"]["model"]
        .as_str()
        .expect("model")
        .to_string();
    let huge = "word ".repeat(6000);
    let body = serde_json::json!({
        "model": name, "max_tokens": 4,
        "messages": [{"role": "user", "content": huge}]
    })
    .to_string();
    let t = std::time::Instant::now();
    let resp = Req::post("/v1/chat/completions", body)
        .send(r.http)
        .expect("overflow");
    assert_eq!(resp.status, 400, "{}", resp.text());
    assert!(
        resp.text().contains("context"),
        "the engine's own error body: {}",
        resp.text()
    );
    assert!(t.elapsed() < Duration::from_secs(30), "nothing hangs");
    let uni = agent_of(r.http)["universal"].clone();
    assert_eq!(uni["failed_requests_total"], 0, "not the agent's: {uni}");
    // A long stream, left after its first event.
    let long = serde_json::json!({
        "model": name, "max_tokens": 1500, "stream": true, "temperature": 0,
        "messages": [{"role": "user", "content": "Count from one to one thousand, one number per line."}]
    })
    .to_string();
    let mut s = std::net::TcpStream::connect(("127.0.0.1", r.http)).expect("connect");
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{long}",
        long.len()
    )
    .expect("send");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data:") {
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0, "stream ended early");
        got.extend_from_slice(&buf[..n]);
    }
    let processing = || {
        let text = Req::get("/metrics")
            .send(lport)
            .map(|r| r.text())
            .unwrap_or_default();
        text.lines()
            .find_map(|l| l.strip_prefix("llamacpp:requests_processing "))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    assert_eq!(processing(), Some(1.0), "the engine is generating");
    drop(s);
    // 1,500 tokens take many seconds on one thread: back to 0 long
    // before that means the engine stopped when the client left.
    let left = std::time::Instant::now();
    wait_until(
        Duration::from_secs(5),
        || processing() == Some(0.0),
        "generation stopped after the client left",
    );
    assert!(left.elapsed() < Duration::from_secs(5));
}

/// A killed engine: its agent reports the backend down within seconds and
/// no request waits out a timeout meanwhile; the engine restarted on the
/// same port is served again.
#[test]
fn a_killed_engine_is_marked_down_and_served_again_after_restart() {
    let (server, model) = install();
    let dir = tmpdir("llama-kill");
    let lport = free_port();
    let mut llama = start_llama(&dir, &server, &model, lport);
    let r = start_router(&dir, &[], &[]);
    let _agent = start_agent(
        &dir,
        &r,
        lport,
        "a.key",
        &["--engine", "llamacpp", "--warmup", "off"],
    );
    // The agent's report of its engine (`status.healthy` is the link's
    // liveness; routing needs both).
    let healthy =
        |want: bool| routing_table(r.http)["agents"][0]["status"]["backend_healthy"] == want;
    wait_until(Duration::from_secs(60), || healthy(true), "agent healthy");
    let name = agent_of(r.http)["metadata"]["model"]
        .as_str()
        .expect("model")
        .to_string();
    let body = serde_json::json!({
        "model": name, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi."}]
    })
    .to_string();
    let chat = || {
        Req::post("/v1/chat/completions", body.clone())
            .send(r.http)
            .expect("chat")
    };
    assert_eq!(chat().status, 200);
    llama.kill9();
    let killed = std::time::Instant::now();
    // Meanwhile a request fails fast (the connection is refused), it
    // never waits for --request-timeout (60 s).
    let t = std::time::Instant::now();
    let resp = chat();
    assert!(resp.status >= 500, "{} {}", resp.status, resp.text());
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    wait_until(Duration::from_secs(20), || healthy(false), "backend down");
    let down_after = killed.elapsed();
    let _llama2 = start_llama(&dir, &server, &model, lport);
    wait_until(Duration::from_secs(30), || healthy(true), "backend back");
    assert_eq!(chat().status, 200, "served again");
    assert!(down_after < Duration::from_secs(20), "{down_after:?}");
}
