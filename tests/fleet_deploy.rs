//! Issue 56: the deploy kit, tested as shipped. The router's and the
//! agents' arguments are read from `deploy/systemd/*.service` and
//! `deploy/kubernetes/*.yaml` themselves; only addresses, paths and
//! secrets are substituted. The router runs on one host of a fleet of
//! network namespaces (tests/common/fleet.rs), each agent and its engine
//! (the simulator on the kit's backend port) on another; the agents must
//! link over the swarm key, register and serve both APIs, through the
//! official OpenAI and Anthropic SDKs too.

mod common;
use common::fleet::Fleet;
use common::*;
use std::path::Path;
use std::time::Duration;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The words of a unit's `ExecStart=` (continuation lines joined).
fn exec_start(unit: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root().join("deploy/systemd").join(unit)).expect("unit");
    let mut line = String::new();
    let mut on = false;
    for l in text.lines() {
        if let Some(rest) = l.strip_prefix("ExecStart=") {
            on = true;
            line.push_str(rest);
        } else if on {
            line.push(' ');
            line.push_str(l);
        } else {
            continue;
        }
        if !line.trim_end().ends_with('\\') {
            break;
        }
        let t = line.trim_end().trim_end_matches('\\').to_string();
        line = t;
    }
    line.split_whitespace().map(str::to_string).collect()
}

/// The manifests of a Kubernetes file.
fn manifests(file: &str) -> Vec<serde_json::Value> {
    let text =
        std::fs::read_to_string(root().join("deploy/kubernetes").join(file)).expect("manifest");
    serde_saphyr::from_multiple::<serde_json::Value>(&text).expect("yaml")
}

/// The `args` of container `name` in `file`.
fn container_args(file: &str, name: &str) -> Vec<String> {
    for m in manifests(file) {
        let containers = m["spec"]["template"]["spec"]["containers"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for c in containers {
            if c["name"] == name {
                return c["args"]
                    .as_array()
                    .expect("args")
                    .iter()
                    .map(|a| a.as_str().expect("string arg").to_string())
                    .collect();
            }
        }
    }
    panic!("no container {name} in {file}");
}

/// Replace each `from` with its `to` in every word.
fn substitute(words: &[String], subs: &[(String, String)]) -> Vec<String> {
    words
        .iter()
        .map(|w| {
            subs.iter()
                .fold(w.clone(), |w, (from, to)| w.replace(from.as_str(), to))
        })
        .collect()
}

const SWARM_KEY: &str = "/key/swarm/psk/1.0.0/\n/base16/\n6a1f0c3b9e8d7a6f5e4d3c2b1a09f8e7d6c5b4a3928170f6e5d4c3b2a1908f7e\n";

/// A router on host 0 and an agent with its engine on hosts 1 and 2, run
/// from `router` and `agent` (program first, the kit's `${VAR}`s and
/// paths substituted). Asserts both agents link and serve.
fn fleet_serves(tag: &str, router: Vec<String>, agent: Vec<String>, kit_paths: &[(&str, &str)]) {
    let fleet = Fleet::build(&[3], &[], 0.0);
    let dir = tmpdir(tag);
    let s = |p: &Path| p.to_string_lossy().to_string();
    std::fs::write(dir.join("swarm.key"), SWARM_KEY).expect("swarm key");
    let rdir = dir.join("router");
    std::fs::create_dir_all(rdir.join("policies")).expect("dirs");
    // The ConfigMap's default policy, as the kit mounts it.
    std::fs::write(
        rdir.join("policies/_default.yaml"),
        "routing_policy:\n  strategy: least-loaded\n",
    )
    .expect("policy");
    let router_ip = fleet.hosts[0].ip.clone();
    let mut subs: Vec<(String, String)> = vec![
        (
            "/usr/local/bin/hivenet-router".into(),
            s(&bin("hivenet-router")),
        ),
        (
            "/usr/local/bin/hivenet-agent".into(),
            s(&bin("hivenet-agent")),
        ),
        ("/dns4/hivenet-router/".into(), format!("/ip4/{router_ip}/")),
        ("${ROUTER_P2P}".into(), format!("/ip4/{router_ip}/tcp/9000")),
        ("${BACKEND_URL}".into(), "http://127.0.0.1:8000".into()),
        ("${ENGINE}".into(), "vllm".into()),
        ("${CAPACITY}".into(), "16".into()),
    ];
    for (from, to) in kit_paths {
        subs.push((from.to_string(), to.replace("{dir}", &s(&dir))));
    }
    let router = substitute(&router, &subs);
    let audit = s(&rdir.join("audit.jsonl"));
    let env = [
        ("HIVENET_ROUTER_ADMIN_API_KEYS", ADMIN_KEY),
        ("HIVENET_ROUTER_AUDIT_LOG_PATH", audit.as_str()),
    ];
    let args: Vec<&str> = router[1..].iter().map(String::as_str).collect();
    let r = fleet.spawn_path(0, Path::new(&router[0]), &args, &rdir, &env);
    let http = fleet.addr(0, 8080);
    wait_until(
        Duration::from_secs(20),
        || {
            Req::get("/health")
                .send_to(&http)
                .map(|x| x.status == 200)
                .unwrap_or(false)
        },
        "the kit's router answers on its host's address",
    );
    let mut keep = Vec::new();
    for h in [1, 2] {
        let adir = dir.join(format!("agent{h}"));
        std::fs::create_dir_all(&adir).expect("agent dir");
        keep.push(fleet.spawn(
            h,
            "hivenet-sim",
            &["--port", "8000", "--model", "kit-model"],
            &adir,
            &[],
        ));
        let words = substitute(&agent, &subs);
        let words = substitute(&words, &[(format!("{}/agent-state", s(&dir)), s(&adir))]);
        let mut args: Vec<&str> = words[1..].iter().map(String::as_str).collect();
        let machine = format!("host{h}");
        args.extend(["--machine", machine.as_str()]);
        keep.push(fleet.spawn_path(h, Path::new(&words[0]), &args, &adir, &[]));
    }
    let table = || {
        Req::get("/admin/routing-table")
            .bearer(ADMIN_KEY)
            .send_to(&http)
            .map(|x| x.json())
            .unwrap_or_default()
    };
    let linked = wait_for(Duration::from_secs(30), || table()["total"] == 2);
    assert!(
        linked,
        "{tag}: agents on other hosts did not link: {}\nrouter log:\n{}",
        table(),
        r.log_text()
    );
    // Both APIs, on both agents.
    for i in 0..8 {
        let path = if i % 2 == 0 {
            "/v1/chat/completions"
        } else {
            "/v1/messages"
        };
        let body = r#"{"model":"kit-model","max_tokens":16,"messages":[{"role":"user","content":"hello"}]}"#;
        let (st, b) = Req::post(path, body)
            .send_to(&http)
            .expect("request")
            .pair();
        assert_eq!(st, 200, "{tag} {path}: {}", String::from_utf8_lossy(&b));
    }
    let t = table();
    for a in t["agents"].as_array().expect("agents") {
        assert!(
            a["universal"]["successful_requests_total"]
                .as_u64()
                .unwrap_or(0)
                >= 1,
            "{tag}: every agent serves: {t}"
        );
    }
    sdk_calls(tag, &http);
}

/// Poll `f` until it holds or `limit` passes.
fn wait_for(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// One call of each official SDK (the test command's venv has them).
fn sdk_calls(tag: &str, http: &str) {
    let venv = std::env::var("HIVENET_VENV").unwrap_or_else(|_| ".venv".into());
    let python = root().join(venv).join("bin/python");
    assert!(
        python.exists(),
        "{} is missing: scripts/test.sh makes the venv with the OpenAI and Anthropic SDKs",
        python.display()
    );
    let script = format!(
        r#"
import openai, anthropic
o = openai.OpenAI(base_url="http://{http}/v1", api_key="none", max_retries=0)
r = o.chat.completions.create(model="kit-model", max_tokens=8, messages=[{{"role": "user", "content": "hi"}}])
assert r.choices[0].message.content, r
a = anthropic.Anthropic(base_url="http://{http}", api_key="none", max_retries=0)
m = a.messages.create(model="kit-model", max_tokens=8, messages=[{{"role": "user", "content": "hi"}}])
assert m.content[0].text, m
print("sdk ok")
"#
    );
    let out = std::process::Command::new(&python)
        .args(["-c", &script])
        .output()
        .expect("python");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("sdk ok"),
        "{tag}: SDK calls failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_systemd_units_as_shipped_link_agents_of_other_hosts() {
    fleet_serves(
        "kit-systemd",
        exec_start("hivenet-router.service"),
        exec_start("hivenet-agent.service"),
        &[
            ("/var/lib/hivenet-router", "{dir}/router"),
            ("/var/lib/hivenet-agent", "{dir}/agent-state"),
            ("/etc/hivenet/swarm.key", "{dir}/swarm.key"),
        ],
    );
}

#[test]
fn the_kubernetes_manifests_as_shipped_link_agents_of_other_hosts() {
    let mut router = vec!["/usr/local/bin/hivenet-router".to_string()];
    router.extend(container_args("router.yaml", "router"));
    let mut agent = vec!["/usr/local/bin/hivenet-agent".to_string()];
    agent.extend(container_args("vllm-with-agent.yaml", "hivenet-agent"));
    fleet_serves(
        "kit-k8s",
        router,
        agent,
        &[
            ("/var/lib/hivenet-router", "{dir}/router"),
            ("/var/lib/hivenet-agent", "{dir}/agent-state"),
            ("/etc/hivenet/swarm/swarm.key", "{dir}/swarm.key"),
            ("/etc/hivenet/policies", "{dir}/router/policies"),
        ],
    );
}
