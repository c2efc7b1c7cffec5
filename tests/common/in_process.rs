//! The router built in this process, as `hivenet-router --shards 1` wires
//! it, for tests that count what its shard thread allocates.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use futures::channel::mpsc;
use shards::logic::routing::directory::Directory;
use shards::runtime::front::event_loop::{self, ShardListeners};
use shards::runtime::state::router::{Router, RouterConfig};
use shards::runtime::state::snapshot::Versioned;
use shards::runtime::state::tenancy::AuthState;
use shards::runtime::wire::executor::{self, DriverChoice};

/// The router as `hivenet-router --shards 1` builds it, with its history
/// store and audit log in `dir`, without keys or policies; returns its HTTP
/// address and its p2p port. `on_shard_thread` runs first on the shard's
/// thread (a counting allocator's tests name the thread there).
pub fn start_router(
    dir: &std::path::Path,
    heartbeat_interval: Duration,
    on_shard_thread: fn(),
) -> (SocketAddr, u16) {
    start_router_with(dir, heartbeat_interval, on_shard_thread, None)
}

/// [`start_router`] with a global policy (`--policy-file` of this text).
pub fn start_router_with(
    dir: &std::path::Path,
    heartbeat_interval: Duration,
    on_shard_thread: fn(),
    policy: Option<&str>,
) -> (SocketAddr, u16) {
    let policy_file = policy.map(|text| {
        let path = dir.join("policy.yaml");
        std::fs::write(&path, text).expect("policy file");
        path
    });
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let bind = |what| {
        executor::bind_reuseport(any, 1)
            .unwrap_or_else(|e| panic!("bind {what}: {e}"))
            .remove(0)
    };
    let (http, metrics, p2p) = (bind("http"), bind("metrics"), bind("p2p"));
    let addr = |l: &std::net::TcpListener| l.local_addr().expect("bound address");
    let cfg = RouterConfig {
        http_addr: addr(&http),
        metrics_addr: addr(&metrics),
        p2p_addr: addr(&p2p),
        heartbeat_interval,
        remove_after: Duration::from_secs(600),
        ..RouterConfig::default()
    };
    let (http_addr, p2p_port) = (cfg.http_addr, cfg.p2p_addr.port());
    let auth = hivenet_router::auth_files::load(&hivenet_router::auth_files::AuthSources {
        file: None,
        env_mode: None,
    })
    .expect("default auth");
    let policies =
        hivenet_router::policy_files::load(&hivenet_router::policy_files::PolicySources {
            file: policy_file,
            dir: None,
        })
        .expect("default policies");
    let storage_errors = Arc::new(AtomicU64::new(0));
    let (store, _store_thread, _restored, _recent) = hivenet_router::store::start(
        hivenet_router::store::StoreConfig {
            path: dir.join("db"),
            reset: false,
            ttl_days: 0,
            responses: hivenet_router::store::responses::Bounds {
                per_tenant: 1 << 20,
                total: 1 << 20,
                ttl_secs: 0,
            },
        },
        storage_errors.clone(),
    )
    .expect("history store");
    let (tx, rx) = mpsc::unbounded();
    let shared = Arc::new(Router {
        cfg: cfg.clone(),
        directory: Versioned::new(Directory::new(1)),
        mesh: vec![tx],
        keypair: libp2p_identity::Keypair::generate_ed25519(),
        psk: None,
        store: Some(store),
        budget: shards::runtime::wire::budget::Budget::new(
            cfg.max_buffered_body_bytes,
            cfg.max_client_connections,
        ),
        links: shards::runtime::wire::link::budget::LinkBudget::new(0, 0),
        pending_links: shards::runtime::wire::link::budget::LinkBudget::new(0, 0),
        storage_errors,
        admin_keys: Vec::new(),
        insecure_admin: false,
        auth: Versioned::new(AuthState::build(
            auth.api,
            auth.keys,
            None,
            &Default::default(),
        )),
        registry: Default::default(),
        shared_state: None,
        affinity_outbox: None,
        traces: None,
        // On, as by default: its record costs the shard no allocation.
        audit: Some(
            shards::runtime::services::audit::AuditLog::start(&dir.join("audit.jsonl"), 0)
                .expect("audit log")
                .0,
        ),
        policies: Versioned::new(policies),
        policy_reloads: Default::default(),
        policies_from_api: Default::default(),
        feed: Default::default(),
        sites: Versioned::new(Default::default()),
        holds: Default::default(),
        carry: Default::default(),
        readiness: Default::default(),
    });
    let listeners = ShardListeners {
        http: vec![http],
        metrics: vec![metrics],
        p2p: vec![p2p],
        clients: true,
    };
    executor::spawn_runtime("shard-0".into(), None, DriverChoice::Auto, move || {
        on_shard_thread();
        event_loop::run(0, shared, listeners, rx)
    })
    .expect("router shard thread");
    (http_addr, p2p_port)
}
