//! Issue 56: cross-site with real distance. Three sites a WAN apart
//! (round trips a-b 20 ms, a-c 80 ms, b-c 150 ms, made by
//! tests/common/fleet.rs), a router per site, agents on hosts of their
//! own, clients on hosts of their own. The sibling map's 307 sends a
//! client to the warm sibling (hold-at-zero seed, "Redirect first"); with
//! fresh hints saying the home sibling is cold, a request for a model
//! holdable here is held here until an agent registers. Each client
//! measures its time to the first token from its own host, following the
//! redirect itself; the figures are printed (perf/2026-12-05-cross-site).

mod common;
use common::fleet::Fleet;
use common::*;
use std::time::{Duration, Instant};

const SWARM_KEY: &str = "/key/swarm/psk/1.0.0/\n/base16/\n0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0\n";

/// A client on its host: stream `model` from `router`, following 307s;
/// prints `ttft_s hops status`.
const CLIENT: &str = r#"
import http.client, json, sys, time, urllib.parse
host, port, model, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
body = json.dumps({"model": model, "stream": True, "max_tokens": 8,
                   "messages": [{"role": "user", "content": "hi"}]})
for _ in range(n):
    h, p, path, hops = host, port, "/v1/chat/completions", 0
    t0 = time.monotonic()
    while True:
        c = http.client.HTTPConnection(h, p, timeout=60)
        c.request("POST", path, body, {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status == 307:
            loc = urllib.parse.urlparse(r.getheader("Location"))
            h, p = loc.hostname, loc.port
            path = loc.path + ("?" + loc.query if loc.query else "")
            r.read(); c.close(); hops += 1
            continue
        ttft = None
        while True:
            line = r.readline()
            if not line:
                break
            if line.startswith(b"data: {") and b'"content"' in line:
                ttft = time.monotonic() - t0
                r.read()
                break
        c.close()
        print(f"{ttft} {hops} {r.status}", flush=True)
        break
"#;

struct Sites {
    fleet: Fleet,
    dir: std::path::PathBuf,
    _procs: Vec<Proc>,
}

/// Router of site `s` (1-based) runs on host `3 (s - 1)`, its agents on
/// `3 (s - 1) + 1`, its clients on `3 (s - 1) + 2`.
fn router_host(site: usize) -> usize {
    3 * (site - 1)
}

impl Sites {
    fn router_ip(&self, site: usize) -> String {
        self.fleet.hosts[router_host(site)].ip.clone()
    }

    /// An engine (the simulator on `port`) and its agent for `model` on
    /// the agents' host of `site`.
    fn agent(&self, site: usize, model: &str, port: u16) -> Vec<Proc> {
        let h = router_host(site) + 1;
        let dir = self.dir.join(format!("agent-{model}"));
        std::fs::create_dir_all(&dir).expect("dir");
        let ps = port.to_string();
        let sim = self.fleet.spawn(
            h,
            "hivenet-sim",
            &[
                "--port", &ps, "--model", model, "--ttft", "30ms", "--itl", "5ms",
            ],
            &dir,
            &[],
        );
        let rp = format!("/ip4/{}/tcp/9000", self.router_ip(site));
        let backend = format!("http://127.0.0.1:{port}");
        let key = self.dir.join("swarm.key").to_string_lossy().to_string();
        let agent = self.fleet.spawn(
            h,
            "hivenet-agent",
            &[
                "--router-p2p",
                &rp,
                "--backend-url",
                &backend,
                "--swarm-key-file",
                &key,
                "--identity-path",
                "id.key",
                "--warmup",
                "off",
            ],
            &dir,
            &[],
        );
        vec![sim, agent]
    }

    /// Run the client `n` times from the clients' host of `site` against
    /// that site's router: (time to first token, redirects) each.
    fn client(&self, site: usize, model: &str, n: usize) -> Vec<(Duration, u32)> {
        let h = router_host(site) + 2;
        let out = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.fleet.hosts[h].ns,
                "python3",
                "-c",
                CLIENT,
            ])
            .args([&self.router_ip(site), "8080", model, &n.to_string()])
            .output()
            .expect("client");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let got: Vec<(Duration, u32)> = text
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                assert_eq!(f.get(2), Some(&"200"), "{model}: {l}");
                Some((
                    Duration::from_secs_f64(f[0].parse().ok()?),
                    f[1].parse().ok()?,
                ))
            })
            .collect();
        assert_eq!(
            got.len(),
            n,
            "{model}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        got
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn map_json(s: &Sites, placements: &str) -> String {
    let now = shards::logic::system::timefmt::rfc3339_nanos(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        0,
    );
    let site = |id: &str, n: usize| {
        format!(
            r#"{{"site_id":"{id}","base_url":"http://{}:8080"}}"#,
            s.router_ip(n)
        )
    };
    format!(
        r#"{{"version":"1","hints_generated_at":"{now}","sites":[{},{},{}],"placements":[{placements}]}}"#,
        site("a", 1),
        site("b", 2),
        site("c", 3)
    )
}

#[test]
fn redirects_and_holds_across_sites_a_wan_apart() {
    let t0 = Instant::now();
    // One-way delays: a-b 10 ms, a-c 40 ms, b-c 75 ms.
    let fleet = Fleet::build(&[3, 3, 3], &[(1, 2, 10), (1, 3, 40), (2, 3, 75)], 0.0);
    let setup = t0.elapsed();
    let dir = tmpdir("sites-wan");
    std::fs::write(dir.join("swarm.key"), SWARM_KEY).expect("key");
    let key = dir.join("swarm.key").to_string_lossy().to_string();
    let mut s = Sites {
        fleet,
        dir: dir.clone(),
        _procs: Vec::new(),
    };
    let mut procs = Vec::new();
    for (site, id) in [(1, "a"), (2, "b"), (3, "c")] {
        let rdir = dir.join(format!("router-{id}"));
        std::fs::create_dir_all(&rdir).expect("dir");
        procs.push(s.fleet.spawn(
            router_host(site),
            "hivenet-router",
            &[
                "--site-id",
                id,
                "--http-port",
                ":8080",
                "--metrics-port",
                ":9100",
                "--p2p-port",
                "9000",
                "--p2p-listen-addr",
                "0.0.0.0",
                "--swarm-key-file",
                &key,
                "--shards",
                "1",
                "--wake-keepalive",
                "500ms",
            ],
            &rdir,
            &[("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN_KEY)],
        ));
    }
    for site in 1..=3 {
        let http = format!("{}:8080", s.router_ip(site));
        wait_until(
            Duration::from_secs(20),
            || {
                Req::get("/health")
                    .send_to(&http)
                    .map(|r| r.status == 200)
                    .unwrap_or(false)
            },
            "router up",
        );
    }
    // Warm: `local` at a, `near` at b, `far` and `farther` at c.
    procs.extend(s.agent(1, "local", 8000));
    procs.extend(s.agent(2, "near", 8000));
    procs.extend(s.agent(3, "far", 8000));
    procs.extend(s.agent(3, "farther", 8001));
    for (site, model) in [(1, "local"), (2, "near"), (3, "far"), (3, "farther")] {
        let http = format!("{}:8080", s.router_ip(site));
        wait_until(
            Duration::from_secs(30),
            || {
                Req::get("/v1/models")
                    .send_to(&http)
                    .map(|r| {
                        r.json()["data"].as_array().is_some_and(|a| {
                            a.iter()
                                .any(|m| m["id"] == model && m["agents"]["healthy"] == 1)
                        })
                    })
                    .unwrap_or(false)
            },
            "agent linked across the fleet",
        );
    }
    let p = |site: &str, model: &str, extra: &str| {
        format!(r#"{{"site_id":"{site}","model":"{model}","kind":"chat"{extra}}}"#)
    };
    let sfz = r#","scale_from_zero":true,"hold_budget":"60s""#;
    let placements = [
        p("a", "local", r#","warm":true"#),
        p("a", "near", sfz),
        p("b", "near", r#","warm":true"#),
        p("a", "far", sfz),
        p("c", "far", r#","warm":true"#),
        p("b", "farther", sfz),
        p("c", "farther", r#","warm":true"#),
        p("a", "sleepy", sfz),
        p("b", "sleepy", r#","warm":false"#),
    ]
    .join(",");
    let map = map_json(&s, &placements);
    for site in 1..=3 {
        let http = format!("{}:8080", s.router_ip(site));
        let (st, b) = Req::new("PUT", "/admin/sibling-map")
            .body(map.as_bytes())
            .bearer(ADMIN_KEY)
            .send_to(&http)
            .expect("push")
            .pair();
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    }
    let n = 7;
    let mut rows = Vec::new();
    for (site, model, rtt) in [
        (1, "local", 0),
        (1, "near", 20),
        (1, "far", 80),
        (2, "farther", 150),
    ] {
        let got = s.client(site, model, n);
        let hops = got[0].1;
        assert!(got.iter().all(|g| g.1 == hops), "{model}: {got:?}");
        assert_eq!(
            hops,
            u32::from(rtt > 0),
            "{model}: served here or redirected once"
        );
        let ttft = median(got.into_iter().map(|g| g.0).collect());
        println!(
            "cross-site: model={model} rtt_ms={rtt} redirects={hops} ttft_median_ms={:.1}",
            ttft.as_secs_f64() * 1e3
        );
        rows.push((rtt, ttft));
    }
    // Farther costs more: every hop after the redirect crosses the WAN.
    for w in rows.windows(2) {
        assert!(
            w[0].1 < w[1].1,
            "time to first token grows with distance: {rows:?}"
        );
    }
    // Fresh hints say the home sibling (b) is cold and `sleepy` is
    // holdable here: held at a (no redirect) until its agent registers,
    // 2 s later (the scale from zero).
    let sleepy = {
        let h = router_host(1) + 2;
        let ns = s.fleet.hosts[h].ns.clone();
        let ip = s.router_ip(1);
        std::thread::spawn(move || {
            std::process::Command::new("ip")
                .args([
                    "netns", "exec", &ns, "python3", "-c", CLIENT, &ip, "8080", "sleepy", "1",
                ])
                .output()
                .expect("client")
        })
    };
    wait_until(
        Duration::from_secs(10),
        || {
            Req::get("/metrics")
                .send_to(&format!("{}:9100", s.router_ip(1)))
                .map(|r| {
                    r.text()
                        .contains("hivenet_pending_demand{model=\"sleepy\"} 1")
                })
                .unwrap_or(false)
        },
        "held at a",
    );
    std::thread::sleep(Duration::from_secs(2));
    procs.extend(s.agent(1, "sleepy", 8001));
    let out = sleepy.join().expect("client");
    let line = String::from_utf8_lossy(&out.stdout).to_string();
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        f.get(1..3),
        Some(&["0", "200"][..]),
        "held here, then served: {line}"
    );
    let held: f64 = f[0].parse().expect("ttft");
    assert!(held >= 2.0, "served after the wake: {held}");
    println!(
        "cross-site: model=sleepy held_then_woken_after_s=2 ttft_ms={:.1}",
        held * 1e3
    );
    println!(
        "cross-site: fleet of 9 hosts in 3 sites built in {:.0} ms",
        setup.as_secs_f64() * 1e3
    );
    s._procs = procs;
}
