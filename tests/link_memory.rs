//! The heap an idle registered agent link holds on the router (issue 29
//! #1: "bound the memory per link"): the router shard runs in this process
//! with a counting allocator that keeps live bytes per thread, and a client
//! thread opens real noise + yamux links with fresh identities, registers
//! each and heartbeats. The router's live heap grows by the links' share
//! only; read buffers sized for bulk traffic, held by every idle link, made
//! it about 180 KiB per link (RSS 250 KiB in
//! `perf/2026-12-03-registered-links`).

mod common;

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use common::{tmpdir, wait_until};
use shards::logic::link::control::{ControlMsg, Registration};
use shards::runtime::wire::conn::Conn;
use shards::runtime::wire::executor::{self, DriverChoice};
use shards::runtime::wire::link;

/// Live heap per idle registered link on the router, at most. Measured
/// 48-50 KiB (noise's two 8 KiB codec buffers, the mux's 16 KiB read
/// chunk, a 4 KiB socket read, the tasks and the agent's entry).
const MAX_PER_LINK: i64 = 64 * 1024;
const LINKS: usize = 64;
const MODEL: &str = "link-memory-model";

const OTHER: usize = 0;
const ROUTER: usize = 1;

thread_local! {
    static ROLE: Cell<usize> = const { Cell::new(OTHER) };
}

/// Live bytes by role: allocations minus frees made on that role's thread.
static LIVE: [AtomicI64; 2] = [const { AtomicI64::new(0) }; 2];

fn add(delta: i64) {
    let role = ROLE.try_with(Cell::get).unwrap_or(OTHER);
    LIVE[role].fetch_add(delta, Ordering::Relaxed);
}

struct Counting;

// A global allocator must implement an unsafe trait. Every call goes
// unchanged to mimalloc (as in the binaries); the count touches a const
// thread-local `Cell` and atomics, none of which allocates.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        add(layout.size() as i64);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { mimalloc::MiMalloc.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        add(layout.size() as i64);
        // SAFETY: as above.
        unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        add(new_size as i64 - layout.size() as i64);
        // SAFETY: as above.
        unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        add(-(layout.size() as i64));
        // SAFETY: as above.
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Open `n` links from a thread of their own, each registered and
/// heartbeating every 100 ms until the process ends.
fn open_links(p2p: u16, n: usize) {
    std::thread::Builder::new()
        .name(format!("links-{n}"))
        .spawn(move || {
            executor::run_on_runtime(DriverChoice::Auto, |_| async move {
                let addr = std::net::SocketAddr::from(([127, 0, 0, 1], p2p));
                let mut held = Vec::new();
                for _ in 0..n {
                    held.push(register(addr).await);
                }
                futures::future::pending::<()>().await;
            });
        })
        .expect("link thread");
}

async fn register(addr: std::net::SocketAddr) -> link::LinkHandle {
    let kp = libp2p_identity::Keypair::generate_ed25519();
    let (_, conn) = link::dial(addr, MODEL, None, &kp).await.expect("dial");
    let (handle, inbound, _closed) = link::spawn_driver(conn);
    let mut ctl = handle.open(link::CONTROL_PROTOCOL).await.expect("control");
    let reg = Registration {
        peer_id: kp.public().to_peer_id().to_string(),
        model: MODEL.into(),
        engine: "openai".into(),
        capacity: 4,
        ..Registration::default()
    };
    link::write_frame(&mut ctl, &ControlMsg::Register(reg))
        .await
        .expect("register");
    let mut ctl = Conn::over(ctl, Vec::new());
    let reply = ctl.read_frame().await.expect("registration reply");
    assert!(
        matches!(reply, Some(ControlMsg::Registered { .. })),
        "{reply:?}"
    );
    monoio::spawn(async move {
        let _inbound = inbound;
        let mut ctl = ctl.stream;
        let beat = ControlMsg::Heartbeat {
            backend_healthy: true,
            draining: false,
        };
        while link::write_frame(&mut ctl, &beat).await.is_ok() {
            monoio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    handle
}

fn live_router() -> i64 {
    LIVE[ROUTER].load(Ordering::Relaxed)
}

/// Live router heap once it has stopped moving (the store thread's answers
/// and the heartbeats settle within a few hundred milliseconds).
fn settled_router_heap() -> i64 {
    let mut last = live_router();
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(300));
        let now = live_router();
        if (now - last).abs() < 4096 {
            return now;
        }
        last = now;
    }
    last
}

#[test]
fn an_idle_registered_link_holds_a_bounded_heap_on_the_router() {
    hivenet_router::cli::init_logging();
    let dir = tmpdir("link-memory");
    let (http, p2p) = common::in_process::start_router(&dir, Duration::from_millis(200), || {
        ROLE.with(|r| r.set(ROUTER))
    });
    // One link first: the model's entry, its metrics and the shard's
    // one-off buffers are not a link's cost.
    open_links(p2p, 1);
    wait_until(
        Duration::from_secs(20),
        || common::healthy_agents(http.port(), MODEL) >= 1,
        "first link registered",
    );
    let before = settled_router_heap();
    open_links(p2p, LINKS);
    wait_until(
        Duration::from_secs(60),
        || common::healthy_agents(http.port(), MODEL) > LINKS as u64,
        "all links registered",
    );
    let after = settled_router_heap();
    let per_link = (after - before) / LINKS as i64;
    eprintln!(
        "router live heap: {before} -> {after} bytes with {LINKS} more idle links: {per_link} bytes per link"
    );
    // The count sees the links at all (an agent entry alone is more).
    assert!(
        per_link >= 1024,
        "{per_link} bytes per link: counted nothing?"
    );
    assert!(
        per_link <= MAX_PER_LINK,
        "an idle registered link holds {per_link} bytes of the router's heap (at most {MAX_PER_LINK})"
    );
}
