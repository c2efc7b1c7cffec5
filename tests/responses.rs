//! Issue 52: the Responses API's conversations are the router's and the
//! tenant's. Another tenant's response ID is unknown on every route (404,
//! never its content); a router restarted (SIGKILL) on its store keeps
//! the chains; a flood of large inputs keeps the stored bytes under
//! `--responses-max-bytes-per-tenant` and `--responses-max-bytes`, the
//! oldest evicted first; bad input gets the envelope, never a panic.

mod common;
use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const MODEL: &str = "rm";

fn key(version: &str, raw: &str, owner: &str) -> Value {
    json!({"version": version, "key_hash": sha256_hex(raw), "key_preview": "sk-...r",
           "owner": owner, "name": owner, "allowed_models": [MODEL]})
}

fn put_key(http: u16, id: &str, k: Value) {
    let (st, body) = admin(http, "PUT", &format!("/admin/api-keys/{id}"), k);
    assert_eq!(st, 200, "{body}");
}

fn create(http: u16, raw: &str, input: &str, previous: Option<&str>) -> Resp {
    let mut body = json!({"model": MODEL, "input": input, "max_output_tokens": 4});
    if let Some(p) = previous {
        body["previous_response_id"] = json!(p);
    }
    Req::post("/v1/responses", body.to_string())
        .bearer(raw)
        .send(http)
        .expect("response")
}

fn call(http: u16, method: &str, path: &str, raw: &str) -> Resp {
    Req::new(method, path)
        .bearer(raw)
        .send(http)
        .expect("response")
}

/// One agent on the routing table (the client routes need a key).
fn wait_agent(http: u16) {
    wait_until(
        Duration::from_secs(20),
        || routing_table(http)["total"] == 1,
        "the agent registered",
    );
}

fn router(dir: &std::path::Path, extra: &[&str]) -> Router {
    start_router(
        dir,
        &[&["--shards", "1"][..], extra].concat(),
        &[("HIVENET_ROUTER_AUTH_MODE", "dynamic")],
    )
}

#[test]
fn a_foreign_tenant_gets_404_everywhere_and_a_restart_keeps_the_chains() {
    let dir = tmpdir("responses-tenants");
    let mut r = router(&dir, &[]);
    let (_sim, port) = start_sim(&dir, MODEL, &["--output-tokens", "4"]);
    let _agent = start_agent(&dir, &r, port, "a.key", &[]);
    wait_agent(r.http);
    put_key(r.http, "ka", key("v1", "sk-alpha", "alpha"));
    put_key(r.http, "kb", key("v2", "sk-beta", "beta"));
    let first = create(r.http, "sk-alpha", "one", None);
    assert_eq!(first.status, 200, "{}", first.text());
    let r1 = first.json()["id"].as_str().expect("id").to_string();
    let second = create(r.http, "sk-alpha", "two", Some(&r1));
    assert_eq!(second.status, 200, "{}", second.text());
    let r2 = second.json()["id"].as_str().expect("id").to_string();
    assert_eq!(second.json()["previous_response_id"], json!(r1));
    // The other tenant: unknown on every route, its content never shown.
    for (method, path) in [
        ("GET", format!("/v1/responses/{r2}")),
        ("GET", format!("/v1/responses/{r2}/input_items")),
        ("DELETE", format!("/v1/responses/{r2}")),
    ] {
        let resp = call(r.http, method, &path, "sk-beta");
        assert_eq!(resp.status, 404, "{method} {path}: {}", resp.text());
        assert!(!resp.text().contains("two"), "{}", resp.text());
    }
    let foreign = create(r.http, "sk-beta", "three", Some(&r2));
    assert_eq!(foreign.status, 404, "{}", foreign.text());
    assert!(foreign.text().contains(&r2), "{}", foreign.text());
    // The owner still reads it.
    let own = call(r.http, "GET", &format!("/v1/responses/{r2}"), "sk-alpha");
    assert_eq!(own.status, 200, "{}", own.text());
    assert_eq!(own.json()["previous_response_id"], json!(r1));
    // Killed and restarted on its store: the chain goes on.
    r.proc.kill9();
    let r = router(&dir, &[]);
    let _agent2 = start_agent(&dir, &r, port, "a2.key", &[]);
    wait_agent(r.http);
    put_key(r.http, "ka", key("v3", "sk-alpha", "alpha"));
    let third = create(r.http, "sk-alpha", "three", Some(&r2));
    assert_eq!(third.status, 200, "after a restart: {}", third.text());
    let usage = &third.json()["usage"];
    let second_usage = second.json()["usage"]["input_tokens"].as_u64().unwrap_or(0);
    assert!(
        usage["input_tokens"].as_u64().unwrap_or(0) > second_usage,
        "the whole conversation was sent: {usage} after {second_usage}"
    );
    let items = call(
        r.http,
        "GET",
        &format!("/v1/responses/{r1}/input_items"),
        "sk-alpha",
    );
    assert_eq!(items.status, 200, "{}", items.text());
    assert_eq!(items.json()["data"][0]["content"][0]["text"], "one");
}

#[test]
fn stored_conversations_stay_under_their_bounds_under_a_flood() {
    let dir = tmpdir("responses-bounds");
    let r = router(
        &dir,
        &[
            "--responses-max-bytes-per-tenant",
            "200000",
            "--responses-max-bytes",
            "300000",
        ],
    );
    let (_sim, port) = start_sim(
        &dir,
        MODEL,
        &[
            "--output-tokens",
            "2",
            "--itl",
            "1ms",
            "--prefill-per-token",
            "0s",
            "--ttft",
            "1ms",
        ],
    );
    let _agent = start_agent(&dir, &r, port, "a.key", &[]);
    wait_agent(r.http);
    put_key(r.http, "ka", key("v1", "sk-alpha", "alpha"));
    put_key(r.http, "kb", key("v2", "sk-beta", "beta"));
    let big = "x".repeat(20_000);
    let mut ids = Vec::new();
    for raw in ["sk-alpha", "sk-beta"] {
        for _ in 0..30 {
            let resp = create(r.http, raw, &big, None);
            assert_eq!(resp.status, 200, "{}", resp.text());
            ids.push((raw, resp.json()["id"].as_str().unwrap_or("").to_string()));
        }
    }
    let storage = |http| admin(http, "GET", "/admin/storage", json!(null)).1;
    wait_until(
        Duration::from_secs(5),
        || {
            storage(r.http)["disk_db"]["responses_count"]
                .as_u64()
                .unwrap_or(0)
                > 0
        },
        "records kept",
    );
    let s = storage(r.http);
    let bytes = s["disk_db"]["responses_bytes"].as_u64().expect("bytes");
    let count = s["disk_db"]["responses_count"].as_u64().expect("count");
    eprintln!("responses bounds: {count} records, {bytes} bytes kept of 60 x 20 KB");
    assert!(bytes <= 300_000, "over the total bound: {bytes}");
    assert!(count >= 10, "the newest are kept: {count}");
    // The newest of each tenant are readable, the oldest evicted.
    let status = |(raw, id): &(&str, String)| {
        call(r.http, "GET", &format!("/v1/responses/{id}"), raw).status
    };
    assert_eq!(status(&ids[0]), 404, "alpha's oldest evicted");
    assert_eq!(status(&ids[59]), 200, "beta's newest kept");
    // Per tenant in the metrics, under the tenant's bound.
    for t in ["alpha", "beta"] {
        let b = metric(
            r.metrics,
            &format!("hivenet_responses_stored_bytes{{tenant=\"{t}\"}}"),
        )
        .expect("per-tenant bytes");
        assert!(b > 0.0 && b <= 200_000.0, "{t}: {b}");
    }
    // Bad input: the envelope and a 400, never a panic.
    for bad in [
        r#"{"model":"rm"}"#,
        r#"{"model":"rm","input":5}"#,
        r#"{"model":"rm","input":"x","previous_response_id":"../../etc"}"#,
        r#"{"model":"rm","input":"x","store":"maybe"}"#,
    ] {
        let resp = Req::post("/v1/responses", bad)
            .bearer("sk-alpha")
            .send(r.http)
            .expect("response");
        assert_eq!(resp.status, 400, "{bad}: {}", resp.text());
        assert_eq!(
            resp.json()["error"]["code"],
            "request_invalid",
            "{}",
            resp.text()
        );
    }
    let odd = call(r.http, "GET", "/v1/responses/..%2f", "sk-alpha");
    assert_eq!(odd.status, 404);
}

/// One turn (`previous`: the turn it continues), anonymous: the response.
fn turn(http: u16, n: usize, previous: Option<&str>) -> Value {
    let mut body = json!({"model": MODEL, "instructions": "You are terse. ".repeat(60),
        "input": format!("Turn {n}: tell me about rivers."), "max_output_tokens": 4});
    if let Some(p) = previous {
        body["previous_response_id"] = json!(p);
    }
    let resp = Req::post("/v1/responses", body.to_string())
        .send(http)
        .expect("response");
    assert_eq!(resp.status, 200, "turn {n}: {}", resp.text());
    resp.json()
}

fn cached(v: &Value) -> u64 {
    v["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// Affinity and engine loss: under `prefix-aware`, every turn of a
/// conversation goes to the engine holding it (its session key is its
/// first response's ID) and reads its prefix from that engine's cache;
/// the holder's engine killed between turns, the next turn is served
/// elsewhere (the router holds the conversation) with one prefill there,
/// and the turn after reads it from the new holder.
#[test]
fn turns_follow_their_engine_and_survive_its_loss() {
    let dir = tmpdir("responses-affinity");
    let pf = dir.join("policy.yaml");
    std::fs::write(&pf, "routing_policy:\n  strategy: prefix-aware\n").expect("policy");
    let pfs = pf.to_string_lossy().to_string();
    let r = start_router(
        &dir,
        &[
            "--shards",
            "1",
            "--policy-file",
            &pfs,
            "--remove-after",
            "2s",
        ],
        &[],
    );
    let mut sims = Vec::new();
    let mut agents = Vec::new();
    for k in 0..3 {
        let (s, port) = start_sim(
            &dir,
            MODEL,
            &["--prefix-cache-tokens", "8192", "--output-tokens", "4"],
        );
        sims.push(s);
        let m = format!("a{k}");
        agents.push(start_agent(
            &dir,
            &r,
            port,
            &format!("{m}.key"),
            &["--machine", &m],
        ));
    }
    wait_agents(r.http, MODEL, 3);
    let served = |before: &std::collections::HashMap<String, u64>| {
        let after = successes_by_machine(r.http);
        let moved: Vec<String> = after
            .iter()
            .filter(|(m, n)| before.get(*m).copied().unwrap_or(0) < **n)
            .map(|(m, _)| m.clone())
            .collect();
        assert_eq!(moved.len(), 1, "one agent served: {moved:?}");
        moved[0].clone()
    };
    let mut prev: Option<String> = None;
    let mut home = None;
    for n in 0..4 {
        let before = successes_by_machine(r.http);
        let v = turn(r.http, n, prev.as_deref());
        let who = served(&before);
        assert_eq!(
            home.get_or_insert(who.clone()),
            &who,
            "turn {n} left its engine"
        );
        if n > 0 {
            assert!(cached(&v) > 0, "turn {n} read its prefix: {v}");
        }
        prev = v["id"].as_str().map(String::from);
    }
    let holder = home.expect("holder");
    let k: usize = holder.trim_start_matches('a').parse().expect("machine");
    sims[k].kill9();
    let before = successes_by_machine(r.http);
    let after_loss = turn(r.http, 4, prev.as_deref());
    let new_home = served(&before);
    assert_ne!(new_home, holder, "served elsewhere");
    let prefilled = after_loss["usage"]["input_tokens"].as_u64().unwrap_or(0) - cached(&after_loss);
    let before = successes_by_machine(r.http);
    let next = turn(r.http, 5, after_loss["id"].as_str());
    assert_eq!(served(&before), new_home, "the new holder keeps it");
    let again = next["usage"]["input_tokens"].as_u64().unwrap_or(0) - cached(&next);
    eprintln!(
        "responses affinity: after the holder's loss {prefilled} tokens prefilled, the turn after {again} (of {})",
        next["usage"]["input_tokens"]
    );
    assert!(
        again * 4 < prefilled,
        "one extra prefill only: {prefilled} then {again}"
    );
    drop(agents);
}

/// Two routers sharing one Redis, one agent registered with both.
struct Fleet {
    redis: Proc,
    routers: Vec<Router>,
    _sim: Proc,
    _agent: Proc,
}

fn two_routers_on_redis(name: &str) -> Fleet {
    let dir = tmpdir(name);
    let rport = free_port();
    let redis = start_redis(&dir, rport);
    let url = format!("redis://127.0.0.1:{rport}/0");
    let routers: Vec<Router> = (0..2)
        .map(|i| {
            let d = dir.join(format!("r{i}"));
            std::fs::create_dir_all(&d).expect("dir");
            start_router(&d, &["--shards", "1", "--shared-state", &url], &[])
        })
        .collect();
    let (sim, port) = start_sim(&dir, MODEL, &["--output-tokens", "4"]);
    let second = format!("/ip4/127.0.0.1/tcp/{}", routers[1].p2p);
    let agent = start_agent(&dir, &routers[0], port, "a.key", &["--router-p2p", &second]);
    for r in &routers {
        wait_agent(r.http);
    }
    Fleet {
        redis,
        routers,
        _sim: sim,
        _agent: agent,
    }
}

/// Send a Responses request on a raw connection: when `end` first
/// arrived, and all that did.
fn answer_end(http: u16, body: &str, end: &[u8]) -> (Option<Instant>, Vec<u8>) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", http)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let req = format!(
        "POST /v1/responses HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("send");
    let (mut got, mut at) = (Vec::new(), None);
    let mut buf = [0u8; 16384];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
        if at.is_none() && got.windows(end.len()).any(|w| w == end) {
            at = Some(Instant::now());
        }
    }
    (at, got)
}

/// The router's response ID in an answer (its first `"id":"resp_...`).
fn response_id(got: &[u8]) -> String {
    let text = String::from_utf8_lossy(got);
    let at = text.find("\"id\":\"resp_").expect("a response ID") + 6;
    text[at..].split('"').next().unwrap_or_default().to_string()
}

/// Read-your-writes across the fleet (the CI run that failed: a GET on
/// the second router the moment the first answered was 404). A turn's
/// end, the whole body or the stream's terminal event, reaches the
/// client only once Redis holds the turn: with Redis frozen (SIGSTOP)
/// while the turn is answered, the end arrives after Redis is back, and
/// the other router at once reads it and continues the chain.
#[test]
fn a_turns_end_waits_for_the_fleets_copy() {
    let f = two_routers_on_redis("responses-ryw");
    let (a, b) = (f.routers[0].http, f.routers[1].http);
    for stream in [false, true] {
        let body = json!({"model": MODEL, "input": "remember me", "stream": stream}).to_string();
        let end: &[u8] = if stream {
            b"response.completed"
        } else {
            b"\"object\":\"response\""
        };
        signal(&f.redis, "STOP");
        let asked = std::thread::spawn(move || answer_end(a, &body, end));
        std::thread::sleep(Duration::from_millis(300));
        let resumed = Instant::now();
        signal(&f.redis, "CONT");
        let (at, got) = asked.join().expect("client");
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        let at = at.unwrap_or_else(|| panic!("no end in {text}"));
        assert!(
            at >= resumed,
            "stream={stream}: the end reached the client {:?} before Redis held the turn",
            resumed - at
        );
        let id = response_id(&got);
        let seen = Req::get(&format!("/v1/responses/{id}"))
            .send(b)
            .expect("get");
        assert_eq!(seen.status, 200, "stream={stream}: {}", seen.text());
        let next = json!({"model": MODEL, "input": "and now?", "previous_response_id": id});
        let cont = Req::post("/v1/responses", next.to_string())
            .send(b)
            .expect("post");
        assert_eq!(cont.status, 200, "stream={stream}: {}", cont.text());
    }
}

/// Two routers sharing Redis: a chain begun on one continues on the
/// other, each reads the other's turns, and a response deleted on one is
/// gone on both (a chain through it cannot be continued anywhere).
#[test]
fn a_chain_moves_between_routers_sharing_redis() {
    let f = two_routers_on_redis("responses-fleet");
    let (a, b) = (f.routers[0].http, f.routers[1].http);
    let t0 = turn(a, 0, None);
    let t1 = turn(b, 1, t0["id"].as_str());
    let t2 = turn(a, 2, t1["id"].as_str());
    let used = |v: &Value| v["usage"]["input_tokens"].as_u64().unwrap_or(0);
    assert!(
        used(&t2) > used(&t1) && used(&t1) > used(&t0),
        "the whole conversation each time"
    );
    let id2 = t2["id"].as_str().expect("id");
    let seen = Req::get(&format!("/v1/responses/{id2}"))
        .send(b)
        .expect("get");
    assert_eq!(seen.status, 200, "{}", seen.text());
    assert_eq!(seen.json()["output"], t2["output"]);
    let id1 = t1["id"].as_str().expect("id");
    let del = Req::new("DELETE", &format!("/v1/responses/{id1}"))
        .send(a)
        .expect("delete");
    assert_eq!(del.status, 200, "{}", del.text());
    for http in [a, b] {
        let gone = Req::get(&format!("/v1/responses/{id1}"))
            .send(http)
            .expect("get");
        assert_eq!(gone.status, 404, "{}", gone.text());
        let body = json!({"model": MODEL, "input": "more", "previous_response_id": id2});
        let cont = Req::post("/v1/responses", body.to_string())
            .send(http)
            .expect("post");
        assert_eq!(
            cont.status,
            404,
            "a chain through a deleted turn: {}",
            cont.text()
        );
    }
    // A conversation made on one router is read, continued and deleted
    // on the other.
    let made = Req::post(
        "/v1/conversations",
        json!({"metadata": {"k": "v"}}).to_string(),
    )
    .send(a)
    .expect("create");
    assert_eq!(made.status, 200, "{}", made.text());
    let conv = made.json()["id"].as_str().expect("id").to_string();
    for (i, http) in [b, a].into_iter().enumerate() {
        let body = json!({"model": MODEL, "input": format!("turn {i}"), "conversation": conv});
        let t = Req::post("/v1/responses", body.to_string())
            .send(http)
            .expect("turn");
        assert_eq!(t.status, 200, "{}", t.text());
    }
    let items = Req::get(&format!("/v1/conversations/{conv}/items?order=asc"))
        .send(b)
        .expect("items");
    assert_eq!(
        items.json()["data"][2]["content"],
        "turn 1",
        "{}",
        items.text()
    );
    let del = Req::new("DELETE", &format!("/v1/conversations/{conv}"))
        .send(b)
        .expect("delete");
    assert_eq!(del.status, 200, "{}", del.text());
    let gone = Req::get(&format!("/v1/conversations/{conv}"))
        .send(a)
        .expect("get");
    assert_eq!(gone.status, 404, "{}", gone.text());
}

/// Keys apply to Responses as to chat: the daily budget is charged the
/// turn's usage, the allowlist refuses another model, and
/// `/v1/responses/input_tokens` is answered by the engine.
#[test]
fn a_turn_is_charged_and_keys_apply() {
    let dir = tmpdir("responses-keys");
    let r = router(&dir, &[]);
    let (_sim, port) = start_sim(&dir, MODEL, &["--output-tokens", "4"]);
    let _agent = start_agent(&dir, &r, port, "a.key", &[]);
    wait_agent(r.http);
    let mut k = key("v1", "sk-alpha", "alpha");
    k["quota"] = json!({"tokens_per_day": 100000});
    put_key(r.http, "ka", k);
    let t = create(r.http, "sk-alpha", "count me", None);
    assert_eq!(t.status, 200, "{}", t.text());
    let total = t.json()["usage"]["total_tokens"].as_f64().expect("usage");
    let used = || {
        metric(
            r.metrics,
            "hivenet_tenant_tokens_used_today{tenant_id=\"alpha\",model=\"\"}",
        )
        .unwrap_or(0.0)
    };
    wait_until(
        Duration::from_secs(5),
        || used() == total,
        "charged the turn's usage",
    );
    let other = json!({"model": "another", "input": "x"});
    let refused = Req::post("/v1/responses", other.to_string())
        .bearer("sk-alpha")
        .send(r.http)
        .expect("response");
    assert_eq!(refused.status, 403, "{}", refused.text());
    let count = json!({"model": MODEL, "input": "how many tokens is this"});
    let counted = Req::post("/v1/responses/input_tokens", count.to_string())
        .bearer("sk-alpha")
        .send(r.http)
        .expect("response");
    assert_eq!(counted.status, 200, "{}", counted.text());
    assert!(
        counted.json()["input_tokens"].as_u64().unwrap_or(0) > 0,
        "{}",
        counted.text()
    );
}

/// Affinity across routers (`--shared-state-affinity`): a conversation
/// begun on one router and continued on the other is a key hit there (its
/// session key, its first response's ID, was published through Redis).
#[test]
fn a_chain_continued_on_another_router_keeps_its_engine() {
    let dir = tmpdir("responses-fleet-affinity");
    let rport = free_port();
    let _redis = start_redis(&dir, rport);
    let url = format!("redis://127.0.0.1:{rport}/0");
    let pf = dir.join("policy.yaml");
    std::fs::write(&pf, "routing_policy:\n  strategy: prefix-aware\n").expect("policy");
    let pfs = pf.to_string_lossy().to_string();
    let routers: Vec<Router> = (0..2)
        .map(|i| {
            let d = dir.join(format!("r{i}"));
            std::fs::create_dir_all(&d).expect("dir");
            start_router(
                &d,
                &[
                    "--shards",
                    "1",
                    "--shared-state",
                    &url,
                    "--shared-state-affinity",
                    "--policy-file",
                    &pfs,
                ],
                &[],
            )
        })
        .collect();
    let (_sim, port) = start_sim(&dir, MODEL, &["--output-tokens", "4"]);
    let second = format!("/ip4/127.0.0.1/tcp/{}", routers[1].p2p);
    let _agent = start_agent(&dir, &routers[0], port, "a.key", &["--router-p2p", &second]);
    for r in &routers {
        wait_agent(r.http);
    }
    let decisions = |m: u16, outcome: &str| {
        metric(
            m,
            &format!("hivenet_affinity_decisions_total{{model=\"{MODEL}\",outcome=\"{outcome}\"}}"),
        )
        .unwrap_or(0.0)
    };
    let (a, b) = (&routers[0], &routers[1]);
    let t0 = turn(a.http, 0, None);
    assert_eq!(decisions(a.metrics, "miss"), 1.0);
    wait_until(
        Duration::from_secs(5),
        || {
            metric(
                b.metrics,
                "hivenet_shared_affinity_notes_total{direction=\"received\"}",
            )
            .unwrap_or(0.0)
                >= 1.0
        },
        "turn 0's key heard by the other router",
    );
    let _t1 = turn(b.http, 1, t0["id"].as_str());
    assert_eq!(
        decisions(b.metrics, "key_hit"),
        1.0,
        "the session key, through Redis"
    );
    assert_eq!(decisions(b.metrics, "miss"), 0.0);
}

fn conv_call(http: u16, method: &str, path: &str, raw: &str, body: Value) -> Resp {
    Req::new(method, path)
        .body(body.to_string().as_bytes())
        .bearer(raw)
        .send(http)
        .expect("response")
}

/// The Conversations API: a conversation is created with items and
/// metadata, Responses turns naming it read its items and add theirs, and
/// it is the tenant's own (404 to any other on every route, its content
/// never shown); bad input gets the envelope; a restart keeps it.
#[test]
fn a_conversation_is_its_tenants_own_and_survives_a_restart() {
    let dir = tmpdir("responses-conversations");
    let mut r = router(&dir, &[]);
    let (_sim, port) = start_sim(&dir, MODEL, &["--output-tokens", "4"]);
    let _agent = start_agent(&dir, &r, port, "a.key", &[]);
    wait_agent(r.http);
    put_key(r.http, "ka", key("v1", "sk-alpha", "alpha"));
    put_key(r.http, "kb", key("v2", "sk-beta", "beta"));
    let seed = json!({"items": [{"type": "message", "role": "user", "content": "my secret is tulip"}],
                      "metadata": {"topic": "flowers"}});
    let made = conv_call(r.http, "POST", "/v1/conversations", "sk-alpha", seed);
    assert_eq!(made.status, 200, "{}", made.text());
    let conv = made.json()["id"].as_str().expect("id").to_string();
    assert!(conv.starts_with("conv_"), "{conv}");
    assert_eq!(made.json()["object"], "conversation");
    let turn = |raw: &str, input: &str| {
        Req::post(
            "/v1/responses",
            json!({"model": MODEL, "input": input, "max_output_tokens": 4, "conversation": conv})
                .to_string(),
        )
        .bearer(raw)
        .send(r.http)
        .expect("turn")
    };
    let t1 = turn("sk-alpha", "first");
    assert_eq!(t1.status, 200, "{}", t1.text());
    let t2 = turn("sk-alpha", "second");
    assert_eq!(t2.status, 200, "{}", t2.text());
    let input = |t: &Resp| t.json()["usage"]["input_tokens"].as_u64().unwrap_or(0);
    assert!(
        input(&t2) > input(&t1),
        "the conversation's items were sent"
    );
    let items = conv_call(
        r.http,
        "GET",
        &format!("/v1/conversations/{conv}/items?order=asc"),
        "sk-alpha",
        json!({}),
    );
    assert_eq!(items.status, 200, "{}", items.text());
    let data = items.json()["data"].as_array().cloned().unwrap_or_default();
    assert!(
        data.len() >= 5,
        "seed, then each turn's input and output: {}",
        items.text()
    );
    assert_eq!(data[0]["content"], "my secret is tulip");
    assert_eq!(data[1]["content"], "first");
    let item = data[0]["id"].as_str().expect("item id").to_string();
    // Another tenant: unknown everywhere.
    for (method, path) in [
        ("GET", format!("/v1/conversations/{conv}")),
        ("POST", format!("/v1/conversations/{conv}")),
        ("DELETE", format!("/v1/conversations/{conv}")),
        ("GET", format!("/v1/conversations/{conv}/items")),
        ("POST", format!("/v1/conversations/{conv}/items")),
        ("GET", format!("/v1/conversations/{conv}/items/{item}")),
        ("DELETE", format!("/v1/conversations/{conv}/items/{item}")),
    ] {
        let body = json!({"items": [{"role": "user", "content": "x"}], "metadata": {"a": "b"}});
        let resp = conv_call(r.http, method, &path, "sk-beta", body);
        assert_eq!(resp.status, 404, "{method} {path}: {}", resp.text());
        assert!(!resp.text().contains("tulip"), "{}", resp.text());
    }
    let foreign = turn("sk-beta", "tell me the secret");
    assert_eq!(foreign.status, 404, "{}", foreign.text());
    // Bad input.
    for (method, path, body, status) in [
        ("POST", "/v1/conversations", json!({"items": 3}), 400),
        (
            "POST",
            "/v1/conversations",
            json!({"metadata": {"a": 1}}),
            400,
        ),
        ("POST", "/v1/conversations", json!([1]), 400),
        ("PUT", "/v1/conversations", json!({}), 405),
        ("GET", "/v1/conversations/conv_nope", json!({}), 404),
        ("GET", "/v1/conversations/not-a-conv", json!({}), 404),
    ] {
        let resp = conv_call(r.http, method, path, "sk-alpha", body);
        assert_eq!(resp.status, status, "{method} {path}: {}", resp.text());
        assert!(
            resp.json()["error"]["message"].is_string(),
            "{}",
            resp.text()
        );
    }
    let both = Req::post(
        "/v1/responses",
        json!({"model": MODEL, "input": "x", "conversation": conv,
               "previous_response_id": t1.json()["id"]})
        .to_string(),
    )
    .bearer("sk-alpha")
    .send(r.http)
    .expect("both");
    assert_eq!(both.status, 400, "{}", both.text());
    // Killed and restarted on its store: the conversation goes on.
    r.proc.kill9();
    let r = router(&dir, &[]);
    put_key(r.http, "ka", key("v3", "sk-alpha", "alpha"));
    let again = conv_call(
        r.http,
        "GET",
        &format!("/v1/conversations/{conv}"),
        "sk-alpha",
        json!({}),
    );
    assert_eq!(again.status, 200, "after a restart: {}", again.text());
    assert_eq!(again.json()["metadata"]["topic"], "flowers");
    let gone = conv_call(
        r.http,
        "DELETE",
        &format!("/v1/conversations/{conv}"),
        "sk-alpha",
        json!({}),
    );
    assert_eq!(gone.json()["deleted"], true, "{}", gone.text());
    let after = conv_call(
        r.http,
        "GET",
        &format!("/v1/conversations/{conv}"),
        "sk-alpha",
        json!({}),
    );
    assert_eq!(after.status, 404, "{}", after.text());
}
