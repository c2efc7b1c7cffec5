//! `hivenet-link-flood`: many registered agent links at once, each with a
//! fresh Ed25519 identity (noise + yamux, the agent's own dial code), to
//! measure the router's link caps and its memory per registered link.
//! Driven by `perf/2026-12-03-registered-links/links-registered.py`.
#![forbid(unsafe_code)]

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

use argh::FromArgs;
use shards::logic::link::control::{ControlMsg, Registration};
use shards::runtime::wire::conn::Conn;
use shards::runtime::wire::executor::{run_on_runtime, DriverChoice};
use shards::runtime::wire::link;

/// Open many agent links with fresh identities, register each, hold them.
#[derive(FromArgs)]
struct Args {
    /// router p2p address, e.g. 127.0.0.1:4001
    #[argh(option)]
    router: std::net::SocketAddr,
    /// swarm key file (the router's --swarm-key; none: no private network)
    #[argh(option)]
    swarm_key: Option<std::path::PathBuf>,
    /// links to open
    #[argh(option)]
    links: usize,
    /// dials in flight at once (default 64)
    #[argh(option, default = "64")]
    concurrency: usize,
    /// distinct model names, link i registers flood-(i mod models) (default 1)
    #[argh(option, default = "1")]
    models: usize,
    /// capacity each link declares (default 4)
    #[argh(option, default = "4")]
    capacity: u32,
    /// how long to hold the links once all are dialled (default 10s)
    #[argh(option, default = "String::from(\"10s\")")]
    hold: String,
}

#[derive(Default)]
struct Tally {
    registered: Cell<usize>,
    rejected: RefCell<BTreeMap<String, usize>>,
    failed: RefCell<BTreeMap<String, usize>>,
    /// Registered links the router closed while they were held.
    closed_while_held: Cell<usize>,
}

impl Tally {
    fn fail(&self, map: &RefCell<BTreeMap<String, usize>>, why: String) {
        // Keep the reason's kind, not its per-link details.
        let key: String = why.chars().take(60).collect();
        *map.borrow_mut().entry(key).or_default() += 1;
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    shards::exit_on_version_flag("hivenet-link-flood", &args);
    let a: Args = argh::from_env();
    let hold = match humantime::parse_duration(&a.hold) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("hivenet-link-flood: --hold {:?}: {e}", a.hold);
            std::process::exit(2);
        }
    };
    let psk = match &a.swarm_key {
        Some(p) => match link::load_swarm_key(p) {
            Ok(k) => Some(k),
            Err(e) => {
                eprintln!("hivenet-link-flood: {e}");
                std::process::exit(2);
            }
        },
        None => None,
    };
    run_on_runtime(DriverChoice::Auto, move |_| flood(a, psk, hold));
}

async fn flood(a: Args, psk: Option<libp2p_pnet::PreSharedKey>, hold: Duration) {
    let tally = Rc::new(Tally::default());
    let next = Rc::new(Cell::new(0usize));
    let held: Rc<RefCell<Vec<link::LinkHandle>>> = Rc::default();
    let started = std::time::Instant::now();
    let mut workers = Vec::new();
    for _ in 0..a.concurrency.max(1) {
        let (tally, next, held) = (tally.clone(), next.clone(), held.clone());
        let (router, links, models, capacity) = (a.router, a.links, a.models.max(1), a.capacity);
        workers.push(monoio::spawn(async move {
            loop {
                let i = next.get();
                if i >= links {
                    return;
                }
                next.set(i + 1);
                let model = format!("flood-{}", i % models);
                match one_link(router, &model, psk, capacity, &tally).await {
                    Ok(Some(h)) => held.borrow_mut().push(h),
                    Ok(None) => {}
                    Err(e) => tally.fail(&tally.failed, e),
                }
            }
        }));
    }
    for w in workers {
        w.await;
    }
    let dial_seconds = started.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({"phase": "dialled", "registered": tally.registered.get(),
            "rejected": *tally.rejected.borrow(), "failed": *tally.failed.borrow(),
            "seconds": dial_seconds})
    );
    monoio::time::sleep(hold).await;
    println!(
        "{}",
        serde_json::json!({"phase": "held", "registered": tally.registered.get(),
            "closed_while_held": tally.closed_while_held.get(),
            "rejected": *tally.rejected.borrow(), "failed": *tally.failed.borrow()})
    );
    for h in held.borrow().iter() {
        h.close();
    }
}

/// Dial, register, and keep heartbeating in a task of its own. `Ok(None)`:
/// refused (counted in `rejected`).
async fn one_link(
    router: std::net::SocketAddr,
    model: &str,
    psk: Option<libp2p_pnet::PreSharedKey>,
    capacity: u32,
    tally: &Rc<Tally>,
) -> Result<Option<link::LinkHandle>, String> {
    let kp = libp2p_identity::Keypair::generate_ed25519();
    let peer_id = kp.public().to_peer_id().to_string();
    let (_, conn) =
        monoio::time::timeout(Duration::from_secs(30), link::dial(router, model, psk, &kp))
            .await
            .map_err(|_| "dial timed out".to_string())?
            .map_err(|e| format!("dial: {e}"))?;
    let (handle, inbound, closed) = link::spawn_driver(conn);
    let mut ctl = handle
        .open(link::CONTROL_PROTOCOL)
        .await
        .map_err(|e| format!("control stream: {e}"))?;
    let reg = Registration {
        peer_id,
        model: model.to_string(),
        engine: "openai".into(),
        capacity,
        ..Registration::default()
    };
    link::write_frame(&mut ctl, &ControlMsg::Register(reg))
        .await
        .map_err(|e| format!("register: {e}"))?;
    let mut ctl_in = Conn::over(ctl, Vec::new());
    let reply = monoio::time::timeout(Duration::from_secs(30), ctl_in.read_frame())
        .await
        .map_err(|_| "no registration reply".to_string())?
        .map_err(|e| format!("registration reply: {e}"))?;
    let hb = match reply {
        Some(ControlMsg::Registered {
            heartbeat_interval_ms,
            // Beat at least every 500 ms (the agent's signal cadence), so
            // a short --remove-after does not drop a held link.
            ..
        }) => Duration::from_millis(heartbeat_interval_ms.clamp(100, 500)),
        Some(ControlMsg::Rejected { reason }) => {
            tally.fail(&tally.rejected, reason);
            return Ok(None);
        }
        // The router closed the link without a word: a cap at accept.
        None => {
            tally.fail(&tally.rejected, "closed before a reply".into());
            return Ok(None);
        }
        Some(other) => return Err(format!("unexpected reply {other:?}")),
    };
    tally.registered.set(tally.registered.get() + 1);
    let mut ctl = ctl_in.stream;
    let t = tally.clone();
    monoio::spawn(async move {
        let _inbound = inbound;
        let mut closed = closed;
        loop {
            let tick = monoio::time::sleep(hb);
            futures::pin_mut!(tick);
            if let futures::future::Either::Right(_) =
                futures::future::select(tick, &mut closed).await
            {
                t.closed_while_held.set(t.closed_while_held.get() + 1);
                return;
            }
            let beat = ControlMsg::Heartbeat {
                backend_healthy: true,
                draining: false,
            };
            if link::write_frame(&mut ctl, &beat).await.is_err() {
                return;
            }
        }
    });
    Ok(Some(handle))
}
