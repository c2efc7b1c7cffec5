//! Cache affinity end to end (issue 30): `strategy: prefix-aware` in front
//! of three simulated engines with prefix caches: conversations stay on the
//! agent that holds their prefix, session keys (header and body) go where
//! they went, a full holder is skipped (the load guard), a departed agent
//! is never chosen, entries expire, and bad affinity fields are refused at
//! start and on reload.

mod common;
use common::*;
use std::collections::HashMap;
use std::time::Duration;

const MODEL: &str = "aff-model";

fn policy(extra: &str) -> String {
    format!("routing_policy:\n  strategy: prefix-aware\n{extra}")
}

/// Which agent served one request: the one whose count moved.
fn send_and_see(http: u16, req: Req) -> String {
    let before = successes_by_machine(http);
    let (st, body) = req.send(http).map(Resp::pair).expect("request");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let mut moved = String::new();
    wait_until(
        Duration::from_secs(5),
        || {
            let after = successes_by_machine(http);
            match after
                .iter()
                .find(|(k, v)| before.get(*k).copied().unwrap_or(0) < **v)
            {
                Some((k, _)) => {
                    moved = k.clone();
                    true
                }
                None => false,
            }
        },
        "the serving agent's count",
    );
    moved
}

/// The body of turn `turn` of conversation `conv`: its own long system
/// prompt, every earlier turn and a new question.
fn turn_body(conv: usize, turn: usize) -> String {
    let system =
        format!("You are assistant number {conv}. ") + &"Be precise and brief. ".repeat(40);
    let mut msgs = vec![serde_json::json!({"role": "system", "content": system})];
    for t in 0..=turn {
        msgs.push(serde_json::json!({"role": "user", "content": format!("question {t} of conversation {conv}")}));
        if t < turn {
            msgs.push(serde_json::json!({"role": "assistant", "content": format!("answer {t}")}));
        }
    }
    serde_json::json!({"model": MODEL, "max_tokens": 4, "messages": msgs}).to_string()
}

/// Send a chat request and require a 200.
fn chat_ok(http: u16, body: String) {
    let (st, body) = Req::post("/v1/chat/completions", body)
        .send(http)
        .map(Resp::pair)
        .expect("request");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
}

/// Send a chat request on its own thread; joins to its status.
fn in_background(http: u16, body: String) -> std::thread::JoinHandle<Option<u16>> {
    std::thread::spawn(move || {
        Req::post("/v1/chat/completions", body)
            .send(http)
            .map(Resp::pair)
            .map(|(s, _)| s)
            .ok()
    })
}

/// Requests served per machine since `before`, once `n` are counted
/// (read after both ended, not from whichever count moved first).
fn served_since(
    http: u16,
    before: &std::collections::HashMap<String, u64>,
    n: u64,
) -> Vec<(String, u64)> {
    let mut moved = Vec::new();
    wait_until(
        Duration::from_secs(5),
        || {
            let after = successes_by_machine(http);
            moved = after
                .iter()
                .filter(|(k, v)| before.get(*k).copied().unwrap_or(0) < **v)
                .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
                .collect();
            moved.iter().map(|(_, c)| c).sum::<u64>() == n
        },
        "the requests counted",
    );
    moved.sort();
    moved
}

/// Conversation 1's first turn (its agent: the holder), then its second
/// turn kept in flight on the holder (one slot, slow first token) while
/// the third is sent. Returns the holder, the counts before, the
/// overloaded and prefix-hit decisions before the third turn, and when it
/// was sent; both later turns were answered 200.
fn turn_behind_a_busy_holder(
    http: u16,
    metrics: u16,
) -> (
    String,
    std::collections::HashMap<String, u64>,
    (f64, f64),
    std::time::Instant,
) {
    let first = send_and_see(http, Req::post("/v1/chat/completions", turn_body(1, 0)));
    let busy = in_background(http, turn_body(1, 1));
    let before = successes_by_machine(http);
    std::thread::sleep(Duration::from_millis(300));
    let seen = (
        decisions(metrics, "overloaded"),
        decisions(metrics, "prefix_hit"),
    );
    let t = std::time::Instant::now();
    chat_ok(http, turn_body(1, 2));
    assert_eq!(busy.join().expect("thread").expect("request"), 200);
    (first, before, seen, t)
}

fn decisions(metrics: u16, outcome: &str) -> f64 {
    metric(
        metrics,
        &format!("hivenet_affinity_decisions_total{{model=\"{MODEL}\",outcome=\"{outcome}\"}}"),
    )
    .unwrap_or(0.0)
}

/// `hivenet_affinity_<name>{model}` of the test model.
fn model_metric(metrics: u16, name: &str) -> Option<f64> {
    metric(
        metrics,
        &format!("hivenet_affinity_{name}{{model=\"{MODEL}\"}}"),
    )
}

struct Fleet {
    r: Router,
    _sims: Vec<Proc>,
    agents: Vec<Proc>,
}

fn fleet(name: &str, policy_text: &str, sim_args: &[&str], capacity: &str) -> Fleet {
    fleet_with(name, policy_text, sim_args, capacity, &[])
}

/// [`fleet`] with more router flags.
fn fleet_with(
    name: &str,
    policy_text: &str,
    sim_args: &[&str],
    capacity: &str,
    router_args: &[&str],
) -> Fleet {
    let dir = tmpdir(name);
    let pf = dir.join("policy.yaml");
    std::fs::write(&pf, policy_text).expect("policy");
    let pfs = pf.to_string_lossy().to_string();
    // One shard: every request meets the same index.
    let mut args = vec!["--shards", "1", "--policy-file", &pfs];
    args.extend(["--remove-after", "2s"]);
    args.extend_from_slice(router_args);
    let r = start_router(&dir, &args, &[]);
    let mut sims = Vec::new();
    let mut agents = Vec::new();
    for k in 0..3 {
        let mut args = Vec::new();
        if !sim_args.contains(&"--prefix-cache-tokens") {
            args.extend(["--prefix-cache-tokens", "8192"]);
        }
        args.extend_from_slice(sim_args);
        let (s, port) = start_sim(&dir, MODEL, &args);
        sims.push(s);
        let m = format!("a{k}");
        agents.push(start_agent(
            &dir,
            &r,
            port,
            &format!("{m}.key"),
            &["--machine", &m, "--capacity", capacity],
        ));
    }
    wait_agents(r.http, MODEL, 3);
    Fleet {
        r,
        _sims: sims,
        agents,
    }
}

#[test]
fn conversations_and_session_keys_stay_on_their_agent() {
    let f = fleet("affinity-stay", &policy(""), &[], "4");
    let http = f.r.http;
    // Four conversations, turns interleaved.
    let mut home: HashMap<usize, String> = HashMap::new();
    for turn in 0..4 {
        for conv in 0..4 {
            let who = send_and_see(
                http,
                Req::post("/v1/chat/completions", turn_body(conv, turn)),
            );
            if let Some(h) = home.get(&conv) {
                assert_eq!(&who, h, "conversation {conv} turn {turn} left its agent");
            } else {
                home.insert(conv, who);
            }
        }
    }
    // Turns 1-3 of each hit its prefix (turn 0 shares no conversation
    // prefix; its system prompt is its own).
    let hits = decisions(f.r.metrics, "prefix_hit");
    assert!(hits >= 12.0, "prefix hits {hits}");
    // The engines say so too: most prompt tokens of later turns were cached.
    let prompt = sum_metric(f.r.metrics, "hivenet_agent_prompt_tokens_total");
    let cached = sum_metric(f.r.metrics, "hivenet_agent_cached_prompt_tokens_total");
    assert!(
        prompt > 0.0 && cached / prompt > 0.6,
        "cached {cached} of {prompt}"
    );

    // A session key (header) goes where it went, whatever the prompt.
    let mut first = None;
    for i in 0..5 {
        let body = format!(
            r#"{{"model":"{MODEL}","max_tokens":2,"messages":[{{"role":"user","content":"unrelated prompt {i}"}}]}}"#
        );
        let who = send_and_see(
            http,
            Req::post("/v1/chat/completions", body).header("X-Session-ID", "sess-42"),
        );
        assert_eq!(first.get_or_insert(who.clone()), &who, "session moved");
    }
    // The body's prompt_cache_key does the same.
    let mut first = None;
    for i in 0..5 {
        let body = format!(
            r#"{{"model":"{MODEL}","prompt_cache_key":"app-7","max_tokens":2,"messages":[{{"role":"user","content":"other {i}"}}]}}"#
        );
        let who = send_and_see(http, Req::post("/v1/chat/completions", body));
        assert_eq!(first.get_or_insert(who.clone()), &who, "cache key moved");
    }
    assert!(decisions(f.r.metrics, "key_hit") >= 8.0);
}

fn sum_metric(port: u16, name: &str) -> f64 {
    let (_, body) = Req::get("/metrics")
        .send(port)
        .map(Resp::pair)
        .expect("metrics");
    String::from_utf8_lossy(&body)
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn a_full_holder_is_skipped_and_a_departed_one_forgotten() {
    // One slot per agent and a slow first token: a request in flight
    // fills its agent. The strict guard: no wait for the holder.
    let mut f = fleet(
        "affinity-guard",
        &policy("  affinity:\n    holder_wait_ms: 0\n"),
        &["--ttft", "1500ms"],
        "1",
    );
    let http = f.r.http;
    // Its next turn, sent while another request of the same prefix keeps
    // the holder busy: the holder is full, another agent serves it.
    let (first, before, (over, _), _) = turn_behind_a_busy_holder(http, f.r.metrics);
    // Both end about together: who served which is read from the counts
    // once both are done (the holder one, another agent the other), not
    // from whichever count moved first.
    let moved = served_since(http, &before, 2);
    assert_eq!(
        moved.len(),
        2,
        "the full holder was chosen twice: {moved:?}"
    );
    assert!(moved.iter().any(|(k, _)| *k == first), "{moved:?}");
    assert_eq!(decisions(f.r.metrics, "overloaded"), over + 1.0);

    // The holder of conversation 2 leaves: its next turn is served, by
    // another agent, as a miss for that agent (never named again).
    let holder = send_and_see(http, Req::post("/v1/chat/completions", turn_body(2, 0)));
    let k: usize = holder
        .trim_start_matches('a')
        .parse()
        .expect("machine label");
    f.agents[k].kill9();
    wait_until(
        Duration::from_secs(5),
        || healthy_agents(http, MODEL) == 2,
        "holder gone",
    );
    let misses = decisions(f.r.metrics, "miss");
    let next = send_and_see(http, Req::post("/v1/chat/completions", turn_body(2, 1)));
    assert_ne!(next, holder);
    // Forgotten, not merely absent from the pool: the index names no
    // holder (a miss), where a departed holder would read as overloaded.
    assert_eq!(decisions(f.r.metrics, "miss"), misses + 1.0);
}

#[test]
fn entries_expire_after_their_ttl() {
    let f = fleet(
        "affinity-ttl",
        &policy("  affinity:\n    ttl_seconds: 1\n    load_band: 1.0\n"),
        &[],
        "4",
    );
    let http = f.r.http;
    send_and_see(http, Req::post("/v1/chat/completions", turn_body(3, 0)));
    send_and_see(http, Req::post("/v1/chat/completions", turn_body(3, 1)));
    assert_eq!(decisions(f.r.metrics, "prefix_hit"), 1.0);
    std::thread::sleep(Duration::from_millis(2500));
    let misses = decisions(f.r.metrics, "miss");
    send_and_see(http, Req::post("/v1/chat/completions", turn_body(3, 2)));
    assert_eq!(
        decisions(f.r.metrics, "miss"),
        misses + 1.0,
        "expired entry still used"
    );
    assert_eq!(decisions(f.r.metrics, "prefix_hit"), 1.0);
}

#[test]
fn bad_affinity_fields_are_refused_at_start_and_on_reload() {
    let dir = tmpdir("affinity-bad");
    let bad = [
        (
            "  affinity:\n    load_band: 2\n",
            "routing_policy.affinity.load_band",
        ),
        (
            "  affinity:\n    ttl_seconds: 0\n",
            "routing_policy.affinity.ttl_seconds",
        ),
        (
            "  affinity:\n    block_bytes: 1000\n",
            "routing_policy.affinity.block_bytes",
        ),
        ("  affinity:\n    band: 0.1\n", "band"),
    ];
    for (extra, field) in bad {
        let pf = dir.join("bad.yaml");
        std::fs::write(&pf, policy(extra)).expect("policy");
        let out = std::process::Command::new(bin("hivenet-router"))
            .args([
                "--policy-file",
                &pf.to_string_lossy(),
                "--http-port",
                "127.0.0.1:0",
            ])
            .env("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN_KEY)
            .current_dir(&dir)
            .output()
            .expect("run router");
        let err = String::from_utf8_lossy(&out.stderr).to_string()
            + &String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{extra:?} accepted");
        assert!(err.contains(field), "{extra:?}: {err}");
    }
    // affinity under least-loaded is refused too.
    let pf = dir.join("ll.yaml");
    std::fs::write(
        &pf,
        "routing_policy:\n  strategy: least-loaded\n  affinity:\n    ttl_seconds: 5\n",
    )
    .expect("policy");
    let out = std::process::Command::new(bin("hivenet-router"))
        .args(["--policy-file", &pf.to_string_lossy()])
        .env("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN_KEY)
        .current_dir(&dir)
        .output()
        .expect("run router");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("prefix-aware only"));
    // On reload (PUT /admin/policy): refused, the running policy kept.
    let r = start_router(&dir, &["--shards", "1"], &[]);
    let (st, body) = Req::new("PUT", "/admin/policy")
        .header("Authorization", &format!("Bearer {ADMIN_KEY}"))
        .body(policy("  affinity:\n    load_band: -1\n"))
        .send(r.http)
        .map(Resp::pair)
        .expect("put");
    assert_eq!(st, 400, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("load_band"));
    let (st, body) = Req::new("PUT", "/admin/policy")
        .header("Authorization", &format!("Bearer {ADMIN_KEY}"))
        .body(policy(
            "  affinity:\n    load_band: 0.5\n    ttl_seconds: 30\n",
        ))
        .send(r.http)
        .map(Resp::pair)
        .expect("put");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    // On SIGHUP: a policy file rewritten with a bad field is refused
    // (counted as an error), the running policy kept.
    let hup = dir.join("hup");
    std::fs::create_dir_all(&hup).expect("dir");
    let pf = hup.join("policy.yaml");
    std::fs::write(&pf, policy("  affinity:\n    ttl_seconds: 30\n")).expect("policy");
    let pfs = pf.to_string_lossy().to_string();
    let r = start_router(&hup, &["--shards", "1", "--policy-file", &pfs], &[]);
    std::fs::write(&pf, policy("  affinity:\n    block_bytes: 100\n")).expect("bad policy");
    let errors = "hivenet_policy_reload_total{trigger=\"sighup\",result=\"error\"}";
    signal(&r.proc, "HUP");
    wait_until(
        std::time::Duration::from_secs(5),
        || metric(r.metrics, errors) == Some(1.0),
        "the bad reload counted",
    );
    let (st, body) = Req::get("/admin/policy")
        .header("Authorization", &format!("Bearer {ADMIN_KEY}"))
        .send(r.http)
        .map(Resp::pair)
        .expect("get policy");
    assert_eq!(st, 200);
    let text = String::from_utf8_lossy(&body);
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["routing_policy"]["strategy"], "prefix-aware", "{text}");
    assert_eq!(v["routing_policy"]["affinity"]["ttl_seconds"], 30, "{text}");
    assert_eq!(
        v["routing_policy"]["affinity"]["block_bytes"], 2048,
        "{text}"
    );
    // What GET shows PUTs back unchanged (it said least-loaded before).
    let (st, out) = Req::new("PUT", "/admin/policy")
        .header("Authorization", &format!("Bearer {ADMIN_KEY}"))
        .body(text.to_string())
        .send(r.http)
        .map(Resp::pair)
        .expect("put back");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&out));
    let (_, again) = Req::get("/admin/policy")
        .header("Authorization", &format!("Bearer {ADMIN_KEY}"))
        .send(r.http)
        .map(Resp::pair)
        .expect("get again");
    assert_eq!(String::from_utf8_lossy(&again), text);
}

#[test]
fn a_hit_the_engine_did_not_cache_is_counted_stale() {
    // Engines that keep 16 tokens: the index predicts the conversation's
    // prefix, the engines report almost nothing cached.
    let f = fleet(
        "affinity-stale",
        &policy(""),
        &["--prefix-cache-tokens", "16"],
        "4",
    );
    let http = f.r.http;
    send_and_see(http, Req::post("/v1/chat/completions", turn_body(4, 0)));
    send_and_see(http, Req::post("/v1/chat/completions", turn_body(4, 1)));
    assert_eq!(decisions(f.r.metrics, "prefix_hit"), 1.0);
    let stale = || {
        metric(
            f.r.metrics,
            &format!("hivenet_affinity_stale_total{{model=\"{MODEL}\"}}"),
        )
    };
    assert_eq!(stale(), Some(1.0));
    // The stale hit does not hide the holder after a pause (the index
    // hid entries older than half the stale hit's age until 2026-12-06,
    // and sent an application's next conversation to another
    // application's engine): it re-prefilled the prefix and holds it.
    std::thread::sleep(std::time::Duration::from_millis(2_100));
    send_and_see(http, Req::post("/v1/chat/completions", turn_body(4, 2)));
    assert_eq!(decisions(f.r.metrics, "prefix_hit"), 2.0);
    assert_eq!(decisions(f.r.metrics, "miss"), 1.0);
    assert_eq!(stale(), Some(2.0));
}

#[test]
fn a_freed_slot_goes_to_a_waiter_its_agent_holds_the_prefix_of() {
    // Three agents of one slot each, whose engines take 1 s, 1.5 s and 4 s
    // to the first token: when all three are busy, a0 frees first, then a1.
    let dir = tmpdir("affinity-wake");
    // The strict guard: the wake alone, no wait for a holder.
    let pf = dir.join("policy.yaml");
    std::fs::write(&pf, policy("  affinity:\n    holder_wait_ms: 0\n")).expect("policy");
    let pfs = pf.to_string_lossy().to_string();
    let r = start_router(&dir, &["--shards", "1", "--policy-file", &pfs], &[]);
    let mut procs = Vec::new();
    for (k, ttft) in ["1000ms", "1500ms", "4000ms"].iter().enumerate() {
        let (s, port) = start_sim(
            &dir,
            MODEL,
            &[
                "--prefix-cache-tokens",
                "8192",
                "--ttft",
                ttft,
                "--output-tokens",
                "2",
            ],
        );
        procs.push(s);
        let m = format!("a{k}");
        procs.push(start_agent(
            &dir,
            &r,
            port,
            &format!("{m}.key"),
            &["--machine", &m, "--capacity", "1"],
        ));
    }
    wait_agents(r.http, MODEL, 3);
    let http = r.http;
    // Conversations held by a0 (p) and by a2 (q).
    let (mut p, mut q) = (None, None);
    for conv in 0..12 {
        match send_and_see(http, Req::post("/v1/chat/completions", turn_body(conv, 0))).as_str() {
            "a0" => p = p.or(Some(conv)),
            "a2" => q = q.or(Some(conv)),
            _ => {}
        }
        if p.is_some() && q.is_some() {
            break;
        }
    }
    let (Some(p), Some(q)) = (p, q) else {
        panic!("no conversation landed on a0 and on a2")
    };
    let (hits, over) = (
        decisions(r.metrics, "prefix_hit"),
        decisions(r.metrics, "overloaded"),
    );
    let send = |body: String| in_background(http, body);
    // Fill the three slots (unrelated prompts: least-loaded spreads them).
    let fillers: Vec<_> = (0..3)
        .map(|i| {
            send(format!(
                r#"{{"model":"{MODEL}","max_tokens":2,"messages":[{{"role":"user","content":"filler {i}"}}]}}"#
            ))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(250));
    // Queued in this order: q's next turn (a2 holds it), then p's (a0).
    let wq = send(turn_body(q, 1));
    std::thread::sleep(Duration::from_millis(250));
    let wp = send(turn_body(p, 1));
    for t in fillers.into_iter().chain([wq, wp]) {
        assert_eq!(t.join().expect("thread").expect("request"), 200);
    }
    // a0 frees first: FIFO would give it to q's turn (a cold prefill, its
    // holder a2 busy) and then p's turn would find a0 busy too (two
    // overloaded). The slot goes to p's turn instead: a hit on a0; q's turn
    // takes a1's slot, overloaded.
    assert_eq!(decisions(r.metrics, "prefix_hit"), hits + 1.0);
    assert_eq!(decisions(r.metrics, "overloaded"), over + 1.0);
}

#[test]
fn holder_wait_waits_for_a_full_holder_instead_of_another_agent() {
    // One slot per agent and a slow first token, as in the guard test;
    // with `holder_wait_ms` the turn waits for its holder instead.
    let f = fleet(
        "affinity-holder-wait",
        &policy("  affinity:\n    holder_wait_ms: 10000\n"),
        &["--ttft", "1500ms"],
        "1",
    );
    let http = f.r.http;
    let (first, before, (over, hits), t) = turn_behind_a_busy_holder(http, f.r.metrics);
    // It waited for the busy request to end (about 1.2 s), then took the
    // holder's slot: a second first-token time in all.
    assert!(
        t.elapsed() >= Duration::from_millis(2000),
        "{:?}",
        t.elapsed()
    );
    let moved = served_since(http, &before, 2);
    assert_eq!(moved, vec![(first, 2)], "both turns on the holder");
    assert_eq!(decisions(f.r.metrics, "overloaded"), over);
    assert_eq!(decisions(f.r.metrics, "prefix_hit"), hits + 1.0);
    // Counted as a wait for a holder that did not run out.
    assert_eq!(model_metric(f.r.metrics, "holder_waits_total"), Some(1.0));
    assert_eq!(
        model_metric(f.r.metrics, "holder_wait_timeouts_total"),
        Some(0.0)
    );
}

#[test]
fn a_full_line_of_holder_waits_does_not_refuse_a_request_with_a_free_agent() {
    // `--queue-depth 1`: the third turn of conversation 1 waits for its
    // busy holder and fills the line. A new conversation then finds an
    // idle agent: it is served there, not refused for the full line (the
    // waiter would not have taken that agent's slot).
    let f = fleet_with(
        "affinity-full-line",
        &policy("  affinity:\n    holder_wait_ms: 10000\n"),
        &["--ttft", "1500ms"],
        "1",
        &["--queue-depth", "1"],
    );
    let http = f.r.http;
    let first = send_and_see(http, Req::post("/v1/chat/completions", turn_body(1, 0)));
    let before = successes_by_machine(http);
    let busy = in_background(http, turn_body(1, 1));
    std::thread::sleep(Duration::from_millis(300));
    let waiter = in_background(http, turn_body(1, 2));
    let queued = format!("hivenet_queue_depth{{model=\"{MODEL}\"}}");
    wait_until(
        Duration::from_secs(5),
        || metric(f.r.metrics, &queued) == Some(1.0),
        "the third turn waiting for its holder",
    );
    chat_ok(http, turn_body(2, 0));
    assert_eq!(busy.join().expect("thread").expect("request"), 200);
    assert_eq!(waiter.join().expect("thread").expect("request"), 200);
    // The busy turn and the waiter on the holder, the new conversation
    // beside it.
    let moved = served_since(http, &before, 3);
    assert_eq!(moved.len(), 2, "{moved:?}");
    assert!(moved.contains(&(first.clone(), 2)), "{moved:?}");
    // The waiter still got its holder.
    assert_eq!(model_metric(f.r.metrics, "holder_waits_total"), Some(1.0));
    assert_eq!(
        model_metric(f.r.metrics, "holder_wait_timeouts_total"),
        Some(0.0)
    );
}

#[test]
fn holder_wait_is_cut_to_the_prefill_a_hit_saves() {
    // Engines whose prefill is nearly free and whose answers are slow (a
    // GPU's shape): once the router has learned it from the engines'
    // usage, a full holder is not worth waiting for, whatever
    // `holder_wait_ms` allows (here 10 s, as in the test above where the
    // holder is waited for).
    let f = fleet(
        "affinity-wait-learned",
        &policy("  affinity:\n    holder_wait_ms: 10000\n"),
        &[
            "--ttft",
            "5ms",
            "--prefill-per-token",
            "0.001ms",
            "--itl",
            "300ms",
        ],
        "1",
    );
    let http = f.r.http;
    // Enough answered requests to learn from, hits and misses
    // (conversations other than the one measured below).
    let warm: Vec<_> = (10..19)
        .map(|conv| {
            std::thread::spawn(move || {
                for turn in 0..2 {
                    let (st, body) = Req::post("/v1/chat/completions", turn_body(conv, turn))
                        .send(http)
                        .map(Resp::pair)
                        .expect("warm-up");
                    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
                }
            })
        })
        .collect();
    for w in warm {
        w.join().expect("warm-up thread");
    }
    let waits = |name: &str| model_metric(f.r.metrics, name).unwrap_or(0.0);
    // Learned: nearly free (the sim's prefill is 1 us a token; the
    // fixed 5 ms of each answer spreads over prefill and decode).
    let cost =
        model_metric(f.r.metrics, "miss_cost_seconds_per_token").expect("the miss cost is learned");
    assert!((0.0..0.001).contains(&cost), "{cost}");
    let (w0, t0) = (
        waits("holder_waits_total"),
        waits("holder_wait_timeouts_total"),
    );
    let (first, before, (over, _), _) = turn_behind_a_busy_holder(http, f.r.metrics);
    // Served by another agent, not after the busy holder's turn.
    let moved = served_since(http, &before, 2);
    assert_eq!(moved.len(), 2, "waited for the full holder: {moved:?}");
    assert!(moved.iter().any(|(k, _)| *k == first), "{moved:?}");
    assert_eq!(decisions(f.r.metrics, "overloaded"), over + 1.0);
    // Any wait there was ran out (a wait cut to a few microseconds may
    // still be counted): none ended on the holder.
    assert_eq!(
        waits("holder_waits_total") - w0,
        waits("holder_wait_timeouts_total") - t0
    );
}
