//! One agent linked to several routers (issue 31): it registers with
//! each, its declared capacity holds in total (counted at the engine), and
//! a request one router queued behind another router's is woken when that
//! one ends (the agent's load reports), not left to time out.

mod common;
use common::*;
use std::time::Duration;

const MODEL: &str = "mr-model";

fn sim_metric(port: u16, name: &str) -> f64 {
    metric(port, &format!("{name} ")).unwrap_or_else(|| panic!("{name} not in the sim's /metrics"))
}

fn chat(i: usize) -> String {
    format!(
        r#"{{"model":"{MODEL}","max_tokens":2,"messages":[{{"role":"user","content":"request {i}"}}]}}"#
    )
}

/// `routers` routers, one sim (`ttft` to the first token) and one agent of
/// `capacity` linked to all of them.
fn setup(name: &str, routers: usize, ttft: &str, capacity: &str) -> (Vec<Router>, Proc, u16, Proc) {
    let dir = tmpdir(name);
    let rs: Vec<Router> = (0..routers)
        .map(|i| {
            let d = dir.join(format!("r{i}"));
            std::fs::create_dir_all(&d).expect("router dir");
            start_router(&d, &["--shards", "1", "--request-timeout", "30s"], &[])
        })
        .collect();
    let (sim, port) = start_sim(&dir, MODEL, &["--ttft", ttft, "--output-tokens", "2"]);
    let more: Vec<String> = rs
        .iter()
        .skip(1)
        .map(|r| format!("/ip4/127.0.0.1/tcp/{}", r.p2p))
        .collect();
    let mut extra = vec!["--capacity", capacity, "--machine", "shared"];
    for m in &more {
        extra.extend(["--router-p2p", m.as_str()]);
    }
    let agent = start_agent(&dir, &rs[0], port, "shared.key", &extra);
    for r in &rs {
        wait_agents(r.http, MODEL, 1);
    }
    (rs, sim, port, agent)
}

#[test]
fn a_shared_agent_never_exceeds_its_capacity_and_serves_every_router() {
    let (rs, _sim, sim_port, _agent) = setup("multi-router-cap", 3, "400ms", "2");
    // Five concurrent requests on each of the three routers: 15 against a
    // capacity of 2 in total (each router alone would send 2 at once).
    let threads: Vec<_> = rs
        .iter()
        .flat_map(|r| {
            let http = r.http;
            (0..5).map(move |i| {
                std::thread::spawn(move || {
                    Req::post("/v1/chat/completions", chat(i))
                        .send(http)
                        .map(Resp::pair)
                })
            })
        })
        .collect();
    for t in threads {
        let (st, body) = t.join().expect("thread").expect("request");
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    }
    assert_eq!(
        sim_metric(sim_port, "hivenet_sim_peak_running"),
        2.0,
        "the engine saw more (or fewer) than the agent's capacity at once"
    );
    // Every router served through it.
    for r in &rs {
        let served: u64 = successes_by_machine(r.http).values().sum();
        assert_eq!(served, 5, "router {} served {served}", r.http);
    }
}

#[test]
fn a_request_queued_behind_another_routers_is_woken_when_it_ends() {
    let (rs, _sim, sim_port, _agent) = setup("multi-router-wake", 2, "1500ms", "1");
    let (a, b) = (rs[0].http, rs[1].http);
    // Router B's request holds the only slot.
    let first = std::thread::spawn(move || {
        Req::post("/v1/chat/completions", chat(0))
            .send(b)
            .map(Resp::pair)
    });
    wait_until(
        Duration::from_secs(5),
        || routing_table(a)["agents"][0]["status"]["other_routers_active"].as_u64() == Some(1),
        "router A told of router B's request",
    );
    // Router A's request waits for it, then is served (no refusal needed:
    // A already counts B's request; without the load reports it would wait
    // for its own slots only, none of which is busy, and time out).
    let (st, body) = Req::post("/v1/chat/completions", chat(1))
        .send(a)
        .map(Resp::pair)
        .expect("request on A");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(first.join().expect("thread").expect("request on B").0, 200);
    assert_eq!(sim_metric(sim_port, "hivenet_sim_peak_running"), 1.0);
    // The table says it back to zero.
    wait_until(
        Duration::from_secs(5),
        || routing_table(a)["agents"][0]["status"]["other_routers_active"].as_u64() == Some(0),
        "router A told the slot is free",
    );
}
