//! Issue 56: the real engine on the fleet. llama-server and its agent run
//! on one host (the engine on that host's loopback, as the kit's sidecar
//! has it), the router on another; the agent links over the swarm key and
//! a chat answered by the engine comes back through the router's address.

mod common;
use common::fleet::Fleet;
use common::llama::install;
use common::*;
use std::time::Duration;

const SWARM_KEY: &str = "/key/swarm/psk/1.0.0/\n/base16/\n3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b\n";

#[test]
fn a_real_engine_on_another_host_serves_through_the_router() {
    let (server, model) = install();
    let fleet = Fleet::build(&[2], &[], 0.0);
    let dir = tmpdir("fleet-real");
    std::fs::write(dir.join("swarm.key"), SWARM_KEY).expect("key");
    let key = dir.join("swarm.key").to_string_lossy().to_string();
    let _router = fleet.spawn(
        0,
        "hivenet-router",
        &[
            "--shards",
            "1",
            "--http-port",
            ":8080",
            "--p2p-port",
            "9000",
            "--p2p-listen-addr",
            "0.0.0.0",
            "--swarm-key-file",
            &key,
        ],
        &dir,
        &[("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN_KEY)],
    );
    let m = model.to_string_lossy().to_string();
    let _llama = fleet.spawn_path(
        1,
        &server,
        &[
            "-m",
            &m,
            "--host",
            "127.0.0.1",
            "--port",
            "8000",
            "-t",
            "1",
            "-c",
            "2048",
            "-np",
            "1",
            "--metrics",
        ],
        &dir,
        &[],
    );
    let rp = format!("/ip4/{}/tcp/9000", fleet.hosts[0].ip);
    let _agent = fleet.spawn(
        1,
        "hivenet-agent",
        &[
            "--router-p2p",
            &rp,
            "--backend-url",
            "http://127.0.0.1:8000",
            "--engine",
            "llamacpp",
            "--swarm-key-file",
            &key,
            "--identity-path",
            "agent.key",
            "--warmup",
            "off",
        ],
        &dir,
        &[],
    );
    let http = fleet.addr(0, 8080);
    wait_until(
        Duration::from_secs(120),
        || {
            Req::get("/admin/routing-table")
                .bearer(ADMIN_KEY)
                .send_to(&http)
                .map(|r| r.json()["agents"][0]["status"]["backend_healthy"] == true)
                .unwrap_or(false)
        },
        "the engine's agent linked from its host",
    );
    let name = Req::get("/admin/routing-table")
        .bearer(ADMIN_KEY)
        .send_to(&http)
        .expect("table")
        .json()["agents"][0]["metadata"]["model"]
        .as_str()
        .expect("model")
        .to_string();
    let body = serde_json::json!({"model": name, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi."}]})
    .to_string();
    let r = Req::post("/v1/chat/completions", body)
        .send_to(&http)
        .expect("chat");
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .is_some_and(|s| !s.is_empty()),
        "{v}"
    );
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap_or(0) > 0,
        "{v}"
    );
}
