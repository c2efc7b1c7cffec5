//! `GOLOG_LOG_FMT=json` (spec 06): every log line of the router and the
//! agent is one JSON object, with level, time and the message fields.

mod common;

use std::time::Duration;

use common::*;

fn check_lines(path: &std::path::Path, who: &str) -> usize {
    let text = std::fs::read_to_string(path).expect("log");
    let mut n = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("{who}: not a JSON line ({e}): {line}"));
        assert!(v["level"].is_string(), "{who}: no level: {line}");
        assert!(v["timestamp"].is_string(), "{who}: no timestamp: {line}");
        assert!(v["fields"].is_object(), "{who}: no fields: {line}");
        n += 1;
    }
    n
}

#[test]
fn router_and_agent_write_one_json_object_per_line() {
    let dir = tmpdir("json-logs");
    let json = [("GOLOG_LOG_FMT", "json")];
    let r = start_router(&dir, &["--shards", "1"], &json);
    let (_sim, sim) = start_sim(&dir, "m", &[]);
    let agent = spawn(
        "hivenet-agent",
        &[
            "--router-p2p",
            &format!("/ip4/127.0.0.1/tcp/{}", r.p2p),
            "--backend-url",
            &format!("http://127.0.0.1:{sim}"),
            "--identity-path",
            &dir.join("a.key").to_string_lossy(),
        ],
        &dir,
        &json,
    );
    wait_agents(r.http, "m", 1);
    let (st, _, _) = Req::chat("m")
        .send(r.http)
        .map(Resp::triple)
        .expect("request");
    assert_eq!(st, 200);
    std::thread::sleep(Duration::from_millis(300));
    let (rlog, alog) = (r.proc.log.clone(), agent.log.clone());
    drop(agent);
    drop(r);
    assert!(
        check_lines(&rlog, "router") >= 2,
        "router logged too little"
    );
    assert!(check_lines(&alog, "agent") >= 2, "agent logged too little");
    // Every agent line is labelled with the agent's peer ID (spec 03).
    let text = std::fs::read_to_string(&alog).expect("agent log");
    let mut peer = None;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).expect("json");
        let p = v["spans"][0]["peer_id"]
            .as_str()
            .unwrap_or_else(|| panic!("agent line without peer_id: {line}"))
            .to_string();
        assert!(p.starts_with("12D3"), "{line}");
        assert!(peer.get_or_insert(p.clone()) == &p, "one peer ID: {line}");
    }
}
