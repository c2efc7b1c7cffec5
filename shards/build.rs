//! Records the commit the binaries are built from (`--version`), as
//! `HIVENET_COMMIT`; "unknown" outside a git checkout.
use std::path::Path;
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
    // Rebuild when HEAD moves (a commit, a checkout).
    let git = Path::new("../.git");
    if git.is_dir() {
        println!("cargo:rerun-if-changed=../.git/HEAD");
        if let Ok(head) = std::fs::read_to_string(git.join("HEAD")) {
            if let Some(r) = head.trim().strip_prefix("ref: ") {
                println!("cargo:rerun-if-changed=../.git/{r}");
            }
        }
        println!("cargo:rerun-if-changed=../.git/packed-refs");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
