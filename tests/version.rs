//! `--version` on every binary names the commit it was built from.

use std::process::Command;

fn head() -> Option<String> {
    let o = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn check(name: &str, path: &str) {
    let out = Command::new(path).arg("--version").output().expect("run");
    assert!(out.status.success(), "{name} --version failed: {out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with(&format!("{name} {} (commit ", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    // Built from this checkout: the commit is HEAD's (cargo rebuilds when
    // HEAD moves), or "unknown" outside git.
    match head() {
        Some(h) => assert!(
            text.contains(&format!("(commit {h})")),
            "{text} vs HEAD {h}"
        ),
        None => assert!(text.contains("(commit unknown)"), "{text}"),
    }
}

#[test]
fn router_and_agent_print_version_and_commit() {
    check("hivenet-router", env!("CARGO_BIN_EXE_hivenet-router"));
    check("hivenet-agent", env!("CARGO_BIN_EXE_hivenet-agent"));
}

#[test]
fn the_agents_version_label_flag_still_takes_a_value() {
    // `--version VALUE` is the agent's spec flag (its version label): it
    // must not print and exit; with no router to dial the agent fails
    // later, on its backend or link, not on the flag.
    let out = Command::new(env!("CARGO_BIN_EXE_hivenet-agent"))
        .args(["--version", "1.2.3", "--capacity", "0"])
        .output()
        .expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("(commit "), "{text}");
    assert!(!out.status.success());
}

#[test]
fn bench_binaries_print_version_and_commit() {
    // Built by `cargo build --workspace --bins` before the tests (test.sh).
    let dir = std::path::Path::new(env!("CARGO_BIN_EXE_hivenet-router"))
        .parent()
        .expect("target dir")
        .to_path_buf();
    for name in ["hivenet-sim", "hivenet-bench", "hivenet-hold-bench"] {
        let p = dir.join(name);
        assert!(
            p.exists(),
            "{} missing: build the workspace bins",
            p.display()
        );
        check(name, &p.to_string_lossy());
    }
}
