//! Heap allocations per proxied request, counted by a counting allocator
//! (issue 14): the router shard and the agent run in this process on
//! threads of their own, wired as the binaries wire them (the router
//! with its history store, logging and audit log), with a
//! real libp2p link and real sockets to a real `hivenet-sim` backend; a
//! keep-alive client sends non-streaming chat requests one at a time and
//! the allocator counts the calls made on each thread. A change that adds
//! one allocation per request on either side fails here.
//!
//! `scripts/count-syscalls.sh` counts allocations in the real binaries
//! with uprobes, less exactly (its router count reads 4, 5 or 6 depending
//! on the run); this test is exact, needs no perf and names the sizes when
//! it fails.

mod common;

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::{start_sim, tmpdir, wait_until};
use hivenet_router::agent::{self, AgentConfig};
use shards::runtime::wire::executor::{self, DriverChoice};

/// Per request, at most. Measured 5.00 on both sides, in every run
/// (perf/2026-12-01-pool-syscalls has the uprobe figures of the
/// binaries); the half leaves room for timers and bookkeeping amortised
/// over the run, not for one more allocation per request.
const MAX_ROUTER: f64 = 5.5;
const MAX_AGENT: f64 = 5.5;
/// The process's other threads (measured 0.00).
const MAX_OTHER: f64 = 0.5;

const WARMUP: usize = 300;
const REQUESTS: usize = 3000;
const MODEL: &str = "alloc-model";

const OTHER: usize = 0;
const ROUTER: usize = 1;
const AGENT: usize = 2;
/// This test's own thread (the client).
const CLIENT: usize = 3;

thread_local! {
    /// Whose allocations this thread's are.
    static ROLE: Cell<usize> = const { Cell::new(OTHER) };
}

/// Allocation calls (alloc, alloc_zeroed, realloc) by role, and by role
/// and power-of-two size class (for the failure message).
static CALLS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];
static BY_SIZE: [[AtomicU64; 24]; 4] = [const { [const { AtomicU64::new(0) }; 24] }; 4];

fn count(size: usize) {
    let role = ROLE.try_with(Cell::get).unwrap_or(OTHER);
    CALLS[role].fetch_add(1, Ordering::Relaxed);
    let class = (usize::BITS - size.leading_zeros()).min(23) as usize;
    BY_SIZE[role][class].fetch_add(1, Ordering::Relaxed);
}

/// mimalloc, as in both binaries, with a count in front.
struct Counting;

// The only unsafe code in the tests: a global allocator must implement an
// unsafe trait. Every call goes unchanged to mimalloc; the count touches a
// const thread-local `Cell` and atomics, none of which allocates.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { mimalloc::MiMalloc.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: as above.
        unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: as above.
        unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn snapshot() -> [u64; 4] {
    [0, 1, 2, 3].map(|r| CALLS[r].load(Ordering::Relaxed))
}

fn sizes(role: usize) -> String {
    let mut out = String::new();
    for (class, n) in BY_SIZE[role].iter().enumerate() {
        let n = n.load(Ordering::Relaxed);
        if n > 0 {
            let hi = 1u64 << class;
            out.push_str(&format!(" <{hi}B:{n}"));
        }
    }
    out
}

/// The agent as `hivenet-agent` runs it, on a thread of its own.
fn start_agent(p2p: u16, sim: u16, dir: &std::path::Path) {
    let cfg = AgentConfig {
        routers: vec![
            agent::parse_router_addr(&format!("/ip4/127.0.0.1/tcp/{p2p}")).expect("router address"),
        ],
        backend: agent::backend::BackendUrl::parse(&format!("http://127.0.0.1:{sim}"))
            .expect("backend url"),
        engine: agent::engine::Engine::Vllm,
        health_url: None,
        capability: shards::logic::link::control::Capability::Llm,
        model: Some(MODEL.into()),
        capacity: 10,
        keypair: shards::runtime::wire::link::load_or_create_identity(&dir.join("agent.key"))
            .expect("agent identity"),
        psk: None,
        region: "test".into(),
        organization: "test".into(),
        machine: "test".into(),
        tags: Vec::new(),
        version: "test".into(),
        deployment_id: String::new(),
        replica_id: String::new(),
        http_timeout: Duration::from_secs(30),
        stream_write_timeout: Some(Duration::from_secs(30)),
        hide_llm: false,
        llm_pretty_name: String::new(),
        llm_info: String::new(),
        drain_timeout: Duration::from_secs(30),
        // Health checks and engine scrapes far apart, as the heartbeats.
        health_interval: Duration::from_secs(600),
        signal_interval: Duration::from_secs(600),
        warmup: false,
        gpu_model: String::new(),
        gpus: Default::default(),
        traces: None,
    };
    std::thread::Builder::new()
        .name("agent".into())
        .spawn(move || {
            ROLE.with(|r| r.set(AGENT));
            // No stop signal in this test: the sender is gone at once.
            let (_, stop) = futures::channel::mpsc::unbounded();
            executor::run_on_runtime(DriverChoice::Auto, |_| agent::run(cfg, stop));
        })
        .expect("agent thread");
}

/// One request on the keep-alive connection; the status and the body.
fn chat(s: &mut TcpStream, buf: &mut Vec<u8>) -> (u16, Vec<u8>) {
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":8}}"#
    );
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("send request");
    common::read_response(s, buf)
}

/// One test at a time: the counters are the process's.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn a_proxied_request_allocates_a_fixed_handful_on_router_and_agent() {
    proxied_requests_allocate_a_fixed_handful(None);
}

/// The same with `strategy: prefix-aware` (issue 30): the index lookup
/// and its records cost the request no allocation (the table is made once,
/// during the warm-up).
#[test]
fn prefix_aware_routing_allocates_nothing_more() {
    proxied_requests_allocate_a_fixed_handful(Some("routing_policy:\n  strategy: prefix-aware\n"));
}

fn proxied_requests_allocate_a_fixed_handful(policy: Option<&str>) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    ROLE.with(|r| r.set(CLIENT));
    hivenet_router::cli::init_logging();
    let dir = tmpdir(if policy.is_some() {
        "allocations-prefix"
    } else {
        "allocations"
    });
    let (_sim, sim_port) = start_sim(&dir, MODEL, &[]);
    let (http, p2p) = common::in_process::start_router_with(
        &dir,
        // Heartbeats and removal checks far apart: the count is the
        // request path's, not the control stream's.
        Duration::from_secs(60),
        || ROLE.with(|r| r.set(ROUTER)),
        policy,
    );
    start_agent(p2p, sim_port, &dir);
    wait_until(
        Duration::from_secs(20),
        || common::healthy_agents(http.port(), MODEL) >= 1,
        "agent registered",
    );
    let mut s = TcpStream::connect(http).expect("connect to the router");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    let mut buf = Vec::with_capacity(16 * 1024);
    for _ in 0..WARMUP {
        let (status, body) = chat(&mut s, &mut buf);
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    for r in [OTHER, ROUTER, AGENT] {
        for c in &BY_SIZE[r] {
            c.store(0, Ordering::Relaxed);
        }
    }
    let before = snapshot();
    for _ in 0..REQUESTS {
        let (status, body) = chat(&mut s, &mut buf);
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    let after = snapshot();
    let per = |r: usize| (after[r] - before[r]) as f64 / REQUESTS as f64;
    let (router, agent, other) = (per(ROUTER), per(AGENT), per(OTHER));
    eprintln!(
        "allocations per request: router {router:.2} (sizes{}), agent {agent:.2} (sizes{}), \
         other threads (the router's store thread, logging) {other:.2}",
        sizes(ROUTER),
        sizes(AGENT),
    );
    // Both sides did work on their own threads (the roles are set where
    // the work runs): a count of zero would mean the test counts nothing.
    assert!(
        router >= 1.0 && agent >= 1.0,
        "router {router}, agent {agent}"
    );
    assert!(
        router <= MAX_ROUTER,
        "router: {router:.2} allocations per request (at most {MAX_ROUTER}); sizes{}",
        sizes(ROUTER)
    );
    // The store thread writes history per interval, not per request.
    assert!(
        other <= MAX_OTHER,
        "other threads: {other:.2} allocations per request (at most {MAX_OTHER}); sizes{}",
        sizes(OTHER)
    );
    assert!(
        agent <= MAX_AGENT,
        "agent: {agent:.2} allocations per request (at most {MAX_AGENT}); sizes{}",
        sizes(AGENT)
    );
}
