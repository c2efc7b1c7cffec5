//! `hivenet-router`'s life after start-up: the store, audit, shared-state
//! and shard threads started, signals (drain, reload, quota flushes)
//! handled, everything joined.

use crate::config::*;
use crate::shard_calls::{each_shard, flush_quota, in_flight};
use futures::channel::mpsc;
use shards::logic::routing::directory::Directory;
use shards::logic::system::upgrade::ListenerKind;
use shards::logic::tenancy::auth::ApiMode;
use shards::runtime::front::event_loop::{self, ShardListeners};
use shards::runtime::state::router::Router;
use shards::runtime::state::snapshot::Versioned;
use shards::runtime::state::tenancy::AuthState;
use shards::runtime::wire::executor::{self};
use std::sync::Arc;
use tracing::{error, info, warn};

/// Re-read `auth.yaml` on SIGHUP: a valid file replaces the keys (the
/// buckets of surviving tenants carry over: no usage is forgotten); an
/// invalid one, or a switch between static and dynamic, keeps the old.
pub(crate) fn reload_auth(shared: &Router, src: &hivenet_router::auth_files::AuthSources) {
    if src.file.is_none() {
        return;
    }
    let prev = shared.auth.load();
    match hivenet_router::auth_files::load(src) {
        Ok(cfg) if cfg.api != prev.mode => error!(
            from = prev.mode.as_str(),
            to = cfg.api.as_str(),
            "SIGHUP: auth reload rejected: changing api.mode needs a restart; keeping the previous keys"
        ),
        // Dynamic keys live in the registry; the file has none to reload.
        Ok(cfg) if cfg.api == ApiMode::Dynamic => info!("SIGHUP: auth mode dynamic: registry kept"),
        Ok(cfg) => {
            let n = cfg.keys.len();
            let next = AuthState::build(cfg.api, cfg.keys, Some(&prev), &Default::default());
            let policies = shared.policies.load();
            let keys = next.itpm_limits.iter().map(|(k, v)| (k.as_str(), *v));
            if let Err(e) = hivenet_router::policy_files::serverless_check(keys, &policies) {
                error!("SIGHUP: auth reload rejected, keeping the previous keys: {e}");
                return;
            }
            shared.auth.store(next);
            info!(keys = n, "SIGHUP: client keys reloaded");
        }
        Err(e) => error!("SIGHUP: auth reload rejected, keeping the previous keys: {e}"),
    }
}

/// The periodic flush of token usage (same period as the history flush).
pub(crate) struct QuotaFlusher {
    stop: Arc<std::sync::atomic::AtomicBool>,
    /// Set while the store moves to a replacing process (issue 54).
    pub(crate) paused: Arc<std::sync::atomic::AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl QuotaFlusher {
    fn stop(mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            h.thread().unpark();
            let _ = h.join();
        }
    }
}

pub(crate) fn start_quota_flush(
    shared: Arc<Router>,
    store: shards::runtime::services::store_api::StoreTx,
) -> QuotaFlusher {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let paused = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (s, p) = (stop.clone(), paused.clone());
    let every = shared.cfg.flush_interval;
    let handle = std::thread::Builder::new()
        .name("quota-flush".into())
        .spawn(move || loop {
            std::thread::park_timeout(every);
            if s.load(std::sync::atomic::Ordering::Relaxed) {
                return;
            }
            if !p.load(std::sync::atomic::Ordering::Relaxed) {
                flush_quota(&shared, &store, false);
            }
        })
        .ok();
    QuotaFlusher {
        stop,
        paused,
        handle,
    }
}

pub(crate) fn run(startup: Startup) -> Result<(), String> {
    let Startup {
        drain,
        policy_sources,
        policies,
        store: store_cfg,
        admin_keys,
        insecure_admin,
        auth_sources,
        auth,
        audit: audit_path,
        cfg,
        plan,
        driver,
        psk,
        keypair,
        shared_state,
        shared_affinity,
        announce,
        upgrade,
    } = startup;
    let n = plan.len();
    // Replacing a running router: its sockets, not new ones (issue 54).
    let mut inherit = if upgrade.take_over {
        Some(crate::upgrade::new::connect(&upgrade.socket)?)
    } else {
        None
    };
    let (http, metrics, p2p) = match inherit.as_mut() {
        Some(i) => (
            i.deal(ListenerKind::Http, n),
            i.deal(ListenerKind::Metrics, n),
            i.deal(ListenerKind::P2p, n),
        ),
        None => {
            let bind = |addr| {
                executor::bind_reuseport(addr, n)
                    .map(|v| v.into_iter().map(|l| vec![l]).collect::<Vec<_>>())
                    .map_err(|e| format!("cannot listen on {addr}: {e}"))
            };
            (
                bind(cfg.http_addr)?,
                bind(cfg.metrics_addr)?,
                bind(cfg.p2p_addr)?,
            )
        }
    };
    // Copies for a later hand-over of this process's own.
    let mut copies = Vec::new();
    for (kind, lists) in [
        (ListenerKind::Http, &http),
        (ListenerKind::Metrics, &metrics),
        (ListenerKind::P2p, &p2p),
    ] {
        for l in lists.iter().flatten() {
            let c = l
                .try_clone()
                .map_err(|e| format!("cannot duplicate a listener: {e}"))?;
            copies.push((kind, c));
        }
    }
    if let Some(i) = &inherit {
        i.want_store()?;
    }
    if psk.is_none() {
        warn!("no --swarm-key-file: agent links are authenticated by noise only; any peer that can reach the p2p port can register");
    }
    if insecure_admin {
        warn!("HIVENET_ROUTER_ALLOW_INSECURE_ADMIN=true: admin routes are open without a key");
    }
    let storage_errors = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (store_tx, store_thread, restored, recent_agents) =
        hivenet_router::store::start(store_cfg, storage_errors.clone())?;
    let restored: std::collections::HashMap<_, _> = restored
        .into_iter()
        .map(|((t, m), s)| ((Arc::<str>::from(t), m), s))
        .collect();
    if !restored.is_empty() {
        info!(
            buckets = restored.len(),
            "today's token usage restored from the store"
        );
    }
    let api_mode = auth.api;
    let key_count = auth.keys.len();
    let auth_state = AuthState::build_linked(
        auth.api,
        auth.keys,
        None,
        &restored,
        shared_state.as_ref().map(|(s, _)| s.link.clone()),
    );
    let audit = match &audit_path {
        Some((p, explicit, audit_max_bytes)) => {
            let audit_max_bytes = *audit_max_bytes;
            match shards::runtime::services::audit::AuditLog::start(p, audit_max_bytes) {
                Ok((log, _writer)) => {
                    info!(path = %p.display(), max_bytes = audit_max_bytes, "audit log on");
                    Some(log)
                }
                // An operator's path must work; the default one may not
                // (a read-only working directory): say so and serve.
                Err(e) if *explicit => {
                    return Err(format!(
                        "HIVENET_ROUTER_AUDIT_LOG_PATH: cannot open {}: {e}",
                        p.display()
                    ))
                }
                Err(e) => {
                    warn!(path = %p.display(), "audit log OFF: cannot open the default path ({e}); set HIVENET_ROUTER_AUDIT_LOG_PATH to a writable file, or \"off\"");
                    None
                }
            }
        }
        None => {
            info!("audit log off (HIVENET_ROUTER_AUDIT_LOG_PATH=off)");
            None
        }
    };
    let traces = crate::cli::trace_export("hivenet-router")?;
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..n).map(|_| mpsc::unbounded()).unzip();
    let shared = Arc::new(Router {
        cfg: cfg.clone(),
        directory: Versioned::new(Directory::new(n)),
        mesh: senders,
        keypair: keypair.clone(),
        psk,
        store: Some(store_tx.clone()),
        budget: shards::runtime::wire::budget::Budget::new(
            cfg.max_buffered_body_bytes,
            cfg.max_client_connections,
        ),
        links: shards::runtime::wire::link::budget::LinkBudget::new(
            cfg.max_agent_links,
            cfg.max_agent_links_per_address,
        ),
        pending_links: shards::runtime::wire::link::budget::LinkBudget::evicting(
            cfg.max_pending_agent_links,
            cfg.max_pending_agent_links_per_address,
        ),
        storage_errors,
        admin_keys,
        insecure_admin,
        auth: Versioned::new(auth_state),
        registry: Default::default(),
        shared_state: shared_state.as_ref().map(|(s, _)| s.clone()),
        affinity_outbox: shared_affinity.then(|| std::sync::Mutex::new(Vec::new())),
        traces,
        audit,
        policies: Versioned::new(policies),
        policy_reloads: std::sync::Mutex::new(Default::default()),
        policies_from_api: Default::default(),
        feed: std::sync::Mutex::new(Vec::new()),
        sites: Versioned::new(Default::default()),
        holds: Default::default(),
        carry: Default::default(),
        readiness: shards::runtime::state::readiness::Readiness::expecting(
            recent_agents,
            shards::runtime::state::readiness::READY_WAIT,
        ),
    });
    info!(
        peer_id = %keypair.public().to_peer_id(),
        http = %http.iter().flatten().next().and_then(|l| l.local_addr().ok()).map(|a| a.to_string()).unwrap_or_default(),
        metrics = %metrics.iter().flatten().next().and_then(|l| l.local_addr().ok()).map(|a| a.to_string()).unwrap_or_default(),
        p2p = %p2p.iter().flatten().next().and_then(|l| l.local_addr().ok()).map(|a| a.to_string()).unwrap_or_default(),
        shards = n,
        auth = api_mode.as_str(),
        keys = key_count,
        "hivenet-router starting"
    );
    if let Some(a) = &announce {
        // The address to give agents of other hosts, with the peer ID
        // they may pin (unless the announced address names it already).
        let text = a.text.trim_end_matches('/');
        if text.contains("/p2p/") {
            info!("agents of other hosts dial --router-p2p {text}");
        } else {
            info!(
                "agents of other hosts dial --router-p2p {text}/p2p/{}",
                keypair.public().to_peer_id()
            );
        }
    }
    if let Some((s, pending)) = shared_state {
        info!(redis = %s.shown, fail_closed = s.link.fail_closed, "shared state on: keys, quotas and held clients are shared through Redis");
        s.start(pending, shared.clone())?;
    }
    let flusher = start_quota_flush(shared.clone(), store_tx.clone());
    let mut handles = Vec::new();
    let lists = http
        .into_iter()
        .zip(metrics)
        .zip(p2p)
        .zip(receivers)
        .zip(plan);
    for (id, ((((h, m), p), rx), cpu)) in lists.enumerate() {
        let shared = shared.clone();
        let listeners = ShardListeners {
            http: h,
            metrics: m,
            p2p: p,
            clients: inherit.is_none(),
        };
        let handle = executor::spawn_runtime(format!("shard-{id}"), cpu, driver, move || {
            event_loop::run(id, shared, listeners, rx)
        })
        .map_err(|e| format!("cannot start shard {id}: {e}"))?;
        handles.push(handle);
    }
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGHUP,
        signal_hook::consts::SIGUSR1,
        signal_hook::consts::SIGUSR2,
    ])
    .map_err(|e| format!("cannot install signal handlers: {e}"))?;
    if let Some(i) = inherit.take() {
        i.take_over(shared.clone(), store_tx.clone())?;
    } else {
        // Type=notify units: this process serves now.
        crate::upgrade::notify_systemd("READY=1");
    }
    let (handed_tx, handed_rx) = std::sync::mpsc::channel();
    let listening = crate::upgrade::old::listen(
        &upgrade.socket,
        upgrade.take_over,
        crate::upgrade::old::Handles {
            shared: shared.clone(),
            store: store_tx.clone(),
            listeners: copies,
            flush_paused: flusher.paused.clone(),
        },
        handed_tx,
    );
    match listening {
        Ok(()) => {}
        // An operator's path must work; the default one may not (a path
        // past the 108 bytes of a Unix socket address): say so and serve.
        Err(e) if upgrade.socket_explicit => return Err(e),
        Err(e) => warn!(
            "upgrade hand-over OFF: {e}; set --upgrade-socket to a short path this user may write"
        ),
    }
    let mut handed = None;
    for sig in signals.forever() {
        if sig == signal_hook::consts::SIGUSR2 {
            crate::upgrade::old::start_replacement(&upgrade);
            continue;
        }
        if sig == signal_hook::consts::SIGUSR1 {
            match handed_rx.try_recv() {
                Ok(h) => {
                    handed = Some(h);
                    break;
                }
                Err(_) => continue,
            }
        }
        if sig == signal_hook::consts::SIGHUP {
            // Auth first (spec 05 §9); an invalid file keeps the old keys.
            reload_auth(&shared, &auth_sources);
            // Without policy files there is nothing to re-read: the
            // policies in force (written through the admin API, or the
            // built-in default) are kept, never reset (issue 28 #17).
            if policy_sources.file.is_none() && policy_sources.dir.is_none() {
                info!("SIGHUP: no policy files: policies kept");
                continue;
            }
            // Reload policies; an invalid set keeps the old one.
            let loaded = hivenet_router::policy_files::load(&policy_sources).and_then(|set| {
                let auth = shared.auth.load();
                let keys = auth.itpm_limits.iter().map(|(k, v)| (k.as_str(), *v));
                hivenet_router::policy_files::serverless_check(keys, &set).map(|()| set)
            });
            match loaded {
                Ok(set) => match shared.swap_policies(set, "sighup") {
                    Ok(()) => info!("SIGHUP: policies reloaded"),
                    Err(e) => {
                        error!("SIGHUP: policy reload rejected, keeping the previous policies: {e}")
                    }
                },
                Err(e) => {
                    shared.count_reload("sighup", false);
                    error!("SIGHUP: policy reload rejected, keeping the previous policies: {e}");
                }
            }
            continue;
        }
        info!(signal = sig, drain = ?drain, "shutting down: draining in-flight requests");
        break;
    }
    shared.readiness.drain();
    // Replaced: the streams here finish (up to --upgrade-drain-timeout);
    // everything else went to the new process.
    if let Some(h) = handed {
        crate::upgrade::old::drain(&shared, h, upgrade.drain);
    }
    // Requests held at zero: alone, this router answers them now
    // (model_waking: the client retries later). With other routers of the
    // fleet (shared state: a rolling replacement), they stay held while it
    // drains: their agent, linked to every router, wakes them here too.
    let keep_held = shared.shared_state.is_some();
    let release_holds = |shared: &Router| {
        for tx in &shared.mesh {
            let _ = tx.unbounded_send(shards::runtime::state::mesh::ShardMsg::ReleaseHolds);
        }
    };
    if !keep_held {
        release_holds(&shared);
    }
    // Let in-flight requests (streams included) finish, up to --drain-timeout.
    let started = std::time::Instant::now();
    let mut released = !keep_held;
    loop {
        let active = in_flight(&shared);
        if active == 0 {
            break;
        }
        if started.elapsed() >= drain {
            if !released {
                // Still held at the deadline: answered now, then a moment
                // for those answers to go out.
                released = true;
                release_holds(&shared);
                std::thread::sleep(std::time::Duration::from_millis(200));
                continue;
            }
            warn!(active, "drain timeout: cutting the remaining requests");
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    info!("flushing history");
    // Every shard hands its agents' history to the store, then the store
    // persists and stops (one FIFO channel keeps that order).
    each_shard(&shared, std::time::Duration::from_secs(5), |reply| {
        shards::runtime::state::mesh::ShardMsg::Shutdown { reply }
    });
    flusher.stop();
    flush_quota(&shared, &store_tx, true);
    let (t, r) = futures::channel::oneshot::channel();
    if store_tx
        .send(shards::runtime::services::store_api::StoreMsg::Shutdown { done: t })
        .is_ok()
    {
        let _ = futures::executor::block_on(r);
    }
    let _ = store_thread.join();
    info!("history persisted; bye");
    Ok(())
}
