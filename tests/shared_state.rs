//! Several routers sharing the dynamic key registry through a real
//! `redis-server` (issue 31, `--shared-state`): a key pushed to one router
//! is in force on the others, the version rule holds across them, a Redis
//! that goes away leaves the keys in force and refuses changes (503), and a
//! Redis restarted empty is seeded back from the routers; quotas and
//! daily token budgets are one across routers (leases), survive Redis
//! restarted empty, and follow `--shared-state-failure-mode` while Redis
//! is away or answers errors; `rediss://` with a private CA and a
//! password; a conversation moved to another router finds its prefix
//! there (`--shared-state-affinity`).

mod common;
use common::*;
use serde_json::json;
use std::time::{Duration, Instant};

const MODEL: &str = "ss-model";

fn key(version: &str, raw: &str) -> serde_json::Value {
    json!({"version": version, "key_hash": sha256_hex(raw), "key_preview": "sk-...x",
           "owner": "acme", "name": "prod", "allowed_models": [MODEL]})
}

/// A chat request with `raw` as its key: the status.
fn with_key(http: u16, raw: &str) -> u16 {
    let body = format!(
        r#"{{"model":"{MODEL}","max_tokens":2,"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    Req::post("/v1/chat/completions", body)
        .header("Authorization", &format!("Bearer {raw}"))
        .send(http)
        .map(|r| r.status)
        .unwrap_or(0)
}

struct Fleet {
    routers: Vec<Router>,
    _sim: Proc,
    _agent: Proc,
}

/// `n` routers in dynamic key mode sharing Redis at `redis`, one sim and
/// one agent linked to all of them.
fn fleet(dir: &std::path::Path, n: usize, redis: u16) -> Fleet {
    fleet_with(dir, n, redis, &[])
}

/// [`fleet`] with more router flags.
fn fleet_with(dir: &std::path::Path, n: usize, redis: u16, extra: &[&str]) -> Fleet {
    fleet_at(dir, n, &format!("redis://127.0.0.1:{redis}/0"), extra)
}

/// [`fleet`] sharing the state at `url`, with more router flags.
fn fleet_at(dir: &std::path::Path, n: usize, url: &str, extra: &[&str]) -> Fleet {
    fleet_of(dir, n, url, extra, &[], "8")
}

/// [`fleet_at`] with the simulator's flags and the agent's capacity.
fn fleet_of(
    dir: &std::path::Path,
    n: usize,
    url: &str,
    extra: &[&str],
    sim_args: &[&str],
    capacity: &str,
) -> Fleet {
    let routers: Vec<Router> = (0..n)
        .map(|i| {
            let d = dir.join(format!("r{i}"));
            std::fs::create_dir_all(&d).expect("router dir");
            let mut args = vec!["--shards", "1", "--shared-state", url];
            args.extend_from_slice(extra);
            start_router(&d, &args, &[("HIVENET_ROUTER_AUTH_MODE", "dynamic")])
        })
        .collect();
    let (sim, port) = start_sim(dir, MODEL, sim_args);
    let more: Vec<String> = routers
        .iter()
        .skip(1)
        .map(|r| format!("/ip4/127.0.0.1/tcp/{}", r.p2p))
        .collect();
    let mut extra = vec!["--capacity", capacity];
    for m in &more {
        extra.extend(["--router-p2p", m.as_str()]);
    }
    let agent = start_agent(dir, &routers[0], port, "a.key", &extra);
    for r in &routers {
        // /v1/models wants a key in dynamic mode: the routing table says.
        wait_until(
            Duration::from_secs(30),
            || {
                routing_table(r.http)["agents"]
                    .as_array()
                    .map_or(0, Vec::len)
                    == 1
            },
            "the agent on every router",
        );
        wait_until(
            Duration::from_secs(10),
            || metric(r.metrics, "hivenet_shared_state_up") == Some(1.0),
            "shared state up",
        );
    }
    Fleet {
        routers,
        _sim: sim,
        _agent: agent,
    }
}

#[test]
fn a_key_put_on_one_router_is_in_force_on_every_router() {
    let dir = tmpdir("shared-keys");
    let rport = free_port();
    let _redis = start_redis(&dir, rport);
    let f = fleet(&dir, 3, rport);
    let (a, b, c) = (f.routers[0].http, f.routers[1].http, f.routers[2].http);
    assert_eq!(with_key(c, "sk-one"), 401, "no key yet");
    let (st, out) = admin(a, "PUT", "/admin/api-keys/k1", key("v0002", "sk-one"));
    assert_eq!(st, 200, "{out}");
    wait_until(
        Duration::from_secs(5),
        || with_key(c, "sk-one") == 200 && with_key(b, "sk-one") == 200,
        "the key in force on B and C",
    );
    // The version rule holds across routers: B refuses an older version.
    let (st, out) = admin(b, "PUT", "/admin/api-keys/k2", key("v0001", "sk-two"));
    assert_eq!(st, 409, "{out}");
    assert_eq!(out["current_version"], "v0002");
    // A delete on B ends the key on A.
    let (st, out) = admin(b, "DELETE", "/admin/api-keys/k1?version=v0003", json!(null));
    assert_eq!(st, 200, "{out}");
    wait_until(
        Duration::from_secs(5),
        || with_key(a, "sk-one") == 401,
        "the key gone on A",
    );
    // Every router lists the same registry.
    for r in [a, b, c] {
        wait_until(
            Duration::from_secs(5),
            || admin(r, "GET", "/admin/api-keys", json!(null)).1["version"] == "v0003",
            "the same version everywhere",
        );
    }
    // Changes on two routers at once: both land, in some order, none lost.
    let t1 =
        std::thread::spawn(move || admin(a, "PUT", "/admin/api-keys/k3", key("v0004", "sk-3")).0);
    let t2 =
        std::thread::spawn(move || admin(c, "PUT", "/admin/api-keys/k4", key("v0004", "sk-4")).0);
    assert_eq!((t1.join().expect("t1"), t2.join().expect("t2")), (200, 200));
    wait_until(
        Duration::from_secs(5),
        || with_key(b, "sk-3") == 200 && with_key(b, "sk-4") == 200,
        "both concurrent keys on B",
    );
}

#[test]
fn redis_lost_keeps_the_keys_refuses_changes_and_is_seeded_back() {
    let dir = tmpdir("shared-keys-chaos");
    let rport = free_port();
    let mut redis = start_redis(&dir, rport);
    let f = fleet(&dir, 2, rport);
    let (a, b) = (f.routers[0].http, f.routers[1].http);
    let (st, out) = admin(a, "PUT", "/admin/api-keys/k1", key("v1", "sk-one"));
    assert_eq!(st, 200, "{out}");
    wait_until(
        Duration::from_secs(5),
        || with_key(b, "sk-one") == 200,
        "the key on B",
    );
    redis.kill9();
    wait_until(
        Duration::from_secs(10),
        || metric(f.routers[0].metrics, "hivenet_shared_state_up") == Some(0.0),
        "Redis seen down",
    );
    // Keys in force stay; a change that could not be shared is refused.
    assert_eq!(with_key(b, "sk-one"), 200);
    let (st, out) = admin(a, "PUT", "/admin/api-keys/k2", key("v2", "sk-two"));
    assert_eq!(st, 503, "{out}");
    assert!(metric(f.routers[0].metrics, "hivenet_shared_state_errors_total").unwrap_or(0.0) > 0.0);
    // Redis comes back empty: a router seeds it, and changes work again.
    let _redis = start_redis(&dir, rport);
    wait_until(
        Duration::from_secs(10),
        || metric(f.routers[1].metrics, "hivenet_shared_state_up") == Some(1.0),
        "Redis seen up",
    );
    wait_until(
        Duration::from_secs(10),
        || admin(b, "PUT", "/admin/api-keys/k2", key("v2", "sk-two")).0 == 200,
        "a change accepted again",
    );
    wait_until(
        Duration::from_secs(5),
        || with_key(a, "sk-two") == 200,
        "the new key on A",
    );
    // The seed kept the key pushed before the loss.
    assert_eq!(with_key(a, "sk-one"), 200);
    assert_eq!(with_key(b, "sk-one"), 200);
}

/// Send a request on a raw socket and leave it open (held).
fn held_request(http: u16, client_id: &str) -> std::net::TcpStream {
    use std::io::Write;
    let body = chat_body("z", false);
    let mut s = std::net::TcpStream::connect(("127.0.0.1", http)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).ok();
    s.write_all(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nX-Client-Request-ID: {client_id}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .expect("write");
    s
}

fn held_sum(routers: &[Router]) -> f64 {
    routers
        .iter()
        .map(|r| metric(r.metrics, "hivenet_held_requests").unwrap_or(0.0))
        .sum()
}

fn demand_sum(routers: &[Router]) -> f64 {
    routers
        .iter()
        .map(|r| metric(r.metrics, "hivenet_pending_demand{model=\"z\"}").unwrap_or(-100.0))
        .sum()
}

#[test]
fn a_client_held_on_two_routers_is_one_pending_demand() {
    let dir = tmpdir("shared-demand");
    let rport = free_port();
    let _redis = start_redis(&dir, rport);
    let url = format!("redis://127.0.0.1:{rport}/0");
    // Two routers of site "a", model "z" placed there at zero.
    let routers: Vec<Router> = (0..2)
        .map(|i| {
            let d = dir.join(format!("r{i}"));
            std::fs::create_dir_all(&d).expect("dir");
            start_router(
                &d,
                &["--shards", "1", "--site-id", "a", "--shared-state", &url],
                &[],
            )
        })
        .collect();
    for r in &routers {
        let map = format!(
            r#"{{"version":"1","sites":[{{"site_id":"a","base_url":"http://127.0.0.1:{}"}}],"placements":[{{"site_id":"a","model":"z","kind":"chat","scale_from_zero":true,"hold_budget":"30s"}}]}}"#,
            r.http
        );
        let (st, b) = Req::new("PUT", "/admin/sibling-map")
            .body(map.as_bytes())
            .raw_headers(&format!("Authorization: Bearer {ADMIN_KEY}\r\n"))
            .send(r.http)
            .map(Resp::pair)
            .expect("map");
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    }
    let u1 = "6f1c2a3e-0000-4000-8000-000000000001";
    let u2 = "6f1c2a3e-0000-4000-8000-000000000002";
    // The same client (no key: the same identity) retried on the other
    // router: one demand over both.
    let _a1 = held_request(routers[0].http, u1);
    let _b1 = held_request(routers[1].http, u1);
    wait_until(
        Duration::from_secs(5),
        || held_sum(&routers) == 2.0 && demand_sum(&routers) == 1.0,
        "two held requests, one demand",
    );
    // Another client: two.
    let _b2 = held_request(routers[1].http, u2);
    wait_until(
        Duration::from_secs(5),
        || demand_sum(&routers) == 2.0,
        "a second client",
    );
    // Whichever router counts u1, its request leaves: the other router
    // takes the count over; still two in all.
    let a_counts_u1 =
        metric(routers[0].metrics, "hivenet_pending_demand{model=\"z\"}") == Some(1.0);
    if a_counts_u1 {
        drop(_a1);
    } else {
        drop(_b1);
    }
    wait_until(
        Duration::from_secs(10),
        || held_sum(&routers) == 2.0 && demand_sum(&routers) == 2.0,
        "u1 still counted once, by the router that still holds it",
    );
}

/// A key of tenant `owner` with `quota`.
fn quota_key(version: &str, raw: &str, owner: &str, quota: serde_json::Value) -> serde_json::Value {
    json!({"version": version, "key_hash": sha256_hex(raw), "key_preview": "sk-...q",
           "owner": owner, "name": "q", "allowed_models": [MODEL], "quota": quota})
}

/// A chat request with `raw` as its key (the whole response).
fn send_with_key(http: u16, raw: &str) -> Resp {
    let body = format!(
        r#"{{"model":"{MODEL}","max_tokens":2,"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    Req::post("/v1/chat/completions", body)
        .header("Authorization", &format!("Bearer {raw}"))
        .send(http)
        .expect("response")
}

/// Put `key` on the first router and wait until every router lists it.
fn put_everywhere(f: &Fleet, id: &str, key: serde_json::Value) {
    let version = key["version"].as_str().unwrap_or_default().to_string();
    let (st, out) = admin(
        f.routers[0].http,
        "PUT",
        &format!("/admin/api-keys/{id}"),
        key,
    );
    assert_eq!(st, 200, "{out}");
    for r in &f.routers {
        wait_until(
            Duration::from_secs(5),
            || {
                admin(r.http, "GET", "/admin/api-keys", json!(null)).1["version"]
                    == version.as_str()
            },
            "the key on every router",
        );
    }
}

/// `redis-cli` against the test's server.
fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli (scripts/test.sh installs redis-tools)");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Prompt plus completion tokens of a served response.
fn used_tokens(r: &Resp) -> u64 {
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
    v["usage"]["prompt_tokens"].as_u64().unwrap_or(0)
        + v["usage"]["completion_tokens"].as_u64().unwrap_or(0)
}

fn today() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() / 86_400)
        .unwrap_or(0)
}

#[test]
fn a_quota_is_one_quota_across_routers() {
    let dir = tmpdir("shared-quota");
    let rport = free_port();
    let _redis = start_redis(&dir, rport);
    let f = fleet(&dir, 3, rport);
    // 30 requests a minute (burst: the whole minute, lease 1 per router).
    put_everywhere(
        &f,
        "k1",
        quota_key("v1", "sk-rpm", "acme", json!({"requests_per_minute": 30})),
    );
    let (mut ok, mut refused) = (0u32, 0u32);
    let t0 = std::time::Instant::now();
    for i in 0..60 {
        let r = send_with_key(f.routers[i % 3].http, "sk-rpm");
        match r.status {
            200 => ok += 1,
            429 => {
                refused += 1;
                let secs: u64 = r
                    .header("retry-after")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                assert!((1..=60).contains(&secs), "an honest Retry-After: {secs}");
                assert!(String::from_utf8_lossy(&r.body).contains("rate_limit_exceeded"));
            }
            s => panic!("status {s}: {}", String::from_utf8_lossy(&r.body)),
        }
        // Paced so that the routers' draws (every 20 ms) follow: sent back
        // to back, the 60 take 50 ms, three rounds, and a router refuses
        // whatever arrives between two rounds beyond its lease (the
        // request path never waits on Redis), which is not what this
        // test measures.
        std::thread::sleep(Duration::from_millis(5));
    }
    // Alone, each router would admit its 20: 60. Shared: the 30 of the
    // minute, plus one lease per router on credit, plus the refill of the
    // seconds the test took (one every 2 s); less what a router holds
    // drawn and unspent when the test stops (its pace-sized top-up is at
    // most a quarter of what the quota had left: near the end, one).
    eprintln!("admitted {ok}, refused {refused} in {:?}", t0.elapsed());
    assert!(
        (26..=30 + 3 + 5).contains(&ok),
        "admitted {ok}, refused {refused}"
    );

    // Daily tokens: 300 a day over three routers.
    put_everywhere(
        &f,
        "k2",
        quota_key("v2", "sk-tpd", "beta", json!({"tokens_per_day": 300})),
    );
    let mut used = 0u64;
    let mut need_max = 0u64;
    let mut tries = 0;
    let mut refused_in_a_row = 0;
    while refused_in_a_row < 6 && tries < 400 {
        tries += 1;
        let r = send_with_key(f.routers[tries % 3].http, "sk-tpd");
        match r.status {
            200 => {
                refused_in_a_row = 0;
                let u = used_tokens(&r);
                used += u;
                need_max = need_max.max(u + 8);
            }
            429 => {
                refused_in_a_row += 1;
                assert!(String::from_utf8_lossy(&r.body).contains("token_limit_exceeded"));
                // Let a draw land before the next try.
                std::thread::sleep(Duration::from_millis(50));
            }
            s => panic!("status {s}"),
        }
    }
    assert!(
        refused_in_a_row >= 6,
        "the budget ran out ({used} used in {tries})"
    );
    // Alone: 900. Shared: 300, plus at most one request's need per router
    // on credit.
    eprintln!("tokens used {used} (need at most {need_max}) in {tries} tries");
    assert!(
        (250..=300 + 3 * need_max).contains(&used),
        "used {used} (need {need_max})"
    );
    // The counter in Redis holds what the routers drew: every token used,
    // plus at most one lease (1 token) per router unspent.
    let key = format!("hivenet:quota:tokens:{}:beta:", today());
    let counted: u64 = redis_cli(rport, &["GET", &key]).parse().unwrap_or(0);
    wait_until(
        Duration::from_secs(5),
        || {
            let c: u64 = redis_cli(rport, &["GET", &key]).parse().unwrap_or(0);
            c >= used && c <= used + 3 + 3 * need_max
        },
        "the shared counter matches the usage",
    );
    // Redis restarted empty: every router adds its usage back, once.
    assert_eq!(redis_cli(rport, &["FLUSHALL"]), "OK");
    wait_until(
        Duration::from_secs(10),
        || {
            let c: u64 = redis_cli(rport, &["GET", &key]).parse().unwrap_or(0);
            c >= used && c <= counted.max(used) + 3 + 3 * need_max
        },
        "the usage added back after FLUSHALL",
    );
    std::thread::sleep(Duration::from_millis(600));
    let after: u64 = redis_cli(rport, &["GET", &key]).parse().unwrap_or(0);
    assert!(
        after <= counted.max(used) + 3 + 3 * need_max,
        "added once: {after}"
    );
    // The budget stays spent: what routers still serve (from the refunds
    // of true-ups left in their leases) keeps the total within the bound.
    for i in 0..9 {
        let r = send_with_key(f.routers[i % 3].http, "sk-tpd");
        if r.status == 200 {
            used += used_tokens(&r);
        }
    }
    assert!(used <= 300 + 3 * need_max, "used {used} after FLUSHALL");
}

#[test]
fn redis_away_fails_open_or_closed_as_told_and_open_usage_is_charged_after() {
    let dir = tmpdir("shared-quota-fail");
    let rport = free_port();
    let mut redis = start_redis(&dir, rport);
    let closed_dir = dir.join("closed");
    std::fs::create_dir_all(&closed_dir).expect("dir");
    let open = fleet(&dir, 1, rport);
    let closed = fleet_with(
        &closed_dir,
        1,
        rport,
        &["--shared-state-failure-mode", "closed"],
    );
    let (o, c) = (&open.routers[0], &closed.routers[0]);
    put_everywhere(
        &open,
        "k1",
        quota_key(
            "v1",
            "sk-lim",
            "acme",
            json!({"tokens_per_day": 1000, "requests_per_minute": 1000}),
        ),
    );
    wait_until(
        Duration::from_secs(5),
        || admin(c.http, "GET", "/admin/api-keys", json!(null)).1["version"] == "v1",
        "the key on the closed router",
    );
    put_everywhere(&open, "k2", key("v2", "sk-free"));
    wait_until(
        Duration::from_secs(5),
        || admin(c.http, "GET", "/admin/api-keys", json!(null)).1["version"] == "v2",
        "the free key on the closed router",
    );
    let mut used = 0;
    for r in [o, c] {
        let resp = send_with_key(r.http, "sk-lim");
        assert_eq!(resp.status, 200);
        used += used_tokens(&resp);
    }
    redis.kill9();
    for r in [o, c] {
        wait_until(
            Duration::from_secs(10),
            || metric(r.metrics, "hivenet_shared_state_up") == Some(0.0),
            "Redis seen down",
        );
    }
    // Closed: the limited key is refused, a key without limits served.
    let r = send_with_key(c.http, "sk-lim");
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("retry-after").as_deref(), Some("1"));
    assert_eq!(with_key(c.http, "sk-free"), 200);
    assert_eq!(
        metric(c.metrics, "hivenet_shared_quota_fail_closed_total"),
        Some(1.0)
    );
    // Open: served on local limits, counted.
    for _ in 0..5 {
        let resp = send_with_key(o.http, "sk-lim");
        assert_eq!(resp.status, 200);
        used += used_tokens(&resp);
    }
    assert!(metric(o.metrics, "hivenet_shared_quota_fail_open_total").unwrap_or(0.0) >= 5.0);
    // Issue 51 #7: on its own, a router spends at most a quarter of the
    // day (250 of 1000 tokens) past its lease, not the whole day again.
    let mut away = 0u64;
    let mut need = 0u64;
    let mut refused = false;
    for _ in 0..200 {
        let resp = send_with_key(o.http, "sk-lim");
        if resp.status == 429 {
            refused = true;
            break;
        }
        assert_eq!(resp.status, 200);
        let u = used_tokens(&resp);
        need = need.max(u + 8);
        away += u;
    }
    assert!(
        refused,
        "fail-open stops at its bound ({away} tokens spent)"
    );
    used += away;
    assert!(
        used <= 2 * 250 + 2 * need + 100,
        "fail-open spend bounded: {used}"
    );
    // Redis back, empty: the usage of both routers, including what the
    // open one spent while it was away, lands in the counter, once.
    let _redis = start_redis(&dir, rport);
    let key = format!("hivenet:quota:tokens:{}:acme:", today());
    // Each router may hold a lease unspent (1 token, or twice its pace).
    wait_until(
        Duration::from_secs(10),
        || {
            let n: u64 = redis_cli(rport, &["GET", &key]).parse().unwrap_or(0);
            n >= used && n <= used + 200
        },
        "the usage charged after Redis returned",
    );
    // The request bucket was charged too (its GCRA state exists again).
    assert_ne!(
        redis_cli(rport, &["EXISTS", "hivenet:quota:requests:acme:"]),
        "0"
    );
    assert_eq!(send_with_key(c.http, "sk-lim").status, 200);
}

#[test]
fn rediss_with_a_private_ca_and_a_password() {
    let dir = tmpdir("shared-tls");
    // A CA of the test's own and a server certificate for 127.0.0.1.
    let (ca, _, _) = make_certs(&dir); // ca.pem, server.pem, server.key in dir
    let port = free_port();
    let log = std::fs::File::create(dir.join("redis-tls.log")).expect("log");
    let child = std::process::Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .args([
            "--tls-cert-file",
            "server.pem",
            "--tls-key-file",
            "server.key",
        ])
        .args(["--tls-ca-cert-file", "ca.pem", "--tls-auth-clients", "no"])
        .args([
            "--requirepass",
            "s3cret",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .current_dir(&dir)
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("redis-server");
    let _redis = Proc {
        child,
        name: "redis-server (tls)".into(),
        log: dir.join("redis-tls.log"),
    };
    wait_until(
        Duration::from_secs(10),
        || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
        "redis-server (tls) up",
    );
    let ca = ca.to_str().unwrap_or_default();
    let url = format!("rediss://:s3cret@127.0.0.1:{port}/0");
    let f = fleet_at(&dir, 2, &url, &["--shared-state-ca-file", ca]);
    // Up on both (fleet waited for it), and a key pushed to one is in
    // force on the other: the registry went through TLS.
    let (st, out) = admin(
        f.routers[0].http,
        "PUT",
        "/admin/api-keys/k1",
        key("v1", "sk-tls"),
    );
    assert_eq!(st, 200, "{out}");
    wait_until(
        Duration::from_secs(5),
        || with_key(f.routers[1].http, "sk-tls") == 200,
        "the key on the other router",
    );
    // The password is never shown.
    let log = std::fs::read_to_string(&f.routers[0].proc.log).unwrap_or_default();
    assert!(log.contains("rediss://***@127.0.0.1"), "{log}");
    assert!(!log.contains("s3cret"));
    // A router that does not trust that CA (the system's roots) and one
    // with a wrong password stop the start with one line (issue 51 #8);
    // told that fail-open is acceptable, they start and count Redis away.
    for (i, (u, extra)) in [
        (url.clone(), vec![]),
        (
            format!("rediss://:wrong@127.0.0.1:{port}/0"),
            vec!["--shared-state-ca-file", ca],
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let d = dir.join(format!("bad{i}"));
        std::fs::create_dir_all(&d).expect("dir");
        let mut args = vec!["--shards", "1", "--shared-state", u.as_str()];
        args.extend(extra);
        let child = std::process::Command::new(bin("hivenet-router"))
            .args(&args)
            .args([
                "--http-port",
                "127.0.0.1:0",
                "--metrics-port",
                "127.0.0.1:0",
                "--p2p-port",
                "0",
            ])
            .env("HIVENET_ROUTER_AUTH_MODE", "dynamic")
            .env("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN_KEY)
            .current_dir(&d)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn");
        let (code, err) = exit_within(child, Duration::from_secs(15));
        assert_eq!(code, Some(2), "{i}: refused at start: {err}");
        assert!(
            err.contains("--shared-state rediss://") && !err.contains("wrong@"),
            "{i}: {err}"
        );
        args.extend(["--shared-state-failure-mode", "open"]);
        let r = start_router(&d, &args, &[("HIVENET_ROUTER_AUTH_MODE", "dynamic")]);
        wait_until(
            Duration::from_secs(10),
            || metric(r.metrics, "hivenet_shared_state_errors_total").unwrap_or(0.0) >= 1.0,
            "a failed call counted",
        );
        assert_eq!(metric(r.metrics, "hivenet_shared_state_up"), Some(0.0));
    }
}

/// Issue 51 #8: Redis preconditions. An evicting `maxmemory-policy` is
/// said loudly at start; a second router started from the same identity
/// file on the same Redis is refused with one line (their contributions
/// would merge); a database index out of range stops the start.
#[test]
fn redis_preconditions_are_checked_at_start() {
    let dir = tmpdir("shared-preconditions");
    let rport = free_port();
    let _redis = start_redis(&dir, rport);
    assert_eq!(
        redis_cli(rport, &["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]),
        "OK"
    );
    let url = format!("redis://127.0.0.1:{rport}/0");
    let d1 = dir.join("r1");
    std::fs::create_dir_all(&d1).expect("dir");
    let id = dir
        .join("shared_identity.key")
        .to_string_lossy()
        .to_string();
    let r1 = start_router(
        &d1,
        &[
            "--shards",
            "1",
            "--shared-state",
            &url,
            "--identity-path",
            &id,
        ],
        &[("HIVENET_ROUTER_AUTH_MODE", "dynamic")],
    );
    assert!(
        r1.proc.log_text().contains("maxmemory-policy allkeys-lru"),
        "{}",
        r1.proc.log_text()
    );
    let refused = |extra: &[&str]| {
        let child = std::process::Command::new(bin("hivenet-router"))
            .args([
                "--shards",
                "1",
                "--http-port",
                "127.0.0.1:0",
                "--metrics-port",
                "127.0.0.1:0",
                "--p2p-port",
                "0",
            ])
            .args(extra)
            .env("HIVENET_ROUTER_AUTH_MODE", "dynamic")
            .env("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN_KEY)
            .current_dir(&dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn");
        exit_within(child, Duration::from_secs(15))
    };
    let (code, err) = refused(&["--shared-state", &url, "--identity-path", &id]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("another router with this identity"), "{err}");
    let (code, err) = refused(&["--shared-state", &format!("redis://127.0.0.1:{rport}/999")]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("database index"), "{err}");
    drop(r1);
}

/// Turn `turn` of one conversation with a long system prompt.
fn conversation_turn(turn: usize, key: &str) -> Req {
    let system = "You are a careful assistant. ".repeat(40);
    let mut msgs = vec![json!({"role": "system", "content": system})];
    for t in 0..=turn {
        msgs.push(json!({"role": "user", "content": format!("question {t}")}));
        if t < turn {
            msgs.push(json!({"role": "assistant", "content": format!("answer {t}")}));
        }
    }
    let body = json!({"model": MODEL, "max_tokens": 2, "messages": msgs}).to_string();
    Req::post("/v1/chat/completions", body).header("Authorization", &format!("Bearer {key}"))
}

fn decisions(metrics: u16, outcome: &str) -> f64 {
    metric(
        metrics,
        &format!("hivenet_affinity_decisions_total{{model=\"{MODEL}\",outcome=\"{outcome}\"}}"),
    )
    .unwrap_or(0.0)
}

#[test]
fn a_conversation_moved_to_another_router_finds_its_prefix_there() {
    let dir = tmpdir("shared-affinity");
    let rport = free_port();
    let _redis = start_redis(&dir, rport);
    let pf = dir.join("policy.yaml");
    std::fs::write(&pf, "routing_policy:\n  strategy: prefix-aware\n").expect("policy");
    let pfs = pf.to_string_lossy().to_string();
    let f = fleet_with(
        &dir,
        2,
        rport,
        &["--policy-file", &pfs, "--shared-state-affinity"],
    );
    put_everywhere(&f, "k1", key("v1", "sk-aff"));
    let (a, b) = (&f.routers[0], &f.routers[1]);
    let (st, body) = conversation_turn(0, "sk-aff")
        .send(a.http)
        .map(Resp::pair)
        .expect("turn 0");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(decisions(a.metrics, "miss"), 1.0);
    let notes = |m: u16, d: &str| {
        metric(
            m,
            &format!("hivenet_shared_affinity_notes_total{{direction=\"{d}\"}}"),
        )
        .unwrap_or(0.0)
    };
    wait_until(
        Duration::from_secs(5),
        || notes(a.metrics, "published") >= 1.0 && notes(b.metrics, "received") >= 1.0,
        "turn 0 published by A, received by B",
    );
    // Turn 1 on the other router, once: it heard of turn 0 through Redis.
    let (st, _) = conversation_turn(1, "sk-aff")
        .send(b.http)
        .map(Resp::pair)
        .expect("turn 1");
    assert_eq!(st, 200);
    assert_eq!(decisions(b.metrics, "prefix_hit"), 1.0);
    assert_eq!(decisions(b.metrics, "miss"), 0.0);
}

#[test]
fn shared_affinity_without_shared_state_is_refused() {
    let dir = tmpdir("shared-affinity-flag");
    let out = std::process::Command::new(bin("hivenet-router"))
        .args(["--shared-state-affinity", "--disk-db-path"])
        .arg(dir.join("db"))
        .output()
        .expect("router");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs --shared-state"));
}

#[test]
fn redis_answering_errors_counts_as_away_and_recovers() {
    let dir = tmpdir("shared-quota-oom");
    let rport = free_port();
    let _redis = start_redis(&dir, rport);
    let f = fleet_with(&dir, 1, rport, &["--shared-state-failure-mode", "closed"]);
    let r = &f.routers[0];
    put_everywhere(
        &f,
        "k1",
        quota_key("v1", "sk-lim", "acme", json!({"requests_per_minute": 1000})),
    );
    assert_eq!(send_with_key(r.http, "sk-lim").status, 200);
    // Redis answers every write with an error (out of memory), reads still
    // work: the lease's draws fail, the router counts Redis away.
    assert_eq!(
        redis_cli(rport, &["CONFIG", "SET", "maxmemory-policy", "noeviction"]),
        "OK"
    );
    assert_eq!(redis_cli(rport, &["CONFIG", "SET", "maxmemory", "1"]), "OK");
    wait_until(
        Duration::from_secs(10),
        || {
            let _ = send_with_key(r.http, "sk-lim");
            metric(r.metrics, "hivenet_shared_state_up") == Some(0.0)
        },
        "Redis answering errors seen as away",
    );
    let resp = send_with_key(r.http, "sk-lim");
    assert_eq!(resp.status, 429, "fail-closed while Redis errs");
    assert!(metric(r.metrics, "hivenet_shared_state_errors_total").unwrap_or(0.0) >= 1.0);
    // Redis well again: served again.
    assert_eq!(redis_cli(rport, &["CONFIG", "SET", "maxmemory", "0"]), "OK");
    wait_until(
        Duration::from_secs(10),
        || send_with_key(r.http, "sk-lim").status == 200,
        "served again once Redis answers",
    );
}

/// Issue 51 #3: Redis content is input. Malformed values (a GCRA state of
/// `1e300`, then of text, then a key of the wrong type, the registry's
/// epoch as text, a daily counter as text) affect only their own key: they
/// are repaired or skipped with a rate-limited line, Redis is never
/// counted away, and another tenant's quota stays one quota across the
/// routers (each alone would admit its own 20).
#[test]
fn malformed_values_in_redis_affect_only_their_own_key() {
    let dir = tmpdir("shared-malformed");
    let rport = free_port();
    let _redis = start_redis(&dir, rport);
    let f = fleet(&dir, 2, rport);
    put_everywhere(
        &f,
        "ka",
        quota_key("v1", "sk-a", "acme", json!({"requests_per_minute": 20})),
    );
    put_everywhere(
        &f,
        "kb",
        quota_key(
            "v2",
            "sk-b",
            "beta",
            json!({"requests_per_minute": 1000, "tokens_per_day": 1000000}),
        ),
    );
    assert_eq!(send_with_key(f.routers[0].http, "sk-b").status, 200);
    let gcra = "hivenet:quota:requests:beta:";
    let tokens = format!("hivenet:quota:tokens:{}:beta:", today());
    wait_until(
        Duration::from_secs(5),
        || redis_cli(rport, &["EXISTS", gcra]) == "1",
        "beta drew",
    );
    // Beta's values, damaged in turn, then the registry's epoch.
    let damage: [&[&str]; 6] = [
        &["SET", gcra, "1e300"],
        &["SET", gcra, "abc"],
        &["SET", &tokens, "text"],
        &["DEL", gcra],
        &["HSET", gcra, "x", "1"],
        &["HSET", "hivenet:keys", "epoch", "abc"],
    ];
    let mut ok_a = 0;
    for (i, cmd) in damage.iter().enumerate() {
        redis_cli(rport, cmd);
        // Acme: 10 requests after each damage, over both routers.
        for j in 0..10 {
            if send_with_key(f.routers[j % 2].http, "sk-a").status == 200 {
                ok_a += 1;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let b = send_with_key(f.routers[i % 2].http, "sk-b");
        assert_eq!(b.status, 200, "beta served after {cmd:?}: {}", b.text());
    }
    // 60 tries: shared, 20 of the minute (plus a lease per router on credit
    // and the refill of the seconds taken); alone each router would admit 20.
    assert!(
        (16..=20 + 2 + 3).contains(&ok_a),
        "acme admitted {ok_a} of 60"
    );
    for r in &f.routers {
        assert_eq!(
            metric(r.metrics, "hivenet_shared_state_up"),
            Some(1.0),
            "never counted away"
        );
        let log = r.proc.log_text();
        assert!(!log.contains("shared state unreachable"), "{log}");
    }
    let logs: String = f.routers.iter().map(|r| r.proc.log_text()).collect();
    assert!(
        logs.contains("malformed"),
        "said, once a second at most:\n{logs}"
    );
    // A key change still goes through and repairs the epoch.
    put_everywhere(
        &f,
        "kc",
        quota_key("v3", "sk-c", "gamma", json!({"requests_per_minute": 5})),
    );
    assert_eq!(send_with_key(f.routers[1].http, "sk-c").status, 200);
}

/// Issue 51 #11: registry data read from Redis is bounded. A 24 MiB
/// registry (past the 16 MiB every router writes at most) is not read:
/// the router's memory stays flat and the keys in force stay; it is said
/// once a second at most, not re-read every poll.
#[test]
fn an_oversize_registry_in_redis_is_not_read() {
    let dir = tmpdir("shared-oversize");
    let rport = free_port();
    let _redis = start_redis(&dir, rport);
    let f = fleet(&dir, 1, rport);
    let r = &f.routers[0];
    put_everywhere(&f, "k1", key("v1", "sk-kept"));
    let rss = || {
        std::fs::read_to_string(format!("/proc/{}/status", r.proc.child.id()))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let before = rss();
    let big = dir.join("big.txt");
    std::fs::write(&big, "x".repeat(24 << 20)).expect("big");
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "redis-cli -p {rport} -x HSET hivenet:keys data < {} && redis-cli -p {rport} HSET hivenet:keys epoch 99999999999999",
            big.display()
        ))
        .output()
        .expect("redis-cli");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::thread::sleep(Duration::from_secs(3));
    let after = rss();
    eprintln!("router RSS {before} kB before, {after} kB with a 24 MiB registry in Redis");
    assert!(
        after < before + 8 * 1024,
        "not read: {before} -> {after} kB"
    );
    assert_eq!(with_key(r.http, "sk-kept"), 200, "the keys in force stay");
    let lines = r
        .proc
        .log_text()
        .lines()
        .filter(|l| l.contains("larger than"))
        .count();
    assert!(
        (1..=4).contains(&lines),
        "said at most once a second: {lines} lines in 3 s"
    );
    assert_eq!(metric(r.metrics, "hivenet_shared_state_up"), Some(1.0));
}

/// A TCP proxy to Redis on `listen` that cuts every connection and refuses
/// new ones while the file `pause` exists (a router cut off from Redis).
const PAUSABLE_PROXY: &str = r#"
import os, select, socket, sys, threading
listen, target, pause = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", listen)); srv.listen(64)
def pipe(a):
    try:
        b = socket.create_connection(("127.0.0.1", target))
    except OSError:
        a.close(); return
    while not os.path.exists(pause):
        r, _, _ = select.select([a, b], [], [], 0.05)
        done = False
        for s in r:
            d = s.recv(65536)
            if not d:
                done = True; break
            (b if s is a else a).sendall(d)
        if done:
            break
    a.close(); b.close()
while True:
    c, _ = srv.accept()
    if os.path.exists(pause):
        c.close(); continue
    threading.Thread(target=pipe, args=(c,), daemon=True).start()
"#;

/// Issue 51 #4: a revoked key never comes back. Router A is cut off from
/// Redis while router B revokes a key; Redis restarts empty while B is
/// cut off too; A reaches the empty Redis first with its stale copy (the
/// key still in it), B a moment later with the newer one. The newest copy
/// seeds Redis: the key stays revoked on both (before, the first router to
/// see the empty store seeded it and every router took the key back).
#[test]
fn a_revoked_key_never_comes_back_through_a_stale_router() {
    let dir = tmpdir("shared-revoked");
    let rport = free_port();
    let _redis = start_redis(&dir, rport);
    let mut proxies = Vec::new();
    let mut routers = Vec::new();
    for name in ["a", "b"] {
        let port = free_port();
        let pause = dir.join(format!("pause-{name}"));
        proxies.push((
            std::process::Command::new("python3")
                .args(["-c", PAUSABLE_PROXY, &port.to_string(), &rport.to_string()])
                .arg(&pause)
                .spawn()
                .expect("proxy"),
            pause,
        ));
        std::thread::sleep(Duration::from_millis(300));
        let d = dir.join(name);
        std::fs::create_dir_all(&d).expect("dir");
        let url = format!("redis://127.0.0.1:{port}/0");
        routers.push(start_router(
            &d,
            &["--shards", "1", "--shared-state", &url],
            &[("HIVENET_ROUTER_AUTH_MODE", "dynamic")],
        ));
    }
    let (a, b) = (&routers[0], &routers[1]);
    let valid = |r: &Router| with_key(r.http, "sk-revoked") != 401;
    let (st, out) = admin(b.http, "PUT", "/admin/api-keys/k1", key("v1", "sk-revoked"));
    assert_eq!(st, 200, "{out}");
    wait_until(
        Duration::from_secs(5),
        || valid(a) && valid(b),
        "the key on both",
    );
    let cut = |i: usize, on: bool| {
        let p = &proxies[i].1;
        if on {
            std::fs::write(p, b"").expect("pause");
        } else {
            let _ = std::fs::remove_file(p);
        }
    };
    cut(0, true);
    wait_until(
        Duration::from_secs(10),
        || metric(a.metrics, "hivenet_shared_state_up") == Some(0.0),
        "A cut off",
    );
    let (st, out) = admin(
        b.http,
        "DELETE",
        "/admin/api-keys/k1?version=v2",
        json!(null),
    );
    assert_eq!(st, 200, "{out}");
    assert!(
        !valid(b) && valid(a),
        "revoked on B, A still has its stale copy"
    );
    cut(1, true);
    wait_until(
        Duration::from_secs(10),
        || metric(b.metrics, "hivenet_shared_state_up") == Some(0.0),
        "B cut off",
    );
    assert_eq!(redis_cli(rport, &["FLUSHALL"]), "OK");
    // A sees the empty store first, B 300 ms later.
    cut(0, false);
    std::thread::sleep(Duration::from_millis(300));
    cut(1, false);
    wait_until(
        Duration::from_secs(10),
        || !redis_cli(rport, &["HGET", "hivenet:keys", "epoch"]).is_empty(),
        "the store seeded again",
    );
    std::thread::sleep(Duration::from_millis(1000));
    assert!(!valid(b), "the key stays revoked on B");
    assert!(
        !valid(a),
        "A took the newer copy: the key is revoked there too"
    );
    let logs = a.proc.log_text() + &b.proc.log_text();
    assert!(
        logs.contains("seeded it with version \"v2\""),
        "said loudly:\n{logs}"
    );
    for (mut p, _) in proxies {
        let _ = p.kill();
    }
}

/// Three routers sharing Redis at `url`, one sim (`sim` flags) and one
/// agent linked to all three.
fn three_routers(dir: &std::path::Path, url: &str, sim: &[&str]) -> Fleet {
    fleet_of(dir, 3, url, &[], sim, "64")
}

/// Issue 51 #5 (second half): forty small requests at once, wave after
/// wave over three routers, use the whole daily budget before they are
/// refused: leases a router holds unspent do not strand the rest (0.45x
/// was used before), and never more than the documented bound.
#[test]
fn many_small_concurrent_requests_use_the_whole_budget() {
    let dir = tmpdir("shared-stranded");
    let rport = free_port();
    let _redis = start_redis(&dir, rport);
    let url = format!("redis://127.0.0.1:{rport}/0");
    let f = three_routers(&dir, &url, &["--output-tokens", "50", "--itl", "2ms"]);
    put_everywhere(
        &f,
        "k1",
        quota_key("v1", "sk-small", "acme", json!({"tokens_per_day": 3000})),
    );
    let body = format!(
        r#"{{"model":"{MODEL}","max_tokens":50,"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    let (mut used, mut served, mut refused) = (0u64, 0usize, 0usize);
    for _wave in 0..12 {
        let handles: Vec<_> = (0..40)
            .map(|i| {
                let (http, body) = (f.routers[i % 3].http, body.clone());
                std::thread::spawn(move || {
                    Req::post("/v1/chat/completions", body)
                        .header("Authorization", "Bearer sk-small")
                        .send(http)
                        .expect("response")
                })
            })
            .collect();
        let answers: Vec<Resp> = handles
            .into_iter()
            .map(|h| h.join().expect("join"))
            .collect();
        let ok: Vec<&Resp> = answers.iter().filter(|r| r.status == 200).collect();
        for r in answers.iter().filter(|r| r.status != 200) {
            assert_eq!(r.status, 429, "{}", r.text());
        }
        used += ok.iter().map(|r| used_tokens(r)).sum::<u64>();
        eprintln!("wave {_wave}: {} of 40 served, {used} used", ok.len());
        // 40 x 70 tokens fit the 3,000: the first wave is served whole
        // (leases stranded on the routers refused most of it before).
        if _wave == 0 {
            assert_eq!(ok.len(), 40, "the first wave fits the budget");
        }
        served += ok.len();
        refused += answers.len() - ok.len();
        if ok.is_empty() {
            break;
        }
        // The next wave after the routers' next draws.
        std::thread::sleep(Duration::from_millis(300));
    }
    eprintln!("stranded leases: {served} served, {refused} refused, {used} tokens of 3000");
    // The documented bound: a lease per router (3 tokens) and what the
    // estimate of the last request admitted on each missed (at most one
    // request's 70 tokens).
    assert!(used <= 3000 + 3 * (3 + 70), "over: {used}");
    // 70 tokens a request: all that fits but one request's worth.
    assert!(
        used >= 3000 - 70,
        "under-admitted: {used} of 3000 ({served} served)"
    );
}

/// Issue 51 #7: a Redis merely slow is not down. Redis frozen for 3 s
/// (SIGSTOP: every call waits, nothing fails) while three routers serve a
/// budget of 1,000 tokens a day: none counts it away or fails open (the
/// old 1 s timeout made each spend on its own limits, 3.0x), no request
/// waits on it longer than a reservation, and the day's use stays within
/// the budget plus a lease per router once it is back.
#[test]
fn a_slow_redis_is_not_down_and_the_budget_holds() {
    let dir = tmpdir("shared-slow");
    let rport = free_port();
    let redis = start_redis(&dir, rport);
    let url = format!("redis://127.0.0.1:{rport}/0");
    let f = three_routers(&dir, &url, &["--output-tokens", "50", "--itl", "1ms"]);
    put_everywhere(
        &f,
        "k1",
        quota_key("v1", "sk-slow", "acme", json!({"tokens_per_day": 1000})),
    );
    let mut used = 0u64;
    let mut per_request = 0;
    for r in &f.routers {
        let resp = send_with_key(r.http, "sk-slow");
        assert_eq!(resp.status, 200, "{}", resp.text());
        per_request = used_tokens(&resp);
        used += per_request;
    }
    signal(&redis, "STOP");
    let t0 = Instant::now();
    let mut slowest = Duration::ZERO;
    let mut during = Vec::new();
    while t0.elapsed() < Duration::from_secs(3) {
        for r in &f.routers {
            let t = Instant::now();
            let resp = send_with_key(r.http, "sk-slow");
            slowest = slowest.max(t.elapsed());
            if resp.status == 200 {
                used += used_tokens(&resp);
            }
            during.push(resp.status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let up: Vec<Option<f64>> = f
        .routers
        .iter()
        .map(|r| metric(r.metrics, "hivenet_shared_state_up"))
        .collect();
    signal(&redis, "CONT");
    assert!(
        up.iter().all(|u| *u == Some(1.0)),
        "counted down while slow: {up:?}"
    );
    for r in &f.routers {
        assert_eq!(
            metric(r.metrics, "hivenet_shared_quota_fail_open_total"),
            Some(0.0),
            "failed open while Redis was slow"
        );
    }
    assert!(
        slowest < Duration::from_millis(1500),
        "a request waited {slowest:?} on a slow Redis: {during:?}"
    );
    // Back: spend the rest of the day.
    for _ in 0..40 {
        let mut any = false;
        for r in &f.routers {
            let resp = send_with_key(r.http, "sk-slow");
            if resp.status == 200 {
                used += used_tokens(&resp);
                any = true;
            }
        }
        if !any {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "slow redis: {} requests during the stall, slowest {slowest:?}, {used} tokens of 1000",
        during.len()
    );
    // The stated bound: a lease (1 token) per router, and what the
    // estimate of the last request admitted on each missed (admission
    // charges the estimate; the true-up the real usage).
    assert!(
        used <= 1000 + 3 * (1 + per_request),
        "over budget: {used} ({per_request} a request)"
    );
    assert!(used >= 1000 - 3 * per_request, "under-admitted: {used}");
}

/// Issue 51 #5: exact shared budgets. Three routers, a daily budget of
/// 3,000 tokens, and one request on each, at once, that needs the whole
/// budget (2,950 tokens of output): at most the budget plus one lease per
/// router is used (one request served). Each router used to admit its
/// request on credit: 8,778 tokens used, 2.93x.
#[test]
fn one_request_of_the_whole_budget_per_router_overshoots_by_at_most_a_lease() {
    let dir = tmpdir("shared-exact");
    let rport = free_port();
    let _redis = start_redis(&dir, rport);
    let url = format!("redis://127.0.0.1:{rport}/0");
    let f = fleet_of(&dir, 3, &url, &[], &["--output-tokens", "2950"], "8");
    put_everywhere(
        &f,
        "k1",
        quota_key("v1", "sk-whole", "acme", json!({"tokens_per_day": 3000})),
    );
    let body = format!(
        r#"{{"model":"{MODEL}","max_tokens":2950,"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    let handles: Vec<_> = f
        .routers
        .iter()
        .map(|r| {
            let (http, body) = (r.http, body.clone());
            std::thread::spawn(move || {
                Req::post("/v1/chat/completions", body)
                    .header("Authorization", "Bearer sk-whole")
                    .send(http)
                    .expect("response")
            })
        })
        .collect();
    let answers: Vec<Resp> = handles
        .into_iter()
        .map(|h| h.join().expect("join"))
        .collect();
    let served = answers.iter().filter(|r| r.status == 200).count();
    let used: u64 = answers
        .iter()
        .filter(|r| r.status == 200)
        .map(used_tokens)
        .sum();
    for r in answers.iter().filter(|r| r.status != 200) {
        assert_eq!(r.status, 429, "{}", r.text());
        assert!(r.text().contains("token_limit_exceeded"), "{}", r.text());
    }
    eprintln!("exact budgets: {served} of 3 served, {used} tokens used of 3000");
    // One lease is 0.1 % of the budget: 3 tokens per router.
    assert!(
        used <= 3000 + 3 * 3,
        "used {used} of 3000 ({served} served)"
    );
    assert!(served >= 1, "the budget serves one of them");
}
