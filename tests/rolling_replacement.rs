//! A Kubernetes-style rolling replacement (issue 54), scaled down: two
//! routers share Redis (`--shared-state`), every agent links to both,
//! clients go through a "Service" that sends each new connection to a
//! ready router (`/ready`), and one router is replaced: SIGTERM, it leaves
//! the Service at once (`/ready` 503), finishes its streams, keeps its
//! held requests until their agent (linked to both) wakes them, exits; a
//! new router takes its ports. No stream cut, no held request lost or
//! failed, no connection refused.

mod common;
use common::hold::{chat_on, push_at_zero, whole_stream, ADMIN};
use common::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn router(dir: &std::path::Path, ports: (u16, u16, u16), redis: u16) -> Proc {
    let h = format!("127.0.0.1:{}", ports.0);
    let m = format!("127.0.0.1:{}", ports.1);
    let p = ports.2.to_string();
    let r = format!("redis://127.0.0.1:{redis}/0");
    let p = spawn(
        "hivenet-router",
        &[
            "--http-port",
            &h,
            "--metrics-port",
            &m,
            "--p2p-port",
            &p,
            "--shards",
            "2",
            "--site-id",
            "a",
            "--shared-state",
            &r,
            "--drain-timeout",
            "30s",
        ],
        dir,
        &[("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN)],
    );
    wait_until(Duration::from_secs(20), || ready(ports.0), "router ready");
    p
}

fn ready(http: u16) -> bool {
    Req::get("/ready")
        .send(http)
        .map(Resp::pair)
        .is_ok_and(|(s, _)| s == 200)
}

/// The Service: the next ready router, in turn (what a Service's
/// endpoints do once a terminating pod's readiness fails).
struct Service {
    routers: Vec<u16>,
    next: AtomicUsize,
}

impl Service {
    fn pick(&self) -> u16 {
        for _ in 0..200 {
            let i = self.next.fetch_add(1, Ordering::Relaxed) % self.routers.len();
            let port = self.routers[i];
            if ready(port) {
                return port;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("no router ready");
    }
}

fn request(
    svc: &Service,
    model: &str,
    stream: bool,
    tokens: u32,
) -> std::io::Result<(String, String)> {
    chat_on(svc.pick(), None, model, stream, tokens)
}

#[test]
fn a_rolling_replacement_of_one_of_two_routers_loses_nothing() {
    let dir = tmpdir("rolling");
    let redis_port = free_port();
    let _redis = start_redis(&dir, redis_port);
    let pa = (free_port(), free_port(), free_port());
    let pb = (free_port(), free_port(), free_port());
    let (da, db) = (dir.join("a"), dir.join("b"));
    std::fs::create_dir_all(&da).expect("dir");
    std::fs::create_dir_all(&db).expect("dir");
    let mut a = router(&da, pa, redis_port);
    let mut b = router(&db, pb, redis_port);
    push_at_zero(pa.0, "z", "120s");
    push_at_zero(pb.0, "z", "120s");
    // Every agent links to both routers.
    let to_both = |sim: u16, key: &str| {
        let ra = format!("/ip4/127.0.0.1/tcp/{}", pa.2);
        let rb = format!("/ip4/127.0.0.1/tcp/{}", pb.2);
        let bu = format!("http://127.0.0.1:{sim}");
        let id = dir.join(key).to_string_lossy().to_string();
        spawn(
            "hivenet-agent",
            &[
                "--router-p2p",
                &ra,
                "--router-p2p",
                &rb,
                "--backend-url",
                &bu,
                "--identity-path",
                &id,
                "--capacity",
                "64",
            ],
            &dir,
            &[],
        )
    };
    let (_sim, sim_port) = start_sim(&dir, "m", &["--itl", "50ms", "--output-tokens", "60"]);
    let _agent = to_both(sim_port, "m.key");
    wait_agents(pa.0, "m", 1);
    wait_agents(pb.0, "m", 1);
    let svc = Arc::new(Service {
        routers: vec![pa.0, pb.0],
        next: AtomicUsize::new(0),
    });
    const STREAMS: usize = 8;
    const HELD: usize = 6;
    let streams: Vec<_> = (0..STREAMS)
        .map(|_| {
            let svc = svc.clone();
            std::thread::spawn(move || request(&svc, "m", true, 60))
        })
        .collect();
    let held: Vec<_> = (0..HELD)
        .map(|_| {
            let svc = svc.clone();
            std::thread::spawn(move || request(&svc, "z", true, 4))
        })
        .collect();
    let demand = |http: u16| metric_or_zero(http);
    wait_until(
        Duration::from_secs(10),
        || demand(pa.1) + demand(pb.1) == HELD as f64,
        "requests held on both",
    );
    assert!(demand(pa.1) > 0.0, "the router replaced holds some");
    let stop = Arc::new(AtomicBool::new(false));
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let opener = {
        let (stop, outcomes, svc) = (stop.clone(), outcomes.clone(), svc.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let r = request(&svc, "m", false, 2)
                    .map(|(h, _)| h.lines().next().unwrap_or_default().to_string());
                outcomes.lock().expect("lock").push(format!("{r:?}"));
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    // The pod is replaced: SIGTERM (after preStop), out of the Service.
    signal(&a, "TERM");
    wait_until(
        Duration::from_secs(5),
        || !ready(pa.0),
        "A leaves the Service",
    );
    // The model at zero wakes while A drains: its agent links to both.
    let (_zsim, zport) = start_sim(&dir, "z", &[]);
    let _zagent = to_both(zport, "z.key");
    for h in held {
        let (head, body) = h.join().expect("held").expect("held answer");
        assert!(head.starts_with("HTTP/1.1 200"), "held: {head}\n{body}");
        assert!(whole_stream(&body, 2), "held answer: {body}");
    }
    for s in streams {
        let (head, body) = s.join().expect("stream").expect("stream answer");
        assert!(head.starts_with("HTTP/1.1 200"), "stream: {head}");
        assert!(whole_stream(&body, 60), "a stream was cut: {body}");
    }
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30) {
        if let Ok(Some(st)) = a.child.try_wait() {
            assert!(st.success(), "{st:?}\n{}", a.log_text());
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        a.child.try_wait().ok().flatten().is_some(),
        "A did not exit"
    );
    // The new pod on A's ports; the agents come back to it.
    let mut a2 = router(&da, pa, redis_port);
    push_at_zero(pa.0, "z", "120s");
    wait_agents(pa.0, "m", 1);
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    opener.join().expect("opener");
    let outcomes = outcomes.lock().expect("lock").clone();
    assert!(outcomes.len() > 20, "{outcomes:?}");
    let bad: Vec<_> = outcomes.iter().filter(|o| !o.contains("200")).collect();
    assert!(bad.is_empty(), "connections failed: {bad:?}");
    sigterm(&mut a2);
    sigterm(&mut b);
}

fn metric_or_zero(metrics: u16) -> f64 {
    metric(metrics, "hivenet_pending_demand{model=\"z\"}").unwrap_or(0.0)
}
