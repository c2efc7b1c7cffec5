//! Replacing a running router (issue 54), scaled down: under load (long
//! streams in flight, requests held at zero, a client opening connections
//! all the time, a keep-alive client) `hivenet-router --upgrade` takes
//! over: no stream cut, no held request lost or failed, no connection
//! refused, the pending demand never counted twice; the SRTT history and
//! today's token usage are the same before and after; a replacement that
//! fails at start, or dies during the hand-over, leaves the old router
//! serving with nothing lost.

mod common;
use common::hold::{chat_on, push_at_zero, whole_stream, ADMIN};
use common::*;
use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The router's arguments (the replacement gets the same plus --upgrade).
fn args(ports: (u16, u16, u16)) -> Vec<String> {
    vec![
        "--http-port".into(),
        format!("127.0.0.1:{}", ports.0),
        "--metrics-port".into(),
        format!("127.0.0.1:{}", ports.1),
        "--p2p-port".into(),
        ports.2.to_string(),
        "--shards".into(),
        "2".into(),
        "--site-id".into(),
        "a".into(),
        "--auth-config-file".into(),
        "auth.yaml".into(),
    ]
}

const KEY: &str = "sk-upgrade";

const RPM_KEY: &str = "sk-upgrade-rpm";

fn auth_yaml() -> String {
    format!(
        "api:\n  mode: api-key\n  keys:\n    - key_hash: \"{}\"\n      metadata: {{name: k, owner: acme}}\n      quota: {{tokens_per_day: 100000000}}\n    - key_hash: \"{}\"\n      metadata: {{name: r, owner: slow}}\n      quota: {{requests_per_minute: 3}}\n",
        sha256_hex(KEY),
        sha256_hex(RPM_KEY)
    )
}

/// One non-streamed chat with `key`: its status.
fn status_with(http: u16, key: &str) -> u16 {
    Req::chat("m")
        .bearer(key)
        .send(http)
        .map(Resp::pair)
        .map(|(s, _)| s)
        .unwrap_or(0)
}

fn start(dir: &std::path::Path, ports: (u16, u16, u16), upgrade: bool) -> Proc {
    start_args(
        dir,
        &args(ports),
        upgrade,
        &[("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN)],
    )
}

/// A router with `args` (plus `--upgrade` for a replacement).
fn start_args(dir: &std::path::Path, args: &[String], upgrade: bool, env: &[(&str, &str)]) -> Proc {
    let mut refs: Vec<&str> = args.iter().map(String::as_str).collect();
    if upgrade {
        refs.push("--upgrade");
    }
    spawn("hivenet-router", &refs, dir, env)
}

/// Wait until `model` has a healthy agent (`/v1/models` with the key).
fn wait_model(http: u16, model: &str) {
    wait_until(
        Duration::from_secs(30),
        || {
            let Ok((200, b)) = Req::get("/v1/models")
                .bearer(KEY)
                .send(http)
                .map(Resp::pair)
            else {
                return false;
            };
            let v: serde_json::Value = serde_json::from_slice(&b).unwrap_or_default();
            v["data"]
                .as_array()
                .and_then(|a| a.iter().find(|m| m["id"] == model))
                .and_then(|m| m["agents"]["healthy"].as_u64())
                .is_some_and(|n| n >= 1)
        },
        &format!("an agent of {model}"),
    );
}

fn healthy(http: u16) -> bool {
    Req::get("/health")
        .send(http)
        .map(Resp::pair)
        .map(|(s, _)| s == 200)
        .unwrap_or(false)
}

/// One chat with the test's key on its own connection.
fn request(http: u16, model: &str, stream: bool, tokens: u32) -> std::io::Result<(String, String)> {
    chat_on(http, Some(KEY), model, stream, tokens)
}

/// A router with a served model `m` (a sim with `sim`, its agent).
struct Setup {
    dir: std::path::PathBuf,
    ports: (u16, u16, u16),
    old: Proc,
    _sim: Proc,
    _agent: Proc,
}

fn setup(tag: &str, sim: &[&str]) -> Setup {
    let dir = tmpdir(tag);
    std::fs::write(dir.join("auth.yaml"), auth_yaml()).expect("auth");
    let ports = (free_port(), free_port(), free_port());
    let old = start(&dir, ports, false);
    wait_until(Duration::from_secs(20), || healthy(ports.0), "router");
    let (_sim, sim_port) = start_sim(&dir, "m", sim);
    let _agent = agent_to(&dir, ports.2, sim_port, "a.key", &[]);
    wait_model(ports.0, "m");
    Setup {
        dir,
        ports,
        old,
        _sim,
        _agent,
    }
}

fn wait_exit(p: &mut Proc, limit: Duration) -> Option<std::process::ExitStatus> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if let Ok(Some(s)) = p.child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

fn srtt(http: u16) -> Vec<(String, Option<f64>)> {
    let (st, b) = Req::get("/admin/routing-table")
        .bearer(ADMIN)
        .send(http)
        .map(Resp::pair)
        .expect("routing table");
    assert_eq!(st, 200);
    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
    let mut out: Vec<_> = v["agents"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|a| {
                    (
                        a["peer_id"].as_str().unwrap_or_default().to_string(),
                        a["universal"]["srtt_ms"].as_f64(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn used_today(metrics: u16) -> f64 {
    metric(
        metrics,
        "hivenet_tenant_tokens_used_today{tenant_id=\"acme\",model=\"\"}",
    )
    .unwrap_or(0.0)
}

#[test]
fn an_upgrade_under_load_cuts_nothing_and_loses_nothing() {
    let dir = tmpdir("upgrade-load");
    std::fs::write(dir.join("auth.yaml"), auth_yaml()).expect("auth");
    let ports = (free_port(), free_port(), free_port());
    let mut old = start(&dir, ports, false);
    wait_until(Duration::from_secs(20), || healthy(ports.0), "router");
    // `m` served (50 ms between tokens: a 60-token stream lasts 3 s),
    // `z` placed here at zero: held.
    let (_sim, sim_port) = start_sim(&dir, "m", &["--itl", "50ms", "--output-tokens", "60"]);
    let _agent = agent_to(&dir, ports.2, sim_port, "a.key", &[]);
    wait_model(ports.0, "m");
    push_at_zero(ports.0, "z", "120s");
    const STREAMS: usize = 12;
    const HELD: usize = 8;
    let streams: Vec<_> = (0..STREAMS)
        .map(|_| std::thread::spawn(move || request(ports.0, "m", true, 60)))
        .collect();
    let held: Vec<_> = (0..HELD)
        .map(|_| std::thread::spawn(move || request(ports.0, "z", true, 4)))
        .collect();
    wait_until(
        Duration::from_secs(10),
        || metric(ports.1, "hivenet_pending_demand{model=\"z\"}") == Some(HELD as f64),
        "requests held",
    );
    // A client opening a connection every 20 ms, one keeping its own.
    let stop = Arc::new(AtomicBool::new(false));
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let opener = {
        let (stop, outcomes) = (stop.clone(), outcomes.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let r = request(ports.0, "m", false, 2)
                    .map(|(h, _)| h.lines().next().unwrap_or_default().to_string());
                outcomes.lock().expect("lock").push(format!("{r:?}"));
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let keeper = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut s = TcpStream::connect(("127.0.0.1", ports.0)).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(30))).ok();
            let mut buf = Vec::new();
            let mut statuses = Vec::new();
            let body = chat_body("m", false);
            while !stop.load(Ordering::Relaxed) {
                let req = format!(
                    "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                s.write_all(req.as_bytes()).expect("keep-alive write");
                statuses.push(read_response(&mut s, &mut buf).0);
                std::thread::sleep(Duration::from_millis(30));
            }
            statuses
        })
    };
    // The pending demand, scraped all along: never above what is held.
    let demand_max = Arc::new(Mutex::new(0f64));
    let scraper = {
        let (stop, max) = (stop.clone(), demand_max.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Some(d) = metric(ports.1, "hivenet_pending_demand{model=\"z\"}") {
                    let mut m = max.lock().expect("lock");
                    *m = m.max(d);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let mut new = start(&dir, ports, true);
    // The old process leaves once its streams ended.
    let st = wait_exit(&mut old, Duration::from_secs(30));
    assert!(
        st.is_some_and(|s| s.success()),
        "the old router did not finish: {st:?}\n{}",
        old.log_text()
    );
    let old_log = old.log_text();
    assert!(
        old_log.contains(&format!("held={HELD}")),
        "held requests not handed over:\n{old_log}"
    );
    // The keep-alive client's connection went over at its next request.
    assert!(
        !old_log.contains("handed over connections=0"),
        "no connection carried over:\n{old_log}"
    );
    // The held requests wake in the new process.
    let (_zsim, zport) = start_sim(&dir, "z", &[]);
    let _zagent = agent_to(&dir, ports.2, zport, "z.key", &[]);
    for h in held {
        let (head, body) = h.join().expect("held").expect("held answer");
        assert!(head.starts_with("HTTP/1.1 200"), "held: {head}\n{body}");
        assert!(whole_stream(&body, 4), "held answer cut: {body}");
    }
    for s in streams {
        let (head, body) = s.join().expect("stream").expect("stream answer");
        assert!(head.starts_with("HTTP/1.1 200"), "stream: {head}");
        assert!(whole_stream(&body, 60), "a stream was cut: {body}");
    }
    // The sibling map came over: the new process places `z` here (its
    // demand series exists only while a map does).
    assert_eq!(
        metric(ports.1, "hivenet_pending_demand{model=\"z\"}"),
        Some(0.0),
        "the sibling map was not carried over"
    );
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    opener.join().expect("opener");
    let kept = keeper.join().expect("keeper");
    scraper.join().expect("scraper");
    let outcomes = outcomes.lock().expect("lock").clone();
    assert!(
        outcomes.len() > 20,
        "too few connections tried: {outcomes:?}"
    );
    let bad: Vec<_> = outcomes.iter().filter(|o| !o.contains("200")).collect();
    assert!(bad.is_empty(), "connections failed: {bad:?}");
    assert!(
        kept.len() > 10 && kept.iter().all(|s| *s == 200),
        "keep-alive client: {kept:?}"
    );
    let max = *demand_max.lock().expect("lock");
    assert!(max <= HELD as f64, "pending demand counted twice: {max}");
    assert!(healthy(ports.0), "{}", new.log_text());
    sigterm(&mut new);
}

#[test]
fn history_and_usage_are_the_same_after_an_upgrade() {
    let mut su = setup("upgrade-state", &["--ttft", "5ms"]);
    let (dir, ports) = (su.dir.clone(), su.ports);
    let old = &mut su.old;
    for _ in 0..5 {
        let (h, _) = request(ports.0, "m", false, 8).expect("chat");
        assert!(h.starts_with("HTTP/1.1 200"), "{h}");
    }
    // A tenant's minute of requests spent before the upgrade.
    for _ in 0..3 {
        assert_eq!(status_with(ports.0, RPM_KEY), 200);
    }
    let before = srtt(ports.0);
    let used = used_today(ports.1);
    assert!(
        used > 0.0 && before.iter().all(|(_, s)| s.is_some()),
        "{before:?} {used}"
    );
    let mut new = start(&dir, ports, true);
    assert!(
        wait_exit(old, Duration::from_secs(30)).is_some(),
        "old still running"
    );
    wait_model(ports.0, "m");
    assert_eq!(
        srtt(ports.0),
        before,
        "SRTT history changed across the upgrade"
    );
    assert_eq!(
        used_today(ports.1),
        used,
        "today's usage changed across the upgrade"
    );
    // No second minute's budget in the new process.
    assert_eq!(
        status_with(ports.0, RPM_KEY),
        429,
        "the request rate was not carried over"
    );
    // Served after it, counted on top.
    let (h, _) = request(ports.0, "m", false, 8).expect("chat");
    assert!(h.starts_with("HTTP/1.1 200"), "{h}");
    assert!(used_today(ports.1) > used);
    sigterm(&mut new);
}

#[test]
fn a_replacement_that_fails_leaves_the_old_router_serving() {
    let mut su = setup("upgrade-fail", &["--itl", "20ms", "--output-tokens", "50"]);
    let (dir, ports) = (su.dir.clone(), su.ports);
    let old = &mut su.old;
    let streams: Vec<_> = (0..4)
        .map(|_| std::thread::spawn(move || request(ports.0, "m", true, 50)))
        .collect();
    // A bad configuration: refused before it touches anything.
    let mut a = args(ports);
    a.extend(["--upgrade".into(), "--queue-depth".into(), "lots".into()]);
    let bad = std::process::Command::new(bin("hivenet-router"))
        .args(&a)
        .current_dir(&dir)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let (code, err) = exit_within(bad, Duration::from_secs(10));
    assert_eq!(code, Some(2), "{err}");
    // Replacements killed at steps of the hand-over: once connected
    // (the sockets received), once the store moved to it.
    // The agent is paused meanwhile: the replacement waits for it to
    // link (up to 10 s), so each kill lands before the switch.
    for step in ["listening sockets received", "the store is ours"] {
        signal(&su._agent, "STOP");
        let mut p = start(&dir, ports, true);
        wait_until(
            Duration::from_secs(20),
            || p.log_text().contains(step),
            step,
        );
        p.kill9();
        signal(&su._agent, "CONT");
        assert!(
            !p.log_text().contains("this process serves"),
            "killed too late (after the switch):\n{}",
            p.log_text()
        );
        // The old one serves on, its store back.
        wait_until(
            Duration::from_secs(70),
            || request(ports.0, "m", false, 2).is_ok_and(|(h, _)| h.starts_with("HTTP/1.1 200")),
            "old router serving again",
        );
        assert!(
            old.child.try_wait().ok().flatten().is_none(),
            "old router exited"
        );
    }
    for s in streams {
        let (head, body) = s.join().expect("stream").expect("stream answer");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(whole_stream(&body, 50), "a stream was cut: {body}");
    }
    // Its store is its own again: a restart-free flush still works and a
    // later replacement succeeds.
    let mut new = start(&dir, ports, true);
    assert!(
        wait_exit(old, Duration::from_secs(30)).is_some(),
        "{}",
        new.log_text()
    );
    wait_model(ports.0, "m");
    let (h, _) = request(ports.0, "m", false, 2).expect("chat");
    assert!(h.starts_with("HTTP/1.1 200"), "{h}");
    sigterm(&mut new);
}

#[test]
fn sigusr2_replaces_the_router_with_the_binary_at_its_path() {
    // What `systemctl reload` does with the shipped unit.
    let mut su = setup("upgrade-usr2", &["--itl", "20ms", "--output-tokens", "50"]);
    let ports = su.ports;
    let old = &mut su.old;
    let stream = std::thread::spawn(move || request(ports.0, "m", true, 50));
    std::thread::sleep(Duration::from_millis(200));
    signal(old, "USR2");
    let st = wait_exit(old, Duration::from_secs(30));
    let log = old.log_text();
    assert!(st.is_some_and(|s| s.success()), "{st:?}\n{log}");
    let pid: u32 = log
        .lines()
        .find(|l| l.contains("SIGUSR2: replacement started"))
        .and_then(|l| l.split("pid=").nth(1))
        .and_then(|p| p.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no replacement pid in the log:\n{log}"));
    let (head, body) = stream.join().expect("stream").expect("stream answer");
    assert!(
        head.starts_with("HTTP/1.1 200") && whole_stream(&body, 50),
        "{body}"
    );
    wait_model(ports.0, "m");
    let (h, _) = request(ports.0, "m", false, 2).expect("chat");
    assert!(h.starts_with("HTTP/1.1 200"), "{h}");
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    wait_until(
        Duration::from_secs(15),
        || !std::path::Path::new(&format!("/proc/{pid}")).exists() || zombie(pid),
        "the replacement stops",
    );
}

fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.contains(") Z "))
        .unwrap_or(true)
}

/// Turn `turn` of conversation `conv`: its own long system prompt, the
/// turns before, a new question.
fn conversation_turn(conv: usize, turn: usize) -> String {
    let system = format!("You are assistant {conv}. ") + &"Answer briefly. ".repeat(60);
    let mut msgs = vec![serde_json::json!({"role": "system", "content": system})];
    for t in 0..=turn {
        msgs.push(
            serde_json::json!({"role": "user", "content": format!("question {t} of {conv}")}),
        );
        if t < turn {
            msgs.push(serde_json::json!({"role": "assistant", "content": format!("answer {t}")}));
        }
    }
    serde_json::json!({"model": "m", "max_tokens": 2, "messages": msgs}).to_string()
}

/// Which of `sims` served one request (its completion count moved).
fn served_by(http: u16, sims: &[u16], body: &str) -> usize {
    let before: Vec<f64> = sims.iter().map(|p| sim_completions(*p)).collect();
    let (st, b) = Req::post("/v1/chat/completions", body)
        .bearer(KEY)
        .send(http)
        .map(Resp::pair)
        .expect("turn");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let mut who = usize::MAX;
    wait_until(
        Duration::from_secs(5),
        || {
            who = sims
                .iter()
                .zip(&before)
                .position(|(p, b)| sim_completions(*p) > *b)
                .unwrap_or(usize::MAX);
            who != usize::MAX
        },
        "the serving engine",
    );
    who
}

#[test]
fn conversations_keep_their_engines_across_an_upgrade() {
    let dir = tmpdir("upgrade-affinity");
    std::fs::write(dir.join("auth.yaml"), auth_yaml()).expect("auth");
    std::fs::write(
        dir.join("policy.yaml"),
        "routing_policy:\n  strategy: prefix-aware\n",
    )
    .expect("policy");
    let ports = (free_port(), free_port(), free_port());
    let mut a = args(ports);
    a.extend(["--policy-file".into(), "policy.yaml".into()]);
    let start_with = |upgrade: bool| {
        start_args(
            &dir,
            &a,
            upgrade,
            &[("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN)],
        )
    };
    let mut old = start_with(false);
    wait_until(Duration::from_secs(20), || healthy(ports.0), "router");
    let mut keep = Vec::new();
    let mut sims = Vec::new();
    for i in 0..3 {
        let (s, port) = start_sim(&dir, "m", &["--prefix-cache-tokens", "65536"]);
        keep.push(s);
        keep.push(agent_to(&dir, ports.2, port, &format!("a{i}.key"), &[]));
        sims.push(port);
    }
    let three = || {
        let Ok((200, b)) = Req::get("/v1/models")
            .bearer(KEY)
            .send(ports.0)
            .map(Resp::pair)
        else {
            return false;
        };
        String::from_utf8_lossy(&b).contains("\"healthy\":3")
    };
    wait_until(Duration::from_secs(30), three, "three engines");
    let holders: Vec<usize> = (0..6)
        .map(|c| served_by(ports.0, &sims, &conversation_turn(c, 0)))
        .collect();
    assert!(
        holders
            .iter()
            .collect::<std::collections::HashSet<_>>()
            .len()
            > 1,
        "the conversations all went to one engine: {holders:?}"
    );
    let mut new = start_with(true);
    assert!(
        wait_exit(&mut old, Duration::from_secs(30)).is_some(),
        "old still running"
    );
    wait_until(
        Duration::from_secs(30),
        three,
        "three engines after the upgrade",
    );
    let after: Vec<usize> = (0..6)
        .map(|c| served_by(ports.0, &sims, &conversation_turn(c, 1)))
        .collect();
    assert_eq!(after, holders, "a conversation moved to another engine");
    sigterm(&mut new);
}

#[test]
fn dynamic_keys_are_carried_over() {
    let dir = tmpdir("upgrade-dyn");
    let ports = (free_port(), free_port(), free_port());
    let mut a = args(ports);
    a.truncate(a.len() - 2); // no auth file: the registry's keys
    let start_dyn = |upgrade: bool| {
        start_args(
            &dir,
            &a,
            upgrade,
            &[("HIVENET_ROUTER_AUTH_MODE", "dynamic")],
        )
    };
    let mut old = start_dyn(false);
    wait_until(Duration::from_secs(20), || healthy(ports.0), "router");
    let (_sim, sim_port) = start_sim(&dir, "m", &[]);
    let _agent = agent_to(&dir, ports.2, sim_port, "a.key", &[]);
    let raw = "sk-dynamic-upgrade";
    let dto = serde_json::json!({"version": "v1", "key_hash": sha256_hex(raw), "key_preview": "sk-...e",
        "owner": "acme", "name": "dyn", "allowed_models": ["m"], "quota": {"requests_per_minute": 1000}});
    let (st, v) = admin(ports.0, "PUT", "/admin/api-keys/dyn", dto);
    assert_eq!(st, 200, "{v}");
    let chat = || status_with(ports.0, raw);
    wait_until(Duration::from_secs(30), || chat() == 200, "the key serves");
    let mut new = start_dyn(true);
    assert!(
        wait_exit(&mut old, Duration::from_secs(30)).is_some(),
        "old still running"
    );
    assert_eq!(chat(), 200, "the dynamic key was lost in the upgrade");
    assert_eq!(status_with(ports.0, "sk-unknown"), 401);
    sigterm(&mut new);
}

#[test]
fn an_upgrade_socket_that_cannot_be_bound_is_said() {
    // The default path (beside the store) past a Unix socket's 108
    // bytes: the router serves, without the hand-over, and says so.
    let dir = tmpdir("upgrade-long");
    std::fs::write(dir.join("auth.yaml"), auth_yaml()).expect("auth");
    let ports = (free_port(), free_port(), free_port());
    let db = dir.join("d".repeat(120)).to_string_lossy().to_string();
    let mut a = args(ports);
    a.extend(["--disk-db-path".into(), db]);
    let mut p = start_args(&dir, &a, false, &[]);
    wait_until(Duration::from_secs(20), || healthy(ports.0), "router");
    assert!(
        p.log_text().contains("upgrade hand-over OFF"),
        "{}",
        p.log_text()
    );
    sigterm(&mut p);
    // Named by the operator: it must work, or the router does not start.
    let long = dir.join("s".repeat(120)).to_string_lossy().to_string();
    let mut a = args((free_port(), free_port(), free_port()));
    a.extend(["--upgrade-socket".into(), long]);
    let child = std::process::Command::new(bin("hivenet-router"))
        .args(&a)
        .current_dir(&dir)
        .env("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let (code, err) = exit_within(child, Duration::from_secs(20));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--upgrade-socket"), "{err}");
}

/// The simulator's words, in order (bench/src/sim.rs `WORDS`).
const WORDS: [&str; 16] = [
    "The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".", " Hivenet",
    " routes", " every", " token", " home", ".",
];

/// One streamed chat of `model` with usage on its own connection: (head, body).
fn stream_with_usage(http: u16, model: &str, i: usize) -> std::io::Result<(String, String)> {
    use std::io::Read;
    let body = format!(
        r#"{{"model":"{model}","stream":true,"stream_options":{{"include_usage":true}},"max_tokens":100,"messages":[{{"role":"user","content":"story {i}"}}]}}"#
    );
    let mut s = TcpStream::connect(("127.0.0.1", http))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    s.write_all(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    Ok(common::hold::split_response(&out))
}

/// Streams still relayed when `--upgrade-drain-timeout` passes are not
/// cut: each goes to the new process with what its client received, and
/// the new process continues it (on the same engine, relinked): every
/// client reads one whole answer, byte for byte the uninterrupted text,
/// one role, one ID, one usage, and today's usage counts each answer once.
#[test]
fn streams_past_the_drain_timeout_are_continued_by_the_new_process() {
    let dir = tmpdir("upgrade-carry-streams");
    std::fs::write(dir.join("auth.yaml"), auth_yaml()).expect("auth");
    let ports = (free_port(), free_port(), free_port());
    let mut a = args(ports);
    a.extend(["--upgrade-drain-timeout".to_string(), "1s".to_string()]);
    let env = [("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN)];
    let mut old = start_args(&dir, &a, false, &env);
    wait_until(Duration::from_secs(20), || healthy(ports.0), "router");
    // 60 tokens 200 ms apart: 12 s, far past the 1 s drain.
    let (_sim, sim_port) = start_sim(&dir, "m", &["--itl", "200ms", "--output-tokens", "60"]);
    let _agent = agent_to(&dir, ports.2, sim_port, "a.key", &[]);
    wait_model(ports.0, "m");
    let before = used_today(ports.1);
    const STREAMS: usize = 4;
    let streams: Vec<_> = (0..STREAMS)
        .map(|i| std::thread::spawn(move || stream_with_usage(ports.0, "m", i)))
        .collect();
    std::thread::sleep(Duration::from_millis(800));
    let new = start_args(&dir, &a, true, &env);
    let gone = wait_exit(&mut old, Duration::from_secs(30));
    assert!(
        gone.is_some(),
        "the old router left after its drain timeout"
    );
    // It left them running (before: it relayed them to their end).
    assert!(
        streams.iter().all(|s| !s.is_finished()),
        "the old router left while the streams ran"
    );
    let want: String = (0..60).map(|i| WORDS[i % WORDS.len()]).collect();
    let mut total = 0u64;
    for (i, s) in streams.into_iter().enumerate() {
        let (head, body) = s.join().expect("thread").expect("stream");
        assert!(head.starts_with("HTTP/1.1 200"), "stream {i}: {head}");
        assert!(!body.contains("error"), "stream {i} was cut:\n{body}");
        assert_eq!(
            body.matches("data: [DONE]").count(),
            1,
            "stream {i}:\n{body}"
        );
        let (mut text, mut roles, mut ids, mut usage) = (String::new(), 0, Vec::new(), None);
        for e in body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        {
            if let Some(id) = e["id"].as_str() {
                if !ids.iter().any(|x| x == id) {
                    ids.push(id.to_string());
                }
            }
            let d = &e["choices"][0]["delta"];
            roles += usize::from(d.get("role").is_some());
            text.push_str(d["content"].as_str().unwrap_or(""));
            if e["usage"].is_object() {
                usage = Some(e["usage"].clone());
            }
        }
        assert_eq!(text, want, "stream {i}: the whole text\n{body}");
        assert_eq!(roles, 1, "stream {i}: one role delta\n{body}");
        assert_eq!(ids.len(), 1, "stream {i}: one ID {ids:?}");
        let u = usage.unwrap_or_else(|| panic!("stream {i}: a usage event\n{body}"));
        assert_eq!(u["completion_tokens"], 60, "stream {i}: {u}");
        total += u["total_tokens"].as_u64().unwrap_or(0);
    }
    // Each was continued by the new process, none finished by the old.
    let continued = metric(
        ports.1,
        "hivenet_stream_migrations_total{model=\"m\",outcome=\"continued\"}",
    );
    assert_eq!(continued, Some(STREAMS as f64), "{}", metrics_text(ports.1));
    // Their daily tokens counted once: the old process's reservation
    // settled by the new one against the whole answers' usage.
    wait_until(
        Duration::from_secs(5),
        || used_today(ports.1) - before == total as f64,
        &format!(
            "today's usage up by {total}: {}",
            used_today(ports.1) - before
        ),
    );
    assert!(healthy(ports.0), "{}", new.log_text());
}

/// The `total_tokens` of a streamed answer's usage event.
fn total_tokens(body: &str) -> u64 {
    body.lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find_map(|e| e["usage"]["total_tokens"].as_u64())
        .unwrap_or(0)
}

/// Tokens are counted once across an upgrade: streams that end in the
/// old process after the switch (their usage goes over as deltas) and
/// requests held at zero there, carried with their daily reservation and
/// served by the new process (which settles it). Today's usage in the
/// new process is the old one's plus exactly what the answers reported.
#[test]
fn tokens_of_streams_and_held_requests_across_an_upgrade_are_counted_once() {
    let s = setup("upgrade-usage", &["--itl", "50ms", "--output-tokens", "60"]);
    let ports = s.ports;
    push_at_zero(ports.0, "z", "120s");
    let before = used_today(ports.1);
    let streams: Vec<_> = (0..3)
        .map(|i| std::thread::spawn(move || stream_with_usage(ports.0, "m", i)))
        .collect();
    let held: Vec<_> = (0..2)
        .map(|i| std::thread::spawn(move || stream_with_usage(ports.0, "z", i)))
        .collect();
    wait_until(
        Duration::from_secs(10),
        || metric(ports.1, "hivenet_pending_demand{model=\"z\"}") == Some(2.0),
        "requests held",
    );
    std::thread::sleep(Duration::from_millis(300));
    let new = start(&s.dir, ports, true);
    let mut old = s.old;
    let gone = wait_exit(&mut old, Duration::from_secs(30));
    assert!(gone.is_some(), "the old router left once its streams ended");
    // The model wakes in the new process.
    let (_zsim, zport) = start_sim(&s.dir, "z", &["--output-tokens", "5"]);
    let _zagent = agent_to(&s.dir, ports.2, zport, "z.key", &[]);
    let mut total = 0;
    for (i, h) in streams.into_iter().chain(held).enumerate() {
        let (head, body) = h.join().expect("thread").expect("answer");
        assert!(head.starts_with("HTTP/1.1 200"), "answer {i}: {head}");
        assert!(body.contains("data: [DONE]"), "answer {i}: {body}");
        let t = total_tokens(&body);
        assert!(t > 0, "answer {i} has its usage: {body}");
        total += t;
    }
    wait_until(
        Duration::from_secs(5),
        || used_today(ports.1) - before == total as f64,
        &format!(
            "today's usage up by {total} in the new router: {}\n{}",
            used_today(ports.1) - before,
            new.log_text()
        ),
    );
}

/// A Responses turn still streaming in the old process when it hands its
/// store over ends there: its record goes to the new process's store
/// (forwarded over the upgrade socket), which then serves it and
/// continues the chain.
#[test]
fn a_responses_turn_across_the_switch_is_kept_by_the_new_router() {
    use std::io::Read;
    let s = setup(
        "upgrade-responses",
        &["--itl", "50ms", "--output-tokens", "60"],
    );
    let http = s.ports.0;
    let turn = std::thread::spawn(move || {
        let body = r#"{"model":"m","input":"remember me","stream":true}"#;
        let mut c = TcpStream::connect(("127.0.0.1", http)).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(30))).ok();
        let req = format!(
            "POST /v1/responses HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        c.write_all(req.as_bytes()).expect("send");
        let mut got = Vec::new();
        let _ = c.read_to_end(&mut got);
        String::from_utf8_lossy(&got).to_string()
    });
    std::thread::sleep(Duration::from_millis(500));
    let new = start(&s.dir, s.ports, true);
    let mut old = s.old;
    let text = turn.join().expect("turn");
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("response.completed"), "{text}");
    let at = text.find("\"id\":\"resp_").expect("a response ID") + 6;
    let id = text[at..].split('"').next().unwrap_or_default().to_string();
    assert!(
        wait_exit(&mut old, Duration::from_secs(30)).is_some(),
        "the old router left"
    );
    // Served by the new router from its store, and continued.
    let seen = Req::get(&format!("/v1/responses/{id}"))
        .bearer(KEY)
        .send(http)
        .expect("get");
    assert_eq!(seen.status, 200, "{}\n{}", seen.text(), new.log_text());
    let next = format!(r#"{{"model":"m","input":"and now?","previous_response_id":"{id}"}}"#);
    let cont = Req::post("/v1/responses", next)
        .bearer(KEY)
        .send(http)
        .expect("post");
    assert_eq!(cont.status, 200, "{}", cont.text());
}

/// An agent's capacity holds in total across its two links while both
/// routers serve (the old one its streams, the new one new clients): its
/// engine never runs more than `--capacity` answers at once, and the
/// requests beyond it wait at the new router (served whole, never refused).
#[test]
fn an_agents_capacity_holds_across_both_routers_during_the_switch() {
    let dir = tmpdir("upgrade-capacity");
    std::fs::write(dir.join("auth.yaml"), auth_yaml()).expect("auth");
    let ports = (free_port(), free_port(), free_port());
    let mut old = start(&dir, ports, false);
    wait_until(Duration::from_secs(20), || healthy(ports.0), "router");
    let (_sim, sim_port) = start_sim(&dir, "m", &["--itl", "50ms", "--output-tokens", "60"]);
    let _agent = agent_to(&dir, ports.2, sim_port, "a.key", &["--capacity", "3"]);
    wait_model(ports.0, "m");
    let first: Vec<_> = (0..3)
        .map(|i| std::thread::spawn(move || stream_with_usage(ports.0, "m", i)))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let new = start(&dir, ports, true);
    wait_until(
        Duration::from_secs(20),
        || new.log_text().contains("this process serves"),
        "the new router serving",
    );
    let second: Vec<_> = (3..6)
        .map(|i| std::thread::spawn(move || stream_with_usage(ports.0, "m", i)))
        .collect();
    for (i, h) in first.into_iter().chain(second).enumerate() {
        let (head, body) = h.join().expect("thread").expect("answer");
        assert!(
            head.starts_with("HTTP/1.1 200"),
            "answer {i}: {head}\n{body}"
        );
        assert!(whole_stream(&body, 60), "answer {i} whole: {body}");
    }
    assert!(wait_exit(&mut old, Duration::from_secs(30)).is_some());
    let peak = metric(sim_port, "hivenet_sim_peak_running");
    assert_eq!(peak, Some(3.0), "the engine ran at most 3 at once");
}

/// The agents of the routing table: (peer ID, draining).
fn draining(http: u16) -> Vec<(String, bool)> {
    let (st, b) = Req::get("/admin/routing-table")
        .bearer(ADMIN)
        .send(http)
        .map(Resp::pair)
        .expect("routing table");
    assert_eq!(st, 200);
    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
    v["agents"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|a| {
                    (
                        a["peer_id"].as_str().unwrap_or_default().to_string(),
                        a["status"]["draining"].as_bool().unwrap_or(false),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// What lives only in the running router's memory goes over too: the
/// policies written through the admin API (in force instead of the
/// files', as they were) and the agents drained through it.
#[test]
fn admin_policies_and_drain_marks_are_carried_over() {
    let s = setup("upgrade-admin", &[]);
    let http = s.ports.0;
    let docs = [
        (
            "/admin/policy",
            r#"{"routing_policy":{"match":{},"strategy":"least-loaded"},"aliases":{"mm":"m"}}"#,
        ),
        (
            "/admin/policy/models/pinned",
            r#"{"models":["m"],"routing_policy":{"match":{},"strategy":"least-loaded","max_tries":2}}"#,
        ),
    ];
    for (path, doc) in docs {
        let put = Req::new("PUT", path)
            .body(doc.as_bytes())
            .bearer(ADMIN)
            .send(http)
            .expect("put");
        assert_eq!(put.status, 200, "{path}: {}", put.text());
    }
    let get = |http: u16| {
        ["/admin/policy", "/admin/policy/models"].map(|path| {
            Req::get(path)
                .bearer(ADMIN)
                .send(http)
                .map(Resp::pair)
                .expect("get")
        })
    };
    let before = get(http);
    assert!(String::from_utf8_lossy(&before[0].1).contains("mm"));
    assert!(String::from_utf8_lossy(&before[1].1).contains("pinned"));
    let peer = draining(http)
        .first()
        .map(|(p, _)| p.clone())
        .expect("an agent");
    let drain = Req::new("POST", &format!("/admin/agents/{peer}/drain"))
        .bearer(ADMIN)
        .send(http)
        .expect("drain");
    assert_eq!(drain.status, 200, "{}", drain.text());
    let new = start(&s.dir, s.ports, true);
    let mut old = s.old;
    assert!(wait_exit(&mut old, Duration::from_secs(30)).is_some());
    assert_eq!(get(http), before, "{}", new.log_text());
    assert_eq!(draining(http), vec![(peer, true)], "{}", new.log_text());
    // The alias the carried policy declares is served (drained agent:
    // no agent takes it, so a 503, not the 404 of an unknown model).
    let (st, body) = Req::chat("mm")
        .bearer(KEY)
        .send(http)
        .map(Resp::pair)
        .expect("chat");
    assert_ne!(st, 404, "{}", String::from_utf8_lossy(&body));
}
