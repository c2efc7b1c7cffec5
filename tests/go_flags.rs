//! Issue 56: a Go router user's files start unchanged. Every flag of the
//! spec's router table (06 §1, plus the hold-at-zero seed's) and agent
//! table (03 §11) on one command line starts both binaries; the flags
//! that carry meaning here take effect (announce address, per-address
//! link cap, unhealthy-after, hide_llm / pretty name / info), the others
//! are named in one warning each with what replaces them.

mod common;
use common::*;
use std::time::Duration;

#[test]
fn every_flag_of_the_spec_tables_starts_router_and_agent() {
    let dir = tmpdir("go-flags");
    let (http, metrics, p2p) = (free_port(), free_port(), free_port());
    let grpc = free_port();
    let d = |name: &str| dir.join(name).to_string_lossy().to_string();
    std::fs::write(dir.join("jwt.secret"), "0123456789abcdef0123456789abcdef").expect("jwt");
    std::fs::create_dir_all(dir.join("policies")).expect("policies");
    std::fs::write(
        dir.join("policy.yaml"),
        "routing_policy:\n  strategy: least-loaded\n",
    )
    .expect("policy");
    std::fs::write(dir.join("auth.yaml"), "api:\n  mode: none\n").expect("auth");
    let (http_s, metrics_s, p2p_s, grpc_s) = (
        format!(":{http}"),
        format!("127.0.0.1:{metrics}"),
        p2p.to_string(),
        format!(":{grpc}"),
    );
    let announce = format!("/ip4/127.0.0.1/tcp/{p2p}");
    let (db, pol, pdir, jwt, auth) = (
        d("db"),
        d("policy.yaml"),
        d("policies"),
        d("jwt.secret"),
        d("auth.yaml"),
    );
    let router_args = [
        "--http-port",
        &http_s,
        "--grpc-port",
        &grpc_s,
        "--metrics-port",
        &metrics_s,
        "--p2p-port",
        &p2p_s,
        "--p2p-listen-addr",
        "127.0.0.1",
        "--p2p-announce-addr",
        &announce,
        "--p2p-max-conns-per-ip",
        "32",
        "--queue-size",
        "100",
        "--request-timeout",
        "60s",
        "--health-check-interval",
        "5s",
        "--unhealthy-after",
        "15s",
        "--remove-after",
        "30s",
        "--heartbeat-interval",
        "5s",
        "--disk-db-path",
        &db,
        "--reset-disk-db=false",
        "--disk-db-ttl",
        "30",
        "--universal-flush-interval",
        "30s",
        "--max-concurrent",
        "50",
        "--policy-file",
        &pol,
        "--policy-model-dir",
        &pdir,
        "--max-tries-per-step",
        "3",
        "--queue-depth",
        "30",
        "--session-ttl",
        "1h",
        "--jwt-secret-file",
        &jwt,
        "--auth-config-file",
        &auth,
        "--site-id",
        "eu-1",
        "--wake-hold-budget",
        "5m",
        "--wake-hold-max-per-key",
        "32",
        "--wake-hold-max-per-model",
        "512",
        "--wake-hold-max-total",
        "268435456",
        "--wake-keepalive",
        "15s",
        "--shards",
        "1",
    ];
    let router = spawn("hivenet-router", &router_args, &dir, &[]);
    wait_until(
        Duration::from_secs(20),
        || {
            Req::get("/health")
                .send(http)
                .map(|r| r.status == 200)
                .unwrap_or(false)
        },
        "router up with every Go flag",
    );
    let (_sim, port) = start_sim(&dir, "m", &[]);
    let backend = format!("http://127.0.0.1:{port}");
    let health = format!("{backend}/health");
    let router_p2p = format!("/ip4/127.0.0.1/tcp/{p2p}");
    let id = d("agent.key");
    let gpus = d("gpus.txt");
    std::fs::write(&gpus, "all\n").expect("gpus");
    let agent_args = [
        "--engine",
        "vllm",
        "--backend-url",
        &backend,
        "--model",
        "m",
        "--health-url",
        &health,
        "--capacity",
        "10",
        "--capability",
        "llm",
        "--version",
        "1.2.3",
        "--region",
        "UE-France",
        "--organization",
        "Org",
        "--machine",
        "box",
        "--tags",
        "production,a",
        "--router-grpc",
        "localhost:50051",
        "--router-p2p",
        &router_p2p,
        "--http-timeout",
        "120s",
        "--stream-write-timeout",
        "60s",
        "--identity-path",
        &id,
        "--p2p-listen-port",
        "0",
        "--hardware-sample-interval",
        "2s",
        "--engine-sample-interval",
        "500ms",
        "--routing-signal-interval",
        "500ms",
        "--jwt-secret-file",
        &jwt,
        "--gpu-devices-file",
        &gpus,
        "--gpu-model",
        "NVIDIA H100",
        "--deployment-id",
        "dep",
        "--replica-id",
        "rep",
        "--hide-llm",
        "--llm-pretty-name",
        "Model M",
        "--llm-info",
        "a test model",
        "--warmup",
        "off",
    ];
    let agent = spawn("hivenet-agent", &agent_args, &dir, &[]);
    wait_agents(http, "m", 1);
    // The flags with meaning took effect.
    let (status, body) = Req::get("/v1/models").send(http).expect("models").pair();
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(status, 200);
    let m = &v["data"][0];
    assert_eq!(m["pretty_name"], "Model M", "{v}");
    assert_eq!(m["info"], "a test model", "{v}");
    assert_eq!(m["hide_llm"], true, "{v}");
    let t = routing_table(http);
    let meta = &t["agents"][0]["metadata"];
    assert_eq!(meta["llm_pretty_name"], "Model M", "{t}");
    assert_eq!(meta["hide_llm"], true, "{t}");
    assert_eq!(meta["gpu_model"], "NVIDIA H100", "{t}");
    let (s, _) = Req::chat("m").send(http).expect("chat").pair();
    assert_eq!(s, 200);
    // The others: one warning each, naming what replaces it.
    let rlog = router.log_text();
    for flag in [
        "--grpc-port",
        "--queue-size",
        "--health-check-interval",
        "--max-concurrent",
        "--session-ttl",
        "--jwt-secret-file",
    ] {
        let n = rlog
            .lines()
            .filter(|l| l.contains(&format!("{flag} is a Go router flag")))
            .count();
        assert_eq!(n, 1, "one warning for {flag}:\n{rlog}");
    }
    assert!(
        rlog.contains("agents of other hosts dial --router-p2p"),
        "the announce address is logged:\n{rlog}"
    );
    let alog = agent.log_text();
    for flag in ["--router-grpc", "--jwt-secret-file", "--p2p-listen-port"] {
        assert!(
            alog.contains(&format!("{flag} is a Go agent flag")),
            "{flag}:\n{alog}"
        );
    }
}

/// A loopback p2p bind announced to other hosts can never link an agent:
/// refused at start with one line (the shipped kit's failure, issue 56).
#[test]
fn a_loopback_bind_announced_to_other_hosts_is_refused() {
    let dir = tmpdir("go-flags-announce");
    let args = [
        "--p2p-listen-addr",
        "127.0.0.1",
        "--p2p-announce-addr",
        "/ip4/10.1.2.3/tcp/9000",
    ];
    let child = std::process::Command::new(bin("hivenet-router"))
        .args(args)
        .current_dir(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let (code, err) = exit_within(child, Duration::from_secs(10));
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--p2p-listen-addr 127.0.0.1 is loopback"),
        "{err}"
    );
    // A bad multiaddr is fatal too (spec 06).
    let child = std::process::Command::new(bin("hivenet-router"))
        .args(["--p2p-announce-addr", "10.1.2.3:9000"])
        .current_dir(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let (code, err) = exit_within(child, Duration::from_secs(10));
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--p2p-announce-addr"), "{err}");
}

/// `--unhealthy-after` takes effect: agents heartbeat every 2 s (three
/// missed: 6 s), and 1 s after the last one the agent is unhealthy.
#[test]
fn unhealthy_after_sets_the_missed_heartbeat_window() {
    let dir = tmpdir("go-flags-unhealthy");
    let r = start_router(
        &dir,
        &[
            "--shards",
            "1",
            "--heartbeat-interval",
            "2s",
            "--unhealthy-after",
            "2500ms",
        ],
        &[],
    );
    let (mut sim, port) = start_sim(&dir, "u", &[]);
    let mut a = start_agent(&dir, &r, port, "u.key", &[]);
    wait_agents(r.http, "u", 1);
    // SIGSTOP the agent: its link stays open, its heartbeats stop.
    signal(&a, "STOP");
    let t0 = std::time::Instant::now();
    wait_until(
        Duration::from_secs(10),
        || healthy_agents(r.http, "u") == 0,
        "unhealthy after --unhealthy-after",
    );
    let took = t0.elapsed();
    signal(&a, "CONT");
    // At most 2.5 s after the last heartbeat (sent at most 2 s before
    // the stop), far below the 6 s of three heartbeats.
    assert!(took < Duration::from_millis(4500), "not 3 x 2 s: {took:?}");
    a.kill9();
    sim.kill9();
}
