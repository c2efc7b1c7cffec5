//! The house rules of the code's shape, checked (issue 50): the README's
//! code map names every source file and script; no source file grows past
//! 650 lines and the request driver past 600; the decision machine is the
//! only decider (one selector, one capacity wait); `Result<_, String>`
//! stays rare in the shard crate's signatures. A feature that needs more
//! room grows in its own file, not in the driver.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every file under `dir` (recursively) whose name ends with one of `ext`.
fn files(dir: &Path, ext: &[&str], out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, ext, out);
        } else if ext.iter().any(|x| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().ends_with(x))
        }) {
            out.push(p);
        }
    }
}

/// Source files, tests (`tests.rs`, `tests/` folders) left out.
fn sources(dirs: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for d in dirs {
        files(&root().join(d), &[".rs"], &mut out);
    }
    out.retain(|p| {
        let s = p.to_string_lossy();
        !s.ends_with("/tests.rs") && !s.contains("/tests/")
    });
    out.sort();
    out
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root())
        .unwrap_or(p)
        .to_string_lossy()
        .into_owned()
}

#[test]
fn the_code_map_names_every_source_file_and_script() {
    let readme = read(&root().join("README.md"));
    let map = readme
        .split("## Code map")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("README has a Code map section");
    let mut missing = Vec::new();
    let mut all = sources(&["src", "shards/src", "bench/src"]);
    files(
        &root().join("scripts"),
        &[".sh", ".py", ".c", ".h", ".yaml"],
        &mut all,
    );
    for p in all {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if name == "mod.rs" {
            continue;
        }
        let stem = name.trim_end_matches(".rs");
        // Named as `stem`, `file.ext`, or as the tail of a path in backticks.
        let named = map.contains(&format!("`{stem}`"))
            || map.contains(&format!("`{name}`"))
            || map.contains(&format!("/{stem}`"))
            || map.contains(&format!("/{name}`"))
            || map.contains(&format!("`{stem}/"))
            || map.contains(&format!("`{}`", rel(&p)));
        if !named {
            missing.push(rel(&p));
        }
    }
    assert!(
        missing.is_empty(),
        "the README's code map does not name: {missing:?}"
    );
}

#[test]
fn no_source_file_outgrows_its_room() {
    let mut big = Vec::new();
    for p in sources(&["src", "shards/src"]) {
        let n = read(&p).lines().count();
        if n > 650 {
            big.push((rel(&p), n));
        }
    }
    assert!(big.is_empty(), "over 650 lines (split by concern): {big:?}");
    let driver = root().join("shards/src/runtime/request/dispatch.rs");
    let n = read(&driver).lines().count();
    assert!(
        n <= 600,
        "request/dispatch.rs has {n} lines: the driver stays a short loop; a feature's lines go to its own room"
    );
}

/// Lines of `text` outside comments that contain `needle`.
fn code_uses(text: &str, needle: &str) -> usize {
    text.lines()
        .filter(|l| {
            let t = l.trim_start();
            !t.starts_with("//") && t.contains(needle)
        })
        .count()
}

#[test]
fn the_machine_is_the_only_decider() {
    // One selector: the policy's step pipeline is called by the decision
    // machine only (and by its own tests and benches).
    // One capacity wait: the queue is joined in one place.
    let mut selectors = Vec::new();
    let mut waits = Vec::new();
    for p in sources(&["shards/src", "src"]) {
        let r = rel(&p);
        let text = read(&p);
        let sel = code_uses(&text, "select_with(") + code_uses(&text, "policy::select(");
        if sel > 0 && !r.starts_with("shards/src/logic/routing/") {
            selectors.push(r.clone());
        }
        let joins = code_uses(&text, ".push_head(")
            + code_uses(&text, ".push_displacing(")
            + code_uses(&text, ".requeue(");
        if joins > 0 && r.starts_with("shards/src/runtime/") {
            waits.push(r);
        }
    }
    assert!(
        selectors.is_empty(),
        "agents are selected outside the decision machine in {selectors:?}"
    );
    assert_eq!(
        waits,
        vec!["shards/src/runtime/request/dispatch/wait.rs".to_string()],
        "the capacity queue is joined outside the one capacity wait"
    );
}

#[test]
fn string_errors_stay_rare_in_the_shard_crate() {
    let mut n = 0;
    let mut at = Vec::new();
    for p in sources(&["shards/src"]) {
        for (i, l) in read(&p).lines().enumerate() {
            let t = l.trim_start();
            if !t.starts_with("//")
                && t.contains("->")
                && t.contains("Result<")
                && t.contains(", String>")
            {
                n += 1;
                at.push(format!("{}:{}", rel(&p), i + 1));
            }
        }
    }
    assert!(
        n <= 10,
        "{n} signatures return Result<_, String> in shards/src (at most 10: give a boundary a typed error): {at:?}"
    );
}
