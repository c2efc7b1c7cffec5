//! Test harness: real processes on loopback, raw sockets, readiness polls.
//! Every process is killed when its guard drops.
#![allow(dead_code)]

pub mod fleet;
pub mod hold;
pub mod in_process;
pub mod latency;
pub mod llama;
pub mod phoenix;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The admin key every test router is started with.
pub const ADMIN_KEY: &str = "test-admin-key";

/// The one test client: a request built step by step, sent on its own
/// connection (`Connection: close`), read to the end. (`raw` writes bytes
/// as they are; `read_response` reads a keep-alive connection.)
///
/// ```ignore
/// let r = Req::post("/v1/chat/completions", chat_body("m", false)).bearer(key).send(http)?;
/// assert_eq!(r.status, 200);
/// ```
#[derive(Debug, Clone)]
pub struct Req {
    method: String,
    path: String,
    body: Vec<u8>,
    /// Extra header lines, each ending in CRLF.
    headers: String,
}

/// A response: status, head (lower case) and body (de-chunked).
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

impl Req {
    pub fn new(method: &str, path: &str) -> Self {
        Req {
            method: method.into(),
            path: path.into(),
            body: Vec::new(),
            headers: String::new(),
        }
    }

    pub fn get(path: &str) -> Self {
        Req::new("GET", path)
    }

    pub fn post(path: &str, body: impl AsRef<[u8]>) -> Self {
        Req::new("POST", path).body(body)
    }

    /// A non-streaming chat for `model` (`chat_body`).
    pub fn chat(model: &str) -> Self {
        Req::post("/v1/chat/completions", chat_body(model, false))
    }

    pub fn body(mut self, body: impl AsRef<[u8]>) -> Self {
        self.body = body.as_ref().to_vec();
        self
    }

    /// `Authorization: Bearer <key>`.
    pub fn bearer(self, key: &str) -> Self {
        self.header("Authorization", &format!("Bearer {key}"))
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push_str(&format!("{name}: {value}\r\n"));
        self
    }

    /// Header lines as they are (each ending in CRLF).
    pub fn raw_headers(mut self, lines: &str) -> Self {
        self.headers.push_str(lines);
        self
    }

    pub fn send(&self, port: u16) -> std::io::Result<Resp> {
        self.send_to(&format!("127.0.0.1:{port}"))
    }

    /// [`Req::send`] to `addr` (`ip:port`, a host of a test fleet).
    pub fn send_to(&self, addr: &str) -> std::io::Result<Resp> {
        let mut s = TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        let head = format!(
            "{} {} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{}Content-Length: {}\r\nConnection: close\r\n\r\n",
            self.method,
            self.path,
            self.headers,
            self.body.len()
        );
        s.write_all(head.as_bytes())?;
        s.write_all(&self.body)?;
        let mut out = Vec::new();
        s.read_to_end(&mut out)?;
        let split = out
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map(|p| p + 4)
            .unwrap_or(out.len());
        let head = String::from_utf8_lossy(&out[..split]).to_ascii_lowercase();
        let mut body = out[split..].to_vec();
        if head.contains("transfer-encoding: chunked") {
            body = dechunk(&body);
        }
        Ok(Resp {
            status: status_of(head.as_bytes()),
            head,
            body,
        })
    }
}

impl Resp {
    /// (status, body), for call sites that destructure.
    pub fn pair(self) -> (u16, Vec<u8>) {
        (self.status, self.body)
    }

    /// (status, head, body).
    pub fn triple(self) -> (u16, String, Vec<u8>) {
        (self.status, self.head, self.body)
    }

    /// A header's value (name in lower case).
    pub fn header(&self, name: &str) -> Option<String> {
        header_of(&self.head, name)
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// The routing table as JSON.
/// Successful requests per agent, by its `--machine` label (from the
/// routing table).
pub fn successes_by_machine(http: u16) -> std::collections::HashMap<String, u64> {
    routing_table(http)["agents"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|a| {
            (
                a["metadata"]["machine"].as_str().unwrap_or("").to_string(),
                a["universal"]["successful_requests_total"]
                    .as_u64()
                    .unwrap_or(0),
            )
        })
        .collect()
}

pub fn routing_table(http: u16) -> serde_json::Value {
    let (st, b) = Req::get("/admin/routing-table")
        .bearer(ADMIN_KEY)
        .send(http)
        .map(Resp::pair)
        .expect("routing table");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    serde_json::from_slice(&b).expect("json")
}

/// A child process killed on drop.
pub struct Proc {
    pub child: Child,
    pub name: String,
    pub log: PathBuf,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

pub fn bin_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hivenet-router"))
        .parent()
        .expect("bin dir")
        .to_path_buf()
}

/// Path of a workspace binary; builds `hivenet-sim` when missing.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    if !p.exists() && name == "hivenet-sim" {
        let st = Command::new(env!("CARGO"))
            .args(["build", "-p", "bench", "--bin", "hivenet-sim"])
            .status()
            .expect("cargo build");
        assert!(st.success(), "building hivenet-sim failed");
    }
    p
}

/// A free port, never the same twice in one test binary (the kernel can
/// hand a just-released port out again, and two of our SO_REUSEPORT
/// listeners on one port would split each other's connections).
pub fn free_port() -> u16 {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static GIVEN: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    let given = GIVEN.get_or_init(|| Mutex::new(HashSet::new()));
    loop {
        let p = TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port();
        if given.lock().expect("lock").insert(p) {
            return p;
        }
    }
}

pub fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "hivenet-test-{tag}-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&d).expect("tmpdir");
    d
}

pub fn spawn(name: &str, args: &[&str], dir: &Path, env: &[(&str, &str)]) -> Proc {
    let log = dir.join(format!("{}-{}.log", name, free_port()));
    let f = std::fs::File::create(&log).expect("log file");
    let f2 = f.try_clone().expect("clone");
    let mut cmd = Command::new(bin(name));
    cmd.args(args)
        .current_dir(dir)
        .stdout(Stdio::from(f))
        .stderr(Stdio::from(f2));
    cmd.env("RUST_LOG", "info");
    cmd.env("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN_KEY);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {name}: {e}"));
    Proc {
        child,
        name: name.to_string(),
        log,
    }
}

pub struct Router {
    pub proc: Proc,
    pub http: u16,
    pub metrics: u16,
    pub p2p: u16,
}

pub fn start_router(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Router {
    let (http, metrics, p2p) = (free_port(), free_port(), free_port());
    let h = format!("127.0.0.1:{http}");
    let m = format!("127.0.0.1:{metrics}");
    let p = p2p.to_string();
    let mut args = vec!["--http-port", &h, "--metrics-port", &m, "--p2p-port", &p];
    args.extend_from_slice(extra);
    let proc = spawn("hivenet-router", &args, dir, env);
    let r = Router {
        proc,
        http,
        metrics,
        p2p,
    };
    wait_until(
        Duration::from_secs(20),
        || {
            Req::get("/health")
                .send(r.http)
                .map(Resp::pair)
                .map(|(s, _)| s == 200)
                .unwrap_or(false)
        },
        "router health",
    );
    r
}

pub fn start_sim(dir: &Path, model: &str, extra: &[&str]) -> (Proc, u16) {
    let port = free_port();
    let ps = port.to_string();
    let mut args = vec!["--port", &ps, "--model", model];
    args.extend_from_slice(extra);
    let p = spawn("hivenet-sim", &args, dir, &[]);
    wait_until(
        Duration::from_secs(20),
        || {
            Req::get("/v1/models")
                .send(port)
                .map(Resp::pair)
                .map(|(s, _)| s == 200)
                .unwrap_or(false)
        },
        "sim up",
    );
    (p, port)
}

pub fn start_agent(
    dir: &Path,
    router: &Router,
    sim_port: u16,
    identity: &str,
    extra: &[&str],
) -> Proc {
    agent_to(dir, router.p2p, sim_port, identity, extra)
}

/// An agent dialing the router's libp2p port `p2p`.
pub fn agent_to(dir: &Path, p2p: u16, sim_port: u16, identity: &str, extra: &[&str]) -> Proc {
    agent_to_env(dir, p2p, sim_port, identity, extra, &[])
}

/// [`agent_to`] with environment variables.
pub fn agent_to_env(
    dir: &Path,
    p2p: u16,
    sim_port: u16,
    identity: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Proc {
    let ra = format!("/ip4/127.0.0.1/tcp/{p2p}");
    let bu = format!("http://127.0.0.1:{sim_port}");
    let id = dir.join(identity);
    let ids = id.to_string_lossy().to_string();
    let mut args = vec![
        "--router-p2p",
        &ra,
        "--backend-url",
        &bu,
        "--identity-path",
        &ids,
    ];
    args.extend_from_slice(extra);
    spawn("hivenet-agent", &args, dir, env)
}

/// Healthy agents of `model` per `/v1/models`.
pub fn healthy_agents(http: u16, model: &str) -> u64 {
    let Ok((200, body)) = Req::get("/v1/models").send(http).map(Resp::pair) else {
        return 0;
    };
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    v["data"]
        .as_array()
        .and_then(|a| a.iter().find(|m| m["id"] == model))
        .and_then(|m| m["agents"]["healthy"].as_u64())
        .unwrap_or(0)
}

pub fn wait_agents(http: u16, model: &str, n: u64) {
    wait_until(
        Duration::from_secs(30),
        || healthy_agents(http, model) >= n,
        &format!("{n} agents for {model}"),
    );
}

pub fn wait_until(limit: Duration, mut f: impl FnMut() -> bool, what: &str) {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for {what}");
}

/// Send raw bytes, read until the peer closes or `wait` passes.
pub fn raw(port: u16, bytes: &[u8], wait: Duration) -> Vec<u8> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(wait)).expect("timeout");
    let _ = s.write_all(bytes);
    let mut out = Vec::new();
    let mut buf = [0u8; 65536];
    let deadline = Instant::now() + wait;
    while Instant::now() < deadline {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(_) => break,
        }
    }
    out
}

/// Read a chunked response into `got` until its last chunk (true) or
/// until the peer closes (false: cut); a read error or a stall past the
/// socket's timeout fails the test.
pub fn read_stream_end(s: &mut TcpStream, got: &mut Vec<u8>) -> bool {
    let mut tmp = [0u8; 16384];
    loop {
        match s.read(&mut tmp) {
            Ok(0) => return false,
            Ok(n) => {
                got.extend_from_slice(&tmp[..n]);
                if got.ends_with(b"\r\n0\r\n\r\n") {
                    return true;
                }
            }
            Err(e) => panic!(
                "stream neither ended nor failed: {e}\n{}",
                String::from_utf8_lossy(got)
            ),
        }
    }
}

/// Status code of the first response in `resp`.
pub fn status_of(resp: &[u8]) -> u16 {
    let s = String::from_utf8_lossy(resp);
    s.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

pub fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(std::str::from_utf8(&b[..nl]).unwrap_or("0").trim(), 16)
            .unwrap_or(0);
        if n == 0 {
            break;
        }
        let start = nl + 2;
        if b.len() < start + n {
            out.extend_from_slice(&b[start..]);
            break;
        }
        out.extend_from_slice(&b[start..start + n]);
        b = &b[(start + n + 2).min(b.len())..];
    }
    out
}

/// A metric's value from Prometheus text (first line that starts with `prefix`).
pub fn metric(metrics_port: u16, prefix: &str) -> Option<f64> {
    let (_, body) = Req::get("/metrics")
        .send(metrics_port)
        .map(Resp::pair)
        .ok()?;
    let text = String::from_utf8_lossy(&body).to_string();
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

pub fn metrics_text(metrics_port: u16) -> String {
    Req::get("/metrics")
        .send(metrics_port)
        .map(Resp::pair)
        .map(|(_, b)| String::from_utf8_lossy(&b).to_string())
        .unwrap_or_default()
}

/// The peer ID an agent logged at start.
pub fn peer_in_log(p: &Proc) -> String {
    let log = p.log_text();
    log.split("peer_id=")
        .nth(1)
        .map(|r| {
            // Base58: the ID ends at the first other character (a space, or
            // the `}` of the agent's `agent{peer_id=..}` label).
            r.chars()
                .take_while(char::is_ascii_alphanumeric)
                .collect::<String>()
        })
        .unwrap_or_default()
}

/// A hand-driven agent link: dialled, registered, its control stream open.
pub struct RawLink {
    /// Opens streams; `close()` ends the link.
    pub handle: shards::runtime::wire::link::LinkHandle,
    /// Completes when the connection ends.
    pub closed: futures::channel::oneshot::Receiver<()>,
    /// The control stream.
    pub ctl: shards::runtime::wire::conn::Conn<shards::runtime::wire::link::LinkStream>,
    /// The router's answer to the registration.
    pub reply: Option<shards::logic::link::control::ControlMsg>,
}

/// Dial the router's p2p port as `kp`, register `model` (capacity 1) and
/// read the answer. Runs on a monoio runtime (`run_on_runtime`).
pub async fn raw_register(p2p: u16, kp: &libp2p_identity::Keypair, model: &str) -> Option<RawLink> {
    use shards::logic::link::control::{ControlMsg, Registration};
    use shards::runtime::wire::link;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], p2p));
    let (_, conn) = link::dial(addr, model, None, kp).await.ok()?;
    let (handle, _inbound, closed) = link::spawn_driver(conn);
    let mut ctl = handle.open(link::CONTROL_PROTOCOL).await.ok()?;
    let reg = Registration {
        peer_id: kp.public().to_peer_id().to_string(),
        model: model.into(),
        engine: "custom".into(),
        capacity: 1,
        ..Default::default()
    };
    link::write_frame(&mut ctl, &ControlMsg::Register(reg))
        .await
        .ok()?;
    let mut ctl = shards::runtime::wire::conn::Conn::over(ctl, Vec::new());
    let reply = ctl.read_frame().await.ok()?;
    Some(RawLink {
        handle,
        closed,
        ctl,
        reply,
    })
}

/// Open `/admin/registration-stream` and read its response head.
pub fn open_feed(http: u16) -> (TcpStream, Vec<u8>) {
    let mut s = TcpStream::connect(("127.0.0.1", http)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    write!(s, "GET /admin/registration-stream HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {ADMIN_KEY}\r\n\r\n").expect("write");
    let mut got = Vec::new();
    read_until(&mut s, &mut got, "\r\n\r\n");
    (s, got)
}

/// Read from `s` into `got` until it contains `needle`.
pub fn read_until(s: &mut TcpStream, got: &mut Vec<u8>, needle: &str) {
    let mut tmp = [0u8; 4096];
    while !String::from_utf8_lossy(got).contains(needle) {
        let n = s.read(&mut tmp).expect("read");
        assert!(
            n > 0,
            "stream closed before {needle:?}: {}",
            String::from_utf8_lossy(got)
        );
        got.extend_from_slice(&tmp[..n]);
    }
}

/// Completions a `hivenet-sim` has served (its vLLM-style success counter).
pub fn sim_completions(port: u16) -> f64 {
    let Ok((_, body)) = Req::get("/metrics").send(port).map(Resp::pair) else {
        return -1.0;
    };
    String::from_utf8_lossy(&body)
        .lines()
        .find(|l| l.starts_with("vllm:request_success_total"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(-1.0)
}

/// A streaming request on its own thread that holds a slot until the
/// stream ends; joins to its status.
pub fn hold_slot(http: u16, model: &str) -> std::thread::JoinHandle<std::io::Result<u16>> {
    let body = format!(r#"{{"model":"{model}","stream":true,"messages":[]}}"#);
    std::thread::spawn(move || {
        Req::post("/v1/chat/completions", &body)
            .send(http)
            .map(Resp::pair)
            .map(|x| x.0)
    })
}

/// (Re)start a router on fixed ports (2 shards unless `extra` says) and
/// wait for its health.
pub fn router_on(dir: &Path, ports: (u16, u16, u16), extra: &[&str]) -> Proc {
    let h = format!("127.0.0.1:{}", ports.0);
    let m = format!("127.0.0.1:{}", ports.1);
    let p = ports.2.to_string();
    let mut args = vec!["--http-port", &h, "--metrics-port", &m, "--p2p-port", &p];
    if !extra.contains(&"--shards") {
        args.extend_from_slice(&["--shards", "2"]);
    }
    args.extend_from_slice(extra);
    let proc = spawn("hivenet-router", &args, dir, &[]);
    wait_until(
        Duration::from_secs(20),
        || {
            Req::get("/health")
                .send(ports.0)
                .map(Resp::pair)
                .map(|(s, _)| s == 200)
                .unwrap_or(false)
        },
        "router",
    );
    proc
}

/// The value of header `name` (lower case) in a lower-cased head.
pub fn header_of(head: &str, name: &str) -> Option<String> {
    head.lines().find_map(|l| {
        l.strip_prefix(&format!("{name}:"))
            .map(|v| v.trim().to_string())
    })
}

/// SHA-256 hex of a key (what auth.yaml stores).
pub fn sha256_hex(key: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A chat body for `model`.
pub fn chat_body(model: &str, stream: bool) -> String {
    format!(
        r#"{{"model":"{model}","stream":{stream},"max_tokens":4,"messages":[{{"role":"user","content":"hello there"}}]}}"#
    )
}

/// Send `sig` (`TERM`, `HUP`) to a process.
pub fn signal(p: &Proc, sig: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{sig}"), &p.child.id().to_string()])
        .status();
}

/// SIGTERM and wait for a graceful exit.
pub fn sigterm(p: &mut Proc) {
    signal(p, "TERM");
    let start = Instant::now();
    loop {
        if let Ok(Some(st)) = p.child.try_wait() {
            assert!(st.success(), "graceful exit: {st:?}\n{}", p.log_text());
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "router did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One response with a Content-Length from a keep-alive connection:
/// status and body; `buf` keeps what was read past it.
pub fn read_response(s: &mut TcpStream, buf: &mut Vec<u8>) -> (u16, Vec<u8>) {
    let mut tmp = [0u8; 8192];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4) {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let cl: usize = head
                .lines()
                .find_map(|l| {
                    l.strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap_or(0))
                })
                .expect("content-length");
            while buf.len() < end + cl {
                let n = s.read(&mut tmp).expect("read body");
                assert!(n > 0, "closed mid-body");
                buf.extend_from_slice(&tmp[..n]);
            }
            let body = buf[end..end + cl].to_vec();
            let status = status_of(&buf[..end]);
            buf.drain(..end + cl);
            return (status, body);
        }
        let n = s.read(&mut tmp).expect("read head");
        assert!(n > 0, "closed before head");
        buf.extend_from_slice(&tmp[..n]);
    }
}

/// Wait at most `limit` for a spawned process (stderr piped) to exit: its
/// exit code (`None`: it was still running and was killed, or died by a
/// signal) and its stderr. For start-up refusals: a process that starts
/// anyway fails the test instead of hanging it.
pub fn exit_within(mut child: std::process::Child, limit: Duration) -> (Option<i32>, String) {
    let t = std::time::Instant::now();
    let code = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s.code(),
            Ok(None) if t.elapsed() < limit => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let err = child
        .wait_with_output()
        .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
        .unwrap_or_default();
    (code, err)
}

/// A `redis-server` of its own on a free port, nothing persisted.
pub fn start_redis(dir: &std::path::Path, port: u16) -> Proc {
    let log = dir.join(format!("redis-{port}.log"));
    let f = std::fs::File::create(&log).expect("redis log");
    let f2 = f.try_clone().expect("clone");
    let child = std::process::Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .current_dir(dir)
        .stdout(f)
        .stderr(f2)
        .spawn()
        .expect("redis-server (scripts/test.sh installs it)");
    let p = Proc {
        child,
        name: "redis-server".into(),
        log,
    };
    wait_until(
        Duration::from_secs(10),
        || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
        "redis-server up",
    );
    p
}

/// An admin call with the test admin key: status and JSON body (Null
/// when empty or not JSON).
pub fn admin(
    http: u16,
    method: &str,
    path: &str,
    body: serde_json::Value,
) -> (u16, serde_json::Value) {
    let b = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    let (st, _, out) = Req::new(method, path)
        .body(b.as_bytes())
        .raw_headers(&format!("Authorization: Bearer {ADMIN_KEY}\r\n"))
        .send(http)
        .map(Resp::triple)
        .expect("admin");
    (
        st,
        serde_json::from_slice(&out).unwrap_or(serde_json::Value::Null),
    )
}

/// A CA and a certificate for `localhost` and 127.0.0.1 signed by it
/// (openssl CLI): (ca.pem, server.pem, server.key) in `dir`.
pub fn make_certs(
    dir: &std::path::Path,
) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .current_dir(dir)
            .args(args)
            .output()
            .expect("openssl (the test needs the openssl command)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=hivenet test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n",
    )
    .expect("ext");
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
    (
        dir.join("ca.pem"),
        dir.join("server.pem"),
        dir.join("server.key"),
    )
}
