//! Issue 51 #1: a configuration value the machine cannot honour stops the
//! start with one line naming its flag, instead of passing and killing a
//! shard at the first request that uses it (hours later, after a policy
//! change). `--affinity-table-entries` was only checked for >= 1024: a
//! huge count started, then panicked (`capacity overflow`) or ate memory
//! at the first prefix-aware request, leaving a listener that never
//! answered.

mod common;
use common::*;
use std::time::Duration;

/// Start the router with `flag value`; its exit code and standard error
/// (a router that starts anyway is stopped after `limit` and fails).
fn start_with(dir: &std::path::Path, flag: &str, value: &str) -> (Option<i32>, String) {
    let child = std::process::Command::new(bin("hivenet-router"))
        .args([
            "--p2p-port",
            "0",
            "--http-port",
            "127.0.0.1:0",
            "--metrics-port",
            "127.0.0.1:0",
            flag,
            value,
        ])
        .env("HIVENET_ROUTER_ADMIN_API_KEYS", "test-admin-key")
        .current_dir(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    exit_within(child, Duration::from_secs(10))
}

#[test]
fn an_affinity_table_the_machine_cannot_hold_stops_the_start() {
    let dir = tmpdir("flag-bounds");
    // usize::MAX (past what can be addressed), 2^32 entries (160 GiB),
    // 2^40 (past any machine here).
    for value in ["18446744073709551615", "4294967296", "1099511627776"] {
        let (code, err) = start_with(&dir, "--affinity-table-entries", value);
        assert_eq!(code, Some(2), "{value}: started anyway? {err}");
        assert!(err.contains("--affinity-table-entries"), "{value}: {err}");
        assert_eq!(
            err.trim()
                .lines()
                .filter(|l| l.contains("hivenet-router:"))
                .count(),
            1,
            "{value}: one line: {err}"
        );
    }
    // Below 1024: refused as before.
    let (code, err) = start_with(&dir, "--affinity-table-entries", "1023");
    assert_eq!(code, Some(2), "1023: {err}");
    assert!(err.contains("at least 1024"), "{err}");
}

/// Issue 51 #1: every numeric flag of the router, fed its extremes, either
/// stops the start with one line naming it (exit 2) or starts a router
/// that answers, requests included: never a panic, never a half-alive
/// process.
#[test]
fn every_numeric_flag_at_its_extremes_starts_or_stops_cleanly() {
    const INTS: [&str; 3] = ["0", "18446744073709551615", "-1"];
    const DURATIONS: [&str; 4] = ["0s", "1ns", "7d", "99999999999h"];
    let ints = [
        "--shards",
        "--max-client-connections",
        "--max-agent-links",
        "--max-agent-links-per-address",
        "--max-pending-agent-links",
        "--max-pending-agent-links-per-address",
        "--affinity-table-entries",
        "--max-buffered-body-bytes",
        "--disk-db-ttl",
        "--responses-max-bytes",
        "--responses-max-bytes-per-tenant",
        "--responses-ttl-days",
        "--max-tries-per-step",
        "--queue-depth",
        "--stream-migrations",
        "--wake-hold-max-per-key",
        "--wake-hold-max-per-model",
        "--wake-hold-max-total",
        "--p2p-max-conns-per-ip",
        "--queue-size",
        "--max-concurrent",
    ];
    let durations = [
        "--request-timeout",
        "--stream-idle-timeout",
        "--remove-after",
        "--heartbeat-interval",
        "--header-timeout",
        "--body-timeout",
        "--universal-flush-interval",
        "--preamble-timeout",
        "--handshake-timeout",
        "--sibling-hints-max-age",
        "--wake-hold-budget",
        "--wake-keepalive",
        "--drain-timeout",
        "--unhealthy-after",
        "--health-check-interval",
        "--session-ttl",
    ];
    let mut cases: Vec<(&str, &str)> = Vec::new();
    for f in ints {
        cases.extend(INTS.iter().map(|v| (f, *v)));
    }
    for f in durations {
        cases.extend(DURATIONS.iter().map(|v| (f, *v)));
    }
    let dir = tmpdir("flag-extremes");
    let failures: Vec<String> = std::thread::scope(|s| {
        let chunks: Vec<_> = cases.chunks(cases.len().div_ceil(4)).collect();
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|chunk| {
                let dir = &dir;
                s.spawn(move || {
                    chunk
                        .iter()
                        .filter_map(|(f, v)| match one_extreme(dir, f, v) {
                            Ok(started) => {
                                eprintln!(
                                    "{f} {v}: {}",
                                    if started {
                                        "started and answered"
                                    } else {
                                        "refused with one line"
                                    }
                                );
                                None
                            }
                            Err(e) => Some(e),
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    });
    assert!(
        failures.is_empty(),
        "{} cases:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// One flag at one value: refused with one line naming it, or a router
/// that answers `/health` and a request, then stops without a panic.
fn one_extreme(dir: &std::path::Path, flag: &str, value: &str) -> Result<bool, String> {
    let (http, metrics, p2p) = (free_port(), free_port(), free_port());
    let d = dir.join(format!("{}-{}", flag.trim_start_matches('-'), free_port()));
    std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
    let (h, m, p) = (
        format!("127.0.0.1:{http}"),
        format!("127.0.0.1:{metrics}"),
        p2p.to_string(),
    );
    let mut args = vec!["--http-port", &h, "--metrics-port", &m, "--p2p-port", &p];
    if flag != "--shards" {
        args.extend(["--shards", "1"]);
    }
    args.extend([flag, value]);
    let mut child = std::process::Command::new(bin("hivenet-router"))
        .args(&args)
        .env("HIVENET_ROUTER_ADMIN_API_KEYS", "test-admin-key")
        .current_dir(&d)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let t0 = std::time::Instant::now();
    let started = loop {
        if let Ok(Some(_)) = child.try_wait() {
            break false;
        }
        if Req::get("/health")
            .send(http)
            .map(|r| r.status == 200)
            .unwrap_or(false)
        {
            break true;
        }
        if t0.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            return Err(format!(
                "{flag} {value}: neither started nor stopped in 10 s"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if started {
        // The request path computes deadlines and budgets from the flags.
        let answered = Req::chat("ghost").send(http).map(|r| r.status).unwrap_or(0);
        let health = Req::get("/health")
            .send(http)
            .map(|r| r.status)
            .unwrap_or(0);
        let _ = child.kill();
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        if answered == 0 || health != 200 || err.contains("panicked") {
            return Err(format!(
                "{flag} {value}: started, then chat {answered}, health {health}: {err}"
            ));
        }
        return Ok(true);
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    let line = err
        .lines()
        .filter(|l| !l.contains(" INFO ") && !l.contains(" WARN "))
        .collect::<Vec<_>>()
        .join("\n");
    if out.status.code() != Some(2)
        || !line.contains(flag.trim_start_matches('-').split('-').next().unwrap_or(""))
    {
        return Err(format!(
            "{flag} {value}: exit {:?}: {err}",
            out.status.code()
        ));
    }
    Ok(false)
}

/// The agent's numeric flags at their extremes: refused with one line, or
/// an agent that runs (here against a backend that is not there) without a
/// panic.
#[test]
fn every_numeric_agent_flag_at_its_extremes_starts_or_stops_cleanly() {
    let dir = tmpdir("agent-extremes");
    let mut failures = Vec::new();
    let cases = [
        ("--capacity", ["0", "4294967295", "-1", "99999999999"]),
        ("--http-timeout", ["0s", "1ns", "7d", "99999999999h"]),
        (
            "--stream-write-timeout",
            ["0s", "1ns", "7d", "99999999999h"],
        ),
        ("--drain-timeout", ["0s", "1ns", "7d", "99999999999h"]),
        (
            "--hardware-sample-interval",
            ["0s", "1ns", "7d", "99999999999h"],
        ),
        (
            "--engine-sample-interval",
            ["0s", "1ns", "7d", "99999999999h"],
        ),
        (
            "--routing-signal-interval",
            ["0s", "1ns", "7d", "99999999999h"],
        ),
    ];
    let backend = format!("http://127.0.0.1:{}", free_port());
    let router = format!("/ip4/127.0.0.1/tcp/{}", free_port());
    for (flag, values) in cases {
        for value in values {
            let id = dir.join(format!("{}.key", free_port()));
            let mut child = std::process::Command::new(bin("hivenet-agent"))
                .args([
                    "--backend-url",
                    &backend,
                    "--router-p2p",
                    &router,
                    "--identity-path",
                ])
                .arg(&id)
                .args([flag, value])
                .current_dir(&dir)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("agent");
            std::thread::sleep(Duration::from_millis(800));
            let running = matches!(child.try_wait(), Ok(None));
            if running {
                let _ = child.kill();
            }
            let out = child.wait_with_output().expect("wait");
            let err = String::from_utf8_lossy(&out.stderr).to_string();
            let fine = if running {
                !err.contains("panicked")
            } else {
                out.status.code() == Some(2) && err.contains(flag)
            };
            if !fine {
                failures.push(format!(
                    "{flag} {value}: running {running}, exit {:?}: {err}",
                    out.status.code()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
