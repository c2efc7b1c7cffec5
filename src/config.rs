//! `hivenet-router`'s flags and the start-up they build: every file and
//! flag validated into one [`Startup`] before a thread starts (an invalid
//! configuration stops the process with a one-line reason).

use argh::FromArgs;
use hivenet_router::cli;
use shards::logic::system::core_plan;
use shards::runtime::state::router::RouterConfig;
use shards::runtime::wire::executor::{self, DriverChoice};
use tracing::warn;

/// OpenAI- and Anthropic-compatible inference router (thread-per-core).
#[derive(FromArgs)]
pub(crate) struct Flags {
    /// client HTTP listen address (default ":8080"; env HIVENET_ROUTER_HTTP_PORT)
    #[argh(option)]
    http_port: Option<String>,
    /// prometheus listen address (default ":2112"; env HIVENET_ROUTER_METRICS_PORT)
    #[argh(option)]
    metrics_port: Option<String>,
    /// libp2p TCP port for agents (default 9000; env HIVENET_ROUTER_P2P_PORT)
    #[argh(option)]
    p2p_port: Option<String>,
    /// libp2p listen IP (default 127.0.0.1)
    #[argh(option, default = "String::from(\"127.0.0.1\")")]
    p2p_listen_addr: String,
    /// number of shards (default: one per usable CPU)
    #[argh(option)]
    shards: Option<usize>,
    /// CPUs to pin shards to, e.g. "0-3,6" (default: every CPU the process may use)
    #[argh(option)]
    cpus: Option<String>,
    /// do not pin shards to CPUs (the kernel places them): for a machine whose cores the router shares with CPU-heavy processes, such as an engine beside it (perf/2026-12-02-real-hops)
    #[argh(switch)]
    no_pin: bool,
    /// pre-shared key file in the standard swarm.key format; without it links are noise-only
    #[argh(option)]
    swarm_key_file: Option<String>,
    /// accept agent links without --swarm-key-file on a p2p address that is not loopback (any peer that reaches the port may then register a model and receive prompts)
    #[argh(switch)]
    allow_open_p2p: bool,
    /// router-side request deadline to the agent's response head (default 60s; env HIVENET_ROUTER_REQUEST_TIMEOUT)
    #[argh(option)]
    request_timeout: Option<String>,
    /// most client connections open at once; beyond it a connection gets 503 with Retry-After (default 4096; 0 disables)
    #[argh(option, default = "4096")]
    max_client_connections: usize,
    /// most agent links open at once; beyond it a link is refused at accept, counted (default 1024; 0 disables)
    #[argh(option, default = "1024")]
    max_agent_links: usize,
    /// most agent links from one source address (default 128; 0 disables)
    #[argh(option, default = "128")]
    max_agent_links_per_address: usize,
    /// most agent connections open before their handshake (the registered agents' caps count only handshaken links); each holds its place at most --preamble-timeout + --handshake-timeout (default 4096)
    #[argh(option, default = "4096")]
    max_pending_agent_links: usize,
    /// most agent connections before their handshake from one source address (default 256)
    #[argh(option, default = "256")]
    max_pending_agent_links_per_address: usize,
    /// entries of the cache-affinity index of prefix-aware policies, all shards together, 40 bytes each, allocated on the first prefix-aware request (default 1048576 = 40 MiB; at least 1024, at most what fits in a quarter of the machine's memory)
    #[argh(option, default = "1048576")]
    affinity_table_entries: usize,
    /// most request-body bytes buffered at once, all connections together; beyond it a request gets 503 with Retry-After (default 268435456; 0 disables)
    #[argh(option, default = "268435456")]
    max_buffered_body_bytes: u64,
    /// cut a relayed response after this long without a byte from the agent, with an error event for streams (default 30s)
    #[argh(option, default = "String::from(\"30s\")")]
    stream_idle_timeout: String,
    /// remove an agent whose control stream stays silent this long, closing its link (default 30s)
    #[argh(option, default = "String::from(\"30s\")")]
    remove_after: String,
    /// the router's Ed25519 libp2p identity, created (mode 0600) when absent (default ./router_identity.key; env HIVENET_ROUTER_IDENTITY_PATH)
    #[argh(option)]
    identity_path: Option<String>,
    /// heartbeat period agents are told to use (default 5s)
    #[argh(option, default = "String::from(\"5s\")")]
    heartbeat_interval: String,
    /// time allowed to receive a request head (default 10s)
    #[argh(option, default = "String::from(\"10s\")")]
    header_timeout: String,
    /// time allowed to receive a whole request body (default 60s)
    #[argh(option, default = "String::from(\"60s\")")]
    body_timeout: String,
    /// history store directory (default ./hivenet-data; env HIVENET_ROUTER_DISK_DB_PATH)
    #[argh(option)]
    disk_db_path: Option<String>,
    /// redis://[:password@]host:port/db (or rediss:// for TLS) shared with the other routers of the fleet: the dynamic key registry, quotas and daily token budgets, held-client dedup (env HIVENET_ROUTER_SHARED_STATE_URL; default: none, this router alone)
    #[argh(option)]
    shared_state: Option<String>,
    /// PEM file of the CA(s) a rediss:// shared state's certificate must chain to (env HIVENET_ROUTER_SHARED_STATE_CA_FILE; default: the system's roots)
    #[argh(option)]
    shared_state_ca_file: Option<String>,
    /// while the shared state is unreachable: open admits quota-limited requests on this router's own limits (charged when it returns), closed refuses them with 429 (env HIVENET_ROUTER_SHARED_STATE_FAILURE_MODE; default open)
    #[argh(option)]
    shared_state_failure_mode: Option<String>,
    /// publish this router's prefix-affinity forwards through the shared state and record the other routers' (a conversation landing on another router finds its agent; env HIVENET_ROUTER_SHARED_STATE_AFFINITY=true; needs --shared-state)
    #[argh(switch)]
    shared_state_affinity: bool,
    /// empty the history store at start
    #[argh(switch)]
    reset_disk_db: bool,
    /// days a history record is kept after its last write; 0 keeps forever (default 30)
    #[argh(option, default = "30")]
    disk_db_ttl: u64,
    /// bytes of stored Responses API conversations, all tenants together; the oldest go first (default 1073741824 = 1 GiB; 0 keeps none)
    #[argh(option, default = "1073741824")]
    responses_max_bytes: u64,
    /// bytes of stored Responses API conversations per tenant; its oldest go first (default 67108864 = 64 MiB; 0 keeps none)
    #[argh(option, default = "67108864")]
    responses_max_bytes_per_tenant: u64,
    /// days a stored Responses API response can be read or continued; 0 keeps until the byte bounds evict it (default 30)
    #[argh(option, default = "30")]
    responses_ttl_days: u64,
    /// period of the history flush (default 30s)
    #[argh(option, default = "String::from(\"30s\")")]
    universal_flush_interval: String,
    /// global routing policy YAML (env HIVENET_ROUTER_POLICY_FILE)
    #[argh(option)]
    policy_file: Option<String>,
    /// directory of per-model policy YAML files, _default.yaml is global (env HIVENET_ROUTER_POLICY_MODEL_DIR)
    #[argh(option)]
    policy_model_dir: Option<String>,
    /// tries per policy step before the next fallback step (default 3; env HIVENET_ROUTER_MAX_TRIES_PER_STEP)
    #[argh(option)]
    max_tries_per_step: Option<String>,
    /// capacity queue bound per model, 0 disables (default 30; env HIVENET_ROUTER_QUEUE_DEPTH)
    #[argh(option)]
    queue_depth: Option<String>,
    /// continuations per streamed chat request whose agent dies mid-stream, 0 disables (default 1; env HIVENET_ROUTER_STREAM_MIGRATIONS)
    #[argh(option)]
    stream_migrations: Option<String>,
    /// time allowed for an agent's preamble (default 5s)
    #[argh(option, default = "String::from(\"5s\")")]
    preamble_timeout: String,
    /// time allowed for an agent's pnet + noise handshake and registration (default 10s)
    #[argh(option, default = "String::from(\"10s\")")]
    handshake_timeout: String,
    /// this router's site in the sibling map; without it no map is taken and nothing is redirected (env HIVENET_ROUTER_SITE_ID)
    #[argh(option)]
    site_id: Option<String>,
    /// warm/cold hints of the sibling map older than this are ignored (default 60s; env HIVENET_ROUTER_SIBLING_HINTS_MAX_AGE)
    #[argh(option)]
    sibling_hints_max_age: Option<String>,
    /// how long a request for a model at zero is held unless its placement sets hold_budget (default 5m; env HIVENET_ROUTER_WAKE_HOLD_BUDGET)
    #[argh(option)]
    wake_hold_budget: Option<String>,
    /// held requests per caller identity (default 32; env HIVENET_ROUTER_WAKE_HOLD_MAX_PER_KEY)
    #[argh(option)]
    wake_hold_max_per_key: Option<String>,
    /// held requests per model (default 512; env HIVENET_ROUTER_WAKE_HOLD_MAX_PER_MODEL)
    #[argh(option)]
    wake_hold_max_per_model: Option<String>,
    /// bytes of held request bodies, router-wide (default 268435456; env HIVENET_ROUTER_WAKE_HOLD_MAX_TOTAL)
    #[argh(option)]
    wake_hold_max_total: Option<String>,
    /// keepalive period of held requests, 0 disables (default 15s; env HIVENET_ROUTER_WAKE_KEEPALIVE)
    #[argh(option)]
    wake_keepalive: Option<String>,
    /// on SIGTERM/SIGINT, time allowed for in-flight requests to finish (default 10s)
    #[argh(option, default = "String::from(\"10s\")")]
    drain_timeout: String,
    /// driver: auto (io_uring, falling back to epoll) or epoll (env HIVENET_ROUTER_DRIVER)
    #[argh(option)]
    driver: Option<String>,
    /// multiaddr agents of other hosts dial (/ip4/<ip>/tcp/<port> or /dns4/<name>/tcp/<port>): logged with the peer ID at start; a loopback --p2p-listen-addr with an address elsewhere is refused
    #[argh(option)]
    p2p_announce_addr: Option<String>,
    /// the Go router's name of --max-agent-links-per-address, which it sets when given (> 0; env HIVENET_ROUTER_P2P_MAX_CONNS_PER_IP)
    #[argh(option)]
    p2p_max_conns_per_ip: Option<String>,
    /// an agent with no heartbeat this long is unhealthy, below --remove-after (default three --heartbeat-interval, 15s)
    #[argh(option)]
    unhealthy_after: Option<String>,
    /// accepted for Go router files, with a warning: no gRPC here (agents dial --p2p-port)
    #[argh(option)]
    grpc_port: Option<String>,
    /// accepted for Go router files, with a warning: no global channel here (--queue-depth bounds waits)
    #[argh(option)]
    queue_size: Option<String>,
    /// accepted for Go router files, with a warning: heartbeats are checked as they arrive (--unhealthy-after)
    #[argh(option)]
    health_check_interval: Option<String>,
    /// accepted for Go router files, with a warning: each agent's capacity bounds its forwards
    #[argh(option)]
    max_concurrent: Option<String>,
    /// accepted for Go router files, with a warning: links are noise-authenticated, no sessions
    #[argh(option)]
    session_ttl: Option<String>,
    /// accepted for Go router files, with a warning: the swarm key (--swarm-key-file) replaces the JWT bootstrap
    #[argh(option)]
    jwt_secret_file: Option<String>,
    /// client keys and quotas, auth.yaml (env HIVENET_ROUTER_AUTH_CONFIG; without it HIVENET_ROUTER_AUTH_MODE decides: none or dynamic)
    #[argh(option)]
    auth_config_file: Option<String>,
    /// take over from the router running on --upgrade-socket: its listening sockets, connections, held requests and store; it finishes its streams and exits (SIGUSR2 on a running router starts its replacement this way)
    #[argh(switch)]
    upgrade: bool,
    /// the Unix socket a running router hands its work over on (default: <--disk-db-path>.upgrade.sock, mode 0600, same user only)
    #[argh(option)]
    upgrade_socket: Option<String>,
    /// time a replaced router gives its streams to finish before it exits (default 10m)
    #[argh(option, default = "String::from(\"10m\")")]
    upgrade_drain_timeout: String,
}

pub(crate) use crate::startup::Startup;

pub(crate) fn build() -> Result<Startup, String> {
    let f: Flags = cli::parse_args();
    let mut cfg = RouterConfig {
        http_addr: cli::parse_listen(&cli::flag_or_env(
            f.http_port,
            "HIVENET_ROUTER_HTTP_PORT",
            ":8080",
        ))
        .map_err(|e| format!("--http-port: {e}"))?,
        metrics_addr: cli::parse_listen(&cli::flag_or_env(
            f.metrics_port,
            "HIVENET_ROUTER_METRICS_PORT",
            ":2112",
        ))
        .map_err(|e| format!("--metrics-port: {e}"))?,
        ..RouterConfig::default()
    };
    let p2p_port: u16 = cli::flag_or_env(f.p2p_port, "HIVENET_ROUTER_P2P_PORT", "9000")
        .parse()
        .map_err(|_| "--p2p-port: must be a port number".to_string())?;
    let ip = cli::parse_ip(&f.p2p_listen_addr).map_err(|e| format!("--p2p-listen-addr: {e}"))?;
    cfg.p2p_addr = std::net::SocketAddr::new(ip, p2p_port);
    let ports = [
        ("--http-port", cfg.http_addr.port()),
        ("--metrics-port", cfg.metrics_addr.port()),
        ("--p2p-port", cfg.p2p_addr.port()),
    ];
    for (i, (a, pa)) in ports.iter().enumerate() {
        for (b, pb) in ports.iter().skip(i + 1) {
            if *pa != 0 && pa == pb {
                return Err(format!(
                    "{a} and {b} use the same port {pa}; each listener needs its own"
                ));
            }
        }
    }
    cfg.request_timeout = cli::parse_duration(
        "--request-timeout",
        &cli::flag_or_env(f.request_timeout, "HIVENET_ROUTER_REQUEST_TIMEOUT", "60s"),
    )?;
    cfg.header_timeout = cli::parse_duration("--header-timeout", &f.header_timeout)?;
    cfg.preamble_timeout = cli::parse_duration("--preamble-timeout", &f.preamble_timeout)?;
    cfg.handshake_timeout = cli::parse_duration("--handshake-timeout", &f.handshake_timeout)?;
    cfg.body_timeout = cli::parse_duration("--body-timeout", &f.body_timeout)?;
    cfg.heartbeat_interval = cli::parse_duration("--heartbeat-interval", &f.heartbeat_interval)?;
    if cfg.heartbeat_interval.is_zero() {
        return Err("--heartbeat-interval must be greater than 0".into());
    }
    cfg.max_client_connections = f.max_client_connections;
    cfg.max_agent_links = f.max_agent_links;
    cfg.max_agent_links_per_address = f.max_agent_links_per_address;
    if f.max_pending_agent_links == 0 || f.max_pending_agent_links_per_address == 0 {
        return Err(
            "--max-pending-agent-links and --max-pending-agent-links-per-address must be greater than 0 (they bound what unauthenticated peers may hold)"
                .into(),
        );
    }
    cfg.max_pending_agent_links = f.max_pending_agent_links;
    cfg.max_pending_agent_links_per_address = f.max_pending_agent_links_per_address;
    if f.affinity_table_entries < 1024 {
        return Err(format!(
            "--affinity-table-entries must be at least 1024, not {}",
            f.affinity_table_entries
        ));
    }
    cfg.affinity_table_entries = f.affinity_table_entries;
    // The caps must fit the descriptor limit, or silent connections
    // starve everything else of descriptors (issue 29 #4).
    if let Some(nofile) = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|t| shards::logic::system::procfs::open_files_limit(&t))
    {
        // Links before and after their handshake share the links' room.
        let all_links = match cfg.max_agent_links {
            0 => 0,
            n => n.saturating_add(cfg.max_pending_agent_links),
        };
        let (clients, room, lowered) = shards::logic::system::procfs::fit_connection_caps(
            nofile,
            cfg.max_client_connections,
            all_links,
        );
        if lowered {
            let pending = cfg.max_pending_agent_links.min((room / 2).max(1));
            let links = room.saturating_sub(pending).max(1);
            warn!(
                nofile,
                from_clients = cfg.max_client_connections,
                from_links = cfg.max_agent_links,
                from_pending = cfg.max_pending_agent_links,
                clients,
                links,
                pending,
                "the descriptor limit (ulimit -n) is below the connection caps: caps lowered to fit (raise LimitNOFILE to keep them)"
            );
            cfg.max_client_connections = clients;
            cfg.max_agent_links = links;
            cfg.max_pending_agent_links = pending;
        }
    }
    cfg.max_buffered_body_bytes = f.max_buffered_body_bytes;
    cfg.responses_per_tenant = f.responses_max_bytes_per_tenant;
    cfg.responses_ttl_secs = f.responses_ttl_days.saturating_mul(86_400);
    cfg.stream_idle_timeout = cli::parse_duration("--stream-idle-timeout", &f.stream_idle_timeout)?;
    if cfg.stream_idle_timeout.is_zero() {
        return Err("--stream-idle-timeout must be greater than 0".into());
    }
    cfg.remove_after = cli::parse_duration("--remove-after", &f.remove_after)?;
    if cfg.remove_after.is_zero() {
        return Err("--remove-after must be greater than 0".into());
    }
    let go = crate::go_flags::GoFlags {
        grpc_port: f.grpc_port,
        p2p_announce_addr: f.p2p_announce_addr,
        p2p_max_conns_per_ip: f.p2p_max_conns_per_ip,
        queue_size: f.queue_size,
        health_check_interval: f.health_check_interval,
        unhealthy_after: f.unhealthy_after,
        max_concurrent: f.max_concurrent,
        session_ttl: f.session_ttl,
        jwt_secret_file: f.jwt_secret_file,
    };
    let announce = crate::go_flags::apply(go, ip, &mut cfg)?;
    let identity = cli::flag_or_env(
        f.identity_path,
        "HIVENET_ROUTER_IDENTITY_PATH",
        "./router_identity.key",
    );
    let keypair =
        shards::runtime::wire::link::load_or_create_identity(std::path::Path::new(&identity))
            .map_err(|e| format!("--identity-path: {e}"))?;
    if let Ok(v) = std::env::var("HIVENET_ROUTER_MAX_REQUEST_BYTES") {
        cfg.max_request_bytes = v.trim().parse().map_err(|_| {
            format!("HIVENET_ROUTER_MAX_REQUEST_BYTES: {v:?} is not a non-negative integer")
        })?;
    }
    let cpus = match f.cpus {
        Some(s) => Some(core_plan::parse_cpu_list(&s).map_err(|e| format!("--cpus: {e}"))?),
        None => None,
    };
    if f.no_pin && cpus.is_some() {
        return Err("--no-pin and --cpus: choose one (--cpus pins the shards)".into());
    }
    let mut plan = core_plan::plan(f.shards, cpus.as_deref(), &executor::available_cpus())?;
    if f.no_pin {
        // A pinned shard waits for its own core while an engine computes
        // there; unpinned, it runs on whichever core is free (measured:
        // perf/2026-12-02-real-hops).
        plan.iter_mut().for_each(|c| *c = None);
    }
    crate::start_checks::affinity_fits(cfg.affinity_table_entries, plan.len())?;
    let driver_s = cli::flag_or_env(f.driver, "HIVENET_ROUTER_DRIVER", "auto");
    let driver = DriverChoice::parse(&driver_s)
        .ok_or_else(|| format!("--driver: {driver_s:?} is not auto or epoll"))?;
    let psk = match f.swarm_key_file {
        Some(p) => Some(shards::runtime::wire::link::load_swarm_key(
            std::path::Path::new(&p),
        )?),
        None => None,
    };
    crate::start_checks::open_p2p_check(ip, psk.is_some(), f.allow_open_p2p)?;
    cfg.flush_interval =
        cli::parse_duration("--universal-flush-interval", &f.universal_flush_interval)?;
    if cfg.flush_interval.is_zero() {
        return Err("--universal-flush-interval must be greater than 0".into());
    }
    let shared_state = match cli::flag_or_env_opt(f.shared_state, "HIVENET_ROUTER_SHARED_STATE_URL")
    {
        Some(url) if !url.trim().is_empty() => {
            let explicit = cli::flag_or_env_opt(
                f.shared_state_failure_mode,
                "HIVENET_ROUTER_SHARED_STATE_FAILURE_MODE",
            );
            let mode = explicit.clone().unwrap_or_else(|| "open".into());
            let fail_closed = match mode.trim() {
                "open" => false,
                "closed" => true,
                other => {
                    return Err(format!(
                        "--shared-state-failure-mode: {other:?} is neither open nor closed"
                    ))
                }
            };
            let ca_pem = match cli::flag_or_env_opt(
                f.shared_state_ca_file,
                "HIVENET_ROUTER_SHARED_STATE_CA_FILE",
            ) {
                Some(p) => Some(
                    std::fs::read(&p)
                        .map_err(|e| format!("--shared-state-ca-file: cannot read {p}: {e}"))?,
                ),
                None => None,
            };
            let (state, pending) = shards::runtime::services::shared_state::SharedState::new(
                &url,
                fail_closed,
                ca_pem,
            )?;
            let me = keypair.public().to_peer_id().to_string();
            crate::start_checks::shared_state_usable(
                state.preflight(&pending, &me),
                &state.shown,
                explicit.as_deref().map(str::trim) == Some("open"),
            )?;
            Some((state, pending))
        }
        _ => None,
    };
    let shared_affinity = f.shared_state_affinity
        || matches!(
            std::env::var("HIVENET_ROUTER_SHARED_STATE_AFFINITY").as_deref(),
            Ok("true" | "1")
        );
    if shared_affinity && shared_state.is_none() {
        return Err("--shared-state-affinity needs --shared-state".into());
    }
    let store = hivenet_router::store::StoreConfig {
        path: std::path::PathBuf::from(cli::flag_or_env(
            f.disk_db_path,
            "HIVENET_ROUTER_DISK_DB_PATH",
            "./hivenet-data",
        )),
        reset: f.reset_disk_db,
        ttl_days: f.disk_db_ttl,
        responses: hivenet_router::store::responses::Bounds {
            per_tenant: f.responses_max_bytes_per_tenant,
            total: f.responses_max_bytes,
            ttl_secs: f.responses_ttl_days.saturating_mul(86_400),
        },
    };
    let auth_sources = hivenet_router::auth_files::AuthSources {
        file: cli::flag_or_env_opt(f.auth_config_file, "HIVENET_ROUTER_AUTH_CONFIG")
            .map(Into::into),
        env_mode: std::env::var("HIVENET_ROUTER_AUTH_MODE").ok(),
    };
    let auth = hivenet_router::auth_files::load(&auth_sources)?;
    let (admin_keys, insecure_admin) = hivenet_router::auth_files::admin(
        &auth,
        std::env::var("HIVENET_ROUTER_ADMIN_API_KEYS")
            .ok()
            .as_deref(),
        std::env::var("HIVENET_ROUTER_ALLOW_INSECURE_ADMIN")
            .ok()
            .as_deref(),
    )?;
    if let Ok(v) = std::env::var("HIVENET_ROUTER_RPM_BURST_SECONDS") {
        cfg.rpm_burst_secs = match v.trim().parse::<u64>() {
            Ok(n) if n < 60 => n,
            _ => {
                return Err(format!(
                    "HIVENET_ROUTER_RPM_BURST_SECONDS: {v:?} must be an integer in [0, 60)"
                ))
            }
        };
    }
    if let Ok(v) = std::env::var("HIVENET_ROUTER_ADMIT_FRACTION") {
        cfg.admit_fraction = match v.trim().parse::<f64>() {
            Ok(x) if x > 0.0 && x <= 1.0 => x,
            _ => {
                return Err(format!(
                    "HIVENET_ROUTER_ADMIT_FRACTION: {v:?} must be a number in (0, 1]"
                ))
            }
        };
    }
    if let Ok(v) = std::env::var("HIVENET_ROUTER_ADMIT_PARK_TIMEOUT") {
        // "0" (no unit) means no park, as in Go.
        cfg.admit_park_timeout = if v.trim() == "0" {
            std::time::Duration::ZERO
        } else {
            cli::parse_duration("HIVENET_ROUTER_ADMIT_PARK_TIMEOUT", &v)?
        };
    }
    let audit_path = audit_path_of(std::env::var("HIVENET_ROUTER_AUDIT_LOG_PATH").ok());
    let audit_max_bytes = match std::env::var("HIVENET_ROUTER_AUDIT_MAX_BYTES") {
        Err(_) => DEFAULT_AUDIT_MAX_BYTES,
        Ok(v) => v.trim().parse::<u64>().map_err(|_| {
            format!("HIVENET_ROUTER_AUDIT_MAX_BYTES: {v:?} is not a byte count (0: no cap)")
        })?,
    };
    let tries = cli::flag_or_env(
        f.max_tries_per_step,
        "HIVENET_ROUTER_MAX_TRIES_PER_STEP",
        "3",
    );
    cfg.max_tries_per_step = match tries.trim().parse::<u32>() {
        Ok(n) if n >= 1 => n,
        _ => {
            return Err(format!(
                "--max-tries-per-step: {tries:?} must be an integer >= 1"
            ))
        }
    };
    let migrations = cli::flag_or_env(f.stream_migrations, "HIVENET_ROUTER_STREAM_MIGRATIONS", "1");
    cfg.stream_migrations = match migrations.trim().parse::<u32>() {
        Ok(n) if n <= MAX_STREAM_MIGRATIONS => n,
        _ => {
            return Err(format!(
                "--stream-migrations: {migrations:?} must be an integer from 0 to {MAX_STREAM_MIGRATIONS}"
            ))
        }
    };
    let depth = cli::flag_or_env(f.queue_depth, "HIVENET_ROUTER_QUEUE_DEPTH", "30");
    cfg.queue_depth = depth
        .trim()
        .parse::<usize>()
        .map_err(|_| format!("--queue-depth: {depth:?} must be an integer >= 0"))?;
    let policy_sources = hivenet_router::policy_files::PolicySources {
        file: cli::flag_or_env_opt(f.policy_file, "HIVENET_ROUTER_POLICY_FILE").map(Into::into),
        dir: cli::flag_or_env_opt(f.policy_model_dir, "HIVENET_ROUTER_POLICY_MODEL_DIR")
            .map(Into::into),
    };
    let policies = hivenet_router::policy_files::load(&policy_sources)?;
    cfg.providers =
        shards::runtime::services::providers::Providers::from_env(|k| std::env::var(k).ok())?;
    cfg.providers
        .check(&policies)
        .map_err(|e| format!("policy: {e}"))?;
    hivenet_router::policy_files::serverless_check(
        auth.keys.iter().filter_map(|(_, k)| match k.limits {
            shards::logic::tenancy::auth::Limits::Flat { itpm, .. } if itpm > 0 => {
                Some((k.name.as_str(), itpm))
            }
            _ => None,
        }),
        &policies,
    )?;
    cfg.site_id = cli::flag_or_env_opt(f.site_id, "HIVENET_ROUTER_SITE_ID");
    if let Some(id) = &cfg.site_id {
        if !shards::logic::sites::valid_site_id(id) {
            return Err(format!(
                "--site-id: {id:?} must match [A-Za-z0-9._-]{{1,64}}"
            ));
        }
    }
    let age = cli::flag_or_env(
        f.sibling_hints_max_age,
        "HIVENET_ROUTER_SIBLING_HINTS_MAX_AGE",
        "60s",
    );
    cfg.sibling_hints_max_age = cli::parse_duration("--sibling-hints-max-age", &age)?;
    if cfg.sibling_hints_max_age.is_zero() {
        return Err("--sibling-hints-max-age must be > 0".into());
    }
    let budget = cli::flag_or_env(f.wake_hold_budget, "HIVENET_ROUTER_WAKE_HOLD_BUDGET", "5m");
    cfg.wake_hold_budget = cli::parse_duration("--wake-hold-budget", &budget)?;
    if cfg.wake_hold_budget.is_zero() {
        return Err("--wake-hold-budget must be > 0".into());
    }
    let limit = |flag: Option<String>, name: &str, env: &str, default: &str| {
        let v = cli::flag_or_env(flag, env, default);
        match v.trim().parse::<u64>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{name}: {v:?} must be an integer > 0")),
        }
    };
    cfg.hold_limits = shards::logic::sites::hold::Limits {
        per_key: limit(
            f.wake_hold_max_per_key,
            "--wake-hold-max-per-key",
            "HIVENET_ROUTER_WAKE_HOLD_MAX_PER_KEY",
            "32",
        )?,
        per_model: limit(
            f.wake_hold_max_per_model,
            "--wake-hold-max-per-model",
            "HIVENET_ROUTER_WAKE_HOLD_MAX_PER_MODEL",
            "512",
        )?,
        total_bytes: limit(
            f.wake_hold_max_total,
            "--wake-hold-max-total",
            "HIVENET_ROUTER_WAKE_HOLD_MAX_TOTAL",
            "268435456",
        )?,
    };
    let ka = cli::flag_or_env(f.wake_keepalive, "HIVENET_ROUTER_WAKE_KEEPALIVE", "15s");
    cfg.wake_keepalive = if ka.trim() == "0" {
        std::time::Duration::ZERO
    } else {
        cli::parse_duration("--wake-keepalive", &ka)?
    };
    let drain = cli::parse_duration("--drain-timeout", &f.drain_timeout)?;
    let upgrade = crate::startup::upgrade_cfg(
        f.upgrade,
        f.upgrade_socket,
        &f.upgrade_drain_timeout,
        &store,
    )?;
    cfg.drain_timeout = drain;
    Ok(Startup {
        drain,
        policy_sources,
        policies,
        store,
        admin_keys,
        insecure_admin,
        auth_sources,
        auth,
        audit: audit_path.map(|(p, explicit)| (p, explicit, audit_max_bytes)),
        cfg,
        plan,
        driver,
        psk,
        keypair,
        shared_state,
        shared_affinity,
        announce,
        upgrade,
    })
}

/// Where the audit log goes when no path is set: the working directory,
/// like the store (the service units run in the router's state directory).
pub(crate) const DEFAULT_AUDIT_PATH: &str = "hivenet-audit.jsonl";
/// The audit file's size before it is rotated to `<path>.1`.
pub(crate) const DEFAULT_AUDIT_MAX_BYTES: u64 = 100 * 1024 * 1024;
/// Most continuations of one stream (each one is a whole new request to
/// an agent; more than a few means the fleet is failing, not one agent).
pub(crate) const MAX_STREAM_MIGRATIONS: u32 = 8;

/// The audit log's path and whether the operator chose it; `None`: off.
pub(crate) fn audit_path_of(env: Option<String>) -> Option<(std::path::PathBuf, bool)> {
    match env.as_deref().map(str::trim) {
        None | Some("") => Some((DEFAULT_AUDIT_PATH.into(), false)),
        Some("off") => None,
        Some(p) => Some((p.into(), true)),
    }
}
