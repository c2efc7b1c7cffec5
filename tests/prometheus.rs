//! A real Prometheus scrapes a router serving two agents (one slow, one
//! fast) and loads `deploy/prometheus/alerts.yaml`; every metric the alert
//! rules use exists in what it scraped, the rules evaluate without error,
//! and the operator's first questions get sensible answers through the
//! HTTP API (issue 15).

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

struct Prom(Child);

impl Drop for Prom {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The result vector of an instant query (empty on any failure).
fn query(port: u16, q: &str) -> Vec<serde_json::Value> {
    let Ok((200, body)) = Req::get(&format!("/api/v1/query?query={}", encode(q)))
        .send(port)
        .map(Resp::pair)
    else {
        return Vec::new();
    };
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    v["data"]["result"].as_array().cloned().unwrap_or_default()
}

fn value(r: &serde_json::Value) -> f64 {
    r["value"][1]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Metric names an expression file uses (`hivenet_...`).
fn metric_names(yaml: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut rest = yaml;
    while let Some(i) = rest.find("hivenet_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        if !out.iter().any(|n| n == name) {
            out.push(name.to_string());
        }
        rest = &tail[end..];
    }
    out
}

#[test]
fn prometheus_scrapes_the_router_and_the_alert_rules_use_real_series() {
    let prom_bin = "prometheus";
    assert!(
        Command::new(prom_bin).arg("--version").output().is_ok(),
        "the prometheus server is missing (Debian package prometheus; scripts/test.sh installs it)"
    );
    let dir = tmpdir("prometheus");
    // Model "p" routes with prefix-aware on an engine with a prefix cache
    // (the cache-affinity panels read it).
    let pdir = dir.join("policies");
    std::fs::create_dir_all(&pdir).expect("policy dir");
    std::fs::write(
        pdir.join("p.yaml"),
        "models: [p]\nrouting_policy:\n  strategy: prefix-aware\n",
    )
    .expect("policy");
    let pds = pdir.to_string_lossy().to_string();
    // With --shared-state on a real redis-server: its series are on the
    // dashboard and in the alert rules.
    let redis_port = free_port();
    let _redis = start_redis(&dir, redis_port);
    let redis_url = format!("redis://127.0.0.1:{redis_port}/0");
    let r = start_router(
        &dir,
        &[
            "--shards",
            "1",
            "--policy-model-dir",
            &pds,
            "--shared-state",
            &redis_url,
        ],
        &[],
    );
    let (_fast_sim, fast) = start_sim(&dir, "m", &["--ttft", "1ms"]);
    let (_slow_sim, slow) = start_sim(&dir, "m", &["--ttft", "300ms"]);
    let (_p_sim, p_port) = start_sim(&dir, "p", &["--prefix-cache-tokens", "4096"]);
    let _a = start_agent(&dir, &r, fast, "fast.key", &[]);
    let _b = start_agent(&dir, &r, slow, "slow.key", &[]);
    let _c = start_agent(&dir, &r, p_port, "p.key", &[]);
    wait_agents(r.http, "m", 2);
    wait_agents(r.http, "p", 1);

    let rules =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus/alerts.yaml");
    let yaml = std::fs::read_to_string(&rules).expect("alerts.yaml");
    let prom_port = free_port();
    std::fs::write(
        dir.join("prometheus.yml"),
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nrule_files: ['{}']\nscrape_configs:\n  - job_name: hivenet-router\n    static_configs: [{{targets: ['127.0.0.1:{}']}}]\n",
            rules.display(),
            r.metrics
        ),
    )
    .expect("config");
    let log = std::fs::File::create(dir.join("prometheus.log")).expect("log");
    let _prom = Prom(
        Command::new(prom_bin)
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .current_dir(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start prometheus"),
    );
    wait_until(
        Duration::from_secs(30),
        || {
            Req::get("/-/ready")
                .send(prom_port)
                .map(Resp::pair)
                .map(|(s, _)| s == 200)
                .unwrap_or(false)
        },
        "prometheus ready",
    );

    wait_until(
        Duration::from_secs(30),
        || query(prom_port, "up").first().map(value) == Some(1.0),
        "the router scraped",
    );
    // Traffic through both agents (least loaded, rotating ties), in two
    // bursts a few scrapes apart so counters move between samples.
    for burst in 0..2 {
        if burst == 1 {
            std::thread::sleep(Duration::from_secs(3));
        }
        for _ in 0..20 {
            let (st, _, _) = Req::chat("m")
                .send(r.http)
                .map(Resp::triple)
                .expect("request");
            assert_eq!(st, 200);
        }
        for _ in 0..5 {
            let (st, _, _) = Req::chat("p")
                .send(r.http)
                .map(Resp::triple)
                .expect("request");
            assert_eq!(st, 200);
        }
    }
    // At least two scrapes after the traffic.
    wait_until(
        Duration::from_secs(30),
        || {
            query(prom_port, "count(hivenet_agent_srtt_ms)")
                .first()
                .map(value)
                == Some(3.0)
                && query(
                    prom_port,
                    "sum(increase(hivenet_routing_requests_routed_total[1m]))",
                )
                .first()
                .map(value)
                .unwrap_or(0.0)
                    > 0.0
        },
        "three agents' SRTT and traffic scraped",
    );
    std::thread::sleep(Duration::from_secs(3));

    // Every metric the alerts use exists in what Prometheus scraped.
    let names = metric_names(&yaml);
    assert!(names.len() >= 6, "{names:?}");
    for n in &names {
        let got = query(prom_port, &format!("count({{__name__=\"{n}\"}})"));
        assert!(
            !got.is_empty(),
            "alert rules use {n}, which the router does not export"
        );
    }
    // The rules loaded and evaluate without errors.
    let (st, body) = Req::get("/api/v1/rules")
        .send(prom_port)
        .map(Resp::pair)
        .expect("rules");
    assert_eq!(st, 200);
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
    let rules: Vec<&serde_json::Value> = v["data"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .collect();
    assert_eq!(rules.len(), 7, "{v}");
    for rule in &rules {
        assert_eq!(rule["health"], "ok", "rule failed to evaluate: {rule}");
    }
    // Sensible answers: a counter rate above 0, and the slow agent's p99
    // duration and SRTT above the fast one's.
    let rate = query(
        prom_port,
        "sum(rate(hivenet_request_duration_seconds_count[1m]))",
    );
    assert!(rate.first().map(value).unwrap_or(0.0) > 0.0, "{rate:?}");
    let srtt = query(
        prom_port,
        "max(hivenet_agent_srtt_ms) / min(hivenet_agent_srtt_ms)",
    );
    assert!(
        srtt.first().map(value).unwrap_or(0.0) > 5.0,
        "slow agent's SRTT not above the fast one's: {srtt:?}"
    );
    let p99 = query(
        prom_port,
        "histogram_quantile(0.99, sum by (le, peer_id) (rate(hivenet_request_duration_seconds_bucket[1m])))",
    );
    assert_eq!(p99.len(), 3, "{p99:?}");
    let mut ps: Vec<f64> = p99.iter().map(value).collect();
    ps.sort_by(|a, b| a.total_cmp(b));
    assert!(
        ps[2] > 2.0 * ps[0] && ps[2] >= 0.25,
        "p99 per agent: {ps:?}"
    );
    // Every query of the Grafana dashboard answers (its variables set to
    // "All"), and every variable's label_values() series exists.
    let dash_path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/grafana/hivenet-router.json");
    let dash: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&dash_path).expect("dashboard")).expect("json");
    let fill = |q: &str| {
        q.replace("$__rate_interval", "1m")
            .replace("$__range", "1m")
            .replace("$model", ".*")
            .replace("$agent", ".*")
            .replace("$job", ".*")
    };
    let mut exprs = Vec::new();
    for panel in dash["panels"].as_array().into_iter().flatten() {
        for t in panel["targets"].as_array().into_iter().flatten() {
            if let Some(e) = t["expr"].as_str() {
                exprs.push((
                    panel["title"].as_str().unwrap_or("?").to_string(),
                    e.to_string(),
                ));
            }
        }
    }
    assert!(exprs.len() >= 15, "{} queries", exprs.len());
    for (title, e) in &exprs {
        let got = query(prom_port, &fill(e));
        assert!(
            !got.is_empty(),
            "dashboard panel {title:?}: no result for {e}"
        );
        assert!(
            got.iter().map(value).all(|v| !v.is_nan()),
            "dashboard panel {title:?}: NaN in {got:?}"
        );
    }
    for var in dash["templating"]["list"].as_array().into_iter().flatten() {
        let Some(def) = var["definition"].as_str() else {
            continue;
        };
        // label_values(<selector>, <label>): the selector has series with the label.
        let inner = def
            .strip_prefix("label_values(")
            .and_then(|r| r.strip_suffix(')'))
            .expect("label_values definition");
        let (sel, label) = inner.rsplit_once(',').expect("selector, label");
        let got = query(
            prom_port,
            &fill(&format!("count by ({}) ({})", label.trim(), sel)),
        );
        assert!(
            got.iter().any(|r| r["metric"][label.trim()].is_string()),
            "dashboard variable {def}: no values"
        );
    }
    // No alert fires on a healthy fleet but the slow-agent one (pending at
    // most: its `for` is 10 minutes).
    let firing = query(prom_port, "ALERTS{alertstate=\"firing\"}");
    assert!(firing.is_empty(), "{firing:?}");
}
