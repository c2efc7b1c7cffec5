//! Priority classes and tenant fairness in the capacity queue (issue 32),
//! end to end: one engine with one slot, requests queued behind it. An
//! interactive request overtakes batch requests queued before it; a
//! tenant that floods the queue does not push another tenant's one
//! request behind all of its own; the `X-Hivenet-Priority` header lowers
//! a key's class and is refused when it would raise it; the queue wait is
//! exported per class.

mod common;
use common::*;
use std::time::{Duration, Instant};

const MODEL: &str = "fair-model";

fn auth_yaml() -> String {
    let key = |raw: &str, owner: &str, priority: &str| {
        format!(
            "    - key_hash: \"{}\"\n      metadata: {{name: {raw}, owner: {owner}}}\n      priority: {priority}\n",
            sha256_hex(raw)
        )
    };
    format!(
        "api:\n  mode: api-key\n  keys:\n{}{}{}{}",
        key("sk-batch", "acme", "batch"),
        key("sk-int", "acme", "interactive"),
        key("sk-flood", "flood", "standard"),
        key("sk-calm", "calm", "standard"),
    )
}

fn chat(key: &str, priority: Option<&str>) -> Req {
    let body = format!(
        r#"{{"model":"{MODEL}","max_tokens":2,"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    let mut r =
        Req::post("/v1/chat/completions", body).header("Authorization", &format!("Bearer {key}"));
    if let Some(p) = priority {
        r = r.header("X-Hivenet-Priority", p);
    }
    r
}

struct One {
    r: Router,
    _sim: Proc,
    _agent: Proc,
}

/// A router in front of one engine with one slot, each request 250 ms.
fn one_slot(name: &str) -> One {
    let dir = tmpdir(name);
    std::fs::write(dir.join("auth.yaml"), auth_yaml()).expect("auth.yaml");
    let r = start_router(
        &dir,
        &["--auth-config-file", "auth.yaml", "--shards", "1"],
        &[],
    );
    let (sim, port) = start_sim(&dir, MODEL, &["--ttft", "250ms"]);
    let agent = start_agent(&dir, &r, port, "a.key", &["--capacity", "1"]);
    wait_until(
        Duration::from_secs(30),
        || {
            routing_table(r.http)["agents"]
                .as_array()
                .map_or(0, Vec::len)
                == 1
        },
        "the agent",
    );
    One {
        r,
        _sim: sim,
        _agent: agent,
    }
}

/// Send `reqs` one after the other, 40 ms apart (each queues behind the
/// slot), and return each one's (label, status, completion instant).
fn send_staggered(http: u16, reqs: Vec<(&'static str, Req)>) -> Vec<(&'static str, u16, Instant)> {
    let mut handles = Vec::new();
    for (label, req) in reqs {
        handles.push(std::thread::spawn(move || {
            let st = req.send(http).map(|r| r.status).unwrap_or(0);
            (label, st, Instant::now())
        }));
        std::thread::sleep(Duration::from_millis(40));
    }
    let mut out: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().expect("thread"))
        .collect();
    out.sort_by_key(|(_, _, t)| *t);
    out
}

#[test]
fn interactive_overtakes_batch_queued_before_it() {
    let f = one_slot("fair-classes");
    let order = send_staggered(
        f.r.http,
        vec![
            ("busy", chat("sk-batch", None)),
            ("b1", chat("sk-batch", None)),
            ("b2", chat("sk-batch", None)),
            ("b3", chat("sk-batch", None)),
            ("int", chat("sk-int", None)),
        ],
    );
    assert!(order.iter().all(|(_, st, _)| *st == 200), "{order:?}");
    let labels: Vec<&str> = order.iter().map(|(l, _, _)| *l).collect();
    assert_eq!(labels.first(), Some(&"busy"));
    assert_eq!(
        labels.get(1),
        Some(&"int"),
        "interactive served next: {labels:?}"
    );
    // Its wait is in the interactive series.
    let waits = |class: &str| {
        metric(
            f.r.metrics,
            &format!("hivenet_queue_wait_seconds_count{{model=\"{MODEL}\",class=\"{class}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert_eq!(waits("interactive"), 1.0);
    assert_eq!(waits("batch"), 3.0);
}

#[test]
fn a_flooding_tenant_does_not_push_another_behind_all_its_requests() {
    let f = one_slot("fair-tenants");
    let mut reqs = vec![("busy", chat("sk-flood", None))];
    for l in ["f1", "f2", "f3", "f4", "f5"] {
        reqs.push((l, chat("sk-flood", None)));
    }
    reqs.push(("calm", chat("sk-calm", None)));
    let order = send_staggered(f.r.http, reqs);
    assert!(order.iter().all(|(_, st, _)| *st == 200), "{order:?}");
    let pos = order
        .iter()
        .position(|(l, _, _)| *l == "calm")
        .expect("calm served");
    // First come first served would make it last (7th); fair by tokens,
    // it goes right after the flood's first queued request.
    assert!(pos <= 2, "calm served {}th: {:?}", pos + 1, order);
}

#[test]
fn the_priority_header_lowers_and_never_raises() {
    let f = one_slot("fair-header");
    let r = chat("sk-batch", Some("interactive"))
        .send(f.r.http)
        .expect("response");
    assert_eq!(r.status, 400);
    let body = String::from_utf8_lossy(&r.body).to_string();
    assert!(body.contains("above this key's class (batch)"), "{body}");
    let r = chat("sk-int", Some("urgent"))
        .send(f.r.http)
        .expect("response");
    assert_eq!(r.status, 400);
    // Lowered: an interactive key's request sent as batch waits behind a
    // standard one queued after it.
    let order = send_staggered(
        f.r.http,
        vec![
            ("busy", chat("sk-calm", None)),
            ("lowered", chat("sk-int", Some("batch"))),
            ("standard", chat("sk-calm", None)),
        ],
    );
    let labels: Vec<&str> = order.iter().map(|(l, _, _)| *l).collect();
    assert_eq!(labels, vec!["busy", "standard", "lowered"]);
}
