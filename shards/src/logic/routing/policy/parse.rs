//! Policy YAML to a validated [`Policy`] (spec 04 §3-5): unknown fields
//! refused, every error naming the file, line and field.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::*;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    #[serde(default)]
    models: Vec<String>,
    routing_policy: Option<RawStep>,
    #[serde(default)]
    fallback_chain: Vec<RawStep>,
    #[serde(default)]
    aliases: BTreeMap<String, String>,
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    max_input_tokens: Option<i64>,
    #[serde(default)]
    images_max: Option<i64>,
    #[serde(default)]
    admit_budget_tokens: Option<i64>,
    #[serde(default)]
    max_inflight: Option<i64>,
    #[serde(default)]
    shed_if: Option<BTreeMap<String, BTreeMap<String, f64>>>,
    #[serde(default)]
    fallback_provider: Option<RawProvider>,
    #[serde(default)]
    min_share: Option<BTreeMap<String, f64>>,
    #[serde(default)]
    tenant_headroom: Option<i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProvider {
    #[serde(default)]
    engine: String,
    #[serde(default)]
    model: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStep {
    #[serde(default)]
    name: Option<String>,
    #[serde(default, rename = "match")]
    matcher: Option<Match>,
    #[serde(default)]
    exclude_if: Option<BTreeMap<String, BTreeMap<String, f64>>>,
    strategy: Option<String>,
    #[serde(default)]
    max_tries: Option<i64>,
    #[serde(default)]
    affinity: Option<RawAffinity>,
}

/// A `prefix-aware` step's `affinity:` fields.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAffinity {
    #[serde(default)]
    load_band: Option<f64>,
    #[serde(default)]
    ttl_seconds: Option<i64>,
    #[serde(default)]
    block_bytes: Option<i64>,
    #[serde(default)]
    holder_wait_ms: Option<i64>,
}

/// A validation error: file, line, field path and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    /// File name (or `<api>`).
    pub file: String,
    /// 1-based line, 0 when unknown.
    pub line: u64,
    /// Field path, e.g. `fallback_chain[0].exclude_if.srtt_ms`.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl std::fmt::Display for PolicyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "policy: {}:{}: {}: {}",
            self.file, self.line, self.path, self.message
        )
    }
}

/// Line of the last key of `path` (keys like `fallback_chain[1].exclude_if.srtt`),
/// found by walking the text in order; 0 when not found.
fn line_of(text: &str, path: &str) -> u64 {
    let mut from = 0usize;
    let mut found = 0u64;
    for part in path.split('.') {
        let (key, index) = match part.split_once('[') {
            Some((k, rest)) => (k, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (part, None),
        };
        let lines: Vec<&str> = text.lines().collect();
        let mut hit = None;
        for (i, l) in lines.iter().enumerate().skip(from) {
            let t = l.trim_start().trim_start_matches("- ");
            if t.starts_with(&format!("{key}:")) || t.starts_with(&format!("\"{key}\":")) {
                hit = Some(i);
                break;
            }
        }
        let Some(mut i) = hit else { return found };
        if let Some(n) = index {
            // The n-th list item after the key.
            let mut seen = 0usize;
            for (j, l) in lines.iter().enumerate().skip(i + 1) {
                if l.trim_start().starts_with("- ") {
                    if seen == n {
                        i = j;
                        break;
                    }
                    seen += 1;
                }
            }
            from = i;
        } else {
            from = i + 1;
        }
        found = i as u64 + 1;
    }
    found
}

fn err(file: &str, text: &str, path: &str, message: impl Into<String>) -> PolicyError {
    PolicyError {
        file: file.into(),
        line: line_of(text, path),
        path: path.into(),
        message: message.into(),
    }
}

/// Rules of an `exclude_if` (or `shed_if`) map at `path`, each field one
/// of `allowed` with exactly one operator.
fn rules(
    file: &str,
    text: &str,
    path: &str,
    map: BTreeMap<String, BTreeMap<String, f64>>,
    allowed: &[(&str, Field)],
) -> Result<Vec<Rule>, PolicyError> {
    let mut rules = Vec::new();
    for (name, ops) in map {
        let fpath = format!("{path}.{name}");
        if name == "srtt_ms" && allowed.len() == FIELDS.len() {
            return Err(err(file, text, &fpath, "use `srtt`, not `srtt_ms`: srtt_ms is the JSON and Prometheus name; the policy field is srtt (milliseconds)"));
        }
        let Some(field) = allowed.iter().find(|(n, _)| *n == name).map(|(_, f)| *f) else {
            let known: Vec<&str> = allowed.iter().map(|(n, _)| *n).collect();
            return Err(err(
                file,
                text,
                &fpath,
                format!(
                    "unknown {} field {name:?} (known: {})",
                    path.rsplit('.').next().unwrap_or(path),
                    known.join(", ")
                ),
            ));
        };
        if ops.len() != 1 {
            return Err(err(
                file,
                text,
                &fpath,
                format!(
                    "exactly one operator (gt, gte, lt, lte) per field, found {}",
                    ops.len()
                ),
            ));
        }
        for (op, value) in ops {
            let op = match op.as_str() {
                "gt" => Op::Gt,
                "gte" => Op::Gte,
                "lt" => Op::Lt,
                "lte" => Op::Lte,
                other => {
                    return Err(err(
                        file,
                        text,
                        &format!("{fpath}.{other}"),
                        format!("unknown operator {other:?} (gt, gte, lt, lte)"),
                    ))
                }
            };
            if !value.is_finite() {
                return Err(err(file, text, &fpath, "threshold must be a finite number"));
            }
            rules.push(Rule { field, op, value });
        }
    }
    Ok(rules)
}

/// The only signals `shed_if` reads (means over healthy agents).
const SHED_FIELDS: [(&str, Field); 2] = [
    ("kv_cache_utilization", Field::KvCacheUtilization),
    ("waiting_requests", Field::WaitingRequests),
];

/// The admission fields of `raw`, validated.
fn admission(file: &str, text: &str, raw: &mut RawPolicy) -> Result<AdmissionPolicy, PolicyError> {
    let mode = match raw.mode.as_deref() {
        None | Some("reserved") => Mode::Reserved,
        Some("serverless") => Mode::Serverless,
        Some(other) => {
            return Err(err(
                file,
                text,
                "mode",
                format!("unknown mode {other:?} (supported: reserved, serverless)"),
            ))
        }
    };
    let cap = |name: &str, v: Option<i64>| -> Result<u64, PolicyError> {
        match v {
            Some(n) if n < 0 => Err(err(
                file,
                text,
                name,
                format!("{name} must be >= 0 (0 = unset)"),
            )),
            Some(n) => Ok(u64::try_from(n).unwrap_or(0)),
            None => Ok(0),
        }
    };
    Ok(AdmissionPolicy {
        mode,
        max_input_tokens: cap("max_input_tokens", raw.max_input_tokens)?,
        images_max: cap("images_max", raw.images_max)?,
        admit_budget_tokens: cap("admit_budget_tokens", raw.admit_budget_tokens)?,
        max_inflight: cap("max_inflight", raw.max_inflight)?,
        shed_if: rules(
            file,
            text,
            "shed_if",
            raw.shed_if.take().unwrap_or_default(),
            &SHED_FIELDS,
        )?,
    })
}

fn step(
    file: &str,
    text: &str,
    path: &str,
    default_name: &str,
    raw: RawStep,
) -> Result<Step, PolicyError> {
    let prefix_aware = match raw.strategy.as_deref() {
        Some("least-loaded") => false,
        Some("prefix-aware") => true,
        Some("lowest-srtt") => {
            return Err(err(file, text, &format!("{path}.strategy"), "strategy \"lowest-srtt\" is not supported: SRTT is a gate (exclude_if: {srtt: ...}), not a ranking; strategies are least-loaded and prefix-aware"))
        }
        Some(other) => return Err(err(file, text, &format!("{path}.strategy"), format!("unknown strategy {other:?}; strategies are least-loaded and prefix-aware"))),
        None => return Err(err(file, text, path, "strategy is required (least-loaded or prefix-aware)")),
    };
    let affinity = match (prefix_aware, raw.affinity) {
        (false, Some(_)) => {
            return Err(err(
                file,
                text,
                &format!("{path}.affinity"),
                "affinity applies to strategy prefix-aware only",
            ))
        }
        (false, None) => None,
        (true, a) => Some(affinity(file, text, &format!("{path}.affinity"), a)?),
    };
    let rules = rules(
        file,
        text,
        &format!("{path}.exclude_if"),
        raw.exclude_if.unwrap_or_default(),
        &FIELDS,
    )?;
    let matcher = raw.matcher.unwrap_or_default();
    if !matcher.capability.is_empty() && Capability::parse(&matcher.capability).is_none() {
        return Err(err(
            file,
            text,
            &format!("{path}.match.capability"),
            format!(
                "unknown capability {:?} (llm, embedding, reranker)",
                matcher.capability
            ),
        ));
    }
    let max_tries = match raw.max_tries {
        Some(n) if n < 0 => {
            return Err(err(
                file,
                text,
                &format!("{path}.max_tries"),
                "max_tries must be >= 0",
            ))
        }
        Some(n) => u32::try_from(n).unwrap_or(u32::MAX),
        None => 0,
    };
    Ok(Step {
        name: raw
            .name
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| default_name.to_string()),
        matcher,
        exclude_if: rules,
        max_tries,
        affinity,
    })
}

/// Validate a prefix-aware step's `affinity:` (absent: the defaults).
fn affinity(
    file: &str,
    text: &str,
    path: &str,
    raw: Option<RawAffinity>,
) -> Result<AffinityCfg, PolicyError> {
    let mut cfg = AffinityCfg::default();
    let Some(raw) = raw else { return Ok(cfg) };
    if let Some(b) = raw.load_band {
        if !(b.is_finite() && (0.0..=1.0).contains(&b)) {
            return Err(err(
                file,
                text,
                &format!("{path}.load_band"),
                format!("load_band must be between 0 and 1 (a fraction of an agent's capacity), not {b}"),
            ));
        }
        cfg.load_band = b;
    }
    if let Some(w) = raw.holder_wait_ms {
        if !(0..=60_000).contains(&w) {
            return Err(err(
                file,
                text,
                &format!("{path}.holder_wait_ms"),
                format!("holder_wait_ms must be between 0 and 60000, not {w}"),
            ));
        }
        cfg.holder_wait_ms = w as u32;
    }
    if let Some(t) = raw.ttl_seconds {
        if !(1..=86_400).contains(&t) {
            return Err(err(
                file,
                text,
                &format!("{path}.ttl_seconds"),
                format!("ttl_seconds must be between 1 and 86400, not {t}"),
            ));
        }
        cfg.ttl_seconds = t as u32;
    }
    if let Some(b) = raw.block_bytes {
        let base = i64::from(crate::logic::routing::affinity::BASE_BLOCK);
        if !(base..=65_536).contains(&b) || b % base != 0 {
            return Err(err(
                file,
                text,
                &format!("{path}.block_bytes"),
                format!(
                    "block_bytes must be a multiple of {base} between {base} and 65536, not {b}"
                ),
            ));
        }
        cfg.block_bytes = b as u32;
    }
    Ok(cfg)
}

/// Parse and validate one policy document (`file` names it in errors).
pub fn parse(file: &str, text: &str) -> Result<Policy, PolicyError> {
    let mut raw: RawPolicy = serde_saphyr::from_str(text).map_err(|e| {
        let line = e.location().map(|l| l.line()).unwrap_or(0);
        let msg = e.to_string();
        let first = msg.lines().next().unwrap_or("invalid YAML").to_string();
        // serde names the offending key in "unknown field `x`" messages.
        let path = first.split('`').nth(1).unwrap_or("").to_string();
        PolicyError {
            file: file.into(),
            line,
            path,
            message: first,
        }
    })?;
    let admission = admission(file, text, &mut raw)?;
    let Some(primary) = raw.routing_policy else {
        return Err(PolicyError {
            file: file.into(),
            line: 1,
            path: "routing_policy".into(),
            message: "routing_policy is required".into(),
        });
    };
    let mut steps = vec![step(
        file,
        text,
        "routing_policy",
        "routing_policy",
        primary,
    )?];
    for (i, s) in raw.fallback_chain.into_iter().enumerate() {
        steps.push(step(
            file,
            text,
            &format!("fallback_chain[{i}]"),
            &format!("fallback_chain[{i}]"),
            s,
        )?);
    }
    for (alias, target) in &raw.aliases {
        let at = format!("aliases.{alias}");
        if !raw.models.is_empty() {
            return Err(err(
                file,
                text,
                "aliases",
                "aliases belong in the global policy (a document without models:)",
            ));
        }
        if alias.is_empty() || target.is_empty() || alias.len() > 256 || target.len() > 256 {
            return Err(err(
                file,
                text,
                &at,
                "alias and model must be 1 to 256 bytes",
            ));
        }
        if alias == target || raw.aliases.contains_key(target) {
            return Err(err(
                file,
                text,
                &at,
                format!("alias target {target:?} is itself an alias (aliases resolve once)"),
            ));
        }
    }
    let fallback_provider = match raw.fallback_provider {
        None => None,
        Some(fp) => {
            let Some(engine) = crate::logic::http::api::provider::Engine::parse(&fp.engine) else {
                return Err(err(
                    file,
                    text,
                    "fallback_provider.engine",
                    format!(
                        "unsupported provider engine {:?} (supported: openai, anthropic)",
                        fp.engine
                    ),
                ));
            };
            if fp.model.trim().is_empty() {
                return Err(err(
                    file,
                    text,
                    "fallback_provider.model",
                    "fallback_provider.model is required".to_string(),
                ));
            }
            Some(crate::logic::http::api::provider::FallbackProvider {
                engine,
                model: fp.model,
            })
        }
    };
    let mut min_share = [0.0f64; 3];
    for (class, share) in raw.min_share.unwrap_or_default() {
        let at = format!("min_share.{class}");
        let Some(c) = crate::logic::routing::wait_queue::Class::parse(&class) else {
            return Err(err(
                file,
                text,
                &at,
                format!("unknown class {class:?} (interactive, standard, batch)"),
            ));
        };
        if !(0.0..=1.0).contains(&share) || share.is_nan() {
            return Err(err(file, text, &at, "a share is between 0 and 1"));
        }
        if let Some(s) = min_share.get_mut(c.index()) {
            *s = share;
        }
    }
    if min_share.iter().sum::<f64>() > 1.0 {
        return Err(err(
            file,
            text,
            "min_share",
            "the shares add up to more than 1",
        ));
    }
    let tenant_headroom = match raw.tenant_headroom {
        None => crate::logic::routing::wait_queue::tenant_slots::DEFAULT_HEADROOM,
        Some(n) => u32::try_from(n)
            .ok()
            .filter(|n| *n <= 1024)
            .ok_or_else(|| {
                err(
                    file,
                    text,
                    "tenant_headroom",
                    "tenant_headroom is a number of slots, 0 to 1024 (0: none)",
                )
            })?,
    };
    Ok(Policy {
        models: raw.models,
        steps,
        aliases: raw.aliases,
        admission,
        fallback_provider,
        min_share,
        tenant_headroom,
    })
}
