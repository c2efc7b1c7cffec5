//! Loading policy files: the global `--policy-file` and the per-model
//! directory `--policy-model-dir` (`*.yaml`/`*.yml`, `_default.yaml` is the
//! global one, every other file a named document claiming its `models`).
//! Any invalid file fails the load as a whole, naming file, line and field,
//! so a reload either applies completely or not at all.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use shards::logic::routing::policy::{self, Policy};
use shards::logic::routing::policy_set::PolicySet;

/// Where policies come from.
#[derive(Debug, Clone, Default)]
pub struct PolicySources {
    /// `--policy-file`.
    pub file: Option<PathBuf>,
    /// `--policy-model-dir`.
    pub dir: Option<PathBuf>,
}

fn read(path: &Path) -> Result<Policy, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("policy: cannot read {}: {e}", path.display()))?;
    policy::parse(&path.display().to_string(), &text).map_err(|e| e.to_string())
}

/// Load every source into one validated set.
pub fn load(src: &PolicySources) -> Result<PolicySet, String> {
    let mut global = match &src.file {
        Some(f) => read(f)?,
        None => Policy::default(),
    };
    let mut named = BTreeMap::new();
    if let Some(dir) = &src.dir {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| format!("policy: cannot read directory {}: {e}", dir.display()))?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")))
            .collect();
        files.sort();
        for f in files {
            let stem = f
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("")
                .to_string();
            let p = read(&f)?;
            if stem == "_default" {
                if src.file.is_some() {
                    tracing::warn!(file = %f.display(), "_default in --policy-model-dir overrides --policy-file");
                }
                global = p;
            } else {
                if p.models.is_empty() {
                    return Err(format!(
                        "policy: {}:1: models: a per-model document must list at least one model",
                        f.display()
                    ));
                }
                named.insert(stem, Arc::new(p));
            }
        }
    }
    let set = PolicySet {
        global: Arc::new(global),
        named,
    };
    set.validate().map_err(|e| format!("policy: {e}"))?;
    Ok(set)
}

/// The serverless cross-config check (spec 04 §11) of `keys` (name,
/// ITPM) against every document of `set`: at startup and on SIGHUP (the
/// admin API skips it, as in the spec).
pub fn serverless_check<'a>(
    keys: impl Iterator<Item = (&'a str, u64)> + Clone,
    set: &'a PolicySet,
) -> Result<(), String> {
    let docs = std::iter::once(("global", &set.global.admission)).chain(
        set.named
            .iter()
            .map(|(name, p)| (name.as_str(), &p.admission)),
    );
    shards::logic::routing::admission::cross_check(keys, docs).map_err(|e| format!("policy: {e}"))
}
