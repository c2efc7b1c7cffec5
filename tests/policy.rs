//! Routing policies end to end: the SRTT gate with a relaxed fallback in
//! front of a fast and a slow sim, the capacity queue (FIFO, depth 0,
//! timeout), and reloads that keep the old policy when the new one is bad.

mod common;
use common::*;
use std::process::Command;
use std::time::{Duration, Instant};

fn chat(http: u16, model: &str, stream: bool) -> (u16, Vec<u8>) {
    let body = format!(
        r#"{{"model":"{model}","stream":{stream},"max_tokens":2,"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    Req::post("/v1/chat/completions", &body)
        .send(http)
        .map(Resp::pair)
        .expect("chat")
}

const GATED: &str = "routing_policy:\n  exclude_if:\n    srtt:\n      gt: 100\n  strategy: least-loaded\nfallback_chain:\n  - name: relaxed\n    exclude_if:\n      srtt:\n        gt: 1500\n    strategy: least-loaded\n";
const PRIMARY_ONLY: &str =
    "routing_policy:\n  exclude_if:\n    srtt:\n      gt: 100\n  strategy: least-loaded\n";

#[test]
fn srtt_gate_with_relaxed_fallback() {
    let dir = tmpdir("gate");
    let pf = dir.join("policy.yaml");
    std::fs::write(&pf, GATED).expect("policy");
    let pfs = pf.to_string_lossy().to_string();
    let r = start_router(&dir, &["--shards", "1", "--policy-file", &pfs], &[]);
    let (_f, p_fast) = start_sim(&dir, "g-model", &["--ttft", "10ms"]);
    let (_s, p_slow) = start_sim(&dir, "g-model", &["--ttft", "300ms"]);
    let mut fast = start_agent(&dir, &r, p_fast, "fast.key", &["--machine", "fast"]);
    let _slow = start_agent(&dir, &r, p_slow, "slow.key", &["--machine", "slow"]);
    wait_agents(r.http, "g-model", 2);
    // Warm-up: unknown agents pass the gate, so both get a sample.
    for _ in 0..4 {
        assert_eq!(chat(r.http, "g-model", true).0, 200);
    }
    let before = successes_by_machine(r.http);
    assert!(
        before["slow"] >= 1 && before["fast"] >= 1,
        "both warmed up: {before:?}"
    );
    for _ in 0..10 {
        assert_eq!(chat(r.http, "g-model", true).0, 200);
    }
    let after = successes_by_machine(r.http);
    assert_eq!(
        after["slow"], before["slow"],
        "the slow agent (SRTT > 100) gets nothing after warm-up"
    );
    assert_eq!(after["fast"], before["fast"] + 10);
    // The fast agent goes away: the relaxed step serves from the slow one.
    fast.kill9();
    wait_until(
        Duration::from_secs(3),
        || healthy_agents(r.http, "g-model") == 1,
        "fast agent gone",
    );
    let (st, b) = chat(r.http, "g-model", true);
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert!(
        metric(
            r.metrics,
            "hivenet_policy_fallback_routed_total{model=\"g-model\"}"
        )
        .unwrap_or(0.0)
            >= 1.0
    );
    // With only the primary step, the client gets the exhaustion error.
    let (st, b) = Req::new("PUT", "/admin/policy")
        .body(PRIMARY_ONLY.as_bytes())
        .raw_headers(&format!("Authorization: Bearer {ADMIN_KEY}\r\n"))
        .send(r.http)
        .map(Resp::pair)
        .expect("put");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let (st, b) = chat(r.http, "g-model", true);
    assert_eq!(st, 503, "{}", String::from_utf8_lossy(&b));
    assert!(String::from_utf8_lossy(&b).contains("no_agents_available"));
    assert!(
        metric(
            r.metrics,
            "hivenet_policy_exhausted_total{model=\"g-model\"}"
        )
        .unwrap_or(0.0)
            >= 1.0
    );
    assert!(
        r.proc
            .log_text()
            .contains("policy_exhausted: routing_policy: pool=1"),
        "exhaustion log names the gates"
    );
    // Shedding is logged at most once a second per model, with a count.
    let lines_before = r.proc.log_text().matches("policy_exhausted").count();
    let t = Instant::now();
    for _ in 0..40 {
        assert_eq!(chat(r.http, "g-model", true).0, 503);
    }
    let took = t.elapsed();
    let new_lines = r.proc.log_text().matches("policy_exhausted").count() - lines_before;
    assert!(
        new_lines as u64 <= took.as_secs() + 1,
        "{new_lines} exhaustion lines for 40 rejections in {took:?}"
    );
}

/// Send `n` requests `gap` apart from threads; returns (index, status, finish time).
fn burst(
    http: u16,
    model: &str,
    n: usize,
    gap: Duration,
    stream: bool,
) -> Vec<(usize, u16, Instant, String)> {
    let mut hs = Vec::new();
    for i in 0..n {
        let model = model.to_string();
        hs.push(std::thread::spawn(move || {
            let (st, b) = chat(http, &model, stream);
            (
                i,
                st,
                Instant::now(),
                String::from_utf8_lossy(&b).to_string(),
            )
        }));
        std::thread::sleep(gap);
    }
    hs.into_iter().map(|h| h.join().expect("thread")).collect()
}

#[test]
fn capacity_queue_fifo_depth_zero_and_timeout() {
    let dir = tmpdir("queue");
    let r = start_router(&dir, &["--shards", "1"], &[]);
    let (_s, port) = start_sim(&dir, "q-model", &["--ttft", "200ms"]);
    let _a = start_agent(&dir, &r, port, "q.key", &["--capacity", "2"]);
    wait_agents(r.http, "q-model", 1);
    let mut out = burst(r.http, "q-model", 10, Duration::from_millis(25), false);
    assert!(
        out.iter().all(|o| o.1 == 200),
        "all succeed with --queue-depth 30: {out:?}"
    );
    out.sort_by_key(|o| o.2);
    let order: Vec<usize> = out.iter().map(|o| o.0).collect();
    assert_eq!(
        order,
        (0..10).collect::<Vec<_>>(),
        "served in arrival order"
    );
    let m = metrics_text(r.metrics);
    assert!(
        m.contains("hivenet_queue_wait_seconds_count{model=\"q-model\",class=\"standard\"} 8"),
        "{m}"
    );
    drop(r);

    let r0 = start_router(&dir, &["--shards", "1", "--queue-depth", "0"], &[]);
    let _a0 = start_agent(&dir, &r0, port, "q0.key", &["--capacity", "2"]);
    wait_agents(r0.http, "q-model", 1);
    let out = burst(r0.http, "q-model", 10, Duration::from_millis(5), false);
    let ok = out.iter().filter(|o| o.1 == 200).count();
    let full: Vec<_> = out.iter().filter(|o| o.1 == 503).collect();
    assert_eq!(ok, 2, "{out:?}");
    assert_eq!(full.len(), 8);
    assert!(full.iter().all(|o| o.3.contains("no_capacity")), "{full:?}");
    drop(r0);

    // A waiter times out: a 3 s stream holds the only slot, the deadline is 1 s.
    let (_s2, port2) = start_sim(
        &dir,
        "t-model",
        &["--ttft", "5ms", "--itl", "100ms", "--output-tokens", "30"],
    );
    let r1 = start_router(&dir, &["--shards", "1", "--request-timeout", "1s"], &[]);
    let _a1 = start_agent(&dir, &r1, port2, "t.key", &["--capacity", "1"]);
    wait_agents(r1.http, "t-model", 1);
    let http1 = r1.http;
    let holder = std::thread::spawn(move || {
        let body = r#"{"model":"t-model","stream":true,"messages":[]}"#;
        Req::post("/v1/chat/completions", body)
            .send(http1)
            .map(Resp::pair)
            .map(|x| x.0)
    });
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    let (st, b) = Req::post(
        "/v1/chat/completions",
        r#"{"model":"t-model","messages":[]}"#,
    )
    .send(http1)
    .map(Resp::pair)
    .expect("waiter");
    let waited = t0.elapsed();
    assert_eq!(st, 504, "{}", String::from_utf8_lossy(&b));
    let text = String::from_utf8_lossy(&b);
    assert!(
        text.contains("request_timeout") && text.contains("waiting for an available agent"),
        "{text}"
    );
    assert!(
        waited < Duration::from_millis(1500),
        "timed out near the 1 s deadline: {waited:?}"
    );
    assert_eq!(holder.join().expect("holder").expect("stream"), 200);
}

/// Issue 28 #17: without policy files, a SIGHUP keeps the policies
/// written through the admin API (it used to reset them to the default).
#[test]
fn sighup_without_policy_files_keeps_admin_policies() {
    let dir = tmpdir("reload-none");
    let r = start_router(&dir, &["--shards", "1"], &[]);
    let (st, b) = Req::new("PUT", "/admin/policy")
        .body(GATED.as_bytes())
        .raw_headers(&format!("Authorization: Bearer {ADMIN_KEY}\r\n"))
        .send(r.http)
        .map(Resp::pair)
        .expect("put");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let get = || {
        Req::get("/admin/policy")
            .bearer(ADMIN_KEY)
            .send(r.http)
            .map(Resp::pair)
            .expect("get")
            .1
    };
    let before = get();
    assert!(
        String::from_utf8_lossy(&before).contains("fallback_chain"),
        "the PUT policy is in force: {}",
        String::from_utf8_lossy(&before)
    );
    let _ = Command::new("kill")
        .args(["-HUP", &r.proc.child.id().to_string()])
        .status();
    wait_until(
        Duration::from_secs(5),
        || r.proc.log_text().contains("SIGHUP: no policy files"),
        "the SIGHUP handled",
    );
    assert_eq!(get(), before, "the admin API's policy is kept");
}

#[test]
fn bad_reload_keeps_the_policy() {
    let dir = tmpdir("reload");
    let pf = dir.join("policy.yaml");
    std::fs::write(&pf, GATED).expect("policy");
    let pfs = pf.to_string_lossy().to_string();
    let r = start_router(&dir, &["--shards", "1", "--policy-file", &pfs], &[]);
    let (_, before) = Req::get("/admin/policy")
        .bearer(ADMIN_KEY)
        .send(r.http)
        .map(Resp::pair)
        .expect("get");
    std::fs::write(
        &pf,
        "routing_policy:\n  exclude_if:\n    srtt_ms:\n      gt: 100\n  strategy: least-loaded\n",
    )
    .expect("bad");
    let _ = Command::new("kill")
        .args(["-HUP", &r.proc.child.id().to_string()])
        .status();
    wait_until(
        Duration::from_secs(5),
        || r.proc.log_text().contains("policy reload rejected"),
        "reload error line",
    );
    assert!(r.proc.log_text().contains("srtt_ms"), "the error says why");
    let (_, after) = Req::get("/admin/policy")
        .bearer(ADMIN_KEY)
        .send(r.http)
        .map(Resp::pair)
        .expect("get");
    assert_eq!(before, after, "routing unchanged");
    assert_eq!(
        metric(
            r.metrics,
            "hivenet_policy_reload_total{trigger=\"sighup\",result=\"error\"}"
        ),
        Some(1.0)
    );
    // The admin API refuses a bad document with 400 and the reason.
    let (st, b) = Req::new("PUT", "/admin/policy")
        .body(b"routing_policy:\n  strategy: lowest-srtt\n")
        .raw_headers(&format!("Authorization: Bearer {ADMIN_KEY}\r\n"))
        .send(r.http)
        .map(Resp::pair)
        .expect("put");
    assert_eq!(st, 400);
    assert!(String::from_utf8_lossy(&b).contains("lowest-srtt"));
    // A good file on SIGHUP applies.
    std::fs::write(&pf, PRIMARY_ONLY).expect("good");
    let _ = Command::new("kill")
        .args(["-HUP", &r.proc.child.id().to_string()])
        .status();
    wait_until(
        Duration::from_secs(5),
        || r.proc.log_text().contains("policies reloaded"),
        "reload ok",
    );
    let (_, now) = Req::get("/admin/policy")
        .bearer(ADMIN_KEY)
        .send(r.http)
        .map(Resp::pair)
        .expect("get");
    assert!(
        !String::from_utf8_lossy(&now).contains("fallback_chain"),
        "{}",
        String::from_utf8_lossy(&now)
    );
    // Invalid policy at start: one-line reason naming file and line.
    std::fs::write(
        &pf,
        "routing_policy:\n  strategy: least-loaded\n  exclude_if:\n    srtt_ms:\n      gt: 1\n",
    )
    .expect("bad");
    let out = Command::new(bin("hivenet-router"))
        .args([
            "--policy-file",
            &pfs,
            "--http-port",
            "127.0.0.1:0",
            "--metrics-port",
            "127.0.0.1:0",
            "--p2p-port",
            "0",
        ])
        .env("HIVENET_ROUTER_ADMIN_API_KEYS", "k")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("policy.yaml:4") && err.contains("srtt_ms"),
        "{err}"
    );
}

#[test]
fn per_model_directory_and_admin_documents() {
    let dir = tmpdir("modeldir");
    let pd = dir.join("policies");
    std::fs::create_dir_all(&pd).expect("mkdir");
    std::fs::write(
        pd.join("_default.yaml"),
        "routing_policy:\n  strategy: least-loaded\n",
    )
    .expect("default");
    // Any agent with a known SRTT above 0.001 ms is excluded: after one sample, model m-a has no eligible agent.
    std::fs::write(pd.join("strict.yaml"), "models: [m-a]\nrouting_policy:\n  exclude_if:\n    srtt:\n      gt: 0.001\n  strategy: least-loaded\n").expect("strict");
    std::fs::write(pd.join("notes.txt"), "not a policy").expect("ignored");
    let pds = pd.to_string_lossy().to_string();
    let r = start_router(&dir, &["--shards", "2", "--policy-model-dir", &pds], &[]);
    let (_a, pa) = start_sim(&dir, "m-a", &[]);
    let (_b, pb) = start_sim(&dir, "m-b", &[]);
    let _aa = start_agent(&dir, &r, pa, "a.key", &[]);
    let _ab = start_agent(&dir, &r, pb, "b.key", &[]);
    wait_agents(r.http, "m-a", 1);
    wait_agents(r.http, "m-b", 1);
    assert_eq!(chat(r.http, "m-a", false).0, 200, "unknown SRTT passes");
    assert_eq!(
        chat(r.http, "m-a", false).0,
        503,
        "the per-model document applies to m-a"
    );
    for _ in 0..3 {
        assert_eq!(chat(r.http, "m-b", false).0, 200, "m-b uses _default");
    }
    let auth = format!("Authorization: Bearer {ADMIN_KEY}\r\n");
    let (st, b) = Req::get("/admin/policy/models")
        .bearer(ADMIN_KEY)
        .send(r.http)
        .map(Resp::pair)
        .expect("list");
    assert_eq!(st, 200);
    assert!(String::from_utf8_lossy(&b).contains("\"strict\""));
    let (st, b) = Req::new("PUT", "/admin/policy/models/other")
        .body(b"models: [m-a]\nrouting_policy:\n  strategy: least-loaded\n")
        .raw_headers(&auth)
        .send(r.http)
        .map(Resp::pair)
        .expect("put");
    assert_eq!(st, 409, "{}", String::from_utf8_lossy(&b));
    assert!(String::from_utf8_lossy(&b).contains("already claimed by policy"));
    let (st, _) = Req::new("PUT", "/admin/policy/models/other")
        .body(b"routing_policy:\n  strategy: least-loaded\n")
        .raw_headers(&auth)
        .send(r.http)
        .map(Resp::pair)
        .expect("put");
    assert_eq!(st, 400, "a named document needs models");
    let (st, _) = Req::new("DELETE", "/admin/policy/models/strict")
        .body(b"")
        .raw_headers(&auth)
        .send(r.http)
        .map(Resp::pair)
        .expect("delete");
    assert_eq!(st, 200);
    assert_eq!(
        chat(r.http, "m-a", false).0,
        200,
        "m-a falls back to the global policy"
    );
    let (st, b) = Req::get("/admin/policy/models/strict")
        .bearer(ADMIN_KEY)
        .send(r.http)
        .map(Resp::pair)
        .expect("get");
    assert_eq!(st, 404);
    assert!(String::from_utf8_lossy(&b).contains("no policy named: strict"));
}

#[test]
fn engine_signal_gate_from_scraped_metrics() {
    let dir = tmpdir("kvgate");
    let pf = dir.join("policy.yaml");
    std::fs::write(&pf, "routing_policy:\n  exclude_if:\n    kv_cache_utilization:\n      gt: 0.9\n  strategy: least-loaded\n").expect("policy");
    let pfs = pf.to_string_lossy().to_string();
    let r = start_router(&dir, &["--shards", "1", "--policy-file", &pfs], &[]);
    let (_f, p_free) = start_sim(&dir, "kv-model", &["--kv-cache-usage", "0.2"]);
    let (_b, p_busy) = start_sim(&dir, "kv-model", &["--kv-cache-usage", "0.95"]);
    let _af = start_agent(
        &dir,
        &r,
        p_free,
        "free.key",
        &["--machine", "free", "--engine-sample-interval", "100ms"],
    );
    let _ab = start_agent(
        &dir,
        &r,
        p_busy,
        "busy.key",
        &["--machine", "busy", "--engine-sample-interval", "100ms"],
    );
    wait_agents(r.http, "kv-model", 2);
    wait_until(
        Duration::from_secs(5),
        || {
            let t = routing_table(r.http);
            t["agents"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .all(|x| x["engine"]["kv_cache_utilization"].is_number())
                })
                .unwrap_or(false)
        },
        "engine signals in the routing table",
    );
    let before = successes_by_machine(r.http);
    for _ in 0..8 {
        assert_eq!(chat(r.http, "kv-model", false).0, 200);
    }
    let after = successes_by_machine(r.http);
    assert_eq!(
        after["busy"], before["busy"],
        "the agent reporting kv 0.95 is excluded"
    );
    assert_eq!(after["free"], before["free"] + 8);
}

#[test]
fn host_signal_gate_from_the_agent() {
    let dir = tmpdir("hwgate");
    let pf = dir.join("policy.yaml");
    // Any host with memory in use at all is excluded once it reports.
    std::fs::write(&pf, "routing_policy:\n  exclude_if:\n    memory_used_percent:\n      gt: 0.0001\n  strategy: least-loaded\n").expect("policy");
    let pfs = pf.to_string_lossy().to_string();
    let r = start_router(&dir, &["--shards", "1", "--policy-file", &pfs], &[]);
    let (_s, port) = start_sim(&dir, "hw-model", &[]);
    let _a = start_agent(
        &dir,
        &r,
        port,
        "hw.key",
        &["--engine-sample-interval", "100ms"],
    );
    wait_agents(r.http, "hw-model", 1);
    wait_until(
        Duration::from_secs(5),
        || routing_table(r.http)["agents"][0]["hardware"]["memory"]["used_percent"].is_number(),
        "host signals in the routing table",
    );
    let (st, b) = chat(r.http, "hw-model", false);
    assert_eq!(st, 503, "{}", String::from_utf8_lossy(&b));
    assert!(
        r.proc.log_text().contains("exclude_if=1"),
        "the gate removed it"
    );
}

#[test]
fn a_new_agent_wakes_every_waiter() {
    let dir = tmpdir("wakeall");
    let r = start_router(&dir, &["--shards", "1", "--request-timeout", "20s"], &[]);
    let slow = ["--ttft", "5ms", "--itl", "100ms", "--output-tokens", "40"];
    let (_s1, p1) = start_sim(&dir, "w-model", &slow);
    let _a1 = start_agent(&dir, &r, p1, "w1.key", &["--capacity", "1"]);
    wait_agents(r.http, "w-model", 1);
    let http = r.http;
    // A 4 s stream holds the only slot.
    let holder = hold_slot(http, "w-model");
    std::thread::sleep(Duration::from_millis(200));
    let waiters: Vec<_> = (0..2)
        .map(|_| std::thread::spawn(move || (chat(http, "w-model", false).0, Instant::now())))
        .collect();
    wait_until(
        Duration::from_secs(3),
        || metric(r.metrics, "hivenet_queue_depth{model=\"w-model\"}") == Some(2.0),
        "two waiters queued",
    );
    // A second agent arrives: both waiters are woken, not just one. Its
    // backend takes 1 s per request: woken together they finish together
    // (~1 s); woken one after the other the second would need ~2 s.
    let (_s2, p2) = start_sim(&dir, "w-model", &["--ttft", "1s"]);
    let registered = Instant::now();
    let _a2 = start_agent(&dir, &r, p2, "w2.key", &["--capacity", "4"]);
    for w in waiters {
        let (st, done) = w.join().expect("waiter");
        assert_eq!(st, 200);
        let took = done.duration_since(registered);
        assert!(
            took < Duration::from_millis(1700),
            "both waiters woken at once: {took:?}"
        );
    }
    assert_eq!(holder.join().expect("holder").expect("stream"), 200);
}

/// `POST /admin/metrics/reset` clears consecutive-failure streaks (spec 02):
/// an agent excluded by `consecutive_failures` starts a fresh streak.
#[test]
fn reset_clears_failure_streaks() {
    let dir = tmpdir("streak");
    let r = start_router(&dir, &["--shards", "1"], &[]);
    let (_s, port) = start_sim(&dir, "streak-model", &["--error-rate", "1"]);
    let _a = start_agent(&dir, &r, port, "streak.key", &[]);
    wait_agents(r.http, "streak-model", 1);
    let gate = "routing_policy:\n  exclude_if:\n    consecutive_failures:\n      gt: 2\n  strategy: least-loaded\n";
    let auth = format!("Authorization: Bearer {ADMIN_KEY}\r\n");
    let (st, b) = Req::new("PUT", "/admin/policy")
        .body(gate.as_bytes())
        .raw_headers(&auth)
        .send(r.http)
        .map(Resp::pair)
        .expect("put");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    // The backend's 500 reaches the client as the agent's backend_error
    // (502, spec 03 §8).
    for _ in 0..3 {
        assert_eq!(
            chat(r.http, "streak-model", false).0,
            502,
            "backend error relayed"
        );
    }
    let (st, b) = chat(r.http, "streak-model", false);
    assert_eq!(
        st,
        503,
        "excluded after 3 failures: {}",
        String::from_utf8_lossy(&b)
    );
    let (st, _) = Req::post("/admin/metrics/reset", "")
        .bearer(ADMIN_KEY)
        .send(r.http)
        .map(Resp::pair)
        .expect("reset");
    assert_eq!(st, 200);
    // A fresh streak: two more failures are allowed before the gate.
    assert_eq!(chat(r.http, "streak-model", false).0, 502);
    assert_eq!(
        chat(r.http, "streak-model", false).0,
        502,
        "the streak restarted at the reset"
    );
}

/// A recovered agent wakes every queued request (not only a new one): a
/// request queued behind a full agent is served by the other agent as
/// soon as that one's backend is healthy again, long before the slot frees.
#[test]
fn a_recovered_agent_wakes_the_queue() {
    let dir = tmpdir("wake-recovered");
    let r = start_router(&dir, &["--shards", "1", "--request-timeout", "20s"], &[]);
    // Agent A: one slot, held by an 8 s stream.
    let slow = ["--ttft", "5ms", "--itl", "200ms", "--output-tokens", "40"];
    let (_sa, pa) = start_sim(&dir, "rec-model", &slow);
    let _a = start_agent(&dir, &r, pa, "ra.key", &["--capacity", "1"]);
    // Agent B: its backend goes away, so it is registered but unhealthy.
    let (mut sb, pb) = start_sim(&dir, "rec-model", &[]);
    let _b = start_agent(
        &dir,
        &r,
        pb,
        "rb.key",
        &["--capacity", "4", "--hardware-sample-interval", "100ms"],
    );
    wait_agents(r.http, "rec-model", 2);
    sb.kill9();
    wait_until(
        Duration::from_secs(10),
        || healthy_agents(r.http, "rec-model") == 1,
        "B unhealthy",
    );
    let http = r.http;
    let holder = hold_slot(http, "rec-model");
    wait_until(
        Duration::from_secs(3),
        || {
            metric(r.metrics, "hivenet_agent_active_requests{") == Some(1.0) || {
                metrics_text(r.metrics)
                    .lines()
                    .any(|l| l.starts_with("hivenet_agent_active_requests{") && l.ends_with(" 1"))
            }
        },
        "A busy",
    );
    // Three waiters: a recovery wakes every queued request, not one.
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            std::thread::spawn(move || {
                let t = Instant::now();
                (chat(http, "rec-model", false).0, t.elapsed())
            })
        })
        .collect();
    wait_until(
        Duration::from_secs(3),
        || metric(r.metrics, "hivenet_queue_depth{model=\"rec-model\"}") == Some(3.0),
        "the requests wait in the queue",
    );
    // B's backend returns on the same port: B reports healthy and the
    // queued request goes to it at once.
    let ps = pb.to_string();
    let _sb2 = spawn(
        "hivenet-sim",
        &["--port", &ps, "--model", "rec-model"],
        &dir,
        &[],
    );
    for w in waiters {
        let (st, took) = w.join().expect("waiter");
        assert_eq!(st, 200);
        assert!(
            took < Duration::from_secs(5),
            "served by the recovered agent, not after the 8 s stream: {took:?}"
        );
    }
    assert_eq!(holder.join().expect("holder").expect("stream"), 200);
}
