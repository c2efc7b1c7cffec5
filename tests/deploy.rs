//! The deployment files under `deploy/` checked by the tools that read
//! them: `systemd-analyze verify` on the units (systemd-analyze required).

use std::path::Path;
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn systemd_units_verify() {
    // No silent skip (issue 28): the check needs systemd-analyze.
    assert!(
        Command::new("systemd-analyze")
            .arg("--version")
            .output()
            .is_ok(),
        "systemd-analyze is required: Debian package systemd (scripts/test.sh installs it)"
    );
    let dir = std::env::temp_dir().join(format!("hivenet-units-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    for (unit, bin) in [
        (
            "hivenet-router.service",
            env!("CARGO_BIN_EXE_hivenet-router"),
        ),
        ("hivenet-agent.service", env!("CARGO_BIN_EXE_hivenet-agent")),
    ] {
        let text = std::fs::read_to_string(root().join("deploy/systemd").join(unit)).expect("unit");
        let name = unit.trim_end_matches(".service");
        // The installed path is /usr/local/bin; verify against the build.
        let text = text.replace(&format!("/usr/local/bin/{name}"), bin);
        let path = dir.join(unit);
        std::fs::write(&path, text).expect("write");
        let out = Command::new("systemd-analyze")
            .arg("verify")
            .arg(&path)
            .output()
            .expect("systemd-analyze");
        let err = String::from_utf8_lossy(&out.stderr);
        // Warnings (a bad CPUAffinity, an unknown key) exit 0: fail on them too.
        let ours: Vec<&str> = err.lines().filter(|l| l.contains(unit)).collect();
        assert!(
            out.status.success() && ours.is_empty(),
            "{unit}: {}\n{err}",
            out.status
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 28 #18: the router's store and identity and each agent's
/// identity live on persistent volumes (StatefulSets with volume claim
/// templates), never on `emptyDir`: a restarted pod keeps its PeerId and
/// the latency history (the seed's warm start). The schemas themselves are
/// checked by `kubernetes-validate --strict` in scripts/test.sh.
#[test]
fn kubernetes_state_is_on_persistent_volumes() {
    for (file, state, path) in [
        ("router.yaml", "state", "/var/lib/hivenet-router"),
        (
            "vllm-with-agent.yaml",
            "agent-state",
            "/var/lib/hivenet-agent",
        ),
    ] {
        let text =
            std::fs::read_to_string(root().join("deploy/kubernetes").join(file)).expect("manifest");
        assert!(!text.contains("emptyDir"), "{file}: state on emptyDir");
        assert!(
            text.contains("kind: StatefulSet"),
            "{file}: not a StatefulSet"
        );
        let claims = text
            .split("volumeClaimTemplates:")
            .nth(1)
            .unwrap_or_else(|| panic!("{file}: no volumeClaimTemplates"));
        assert!(
            claims.contains(&format!("name: {state}")),
            "{file}: no claim named {state}"
        );
        assert!(
            text.contains(&format!("{{name: {state}, mountPath: {path}}}")),
            "{file}: {state} not mounted at {path}"
        );
    }
}
