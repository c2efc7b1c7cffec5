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
