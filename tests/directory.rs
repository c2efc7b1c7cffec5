//! The model directory and agent presence: preambles that never register
//! leave nothing behind; a model whose agents all left is not found (404)
//! and leaves the model lists; a silent link is removed after
//! `--remove-after`; the router keeps one identity and agents can pin it.

mod common;
use common::*;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use shards::runtime::wire::executor::{run_on_runtime, DriverChoice};

fn shard_requests(metrics: u16) -> Vec<f64> {
    let t = metrics_text(metrics);
    let mut v: Vec<(String, f64)> = t
        .lines()
        .filter(|l| l.starts_with("hivenet_shard_requests_total{"))
        .filter_map(|l| {
            let (k, n) = l.rsplit_once(' ')?;
            Some((k.to_string(), n.parse().ok()?))
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v.into_iter().map(|(_, n)| n).collect()
}

fn chat_status(http: u16, model: &str) -> (u16, serde_json::Value) {
    let body = format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}"#);
    let (st, b) = Req::post("/v1/chat/completions", &body)
        .send(http)
        .map(Resp::pair)
        .expect("request");
    (st, serde_json::from_slice(&b).unwrap_or_default())
}

/// The shard that served one request for `model`.
fn owner_of(r: &Router, model: &str) -> usize {
    let before = shard_requests(r.metrics);
    assert_eq!(chat_status(r.http, model).0, 200);
    let after = shard_requests(r.metrics);
    let moved: Vec<usize> = (0..after.len())
        .filter(|i| after[*i] > before.get(*i).copied().unwrap_or(0.0))
        .collect();
    assert_eq!(moved.len(), 1, "{before:?} -> {after:?}");
    moved[0]
}

#[test]
fn unregistered_preambles_leave_no_reservation() {
    let dir = tmpdir("reservations");
    let r = start_router(&dir, &["--shards", "2"], &[]);
    // 2,000 links that name a random model and close before registering.
    for i in 0..2000u32 {
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", r.p2p)) else {
            continue;
        };
        let model = format!("junk-{i}-{:x}", rand_word(i));
        let _ = std::io::Write::write_all(&mut s, &shards::logic::link::preamble::encode(&model));
    }
    wait_until(
        Duration::from_secs(20),
        || metric(r.metrics, "hivenet_directory_models{state=\"reserved\"}") == Some(0.0),
        "every reservation released",
    );
    let t = metrics_text(r.metrics);
    assert!(
        t.contains("hivenet_directory_models{state=\"live\"} 0"),
        "no junk name is live: {}",
        t.lines()
            .filter(|l| l.starts_with("hivenet_directory_models"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // Two real agents for two new models land on different shards.
    let (_s1, p1) = start_sim(&dir, "real-a", &[]);
    let (_s2, p2) = start_sim(&dir, "real-b", &[]);
    let _a = start_agent(&dir, &r, p1, "a.key", &[]);
    wait_agents(r.http, "real-a", 1);
    let _b = start_agent(&dir, &r, p2, "b.key", &[]);
    wait_agents(r.http, "real-b", 1);
    assert_ne!(owner_of(&r, "real-a"), owner_of(&r, "real-b"));
}

fn rand_word(i: u32) -> u64 {
    // A cheap varied suffix (no rand dependency in the tests).
    u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xDEAD_BEEF
}

#[test]
fn a_model_whose_agents_left_is_not_found() {
    let dir = tmpdir("gone");
    let r = start_router(&dir, &["--shards", "2"], &[]);
    let (_s, port) = start_sim(&dir, "gone-model", &[]);
    let mut a = start_agent(&dir, &r, port, "gone.key", &[]);
    wait_agents(r.http, "gone-model", 1);
    assert_eq!(chat_status(r.http, "gone-model").0, 200);
    a.kill9();
    wait_until(
        Duration::from_secs(5),
        || chat_status(r.http, "gone-model").0 == 404,
        "404 once the last agent left",
    );
    let (st, v) = chat_status(r.http, "gone-model");
    assert_eq!(st, 404);
    assert_eq!(v["error"]["code"], "model_not_found", "{v}");
    let (_, list) = Req::get("/v1/models")
        .send(r.http)
        .map(Resp::pair)
        .expect("models");
    assert!(
        !String::from_utf8_lossy(&list).contains("gone-model"),
        "left the list"
    );
    let (st, _) = Req::get("/v1/models/gone-model")
        .send(r.http)
        .map(Resp::pair)
        .expect("detail");
    assert_eq!(st, 404);
    // The agent comes back: found again, on the same shard as before.
    let _b = start_agent(&dir, &r, port, "gone.key", &[]);
    wait_agents(r.http, "gone-model", 1);
    assert_eq!(chat_status(r.http, "gone-model").0, 200);
}

#[test]
fn an_unhealthy_agents_model_is_listed_with_its_health() {
    let dir = tmpdir("unhealthy-listed");
    let r = start_router(&dir, &["--shards", "1"], &[]);
    let (mut sim, port) = start_sim(&dir, "sick-model", &[]);
    let _a = start_agent(
        &dir,
        &r,
        port,
        "sick.key",
        &["--hardware-sample-interval", "100ms"],
    );
    wait_agents(r.http, "sick-model", 1);
    sim.kill9();
    wait_until(
        Duration::from_secs(10),
        || healthy_agents(r.http, "sick-model") == 0,
        "reported unhealthy",
    );
    let (_, list) = Req::get("/v1/models")
        .send(r.http)
        .map(Resp::pair)
        .expect("models");
    let v: serde_json::Value = serde_json::from_slice(&list).expect("json");
    let m = v["data"]
        .as_array()
        .and_then(|a| a.iter().find(|m| m["id"] == "sick-model"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(m["agents"]["total"], 1, "listed while registered: {v}");
    assert_eq!(m["agents"]["healthy"], 0, "{v}");
    let (st, _) = Req::get("/v1/models/sick-model")
        .send(r.http)
        .map(Resp::pair)
        .expect("detail");
    assert_eq!(st, 200);
    let (st, v) = chat_status(r.http, "sick-model");
    assert_eq!(st, 503, "registered but unhealthy: {v}");
    assert_eq!(v["error"]["code"], "no_agents_available");
}

#[test]
fn a_silent_link_is_removed_after_remove_after() {
    let dir = tmpdir("remove-after");
    let r = start_router(
        &dir,
        &[
            "--shards",
            "1",
            "--heartbeat-interval",
            "200ms",
            "--remove-after",
            "1500ms",
        ],
        &[],
    );
    let p2p = r.p2p;
    let (tx, rx) = std::sync::mpsc::channel::<Duration>();
    // Registers, then never sends another frame; reports when the router
    // closes the link.
    let silent = std::thread::spawn(move || {
        run_on_runtime(DriverChoice::Auto, |_| async move {
            let kp = libp2p_identity::Keypair::generate_ed25519();
            let started = std::time::Instant::now();
            let Some(l) = raw_register(p2p, &kp, "quiet-model").await else {
                return;
            };
            let _ = monoio::time::timeout(Duration::from_secs(10), l.closed).await;
            let _ = tx.send(started.elapsed());
            drop(l.ctl);
        });
    });
    wait_until(
        Duration::from_secs(5),
        || routing_table(r.http)["total"] == 1,
        "registration",
    );
    wait_until(
        Duration::from_secs(5),
        || routing_table(r.http)["total"] == 0,
        "removed after --remove-after",
    );
    let closed_after = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("link closed by the router");
    assert!(
        closed_after >= Duration::from_millis(1400) && closed_after < Duration::from_secs(5),
        "closed after {closed_after:?}"
    );
    let _ = silent.join();
    assert!(r.proc.log_text().contains("--remove-after"));
    let (st, _) = chat_status(r.http, "quiet-model");
    assert_eq!(st, 404);
}

fn router_peer_id(p: &Proc) -> String {
    let log = p.log_text();
    log.lines()
        .find(|l| l.contains("hivenet-router starting"))
        .and_then(|l| l.split("peer_id=").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or("")
        .to_string()
}

#[test]
fn router_identity_is_kept_and_agents_can_pin_it() {
    let dir = tmpdir("router-identity");
    let key = dir.join("id/router.key");
    let keys = key.to_string_lossy().to_string();
    let mut r = start_router(&dir, &["--shards", "1", "--identity-path", &keys], &[]);
    let first = router_peer_id(&r.proc);
    assert!(first.starts_with("12D3KooW"), "{first}");
    let mode = std::fs::metadata(&key).expect("key").permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let (http, metrics, p2p) = (r.http, r.metrics, r.p2p);
    r.proc.kill9();
    let proc = router_on(
        &dir,
        (http, metrics, p2p),
        &["--shards", "1", "--identity-path", &keys],
    );
    assert_eq!(router_peer_id(&proc), first, "same identity after restart");
    let (_s, port) = start_sim(&dir, "pinned", &[]);
    let bu = format!("http://127.0.0.1:{port}");
    // An agent that expects another router refuses this one.
    let other = libp2p_identity::Keypair::generate_ed25519()
        .public()
        .to_peer_id();
    let wrong = format!("/ip4/127.0.0.1/tcp/{p2p}/p2p/{other}");
    let wk = dir.join("w.key").to_string_lossy().to_string();
    let w = spawn(
        "hivenet-agent",
        &[
            "--router-p2p",
            &wrong,
            "--backend-url",
            &bu,
            "--identity-path",
            &wk,
        ],
        &dir,
        &[],
    );
    wait_until(
        Duration::from_secs(15),
        || w.log_text().contains("refusing it"),
        "agent refuses the unexpected router",
    );
    assert_eq!(healthy_agents(http, "pinned"), 0);
    // The right peer ID registers.
    let right = format!("/ip4/127.0.0.1/tcp/{p2p}/p2p/{first}");
    let rk = dir.join("r.key").to_string_lossy().to_string();
    let _a = spawn(
        "hivenet-agent",
        &[
            "--router-p2p",
            &right,
            "--backend-url",
            &bu,
            "--identity-path",
            &rk,
        ],
        &dir,
        &[],
    );
    wait_agents(http, "pinned", 1);
    drop(proc);
}

/// Issue 29 #2 (the probe: 3 rounds of 2,000 names took /metrics from 2.4
/// to 7.4 MiB): a model whose agents all left is forgotten after
/// `--remove-after`, its series with it, so `/metrics` comes back to its
/// size; a model whose agent comes back later starts afresh.
#[test]
fn models_without_agents_are_forgotten_with_their_series() {
    let dir = tmpdir("forget-models");
    let r = start_router(&dir, &["--shards", "2", "--remove-after", "2s"], &[]);
    let baseline = metrics_text(r.metrics).len();
    let models = ["gone-a", "gone-b", "gone-c"];
    let mut agents = Vec::new();
    let mut sims = Vec::new();
    for (i, m) in models.iter().enumerate() {
        let (s, port) = start_sim(&dir, m, &[]);
        agents.push(start_agent(&dir, &r, port, &format!("{i}.key"), &[]));
        sims.push(s);
        wait_agents(r.http, m, 1);
        assert_eq!(chat_status(r.http, m).0, 200);
    }
    let live = metrics_text(r.metrics);
    assert!(live.contains("model=\"gone-b\""));
    for a in &mut agents {
        a.kill9();
    }
    wait_until(
        Duration::from_secs(20),
        || {
            let t = metrics_text(r.metrics);
            !t.contains("model=\"gone-") && t.contains("hivenet_directory_models{state=\"idle\"} 0")
        },
        "every series of the gone models dropped",
    );
    let after = metrics_text(r.metrics).len();
    // Back to within the size of a few lines of its start (gauges and
    // counters of the router itself move).
    assert!(
        after < baseline + 4096,
        "/metrics {baseline} -> {} -> {after} bytes",
        live.len()
    );
    assert_eq!(chat_status(r.http, "gone-a").0, 404);
    // The name comes back with an agent, counters from zero.
    let (_s, port) = start_sim(&dir, "gone-a", &[]);
    let _a = start_agent(&dir, &r, port, "again.key", &[]);
    wait_agents(r.http, "gone-a", 1);
    assert_eq!(chat_status(r.http, "gone-a").0, 200);
}
