//! `hivenet-agent`: waits for its backend, discovers the model, dials the
//! router over libp2p, registers, heartbeats and proxies request streams.
//!
//! Key items: [`AgentConfig`], [`run`] (the reconnect loop), [`serve`]
//! (one request stream).

pub mod backend;
pub mod engine;
pub mod gate;
pub mod gpu;
pub mod progress;
pub mod serve;
pub mod spans;

use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use futures::StreamExt;
use libp2p_identity::Keypair;
use libp2p_pnet::PreSharedKey;
use shards::logic::link::control::{Capability, ControlMsg, Registration};
use shards::runtime::wire::link;
use tracing::{info, warn};

use backend::BackendUrl;
use engine::Engine;
use gate::Gate;

/// Everything the agent was told.
#[derive(Clone)]
pub struct AgentConfig {
    /// The routers' libp2p addresses (one link to each; the capacity is
    /// shared by all of them).
    pub routers: Vec<RouterAddr>,
    /// Backend base URL.
    pub backend: BackendUrl,
    /// Engine.
    pub engine: Engine,
    /// Health URL for `custom`.
    pub health_url: Option<BackendUrl>,
    /// Capability.
    pub capability: Capability,
    /// Model (discovered when `None`).
    pub model: Option<String>,
    /// Declared capacity.
    pub capacity: u32,
    /// Identity.
    pub keypair: Keypair,
    /// Fleet secret.
    pub psk: Option<PreSharedKey>,
    /// Labels.
    pub region: String,
    /// Labels.
    pub organization: String,
    /// Labels.
    pub machine: String,
    /// Labels.
    pub tags: Vec<String>,
    /// Version label.
    pub version: String,
    /// Deployment ID.
    pub deployment_id: String,
    /// Replica ID.
    pub replica_id: String,
    /// Time the backend has to start its answer (its response head), and
    /// the bound of other backend calls (`--http-timeout`).
    pub http_timeout: Duration,
    /// Longest silence of a streamed answer between two bytes, and the
    /// longest write to the router (`--stream-write-timeout`; `None`: 0,
    /// unbounded).
    pub stream_write_timeout: Option<Duration>,
    /// Backend health cadence while registered.
    pub health_interval: Duration,
    /// On SIGTERM, how long requests in flight may take to finish
    /// (`--drain-timeout`).
    pub drain_timeout: Duration,
    /// Engine metrics scrape and push cadence.
    pub signal_interval: Duration,
    /// Warm-up before registering (resolved from `--warmup` and the engine).
    pub warmup: bool,
    /// GPU model registered (`--gpu-model`, else `nvidia-smi`'s first GPU;
    /// empty: none).
    pub gpu_model: String,
    /// `--hide-llm`.
    pub hide_llm: bool,
    /// `--llm-pretty-name`.
    pub llm_pretty_name: String,
    /// `--llm-info`.
    pub llm_info: String,
    /// The host's GPUs as `nvidia-smi` last read them (None: no tool, or
    /// no GPU), sampled off the runtime by [`gpu::start`].
    pub gpus: gpu::Latest,
    /// OTLP trace export (`OTEL_EXPORTER_OTLP_ENDPOINT`; None: off).
    pub traces: Option<std::sync::Arc<shards::runtime::services::otlp::TraceExport>>,
}

/// Parse `--router-p2p`: a multiaddr `/ip4/1.2.3.4/tcp/9000` (or `/dns4/host/tcp/port`) or `host:port`.
pub fn parse_router_addr(s: &str) -> Result<RouterAddr, String> {
    use std::net::ToSocketAddrs;
    let s = s.trim();
    if s.starts_with('/') {
        let parts: Vec<&str> = s.split('/').filter(|p| !p.is_empty()).collect();
        let (host, port, rest) = match parts.as_slice() {
            [proto, host, "tcp", port, rest @ ..]
                if matches!(*proto, "ip4" | "ip6" | "dns" | "dns4" | "dns6") =>
            {
                (*host, *port, rest)
            }
            _ => {
                return Err(format!(
                    "--router-p2p: unsupported multiaddr {s:?} (want /ip4/<ip>/tcp/<port>[/p2p/<peer-id>])"
                ))
            }
        };
        let peer = match rest {
            [] => None,
            ["p2p", id] => Some(id.parse::<libp2p_identity::PeerId>().map_err(|e| {
                format!("--router-p2p: {id:?} in {s:?} is not a peer ID: {e}")
            })?),
            _ => {
                return Err(format!(
                    "--router-p2p: unsupported multiaddr {s:?} (only /p2p/<peer-id> may follow the port)"
                ))
            }
        };
        let port: u16 = port
            .parse()
            .map_err(|_| format!("--router-p2p: bad port in {s:?}"))?;
        let addr = (host, port)
            .to_socket_addrs()
            .map_err(|e| format!("--router-p2p: cannot resolve {host}: {e}"))?
            .next()
            .ok_or_else(|| format!("--router-p2p: cannot resolve {host}"))?;
        return Ok(RouterAddr { addr, peer });
    }
    let addr = s
        .to_socket_addrs()
        .map_err(|e| format!("--router-p2p: {s:?} is neither a multiaddr nor host:port: {e}"))?
        .next()
        .ok_or_else(|| format!("--router-p2p: cannot resolve {s:?}"))?;
    Ok(RouterAddr { addr, peer: None })
}

/// Most routers one agent links to.
pub const MAX_ROUTERS: usize = 16;

/// Where the router is, and (when given) whom the agent expects there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouterAddr {
    /// Socket address.
    pub addr: SocketAddr,
    /// The router's peer ID from `/p2p/<peer-id>`: any other identity is refused.
    pub peer: Option<libp2p_identity::PeerId>,
}

async fn backend_healthy(cfg: &AgentConfig) -> bool {
    let (url, path) = match (&cfg.engine, &cfg.health_url) {
        (Engine::Custom, Some(u)) => {
            let path = if u.prefix.is_empty() {
                "/".to_string()
            } else {
                u.prefix.clone()
            };
            (
                BackendUrl {
                    authority: u.authority.clone(),
                    prefix: String::new(),
                },
                path,
            )
        }
        (e, _) => (cfg.backend.clone(), e.health_path().to_string()),
    };
    matches!(backend::fetch(&url, "GET", &path, b"", Duration::from_secs(5)).await, Ok((h, _)) if h.status == 200)
}

async fn wait_backend(cfg: &AgentConfig) {
    let mut logged = false;
    while !backend_healthy(cfg).await {
        if !logged {
            info!(backend = %cfg.backend.authority, "waiting for the backend's health check");
            logged = true;
        }
        monoio::time::sleep(Duration::from_secs(2)).await;
    }
    info!(backend = %cfg.backend.authority, "backend healthy");
}

async fn discover_model(cfg: &AgentConfig) -> String {
    if let Some(m) = &cfg.model {
        return m.clone();
    }
    let Some(path) = cfg.engine.discovery_path() else {
        // Validated at start: custom needs --model.
        return String::new();
    };
    loop {
        match backend::fetch(&cfg.backend, "GET", path, b"", cfg.http_timeout).await {
            Ok((h, body)) if h.status == 200 => match engine::discover(cfg.engine, &body) {
                Ok(m) => {
                    info!(model = %m, "model discovered from the backend");
                    return m;
                }
                Err(e) => warn!("model discovery: {e}; retrying in 5s"),
            },
            Ok((h, _)) => warn!(status = h.status, "model discovery failed; retrying in 5s"),
            Err(e) => warn!("model discovery: {e}; retrying in 5s"),
        }
        monoio::time::sleep(Duration::from_secs(5)).await;
    }
}

async fn warm_up(cfg: &AgentConfig, model: &str) {
    let body = serde_json::json!({"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1, "stream": false}).to_string();
    loop {
        match backend::fetch(
            &cfg.backend,
            "POST",
            "/v1/chat/completions",
            body.as_bytes(),
            cfg.http_timeout,
        )
        .await
        {
            Ok((h, _)) if h.status == 200 => {
                info!(%model, "warm-up completion succeeded");
                return;
            }
            Ok((h, _)) => warn!(
                status = h.status,
                "warm-up completion failed; retrying in 5s"
            ),
            Err(e) => warn!("warm-up completion: {e}; retrying in 5s"),
        }
        monoio::time::sleep(Duration::from_secs(5)).await;
    }
}

/// One reconnect loop per router: never returns.
pub async fn run(cfg: AgentConfig, stop: futures::channel::mpsc::UnboundedReceiver<()>) {
    let cfg = Rc::new(cfg);
    let gate = Gate::new(cfg.capacity, cfg.routers.len());
    let meter = Rc::new(progress::EngineProgress::new(cfg.engine));
    monoio::spawn(drain_on_stop(stop, gate.clone(), cfg.drain_timeout));
    for i in 0..cfg.routers.len() {
        monoio::spawn(run_link(cfg.clone(), gate.clone(), meter.clone(), i));
    }
    // A link loop ends when the agent drains (which exits the process)
    // or when its router is replaced, its twin loop then going on
    // (issue 54): the agent lives until it is stopped.
    futures::future::pending::<()>().await;
}

/// On the first stop signal (SIGTERM, SIGINT): tell every router to send
/// nothing new, let what is in flight finish for up to `limit`, then exit.
/// A stream still running then is cut with the link, and the router
/// continues it on another agent (issue 33): nothing is lost either way.
async fn drain_on_stop(
    mut stop: futures::channel::mpsc::UnboundedReceiver<()>,
    gate: Rc<Gate>,
    limit: Duration,
) {
    if stop.next().await.is_none() {
        return;
    }
    let in_flight = gate.in_flight();
    info!(in_flight, drain_timeout = ?limit, "stopping: draining (routers send nothing new)");
    gate.drain();
    let start = std::time::Instant::now();
    // The routers hear of it before the first check (the heartbeat goes
    // out at once; a request already on its way is served).
    monoio::time::sleep(Duration::from_millis(100)).await;
    loop {
        let left = gate.in_flight();
        if left == 0 {
            info!(waited = ?start.elapsed(), "drained: every request finished");
            break;
        }
        if start.elapsed() >= limit {
            warn!(
                left,
                "--drain-timeout passed: leaving; the routers continue these streams elsewhere"
            );
            break;
        }
        // A second signal ends the wait.
        let tick = monoio::time::sleep(Duration::from_millis(20));
        futures::pin_mut!(tick);
        if let futures::future::Either::Right((Some(()), _)) =
            futures::future::select(tick, stop.next()).await
        {
            warn!(left, "second stop signal: leaving now");
            break;
        }
    }
    std::process::exit(0);
}

/// The reconnect loop of the link to router `link`: returns only when the
/// agent is draining.
pub(crate) async fn run_link(
    cfg: Rc<AgentConfig>,
    gate: Rc<Gate>,
    meter: Rc<progress::EngineProgress>,
    link: usize,
) {
    let Some(router) = cfg.routers.get(gate.router_of(link)).copied() else {
        return;
    };
    let peer_id = cfg.keypair.public().to_peer_id();
    let mut backoff = FIRST_BACKOFF;
    let max_backoff = Duration::from_secs(30);
    loop {
        // A draining agent does not come back to a router it lost: it is
        // leaving (its other links finish what they serve).
        if gate.draining() {
            info!(router = %router.addr, "draining: not reconnecting");
            return;
        }
        wait_backend(&cfg).await;
        let model = discover_model(&cfg).await;
        if cfg.warmup && cfg.capability == Capability::Llm {
            // One link warms up, the others wait for it; none does while a
            // link is registered (its backend serves: warm), so the engine
            // never sees a warm-up on top of the routed requests.
            while gate.warming() {
                monoio::time::sleep(Duration::from_millis(100)).await;
            }
            if let Some(_turn) = gate.warm_up_turn() {
                warm_up(&cfg, &model).await;
            }
        }
        // A registration resets the backoff: a router that restarts several
        // times in a row is rejoined at once each time.
        let to = Link {
            router,
            gate: gate.clone(),
            index: link,
            meter: meter.clone(),
            interim: None,
        };
        match session(cfg.clone(), to, &model, peer_id.to_string(), &mut backoff).await {
            Ok(()) => info!(router = %router.addr, "router link closed"),
            Err(e) => warn!(router = %router.addr, "session ended: {e}"),
        }
        // Its router was replaced: the twin link serves the new process.
        if gate.retired(link) {
            info!(router = %router.addr, "link to the replaced router process closed; the new one is linked");
            return;
        }
        info!(router = %router.addr, retry_in = ?backoff, "reconnecting");
        monoio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(max_backoff);
    }
}

/// Backoff before the first reconnect after a registered session.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);

/// One router link: where it goes and its share of the capacity.
#[derive(Clone)]
pub struct Link {
    /// The router.
    pub router: RouterAddr,
    /// The capacity shared by every link.
    pub gate: Rc<Gate>,
    /// This link's index in it.
    pub index: usize,
    /// The engine's work counter (shared by every link).
    pub meter: Rc<progress::EngineProgress>,
    /// How often the router wants a progress report on an answer not yet
    /// started (`None`: it reads none).
    pub interim: Option<Duration>,
}

async fn session(
    cfg: Rc<AgentConfig>,
    mut to: Link,
    model: &str,
    peer_id: String,
    backoff: &mut Duration,
) -> Result<(), String> {
    let router = to.router;
    let (router_peer, conn) = monoio::time::timeout(
        Duration::from_secs(30),
        link::dial(router.addr, model, cfg.psk, &cfg.keypair),
    )
    .await
    .map_err(|_| "dial timed out".to_string())?
    .map_err(|e| format!("dial {}: {e}", router.addr))?;
    if let Some(want) = router.peer {
        if router_peer != want {
            // Noise proved who answered; it is not the router we were told.
            return Err(format!(
                "router at {} has identity {router_peer}, not the expected {want}; refusing it",
                router.addr
            ));
        }
    }
    let (handle, mut inbound, mut closed) = link::spawn_driver(conn);
    let mut ctl = handle
        .open(link::CONTROL_PROTOCOL)
        .await
        .map_err(|e| format!("control stream: {e}"))?;
    let reg = Registration {
        peer_id: peer_id.clone(),
        model: model.to_string(),
        engine: cfg.engine.as_str().to_string(),
        capability: cfg.capability,
        capacity: cfg.capacity,
        version: cfg.version.clone(),
        region: cfg.region.clone(),
        organization: cfg.organization.clone(),
        machine: cfg.machine.clone(),
        tags: cfg.tags.clone(),
        deployment_id: cfg.deployment_id.clone(),
        replica_id: cfg.replica_id.clone(),
        gpu_model: cfg.gpu_model.clone(),
        hide_llm: cfg.hide_llm,
        llm_pretty_name: cfg.llm_pretty_name.clone(),
        llm_info: cfg.llm_info.clone(),
    };
    link::write_frame(&mut ctl, &ControlMsg::Register(reg))
        .await
        .map_err(|e| format!("register: {e}"))?;
    let mut ctl_in = shards::runtime::wire::conn::Conn::over(ctl, Vec::new());
    let reply = monoio::time::timeout(Duration::from_secs(30), ctl_in.read_frame())
        .await
        .map_err(|_| "no registration reply within 30s".to_string())?
        .map_err(|e| format!("registration reply: {e}"))?;
    let hb = match reply {
        Some(ControlMsg::Registered {
            heartbeat_interval_ms,
            progress_interval_ms,
        }) => {
            to.interim =
                (progress_interval_ms > 0).then(|| Duration::from_millis(progress_interval_ms));
            Duration::from_millis(heartbeat_interval_ms.max(100))
        }
        Some(ControlMsg::Rejected { reason }) => {
            return Err(format!("router refused registration: {reason}"))
        }
        other => return Err(format!("unexpected registration reply {other:?}")),
    };
    let mut ctl = ctl_in.stream;
    let _registered = to.gate.registered();
    info!(%router_peer, %model, %peer_id, "registered with the router");
    *backoff = FIRST_BACKOFF;
    // Stopped while this link was being set up: the router hears it now,
    // not at the first heartbeat.
    let mut drain_told = false;
    if to.gate.draining() {
        drain_told = true;
        let beat = ControlMsg::Heartbeat {
            backend_healthy: true,
            draining: true,
        };
        link::write_frame(&mut ctl, &beat)
            .await
            .map_err(|e| format!("heartbeat: {e}"))?;
    }
    // Serve request streams.
    let server = {
        let cfg = cfg.clone();
        let to = to.clone();
        monoio::spawn(async move {
            while let Some(s) = inbound.next().await {
                monoio::spawn(serve::serve_stream(cfg.clone(), to.clone(), s));
            }
        })
    };
    // Load reports to this router when the agent's load changes (several
    // routers only; none is due with one).
    let mut load_due = to.gate.subscribe(to.index);
    if to.gate.shared() {
        let (active, own) = to.gate.report(to.index);
        if let Err(e) = link::write_frame(&mut ctl, &ControlMsg::Load { active, own }).await {
            drop(server);
            return Err(format!("load report: {e}"));
        }
    }
    // Heartbeats with backend health: 3 consecutive failed checks = unhealthy.
    let mut failures = 0u32;
    let mut healthy = true;
    // Engine signals (vllm, sglang, llamacpp): scraped every
    // --engine-sample-interval and pushed when they change (or every 5 s).
    let scrape = shards::logic::link::engine_metrics::scraped(cfg.engine.as_str());
    // Routing signals every --engine-sample-interval: engine metrics (vllm,
    // sglang, llamacpp) and host CPU and memory (every engine).
    // Backend health every --hardware-sample-interval (3 failures: report
    // unhealthy at once; 1 success: healthy), heartbeats every `hb` or as
    // soon as the health verdict changes.
    let tick_every = cfg
        .signal_interval
        .min(hb)
        .min(cfg.health_interval)
        .max(Duration::from_millis(10));
    let mut next_hb = shards::runtime::wire::clock::now() + hb;
    let mut next_health = shards::runtime::wire::clock::now() + cfg.health_interval;
    let mut cpu_prev = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|t| shards::logic::link::hardware::cpu_ticks(&t));
    loop {
        let tick = monoio::time::sleep(tick_every);
        futures::pin_mut!(tick);
        let due = load_due.next();
        match futures::future::select(futures::future::select(tick, due), &mut closed).await {
            futures::future::Either::Left((futures::future::Either::Left(_), _)) => {
                // A held place nobody claimed: every router hears of it.
                if to.gate.expire(std::time::Instant::now()) {
                    to.gate.changed();
                }
            }
            futures::future::Either::Left((futures::future::Either::Right(_), _)) => {
                if to.gate.draining() && !drain_told {
                    drain_told = true;
                    let beat = ControlMsg::Heartbeat {
                        backend_healthy: healthy,
                        draining: true,
                    };
                    if let Err(e) = link::write_frame(&mut ctl, &beat).await {
                        drop(server);
                        return Err(format!("heartbeat: {e}"));
                    }
                }
                if !to.gate.shared() {
                    continue;
                }
                let (active, own) = to.gate.report(to.index);
                if let Err(e) = link::write_frame(&mut ctl, &ControlMsg::Load { active, own }).await
                {
                    drop(server);
                    return Err(format!("load report: {e}"));
                }
                continue;
            }
            futures::future::Either::Right(_) => break,
        }
        let mut engine = shards::logic::link::engine_metrics::EngineSignals::default();
        if scrape {
            if let Ok((h, body)) =
                backend::fetch(&cfg.backend, "GET", "/metrics", b"", Duration::from_secs(2)).await
            {
                if h.status == 200 {
                    let text = String::from_utf8_lossy(&body);
                    engine = shards::logic::link::engine_metrics::parse(cfg.engine.as_str(), &text);
                    to.meter.record(std::time::Instant::now(), &text);
                }
            }
            // llama-server exports no KV gauge: read it off its slots.
            if engine.kv_cache_utilization.is_none()
                && shards::logic::link::engine_metrics::kv_from_slots_endpoint(cfg.engine.as_str())
            {
                if let Ok((h, body)) =
                    backend::fetch(&cfg.backend, "GET", "/slots", b"", Duration::from_secs(2)).await
                {
                    if h.status == 200 {
                        engine.kv_cache_utilization =
                            shards::logic::link::engine_metrics::kv_from_slots(&body);
                    }
                }
            }
        }
        let cpu_now = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|t| shards::logic::link::hardware::cpu_ticks(&t));
        let hardware = shards::logic::link::hardware::HardwareSignals {
            cpu_usage_percent: match (cpu_prev, cpu_now) {
                (Some(p), Some(n)) => shards::logic::link::hardware::cpu_usage(p, n),
                _ => None,
            },
            memory_used_percent: std::fs::read_to_string("/proc/meminfo")
                .ok()
                .and_then(|t| shards::logic::link::hardware::memory_used(&t)),
            ..gpu::signals(&cfg.gpus)
        };
        cpu_prev = cpu_now;
        if let Err(e) =
            link::write_frame(&mut ctl, &ControlMsg::RoutingSignals { engine, hardware }).await
        {
            drop(server);
            return Err(format!("routing signals: {e}"));
        }
        let now = shards::runtime::wire::clock::now();
        let mut changed = false;
        if now >= next_health {
            next_health = now + cfg.health_interval;
            let was = healthy;
            if backend_healthy(&cfg).await {
                failures = 0;
                if !healthy {
                    info!("backend healthy again");
                }
                healthy = true;
            } else {
                failures += 1;
                if failures >= 3 && healthy {
                    warn!("backend failed 3 health checks: reporting unhealthy");
                    healthy = false;
                }
            }
            changed = was != healthy;
        }
        if !changed && shards::runtime::wire::clock::now() < next_hb {
            continue;
        }
        next_hb = shards::runtime::wire::clock::now() + hb;
        if let Err(e) = link::write_frame(
            &mut ctl,
            &ControlMsg::Heartbeat {
                backend_healthy: healthy,
                draining: to.gate.draining(),
            },
        )
        .await
        {
            drop(server);
            return Err(format!("heartbeat: {e}"));
        }
    }
    drop(server);
    Ok(())
}
