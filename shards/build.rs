//! Records the commit the binaries are built from (`--version`), as
//! `HIVENET_COMMIT`; "unknown" outside a git checkout.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    let commit = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=HIVENET_COMMIT={commit}");
    // Rebuild when HEAD moves (a commit, a checkout). Paths come from git
    // itself, so that a worktree (where .git is a file) is followed too.
    let git_path = |arg: &str| {
        Command::new("git")
            .args(["rev-parse", "--path-format=absolute", arg])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .map(|s| PathBuf::from(s.trim()))
    };
    if let (Some(dir), Some(common)) = (git_path("--git-dir"), git_path("--git-common-dir")) {
        let head = dir.join("HEAD");
        println!("cargo:rerun-if-changed={}", head.display());
        if let Ok(text) = std::fs::read_to_string(&head) {
            if let Some(r) = text.trim().strip_prefix("ref: ") {
                println!("cargo:rerun-if-changed={}", common.join(r).display());
            }
        }
        println!(
            "cargo:rerun-if-changed={}",
            common.join("packed-refs").display()
        );
    } else if std::path::Path::new("../.git/HEAD").is_file() {
        // A git older than 2.31 (no --path-format): the plain checkout.
        println!("cargo:rerun-if-changed=../.git/HEAD");
        println!("cargo:rerun-if-changed=../.git/refs/heads");
        println!("cargo:rerun-if-changed=../.git/packed-refs");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
