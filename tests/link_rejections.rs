//! Agent-link refusals: garbage or oversize preamble, wrong swarm key,
//! registration naming another model or another peer. Each closes the
//! connection, logs the reason and registers nothing.

mod common;
use common::*;
use std::time::Duration;

use futures::AsyncWriteExt;
use shards::logic::link::control::{ControlMsg, Registration};
use shards::runtime::wire::executor::{run_on_runtime, DriverChoice};
use shards::runtime::wire::link;

fn write_key(dir: &std::path::Path, name: &str, hex: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, format!("/key/swarm/psk/1.0.0/\n/base16/\n{hex}\n")).expect("key");
    p.to_string_lossy().to_string()
}

const K1: &str = "1111111111111111111111111111111111111111111111111111111111111111";
const K2: &str = "2222222222222222222222222222222222222222222222222222222222222222";

fn rejected(r: &Router) -> f64 {
    let t = metrics_text(r.metrics);
    t.lines()
        .filter(|l| l.starts_with("hivenet_agent_links_rejected_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn garbage_and_oversize_preambles_are_refused() {
    let dir = tmpdir("preamble");
    let r = start_router(&dir, &["--shards", "1"], &[]);
    let resp = raw(
        r.p2p,
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        Duration::from_secs(3),
    );
    assert!(resp.is_empty(), "closed without an answer");
    let resp = raw(r.p2p, b"HVNP\x01\xff\xff", Duration::from_secs(3));
    assert!(resp.is_empty());
    wait_until(
        Duration::from_secs(5),
        || rejected(&r) >= 2.0,
        "two refusals counted",
    );
    let log = r.proc.log_text();
    assert!(log.contains("garbage preamble"), "{log}");
    assert!(log.contains("exceeds 256"), "{log}");
    let (_, models) = Req::get("/v1/models")
        .send(r.http)
        .map(Resp::pair)
        .expect("models");
    assert_eq!(
        String::from_utf8_lossy(&models),
        r#"{"data":[],"object":"list"}"#
    );
}

#[test]
fn wrong_swarm_key_is_refused_and_right_key_registers() {
    let dir = tmpdir("pnet");
    let k1 = write_key(&dir, "k1.key", K1);
    let k2 = write_key(&dir, "k2.key", K2);
    let r = start_router(&dir, &["--shards", "1", "--swarm-key-file", &k1], &[]);
    let (_s, port) = start_sim(&dir, "psk-model", &[]);
    let mut bad = start_agent(&dir, &r, port, "bad.key", &["--swarm-key-file", &k2]);
    wait_until(
        Duration::from_secs(10),
        || rejected(&r) >= 1.0,
        "wrong-key refusal",
    );
    assert_eq!(healthy_agents(r.http, "psk-model"), 0, "nothing registered");
    assert!(
        r.proc.log_text().contains("agent link refused"),
        "{}",
        r.proc.log_text()
    );
    bad.kill9();
    let _good = start_agent(&dir, &r, port, "good.key", &["--swarm-key-file", &k1]);
    wait_agents(r.http, "psk-model", 1);
}

/// Dial in-process with full control of what the registration says.
fn register_as(
    p2p: u16,
    preamble_model: &str,
    reg_model: &str,
    fake_peer: bool,
) -> Result<String, String> {
    let mut out = Err("not run".to_string());
    run_on_runtime(DriverChoice::Auto, |_| async {
        let kp = libp2p_identity::Keypair::generate_ed25519();
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], p2p));
        let res = async {
            let (_, conn) = link::dial(addr, preamble_model, None, &kp)
                .await
                .map_err(|e| e.to_string())?;
            let (h, _inb, _closed) = link::spawn_driver(conn);
            let mut ctl = h
                .open(link::CONTROL_PROTOCOL)
                .await
                .map_err(|e| e.to_string())?;
            let peer_id = if fake_peer {
                libp2p_identity::Keypair::generate_ed25519()
                    .public()
                    .to_peer_id()
                    .to_string()
            } else {
                kp.public().to_peer_id().to_string()
            };
            let reg = Registration {
                peer_id,
                model: reg_model.into(),
                engine: "vllm".into(),
                capacity: 1,
                ..Default::default()
            };
            link::write_frame(&mut ctl, &ControlMsg::Register(reg))
                .await
                .map_err(|e| e.to_string())?;
            let mut ctl = shards::runtime::wire::conn::Conn::over(ctl, Vec::new());
            let reply = ctl.read_frame().await.map_err(|e| e.to_string())?;
            let _ = ctl.stream.close().await;
            match reply {
                Some(ControlMsg::Rejected { reason }) => Err(reason),
                Some(ControlMsg::Registered { .. }) => Ok("registered".to_string()),
                other => Err(format!("unexpected {other:?}")),
            }
        }
        .await;
        out = res;
    });
    out
}

#[test]
fn registration_must_match_preamble_and_identity() {
    let dir = tmpdir("register");
    let r = start_router(&dir, &["--shards", "2"], &[]);
    let e = register_as(r.p2p, "model-p", "model-q", false).expect_err("other model refused");
    assert!(e.contains("preamble named"), "{e}");
    let e = register_as(r.p2p, "model-p", "model-p", true).expect_err("other peer refused");
    assert!(e.contains("noise identity"), "{e}");
    assert_eq!(healthy_agents(r.http, "model-p"), 0);
    assert_eq!(healthy_agents(r.http, "model-q"), 0);
    assert_eq!(
        register_as(r.p2p, "model-p", "model-p", false).expect("valid registration"),
        "registered"
    );
}

#[test]
fn slow_preamble_and_stalled_handshake_are_cut() {
    let dir = tmpdir("linktimeouts");
    let r = start_router(
        &dir,
        &[
            "--shards",
            "1",
            "--preamble-timeout",
            "300ms",
            "--handshake-timeout",
            "300ms",
        ],
        &[],
    );
    // Nothing at all: closed after the preamble timeout.
    let t = std::time::Instant::now();
    let resp = raw(r.p2p, b"", Duration::from_secs(5));
    assert!(resp.is_empty());
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "closed by the router, not by our 5 s wait: {:?}",
        t.elapsed()
    );
    // A valid preamble, then silence: closed after the handshake timeout.
    let t = std::time::Instant::now();
    let resp = raw(
        r.p2p,
        &shards::logic::link::preamble::encode("t-model"),
        Duration::from_secs(5),
    );
    assert!(
        resp.is_empty(),
        "no bytes before the noise handshake from our side"
    );
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    wait_until(
        Duration::from_secs(3),
        || rejected(&r) >= 2.0,
        "both counted",
    );
    let log = r.proc.log_text();
    assert!(log.contains("no preamble within"), "{log}");
    assert!(log.contains("handshake or registration timed out"), "{log}");
}

#[test]
fn garbage_after_a_valid_preamble_is_cut_at_once_and_refusals_are_rate_logged() {
    let dir = tmpdir("preamble-garbage");
    let r = start_router(&dir, &["--shards", "1", "--handshake-timeout", "10s"], &[]);
    // A valid preamble, then an HTTP request instead of a noise handshake.
    let mut bytes = shards::logic::link::preamble::encode("some-model");
    bytes.extend_from_slice(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    let t = std::time::Instant::now();
    let resp = raw(r.p2p, &bytes, Duration::from_secs(12));
    assert!(resp.is_empty());
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "cut after {:?}, not at the handshake timeout",
        t.elapsed()
    );
    assert!(r.proc.log_text().contains("not a noise handshake"));
    // 300 garbage preambles: one log line per second per reason, with a count.
    for _ in 0..300 {
        let _ = raw(r.p2p, b"GARBAGE!", Duration::from_millis(200));
    }
    wait_until(
        Duration::from_secs(5),
        || rejected(&r) >= 301.0,
        "every refusal counted",
    );
    let lines = r
        .proc
        .log_text()
        .lines()
        .filter(|l| l.contains("garbage preamble"))
        .count();
    assert!(lines <= 10, "{lines} log lines for 300 refusals");
}

/// Issue 51 ("log lines caused by a peer are rate-limited everywhere"): a
/// peer that registers and leaves in a loop (same identity, 60 times)
/// writes at most a line a second per event with the count, not three
/// lines a cycle.
#[test]
fn a_peer_registering_in_a_loop_cannot_flood_the_log() {
    let dir = tmpdir("register-churn");
    let r = start_router(&dir, &["--shards", "1"], &[]);
    let t0 = std::time::Instant::now();
    let mut registered = 0;
    run_on_runtime(DriverChoice::Auto, |_| async {
        let kp = libp2p_identity::Keypair::generate_ed25519();
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], r.p2p));
        for _ in 0..60 {
            let Ok((_, conn)) = link::dial(addr, "churn-model", None, &kp).await else {
                continue;
            };
            let (h, _inb, _closed) = link::spawn_driver(conn);
            let Ok(mut ctl) = h.open(link::CONTROL_PROTOCOL).await else {
                continue;
            };
            let reg = Registration {
                peer_id: kp.public().to_peer_id().to_string(),
                model: "churn-model".into(),
                engine: "vllm".into(),
                capacity: 1_000_000,
                ..Default::default()
            };
            if link::write_frame(&mut ctl, &ControlMsg::Register(reg))
                .await
                .is_err()
            {
                continue;
            }
            let mut ctl = shards::runtime::wire::conn::Conn::over(ctl, Vec::new());
            if let Ok(Some(ControlMsg::Registered { .. })) = ctl.read_frame().await {
                registered += 1;
            }
            let _ = ctl.stream.close().await;
            h.close();
        }
    });
    let secs = t0.elapsed().as_secs() + 2;
    assert!(registered >= 50, "{registered} of 60 registrations");
    std::thread::sleep(Duration::from_millis(500));
    let log = r.proc.log_text();
    let count = |needle: &str| log.lines().filter(|l| l.contains(needle)).count() as u64;
    for needle in [
        "agent registered",
        "agent left routing",
        "control stream",
        "capacity capped",
    ] {
        let n = count(needle);
        assert!(
            n <= secs + 1,
            "{n} lines of {needle:?} for {registered} cycles in {secs} s"
        );
    }
    assert!(count("agent registered") >= 1, "the first is said");
}

/// Issues 29 #1 and 51 #2: the caps of registered agents count only links
/// that finished their handshake (silent connections filled them and kept
/// agents out); beyond them a registration is refused with the cap's
/// reason, counted, and a closed link gives its place back. Connections
/// before their handshake have their own budget, refused at accept.
#[test]
fn links_are_capped_in_total_and_per_address() {
    let dir = tmpdir("link-caps");
    for (flags, kind) in [
        (
            [
                "--max-agent-links",
                "0",
                "--max-agent-links-per-address",
                "2",
            ],
            "address_cap",
        ),
        (
            [
                "--max-agent-links",
                "2",
                "--max-agent-links-per-address",
                "0",
            ],
            "link_cap",
        ),
    ] {
        let mut args = vec!["--shards", "2"];
        args.extend(flags);
        let r = start_router(&dir, &args, &[]);
        // Ten silent connections: not registered agents, they take no place.
        let silent: Vec<_> = (0..10)
            .map(|_| std::net::TcpStream::connect(("127.0.0.1", r.p2p)).expect("silent"))
            .collect();
        let p2p = r.p2p;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            run_on_runtime(DriverChoice::Auto, |_| async move {
                let mut links = Vec::new();
                let mut out = Vec::new();
                for i in 0..3 {
                    let kp = libp2p_identity::Keypair::generate_ed25519();
                    let l = raw_register(p2p, &kp, &format!("capped-{i}")).await;
                    out.push(l.as_ref().and_then(|l| l.reply.clone()));
                    links.extend(l);
                }
                // The first link closes: its place comes back.
                if let Some(l) = links.first() {
                    l.handle.close();
                }
                monoio::time::sleep(Duration::from_millis(300)).await;
                let kp = libp2p_identity::Keypair::generate_ed25519();
                let again = raw_register(p2p, &kp, "capped-3").await;
                out.push(again.as_ref().and_then(|l| l.reply.clone()));
                for l in &links {
                    l.handle.close();
                }
                monoio::time::sleep(Duration::from_millis(100)).await;
                let _ = tx.send(out);
            })
        })
        .join()
        .expect("registrations");
        let replies = rx.recv().expect("replies");
        let registered = |r: &Option<ControlMsg>| matches!(r, Some(ControlMsg::Registered { .. }));
        assert!(
            registered(&replies[0]) && registered(&replies[1]),
            "{kind}: {replies:?}"
        );
        assert!(
            matches!(&replies[2], Some(ControlMsg::Rejected { reason }) if reason.contains("agent links registered")),
            "{kind}: the third is refused with the cap's reason: {replies:?}"
        );
        assert!(
            registered(&replies[3]),
            "{kind}: a place came back: {replies:?}"
        );
        let by_reason = metric(
            r.metrics,
            &format!("hivenet_agent_link_refusals_total{{reason=\"{kind}\"}}"),
        )
        .unwrap_or(0.0);
        assert!(by_reason >= 1.0, "{kind} counted by reason");
        drop(silent);
    }
    // The budget before the handshake: two silent connections from this
    // address fill it; a third cuts the oldest (counted), so the first is
    // closed by the router.
    let r = start_router(
        &dir,
        &[
            "--shards",
            "2",
            "--max-pending-agent-links-per-address",
            "2",
        ],
        &[],
    );
    let mut s1 = std::net::TcpStream::connect(("127.0.0.1", r.p2p)).expect("c1");
    std::thread::sleep(Duration::from_millis(100));
    let s2 = std::net::TcpStream::connect(("127.0.0.1", r.p2p)).expect("c2");
    std::thread::sleep(Duration::from_millis(100));
    let before = rejected(&r);
    let s3 = std::net::TcpStream::connect(("127.0.0.1", r.p2p)).expect("c3");
    wait_until(
        Duration::from_secs(5),
        || rejected(&r) > before,
        "eviction counted",
    );
    s1.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut b = [0u8; 1];
    assert_eq!(
        std::io::Read::read(&mut s1, &mut b).ok(),
        Some(0),
        "the oldest is closed"
    );
    assert!(
        r.proc.log_text().contains("pending_evicted"),
        "{}",
        r.proc.log_text()
    );
    drop((s2, s3));
}

/// Issue 29 #4 (the probe: with a lowered descriptor limit, 3,000 silent
/// p2p connections starved HTTP): the caps are fitted to `ulimit -n` at
/// start (said in the log), so a flood of silent agent connections is
/// refused past the link cap and HTTP keeps answering.
#[test]
fn connection_caps_fit_the_descriptor_limit() {
    let dir = tmpdir("nofile");
    let (http, metrics, p2p) = (free_port(), free_port(), free_port());
    let log = dir.join("router.log");
    let cmd = format!(
        "ulimit -n 600 && exec {} --shards 1 --http-port 127.0.0.1:{http} --metrics-port 127.0.0.1:{metrics} --p2p-port {p2p} >{} 2>&1",
        bin("hivenet-router").display(),
        log.display()
    );
    let child = std::process::Command::new("sh")
        .arg("-c")
        .arg(&cmd)
        .current_dir(&dir)
        .env("HIVENET_ROUTER_ALLOW_INSECURE_ADMIN", "true")
        .spawn()
        .expect("sh");
    let _router = Proc {
        child,
        name: "hivenet-router".into(),
        log: log.clone(),
    };
    wait_until(
        Duration::from_secs(20),
        || {
            Req::get("/health")
                .send(http)
                .map(|r| r.status == 200)
                .unwrap_or(false)
        },
        "router up",
    );
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(text.contains("caps lowered to fit"), "{text}");
    // 400 silent agent connections: the link cap (a quarter of 472) takes
    // some, the rest are closed at once.
    let silent: Vec<_> = (0..400)
        .filter_map(|_| std::net::TcpStream::connect(("127.0.0.1", p2p)).ok())
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    for _ in 0..20 {
        assert_eq!(
            Req::get("/health")
                .send(http)
                .map(|r| r.status)
                .unwrap_or(0),
            200,
            "HTTP starved"
        );
    }
    let m = metrics_text(metrics);
    let refused: f64 = m
        .lines()
        .filter(|l| l.starts_with("hivenet_agent_links_rejected_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(refused >= 250.0, "refused {refused}");
    drop(silent);
}
