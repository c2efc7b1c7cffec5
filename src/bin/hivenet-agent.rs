//! `hivenet-agent`: the sidecar beside one inference backend.
#![forbid(unsafe_code)]

use std::path::Path;
use std::time::Duration;

use argh::FromArgs;
use hivenet_router::agent::backend::BackendUrl;
use hivenet_router::agent::engine::Engine;
use hivenet_router::agent::{self, AgentConfig};
use hivenet_router::cli;
use shards::logic::link::control::Capability;
use shards::runtime::wire::executor::{self, DriverChoice};
use shards::runtime::wire::link;
use tracing::{info, warn};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Sidecar that registers one inference backend with a hivenet-router.
#[derive(FromArgs)]
struct Flags {
    /// router libp2p address: /ip4/127.0.0.1/tcp/9000[/p2p/<peer-id>] or host:port; repeat it for several routers, which then share --capacity (env HIVENET_AGENT_ROUTER_P2P, comma-separated; default /ip4/127.0.0.1/tcp/9000)
    #[argh(option)]
    router_p2p: Vec<String>,
    /// backend base URL (default http://localhost:8888)
    #[argh(option, default = "String::from(\"http://localhost:8888\")")]
    backend_url: String,
    /// vllm|sglang|ollama|llamacpp|infinity|custom (default vllm)
    #[argh(option, default = "String::from(\"vllm\")")]
    engine: String,
    /// health URL for --engine custom (required there)
    #[argh(option)]
    health_url: Option<String>,
    /// llm|embedding|reranker (default llm)
    #[argh(option, default = "String::from(\"llm\")")]
    capability: String,
    /// model name (default: discovered from the backend)
    #[argh(option)]
    model: Option<String>,
    /// concurrent requests this backend accepts (default 10)
    #[argh(option, default = "10")]
    capacity: u32,
    /// ed25519 identity file, created with mode 0600 when absent (default ./agent_identity.key)
    #[argh(option, default = "String::from(\"./agent_identity.key\")")]
    identity_path: String,
    /// pre-shared key file in the standard swarm.key format (must match the router's)
    #[argh(option)]
    swarm_key_file: Option<String>,
    /// region label (default UE-France)
    #[argh(option, default = "String::from(\"UE-France\")")]
    region: String,
    /// organization label (default Unknown)
    #[argh(option, default = "String::from(\"Unknown\")")]
    organization: String,
    /// machine label (default Unknown)
    #[argh(option, default = "String::from(\"Unknown\")")]
    machine: String,
    /// comma-separated tags (default production)
    #[argh(option, default = "String::from(\"production\")")]
    tags: String,
    /// time the backend has to start its answer (its response head; for a non-streamed answer, the whole answer), and the bound of health and warm-up calls; a stream that has started is bounded by --stream-write-timeout only (default 120s)
    #[argh(option, default = "String::from(\"120s\")")]
    http_timeout: String,
    /// longest silence of a streamed answer between two bytes from the backend, and of each write to the router; 0 disables (default 60s)
    #[argh(option, default = "String::from(\"60s\")")]
    stream_write_timeout: String,
    /// on SIGTERM or SIGINT: the routers are told at once to send nothing
    /// new, and requests in flight have this long to finish; streams still
    /// running then are continued by the router on another agent (default
    /// 30s; a second signal leaves at once)
    #[argh(option, default = "String::from(\"30s\")")]
    drain_timeout: String,
    /// backend health check cadence while registered (default 2s)
    #[argh(option, default = "String::from(\"2s\")")]
    hardware_sample_interval: String,
    /// engine metrics scrape cadence for vllm, sglang and llamacpp (default 500ms)
    #[argh(option, default = "String::from(\"500ms\")")]
    engine_sample_interval: String,
    /// routing-signal push cadence; defaults to --engine-sample-interval (spec name)
    #[argh(option)]
    routing_signal_interval: Option<String>,
    /// version label (default dev)
    #[argh(option, default = "String::from(\"dev\")")]
    version: String,
    /// deployment ID (env HIVENET_ROUTER_DEPLOYMENT_ID)
    #[argh(option)]
    deployment_id: Option<String>,
    /// replica ID (env HIVENET_ROUTER_REPLICA_ID)
    #[argh(option)]
    replica_id: Option<String>,
    /// warm-up before registering: auto (ollama and sglang llm agents), on, off (default auto)
    #[argh(option, default = "String::from(\"auto\")")]
    warmup: String,
    /// driver: auto or epoll (default auto)
    #[argh(option, default = "String::from(\"auto\")")]
    driver: String,
    /// GPU model to register, matched by a policy's match.gpu_model (default: the first GPU nvidia-smi names, when it runs)
    #[argh(option)]
    gpu_model: Option<String>,
    /// nvidia-smi to read the GPUs with, every --hardware-sample-interval (default nvidia-smi on PATH; absent: no GPU signals)
    #[argh(option, default = "String::from(\"nvidia-smi\")")]
    nvidia_smi: String,
    /// file of the GPU UUIDs to report, separated by commas or newlines ("all" and "none" ignored; empty: no GPU; missing: every GPU, the file looked for again at each sample)
    #[argh(option)]
    gpu_devices_file: Option<String>,
    /// mark the model hidden in /v1/models (it stays listed with "hide_llm": true, as in the Go router)
    #[argh(switch)]
    hide_llm: bool,
    /// display name of the model in /v1/models ("pretty_name")
    #[argh(option)]
    llm_pretty_name: Option<String>,
    /// free text about the model in /v1/models ("info")
    #[argh(option)]
    llm_info: Option<String>,
    /// accepted for Go agent files, with a warning with a warning: there is no gRPC here (--router-p2p replaces it)
    #[argh(option)]
    router_grpc: Option<String>,
    /// accepted for Go agent files, with a warning with a warning: the libp2p swarm key (--swarm-key-file) and the noise identity replace the JWT bootstrap
    #[argh(option)]
    jwt_secret_file: Option<String>,
    /// accepted for Go agent files, with a warning with a warning: the agent only dials its routers, it listens on no port
    #[argh(option)]
    p2p_listen_port: Option<String>,
}

/// The Go agent's flags that the libp2p design makes meaningless: each
/// given one is named in one warning with what replaces it.
fn warn_go_flags(f: &Flags) {
    let given = [
        (
            "--router-grpc",
            f.router_grpc.is_some(),
            "agents link over libp2p: --router-p2p",
        ),
        (
            "--jwt-secret-file",
            f.jwt_secret_file.is_some(),
            "the swarm key (--swarm-key-file) and the agent's noise identity (--identity-path)",
        ),
        (
            "--p2p-listen-port",
            f.p2p_listen_port.is_some(),
            "nothing: the agent only dials its routers",
        ),
    ];
    for (flag, set, instead) in given {
        if set {
            warn!(
                flag,
                replaced_by = instead,
                "{flag} is a Go agent flag with no use here; ignored (replaced by: {instead})"
            );
        }
    }
}

fn build() -> Result<(AgentConfig, DriverChoice), String> {
    let f: Flags = cli::parse_args();
    warn_go_flags(&f);
    let engine = Engine::parse(&f.engine).ok_or_else(|| {
        format!(
            "--engine: unknown engine {:?} (vllm|sglang|ollama|llamacpp|infinity|custom)",
            f.engine
        )
    })?;
    let capability = Capability::parse(&f.capability).ok_or_else(|| {
        format!(
            "--capability: unknown capability {:?} (llm|embedding|reranker)",
            f.capability
        )
    })?;
    if engine == Engine::Ollama && capability == Capability::Reranker {
        return Err("--capability reranker is not supported with --engine ollama".into());
    }
    if f.capacity == 0 {
        return Err("--capacity must be greater than 0".into());
    }
    let health_url = match (&engine, f.health_url) {
        (Engine::Custom, None) => return Err("--engine custom requires --health-url".into()),
        (_, Some(u)) => Some(BackendUrl::parse(&u).map_err(|e| format!("--health-url: {e}"))?),
        (_, None) => None,
    };
    if engine == Engine::Custom && f.model.is_none() {
        return Err("--engine custom requires --model (it has no model discovery)".into());
    }
    if let Some(m) = &f.model {
        if m.is_empty() || m.len() > shards::logic::http::api::probe::MAX_MODEL_BYTES {
            return Err("--model must be 1 to 256 bytes".into());
        }
    }
    let warmup = match (f.warmup.as_str(), engine.needs_warmup()) {
        ("auto", w) => w,
        ("on", _) => true,
        ("off", _) => false,
        (other, _) => return Err(format!("--warmup: {other:?} is not auto, on or off")),
    };
    let keypair = link::load_or_create_identity(Path::new(&f.identity_path))?;
    let psk = match f.swarm_key_file {
        Some(p) => Some(link::load_swarm_key(Path::new(&p))?),
        None => None,
    };
    let gpu_model_flag = cli::flag_or_env_opt(f.gpu_model, "HIVENET_ROUTER_GPU_MODEL");
    if let Some(m) = &gpu_model_flag {
        if m.is_empty() || m.len() > 256 {
            return Err("--gpu-model must be 1 to 256 bytes".into());
        }
    }
    let health_interval =
        cli::parse_duration("--hardware-sample-interval", &f.hardware_sample_interval)?;
    let devices = agent::gpu::Devices::from_flag(f.gpu_devices_file.as_deref());
    let (first_gpu, gpus) = agent::gpu::start(&f.nvidia_smi, devices, health_interval);
    let gpu_model = gpu_model_flag
        .or_else(|| first_gpu.map(|g| g.model))
        .unwrap_or_default();
    let cfg = AgentConfig {
        routers: router_addrs(f.router_p2p)?,
        backend: BackendUrl::parse(&f.backend_url).map_err(|e| format!("--backend-url: {e}"))?,
        engine,
        health_url,
        capability,
        model: f.model,
        capacity: f.capacity,
        keypair,
        psk,
        region: f.region,
        organization: f.organization,
        machine: f.machine,
        tags: f
            .tags
            .split(',')
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
            .collect(),
        version: f.version,
        deployment_id: cli::flag_or_env(f.deployment_id, "HIVENET_ROUTER_DEPLOYMENT_ID", ""),
        replica_id: cli::flag_or_env(f.replica_id, "HIVENET_ROUTER_REPLICA_ID", ""),
        http_timeout: cli::parse_duration("--http-timeout", &f.http_timeout)?,
        stream_write_timeout: Some(cli::parse_duration(
            "--stream-write-timeout",
            &f.stream_write_timeout,
        )?)
        .filter(|d| !d.is_zero()),
        drain_timeout: cli::parse_duration("--drain-timeout", &f.drain_timeout)?,
        health_interval,
        warmup,
        gpu_model,
        gpus,
        hide_llm: f.hide_llm,
        llm_pretty_name: f.llm_pretty_name.unwrap_or_default(),
        llm_info: f.llm_info.unwrap_or_default(),
        signal_interval: match &f.routing_signal_interval {
            Some(v) => cli::parse_duration("--routing-signal-interval", v)?,
            None => cli::parse_duration("--engine-sample-interval", &f.engine_sample_interval)?,
        },
        traces: cli::trace_export("hivenet-agent")?,
    };
    if cfg.http_timeout < Duration::from_millis(1) {
        return Err("--http-timeout must be greater than 0".into());
    }
    let driver = DriverChoice::parse(&f.driver)
        .ok_or_else(|| format!("--driver: {:?} is not auto or epoll", f.driver))?;
    Ok((cfg, driver))
}

/// Routers from `--router-p2p` (repeated), else the env's comma-separated
/// list, else the default; the same address twice is refused.
fn router_addrs(flags: Vec<String>) -> Result<Vec<agent::RouterAddr>, String> {
    let given = if flags.is_empty() {
        std::env::var("HIVENET_AGENT_ROUTER_P2P")
            .ok()
            .map(|v| {
                v.split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    } else {
        flags
    };
    let given = if given.is_empty() {
        vec!["/ip4/127.0.0.1/tcp/9000".to_string()]
    } else {
        given
    };
    if given.len() > agent::MAX_ROUTERS {
        return Err(format!(
            "--router-p2p: {} routers, at most {}",
            given.len(),
            agent::MAX_ROUTERS
        ));
    }
    let mut out: Vec<agent::RouterAddr> = Vec::with_capacity(given.len());
    for s in &given {
        let r = agent::parse_router_addr(s)?;
        if out.iter().any(|o| o.addr == r.addr) {
            return Err(format!("--router-p2p: {s:?} is given twice"));
        }
        out.push(r);
    }
    Ok(out)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    shards::exit_on_version_flag("hivenet-agent", &args);
    cli::init_logging();
    let (cfg, driver) = match build() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("hivenet-agent: {e}");
            std::process::exit(2);
        }
    };
    // Every line the agent logs carries its peer ID (spec 03: the agent's
    // logs are labelled `peer_id`); the agent runs on this thread.
    let peer_id = cfg.keypair.public().to_peer_id();
    let _labelled = tracing::info_span!("agent", %peer_id).entered();
    let routers: Vec<String> = cfg.routers.iter().map(|r| r.addr.to_string()).collect();
    info!(peer_id = %peer_id, routers = ?routers, engine = cfg.engine.as_str(), "hivenet-agent starting");
    // SIGTERM and SIGINT start a drain (a second one ends it), read on a
    // thread of their own and handed to the runtime.
    let (stop_tx, stop_rx) = futures::channel::mpsc::unbounded();
    match signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ]) {
        Ok(mut signals) => {
            let spawned = std::thread::Builder::new()
                .name("signals".into())
                .spawn(move || {
                    for _ in signals.forever() {
                        if stop_tx.unbounded_send(()).is_err() {
                            return;
                        }
                    }
                });
            if let Err(e) = spawned {
                eprintln!("hivenet-agent: cannot start the signal thread: {e}");
                std::process::exit(1);
            }
        }
        Err(e) => {
            eprintln!("hivenet-agent: cannot install signal handlers: {e}");
            std::process::exit(1);
        }
    }
    executor::run_on_runtime(driver, |kind| {
        info!("agent runtime driver {kind}");
        agent::run(cfg, stop_rx)
    });
}
