//! The real engine in tests: llama.cpp's llama-server with SmolLM2-135M,
//! installed by `scripts/install-llama.sh` (cached outside the clone; a
//! second run takes a second), and a router + agent `--engine llamacpp`
//! in front of it.

use super::*;

/// The engine and model paths the install script prints.
pub fn install() -> (PathBuf, PathBuf) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(root.join("scripts/install-llama.sh"))
        .output()
        .expect("run scripts/install-llama.sh");
    assert!(
        out.status.success(),
        "scripts/install-llama.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let get = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .map(PathBuf::from)
            .unwrap_or_else(|| panic!("{k} missing in: {text}"))
    };
    (get("LLAMA_SERVER"), get("LLAMA_MODEL"))
}

/// The command line of llama-server on `port`: one thread, a 2048-token
/// context, one slot, metrics on, plus `extra`.
pub fn llama_command(port: u16, extra: &[&str]) -> Command {
    let (server, model) = install();
    let mut c = Command::new(server);
    c.arg("-m").arg(model).args([
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "-t",
        "1",
        "-c",
        "2048",
        "-np",
        "1",
        "--metrics",
    ]);
    c.args(extra);
    c
}

/// llama-server on `port`, up (its `/health` answers 200).
pub fn start_llama(dir: &Path, port: u16, extra: &[&str]) -> Proc {
    let log = dir.join(format!("llama-{port}.log"));
    let f = std::fs::File::create(&log).expect("log");
    let f2 = f.try_clone().expect("clone");
    let child = llama_command(port, extra)
        .stdout(f)
        .stderr(f2)
        .spawn()
        .expect("spawn llama-server");
    let p = Proc {
        child,
        name: "llama-server".into(),
        log,
    };
    wait_until(
        Duration::from_secs(120),
        || {
            Req::get("/health")
                .send(port)
                .map(|r| r.status == 200)
                .unwrap_or(false)
        },
        "llama-server up",
    );
    p
}

/// A router with one agent in front of one llama-server.
pub struct RealStack {
    pub dir: PathBuf,
    pub llama: Proc,
    pub router: Router,
    pub agent: Proc,
    /// The engine's port.
    pub lport: u16,
    /// The model name the agent discovered from the engine.
    pub model: String,
}

impl RealStack {
    /// Start llama-server (`llama_extra`), a router and an agent
    /// (`--engine llamacpp --warmup off` plus `agent_extra`); wait until
    /// the agent is registered with its backend healthy.
    pub fn start(tag: &str, llama_extra: &[&str], agent_extra: &[&str]) -> RealStack {
        RealStack::start_with(tag, &[], llama_extra, agent_extra)
    }

    /// [`RealStack::start`] with `router_extra` on the router's command line.
    pub fn start_with(
        tag: &str,
        router_extra: &[&str],
        llama_extra: &[&str],
        agent_extra: &[&str],
    ) -> RealStack {
        let dir = tmpdir(tag);
        let lport = free_port();
        let llama = start_llama(&dir, lport, llama_extra);
        let router = start_router(&dir, router_extra, &[]);
        let mut args = vec!["--engine", "llamacpp", "--warmup", "off"];
        args.extend_from_slice(agent_extra);
        let agent = start_agent(&dir, &router, lport, "a.key", &args);
        wait_until(
            Duration::from_secs(60),
            || routing_table(router.http)["agents"][0]["status"]["backend_healthy"] == true,
            "agent registered, backend healthy",
        );
        let model = routing_table(router.http)["agents"][0]["metadata"]["model"]
            .as_str()
            .expect("model name")
            .to_string();
        RealStack {
            dir,
            llama,
            router,
            agent,
            lport,
            model,
        }
    }

    /// The routing table's entry of the agent.
    pub fn agent_row(&self) -> serde_json::Value {
        routing_table(self.router.http)["agents"][0].clone()
    }
}
