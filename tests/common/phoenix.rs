//! A real OTLP receiver for the trace tests: Arize Phoenix (PyPI),
//! installed by `scripts/install-phoenix.sh` (cached outside the clone),
//! started on free ports with its own working directory; its stored spans
//! read back through its REST API.

use super::*;

/// A running Phoenix.
pub struct Phoenix {
    pub proc: Proc,
    pub port: u16,
}

/// The `phoenix` command the install script prints.
fn install() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(root.join("scripts/install-phoenix.sh"))
        .output()
        .expect("run scripts/install-phoenix.sh");
    assert!(
        out.status.success(),
        "scripts/install-phoenix.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.lines()
        .find_map(|l| l.strip_prefix("PHOENIX="))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("PHOENIX= missing in: {text}"))
}

pub fn start_phoenix(dir: &Path) -> Phoenix {
    let bin = install();
    let (port, grpc) = (free_port(), free_port());
    let work = dir.join("phoenix");
    std::fs::create_dir_all(&work).expect("phoenix dir");
    let log = dir.join(format!("phoenix-{port}.log"));
    let f = std::fs::File::create(&log).expect("log");
    let f2 = f.try_clone().expect("clone");
    let child = Command::new(bin)
        .arg("serve")
        .env("PHOENIX_WORKING_DIR", &work)
        .env("PHOENIX_PORT", port.to_string())
        .env("PHOENIX_GRPC_PORT", grpc.to_string())
        .env("PHOENIX_HOST", "127.0.0.1")
        .env("PHOENIX_TELEMETRY_ENABLED", "false")
        .current_dir(dir)
        .stdout(f)
        .stderr(f2)
        .spawn()
        .expect("phoenix serve");
    let p = Phoenix {
        proc: Proc {
            child,
            name: "phoenix".into(),
            log,
        },
        port,
    };
    wait_until(
        Duration::from_secs(180),
        || {
            Req::get("/healthz")
                .send(port)
                .map(|r| r.status == 200)
                .unwrap_or(false)
        },
        "phoenix up",
    );
    p
}

impl Phoenix {
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` for it.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every stored span of `trace_id`.
    pub fn spans(&self, trace_id: &str) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        let mut cursor: Option<String> = None;
        for _ in 0..50 {
            let path = match &cursor {
                None => "/v1/projects/default/spans?limit=1000".to_string(),
                Some(c) => format!("/v1/projects/default/spans?limit=1000&cursor={c}"),
            };
            let Ok(r) = Req::get(&path).send(self.port) else {
                break;
            };
            let v = r.json();
            for s in v["data"].as_array().into_iter().flatten() {
                if s["context"]["trace_id"] == trace_id {
                    out.push(s.clone());
                }
            }
            match v["next_cursor"].as_str() {
                Some(c) => cursor = Some(c.to_string()),
                None => break,
            }
        }
        out
    }

    /// The spans of `trace_id` once `ready` says they are all there.
    pub fn wait_trace(
        &self,
        trace_id: &str,
        what: &str,
        ready: impl Fn(&[serde_json::Value]) -> bool,
    ) -> Vec<serde_json::Value> {
        let t0 = Instant::now();
        loop {
            let s = self.spans(trace_id);
            if ready(&s) {
                return s;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "{what}: trace {trace_id} has {} span(s): {}",
                s.len(),
                serde_json::to_string_pretty(&s).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// The span named `name` (the first), or a panic listing the names.
pub fn span<'a>(spans: &'a [serde_json::Value], name: &str) -> &'a serde_json::Value {
    spans
        .iter()
        .find(|s| {
            s["name"]
                .as_str()
                .is_some_and(|n| n == name || n.starts_with(name))
        })
        .unwrap_or_else(|| {
            let names: Vec<&str> = spans.iter().filter_map(|s| s["name"].as_str()).collect();
            panic!("no span {name:?} among {names:?}")
        })
}

/// Whether `child`'s parent is `parent`.
pub fn child_of(child: &serde_json::Value, parent: &serde_json::Value) -> bool {
    child["parent_id"] == parent["context"]["span_id"] && child["parent_id"].is_string()
}
