//! Sites (spec 07 §4-§5), pure: the sibling map (schema, validation,
//! version rule, the placement index, hint freshness), the redirect
//! choice (scope, the home set by rendezvous hashing, warm and cold
//! hints, the ping-pong guard) and the redirect count carried in the URL.
//!
//! Key types: [`SiteMap`] (a validated push), [`choose`] (where a request
//! goes). Time is passed in.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::logic::http::endpoint::Endpoint;
use crate::logic::system::config_error::ConfigError;

/// Placement kinds (spec 07 §1.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Chat completions and messages.
    Chat,
    /// Embeddings.
    Embedding,
    /// Rerank.
    Rerank,
}

impl Kind {
    /// The kind of an endpoint; `count_tokens` has none (never redirected
    /// nor held: it must land where the real request goes).
    pub fn of(e: Endpoint) -> Option<Kind> {
        match e {
            Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::Responses => {
                Some(Kind::Chat)
            }
            Endpoint::Embeddings => Some(Kind::Embedding),
            Endpoint::Rerank => Some(Kind::Rerank),
            Endpoint::CountTokens | Endpoint::ResponsesInputTokens => None,
        }
    }
}

/// One site as pushed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Site {
    /// `[A-Za-z0-9._-]{1,64}`.
    pub site_id: String,
    /// Absolute `http(s)` URL without query; redirects go to
    /// `base_url + path`.
    pub base_url: String,
    /// Scopes (keys with `site_scopes` see only sites sharing one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scopes: Vec<String>,
}

/// One placement as pushed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Placement {
    /// The site.
    pub site_id: String,
    /// The model.
    pub model: String,
    /// Which endpoints.
    pub kind: Kind,
    /// May be held here while at zero replicas.
    #[serde(default)]
    pub scale_from_zero: bool,
    /// Go duration, `0 < d <= 1h` (hold budget of this placement).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_budget: Option<String>,
    /// Hint: the model is warm there (absent: unknown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<bool>,
}

/// A push, as received (also what `GET` returns).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MapDto {
    /// Version (byte-wise order; an older one is refused).
    pub version: String,
    /// When the writer computed the warm hints (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hints_generated_at: Option<String>,
    /// Sites.
    pub sites: Vec<Site>,
    /// Placements.
    #[serde(default)]
    pub placements: Vec<Placement>,
}

/// A validated map with its placement index.
#[derive(Debug, Clone, PartialEq)]
pub struct SiteMap {
    /// What was pushed.
    pub dto: MapDto,
    /// `hints_generated_at` as unix seconds.
    pub hints_at: Option<u64>,
    /// Sites by id (index into `dto.sites`).
    by_site: HashMap<String, usize>,
    /// (model, kind) -> placements (index into `dto.placements`), in the
    /// order pushed.
    by_model: HashMap<(String, Kind), Vec<usize>>,
    /// Parsed hold budgets by placement index.
    budgets: BTreeMap<usize, std::time::Duration>,
}

/// Longest placement hold budget.
pub const MAX_HOLD_BUDGET: std::time::Duration = std::time::Duration::from_secs(3600);

/// Whether `id` is a valid site id.
pub fn valid_site_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

/// Parse a Go duration (`300ms`, `1m30s`, `1.5h`); `None` when invalid.
pub fn parse_go_duration(s: &str) -> Option<std::time::Duration> {
    if s == "0" {
        return Some(std::time::Duration::ZERO);
    }
    let mut rest = s;
    let mut total = 0f64;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, after) = rest.split_at(num_end);
        if num.is_empty() || num == "." {
            return None;
        }
        let v: f64 = num.parse().ok()?;
        let unit_end = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, next) = after.split_at(unit_end);
        let scale = match unit {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        total += v * scale;
        rest = next;
    }
    (total.is_finite() && total < 1e12).then(|| std::time::Duration::from_secs_f64(total))
}

/// An absolute http(s) URL of visible ASCII only, without query,
/// fragment or user info: it is written into `Location` headers, so a
/// control byte or raw non-ASCII must never get there (issue 29 #12).
fn valid_base_url(u: &str) -> bool {
    crate::logic::http::api::provider::BaseUrl::parse(u).is_ok()
}

/// `s` with every byte a `Location` header must not carry raw (controls,
/// space, non-ASCII, `"<>\^`{|}`) percent-encoded; `%` itself is kept,
/// so an already encoded query stays as it was.
fn url_safe(s: &str) -> std::borrow::Cow<'_, str> {
    let bad = |b: u8| !(0x21..=0x7e).contains(&b) || b"\"<>\\^`{|}".contains(&b);
    if !s.bytes().any(bad) {
        return s.into();
    }
    let mut out = String::with_capacity(s.len() + 16);
    for b in s.bytes() {
        if bad(b) {
            out.push_str(&format!("%{b:02X}"));
        } else {
            out.push(char::from(b));
        }
    }
    out.into()
}

/// Validate a push for the router of `local` (spec 07 §4); the error is
/// the reason the whole push is refused.
pub fn validate(dto: MapDto, local: &str) -> Result<SiteMap, ConfigError> {
    if dto.version.is_empty() {
        return Err("version is required".into());
    }
    let hints_at = match &dto.hints_generated_at {
        Some(t) => Some(
            crate::logic::system::calendar::parse_rfc3339(t)
                .ok_or_else(|| format!("hints_generated_at {t:?} is not RFC 3339"))?,
        ),
        None => None,
    };
    let mut by_site = HashMap::new();
    for (i, s) in dto.sites.iter().enumerate() {
        if !valid_site_id(&s.site_id) {
            return Err(ConfigError::from(format!(
                "sites[{i}].site_id {:?} must match [A-Za-z0-9._-]{{1,64}}",
                s.site_id
            )));
        }
        if !valid_base_url(&s.base_url) {
            return Err(ConfigError::from(format!(
                "sites[{i}].base_url {:?} must be an absolute http(s) URL without query",
                s.base_url
            )));
        }
        if by_site.insert(s.site_id.clone(), i).is_some() {
            return Err(ConfigError::from(format!(
                "sites[{i}].site_id {:?} is duplicated",
                s.site_id
            )));
        }
    }
    if !by_site.contains_key(local) {
        return Err(ConfigError::from(format!("local site {local} missing")));
    }
    let mut by_model: HashMap<(String, Kind), Vec<usize>> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    let mut budgets = BTreeMap::new();
    for (i, p) in dto.placements.iter().enumerate() {
        if !by_site.contains_key(&p.site_id) {
            return Err(ConfigError::from(format!(
                "placements[{i}].site_id {:?} is not a listed site",
                p.site_id
            )));
        }
        if p.model.is_empty() || p.model.len() > 256 {
            return Err(ConfigError::from(format!(
                "placements[{i}].model must be 1 to 256 bytes"
            )));
        }
        if !seen.insert((p.site_id.as_str(), p.model.as_str(), p.kind)) {
            return Err(ConfigError::from(format!(
                "placements[{i}]: ({}, {}, {:?}) is duplicated",
                p.site_id, p.model, p.kind
            )));
        }
        if let Some(b) = &p.hold_budget {
            match parse_go_duration(b) {
                Some(d) if !d.is_zero() && d <= MAX_HOLD_BUDGET => {
                    budgets.insert(i, d);
                }
                _ => {
                    return Err(ConfigError::from(format!(
                        "placements[{i}].hold_budget {b:?} must be a duration in (0, 1h]"
                    )))
                }
            }
        }
        by_model
            .entry((p.model.clone(), p.kind))
            .or_default()
            .push(i);
    }
    Ok(SiteMap {
        dto,
        hints_at,
        by_site,
        by_model,
        budgets,
    })
}

/// The version rule (as the key registry): accepted when `next` is at or
/// after `current` ([`crate::logic::system::version`]; equal: a replay).
pub fn version_ok(current: Option<&str>, next: &str) -> bool {
    crate::logic::system::version::at_or_after(current, next)
}

/// A placement of the map.
#[derive(Debug, Clone, Copy)]
pub struct PlacementView<'a> {
    /// Its site.
    pub site: &'a Site,
    /// The placement.
    pub placement: &'a Placement,
    /// Its hold budget, when set.
    pub hold_budget: Option<std::time::Duration>,
}

impl SiteMap {
    /// The site `id`.
    pub fn site(&self, id: &str) -> Option<&Site> {
        self.by_site.get(id).and_then(|i| self.dto.sites.get(*i))
    }

    /// Placements of (model, kind), in push order.
    pub fn placements(&self, model: &str, kind: Kind) -> impl Iterator<Item = PlacementView<'_>> {
        self.by_model
            .get(&(model.to_string(), kind))
            .into_iter()
            .flatten()
            .filter_map(|i| {
                let p = self.dto.placements.get(*i)?;
                Some(PlacementView {
                    site: self.site(&p.site_id)?,
                    placement: p,
                    hold_budget: self.budgets.get(i).copied(),
                })
            })
    }

    /// Whether the hints are fresh at `now_unix` (`max_age` seconds).
    pub fn fresh(&self, now_unix: u64, max_age_secs: u64) -> bool {
        self.hints_at
            .is_some_and(|t| now_unix.saturating_sub(t) <= max_age_secs)
    }

    /// Age of the hints in seconds (`None`: no hints).
    pub fn hints_age(&self, now_unix: u64) -> Option<u64> {
        self.hints_at.map(|t| now_unix.saturating_sub(t))
    }

    /// Models placed here with `scale_from_zero` (their demand series).
    pub fn holdable_here(&self, local: &str) -> Vec<(String, Kind)> {
        let mut v: Vec<(String, Kind)> = self
            .dto
            .placements
            .iter()
            .filter(|p| p.site_id == local && p.scale_from_zero)
            .map(|p| (p.model.clone(), p.kind))
            .collect();
        v.sort();
        v.dedup();
        v
    }
}

// === redirect ===

/// Rendezvous score of `site` for (identity, model).
pub fn score(identity: &str, model: &str, site: &str) -> u64 {
    let mut buf = Vec::with_capacity(identity.len() + model.len() + site.len() + 2);
    buf.extend_from_slice(identity.as_bytes());
    buf.push(0);
    buf.extend_from_slice(model.as_bytes());
    buf.push(0);
    buf.extend_from_slice(site.as_bytes());
    xxhash_rust::xxh64::xxh64(&buf, 0)
}

/// How many sites a caller's home set holds.
pub const HOME_SET: usize = 2;

/// The home set: the [`HOME_SET`] candidates with the highest score
/// (ties by site id), best first.
pub fn home_set<'a>(identity: &str, model: &str, candidates: &[&'a str]) -> Vec<&'a str> {
    let mut scored: Vec<(u64, &str)> = candidates
        .iter()
        .map(|s| (score(identity, model, s), *s))
        .collect();
    scored.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    scored.into_iter().take(HOME_SET).map(|(_, s)| s).collect()
}

/// What a request for a model not served here should do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// 307 to this site.
    Redirect(String),
    /// Stay: fresh hints say every home-set sibling is cold and the model
    /// may be held here.
    HoldHere,
    /// Stay: no sibling to send it to (fails as before, or is held).
    Stay,
}

/// The facts of one redirect decision.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// Caller identity (SHA-256 hex of the bearer token, or `anonymous`).
    pub identity: &'a str,
    /// The model.
    pub model: &'a str,
    /// Its kind.
    pub kind: Kind,
    /// This router's site.
    pub local: &'a str,
    /// The key's scopes (`None`: every site is in scope).
    pub scopes: Option<&'a [String]>,
    /// The site that redirected here (`hn_from`), never sent back to.
    pub from: Option<&'a str>,
    /// Whether the hints are fresh now.
    pub fresh: bool,
}

fn in_scope(site: &Site, scopes: Option<&[String]>) -> bool {
    scopes.is_none_or(|want| site.scopes.iter().any(|s| want.contains(s)))
}

/// Where to send a request whose model has no healthy agent here
/// (spec 07 §5.2).
pub fn choose(map: &SiteMap, a: Ask<'_>) -> Choice {
    let mut local_holdable = false;
    let mut candidates: Vec<&str> = Vec::new();
    let mut warm: HashMap<&str, Option<bool>> = HashMap::new();
    for v in map.placements(a.model, a.kind) {
        if v.site.site_id == a.local {
            local_holdable = v.placement.scale_from_zero;
            candidates.push(&v.site.site_id);
            continue;
        }
        if !in_scope(v.site, a.scopes) {
            continue;
        }
        candidates.push(&v.site.site_id);
        warm.insert(&v.site.site_id, v.placement.warm);
    }
    let home = home_set(a.identity, a.model, &candidates);
    let siblings: Vec<&str> = home.iter().copied().filter(|s| *s != a.local).collect();
    let is = |s: &str, want: bool| a.fresh && warm.get(s).copied().flatten() == Some(want);
    if a.fresh && local_holdable && !siblings.is_empty() && siblings.iter().all(|s| is(s, false)) {
        return Choice::HoldHere;
    }
    let sendable: Vec<&str> = siblings
        .iter()
        .copied()
        .filter(|s| Some(*s) != a.from)
        .collect();
    let pick = sendable
        .iter()
        .find(|s| is(s, true))
        .or(sendable.first())
        .copied()
        .or_else(|| {
            // Warm siblings outside the home set, best score first.
            let mut rest: Vec<&str> = candidates
                .iter()
                .copied()
                .filter(|s| *s != a.local && !home.contains(s) && Some(*s) != a.from)
                .filter(|s| is(s, true))
                .collect();
            rest.sort_by(|x, y| {
                score(a.identity, a.model, y)
                    .cmp(&score(a.identity, a.model, x))
                    .then(x.cmp(y))
            });
            rest.first().copied()
        });
    match pick {
        Some(s) => Choice::Redirect(s.to_string()),
        None => Choice::Stay,
    }
}

/// Most redirects a request may take.
pub const MAX_REDIRECTS: u32 = 2;

/// `hn_redirects` and `hn_from` of a query string (invalid count: 0).
pub fn redirect_params(query: &str) -> (u32, Option<&str>) {
    let mut count = 0;
    let mut from = None;
    for pair in query.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "hn_redirects" => count = v.parse::<u32>().ok().filter(|n| *n <= 2).unwrap_or(0),
            "hn_from" if !v.is_empty() => from = Some(v),
            _ => {}
        }
    }
    (count, from)
}

/// `path?query` without its `hn_*` parameters (what agents receive).
pub fn strip_hn(target: &str) -> std::borrow::Cow<'_, str> {
    let Some((path, query)) = target.split_once('?') else {
        return target.into();
    };
    if !query.split('&').any(|p| p.starts_with("hn_")) {
        return target.into();
    }
    let kept: Vec<&str> = query
        .split('&')
        .filter(|p| !p.starts_with("hn_") && !p.is_empty())
        .collect();
    if kept.is_empty() {
        path.to_string().into()
    } else {
        format!("{path}?{}", kept.join("&")).into()
    }
}

/// The `Location` of a redirect: the target's base URL, the original
/// path and query (without `hn_*`), then the new count and our site.
pub fn location(base_url: &str, target: &str, count: u32, local: &str) -> String {
    let kept = strip_hn(target);
    let sep = if kept.contains('?') { '&' } else { '?' };
    format!(
        "{}{}{sep}hn_redirects={count}&hn_from={}",
        base_url.trim_end_matches('/'),
        url_safe(&kept),
        url_safe(local)
    )
}

pub mod hold;
pub mod serving;

#[cfg(test)]
mod tests;
