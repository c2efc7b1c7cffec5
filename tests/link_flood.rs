//! Issue 51 #2: silent connections cannot lock real agents out. 2,000
//! connections that never send a byte, from eight other addresses, stay
//! open against the p2p port; an agent restarted meanwhile registers again
//! within a second, since the registered agents' caps count only links
//! that finished their handshake and the silent ones sit in their own,
//! larger budget (bounded per address, cut at the preamble deadline).

mod common;
use common::*;
use std::io::{BufRead, BufReader, Write};
use std::time::{Duration, Instant};

/// A flooder: `n` silent connections from 127.0.0.2..9 (or all from
/// 127.0.0.1 with a third argument `own`), held until its stdin closes;
/// prints how many connected.
const FLOOD: &str = r#"
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
own = len(sys.argv) > 3
held = []
for i in range(n):
    src = "127.0.0.1" if own else "127.0.0.%d" % (2 + i % 8)
    try:
        held.append(socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(src, 0)))
    except OSError:
        pass
print(len(held), flush=True)
sys.stdin.read()
"#;

fn registered_again(http: u16, peer: &str) -> bool {
    routing_table(http)["agents"].as_array().is_some_and(|a| {
        a.iter()
            .any(|x| x["peer_id"] == peer && x["status"]["healthy"] == true)
    })
}

#[test]
fn a_restarted_agent_is_back_within_a_second_under_a_silent_flood() {
    let dir = tmpdir("link-flood");
    let r = start_router(&dir, &["--shards", "2", "--preamble-timeout", "30s"], &[]);
    let (_s, port) = start_sim(&dir, "m", &[]);
    let mut a = start_agent(&dir, &r, port, "a.key", &["--warmup", "off"]);
    wait_agents(r.http, "m", 1);
    let peer = routing_table(r.http)["agents"][0]["peer_id"]
        .as_str()
        .expect("peer")
        .to_string();
    // Baseline: a restart with no flood.
    a.kill9();
    wait_until(
        Duration::from_secs(10),
        || routing_table(r.http)["total"] == 0,
        "gone",
    );
    let t0 = Instant::now();
    let mut a = start_agent(&dir, &r, port, "a.key", &["--warmup", "off"]);
    wait_until(
        Duration::from_secs(10),
        || registered_again(r.http, &peer),
        "back",
    );
    let quiet = t0.elapsed();
    let rss = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let before = rss(r.proc.child.id());
    // The flood, held open (30 s preamble deadline: it outlives the test).
    let mut flood = std::process::Command::new("python3")
        .args(["-c", FLOOD, &r.p2p.to_string(), "2000"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("flooder");
    let mut line = String::new();
    BufReader::new(flood.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("count");
    let connected: usize = line.trim().parse().expect("count");
    assert_eq!(
        connected, 2000,
        "every silent connection is accepted and held"
    );
    a.kill9();
    wait_until(
        Duration::from_secs(10),
        || routing_table(r.http)["total"] == 0,
        "gone",
    );
    let t0 = Instant::now();
    let _a = start_agent(&dir, &r, port, "a.key", &["--warmup", "off"]);
    wait_until(
        Duration::from_secs(10),
        || registered_again(r.http, &peer),
        "back under the flood",
    );
    let flooded = t0.elapsed();
    println!(
        "link-flood: restart to registered {:.0} ms quiet, {:.0} ms under 2,000 silent connections",
        quiet.as_secs_f64() * 1e3,
        flooded.as_secs_f64() * 1e3
    );
    let (st, _) = Req::chat("m").send(r.http).expect("chat").pair();
    assert_eq!(st, 200, "served under the flood");
    assert!(
        flooded < Duration::from_secs(1),
        "back within a second: {flooded:?}"
    );
    let during = rss(r.proc.child.id());
    println!(
        "link-flood: router RSS {before} kB before, {during} kB with 2,000 silent connections ({:.1} KiB each)",
        (during.saturating_sub(before)) as f64 / 2000.0
    );
    if let Some(mut i) = flood.stdin.take() {
        let _ = i.write_all(b"");
    }
    let _ = flood.kill();
    let _ = flood.wait();
}

/// Issue 51 #2, the rest: a silent flood from the agent's own address,
/// larger than the per-address budget of connections before their
/// handshake (600 > 256), held open. The budget cuts the address's oldest
/// waiting connection for a new one instead of refusing it, so the
/// restarted agent (same address) registers within a second; before, it
/// was refused until the flood's connections timed out.
#[test]
fn a_flood_from_the_agents_own_address_does_not_keep_it_out() {
    let dir = tmpdir("link-flood-own");
    let r = start_router(&dir, &["--shards", "1", "--preamble-timeout", "30s"], &[]);
    let (_s, port) = start_sim(&dir, "m", &[]);
    let mut a = start_agent(&dir, &r, port, "a.key", &["--warmup", "off"]);
    wait_agents(r.http, "m", 1);
    let peer = routing_table(r.http)["agents"][0]["peer_id"]
        .as_str()
        .expect("peer")
        .to_string();
    let mut flood = std::process::Command::new("python3")
        .args(["-c", FLOOD, &r.p2p.to_string(), "600", "own"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("flooder");
    let mut line = String::new();
    BufReader::new(flood.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("count");
    let connected: usize = line.trim().parse().expect("count");
    assert_eq!(connected, 600, "every connection accepted (the oldest cut)");
    a.kill9();
    wait_until(
        Duration::from_secs(10),
        || routing_table(r.http)["total"] == 0,
        "gone",
    );
    let t0 = Instant::now();
    let _a = start_agent(&dir, &r, port, "a.key", &["--warmup", "off"]);
    wait_until(
        Duration::from_secs(10),
        || registered_again(r.http, &peer),
        "back under a flood from its own address",
    );
    let back = t0.elapsed();
    println!(
        "link-flood: back in {:.0} ms under 600 silent connections from its own address",
        back.as_secs_f64() * 1e3
    );
    assert!(
        back < Duration::from_secs(1),
        "back within a second: {back:?}"
    );
    let evicted = metrics_text(r.metrics)
        .lines()
        .filter(|l| l.contains("pending_evicted"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    assert!(
        evicted >= 344.0,
        "the oldest were cut and counted: {evicted}"
    );
    if let Some(mut i) = flood.stdin.take() {
        let _ = i.write_all(b"");
    }
    let _ = flood.kill();
    let _ = flood.wait();
}
