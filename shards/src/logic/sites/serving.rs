//! "Not served here", decided once (pure): whether an inference request
//! is served on this router, sent to a sibling site (307), held at zero
//! here, or not found. Ingress asks [`decide`] once per request, after the
//! key's allow-set and before any quota.
//!
//! The order (seed hold-at-zero, spec 07 §5): a model with a healthy agent
//! here is served here; otherwise a warm sibling of the key's home set
//! takes it (at most [`super::MAX_REDIRECTS`] hops, never back to the site
//! that sent it); otherwise a placement of this site with
//! `scale_from_zero` holds it for its budget; otherwise a model with
//! agents (all unhealthy) is left to its owner, which answers 503
//! `no_agents_available`, and an unknown one is 404 `model_not_found`.

use std::time::Duration;

use super::{choose, location, Ask, Choice, Kind, SiteMap, MAX_REDIRECTS};

/// What this router knows of the model's agents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalAgents {
    /// No agent of the model is registered here.
    None,
    /// Agents are registered; `healthy`: at least one of them is.
    Registered {
        /// At least one registered agent is healthy.
        healthy: bool,
    },
}

/// The sibling map's part of the facts (all of it absent without
/// `--site-id` or without a map).
#[derive(Debug, Clone, Copy)]
pub struct Sites<'a> {
    /// The map.
    pub map: &'a SiteMap,
    /// This router's site (`--site-id`).
    pub local: &'a str,
    /// Whether the map's hints are fresh now.
    pub fresh: bool,
}

/// The facts of one decision.
#[derive(Debug, Clone, Copy)]
pub struct Facts<'a> {
    /// The (resolved) model.
    pub model: &'a str,
    /// The endpoint's kind (`None`: `count_tokens`, never redirected nor
    /// held).
    pub kind: Option<Kind>,
    /// The model's agents here.
    pub agents: LocalAgents,
    /// The sibling map, when there is one and a site ID.
    pub sites: Option<Sites<'a>>,
    /// Caller identity for the home set (key ID, or `anonymous`).
    pub identity: &'a str,
    /// The key's site scopes (`None`: every site).
    pub scopes: Option<&'a [String]>,
    /// The request's path with its query (`hn_*` parameters read).
    pub path: &'a str,
    /// The hold budget when the placement names none
    /// (`--wake-hold-budget`).
    pub default_budget: Duration,
}

/// Where the request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Serving {
    /// Served by this router (on the model's owner shard).
    Here,
    /// 307 to a sibling site.
    Redirect {
        /// The sibling's site ID.
        site: String,
        /// The `Location`.
        location: String,
        /// The new redirect count.
        count: u32,
    },
    /// Held here for this budget until an agent registers.
    Hold(Duration),
    /// 404 `model_not_found`.
    NotFound,
}

/// The hold budget of `model` for `kind` when the map places it on
/// `local` with `scale_from_zero` (else `None`: not holdable here).
pub fn hold_budget(
    map: &SiteMap,
    model: &str,
    kind: Kind,
    local: &str,
    default_budget: Duration,
) -> Option<Duration> {
    let p = map
        .placements(model, kind)
        .find(|p| p.site.site_id == local && p.placement.scale_from_zero)?;
    Some(p.hold_budget.unwrap_or(default_budget))
}

/// Decide where the request of `f` goes (see the module doc).
pub fn decide(f: &Facts<'_>) -> Serving {
    if f.agents == (LocalAgents::Registered { healthy: true }) {
        return Serving::Here;
    }
    let fallback = match f.agents {
        LocalAgents::None => Serving::NotFound,
        LocalAgents::Registered { .. } => Serving::Here,
    };
    let (Some(s), Some(kind)) = (f.sites, f.kind) else {
        return fallback;
    };
    if let Some(r) = redirect(f, s, kind) {
        return r;
    }
    match hold_budget(s.map, f.model, kind, s.local, f.default_budget) {
        Some(budget) => Serving::Hold(budget),
        None => fallback,
    }
}

/// A sibling for the request, when the map names one it may go to.
fn redirect(f: &Facts<'_>, s: Sites<'_>, kind: Kind) -> Option<Serving> {
    let query = f.path.split_once('?').map_or("", |(_, q)| q);
    let (count, from) = super::redirect_params(query);
    if count >= MAX_REDIRECTS {
        return None;
    }
    let ask = Ask {
        identity: f.identity,
        model: f.model,
        kind,
        local: s.local,
        scopes: f.scopes,
        from,
        fresh: s.fresh,
    };
    match choose(s.map, ask) {
        Choice::Redirect(site) => {
            let base = &s.map.site(&site)?.base_url;
            let location = location(base, f.path, count + 1, s.local);
            Some(Serving::Redirect {
                site,
                location,
                count: count + 1,
            })
        }
        // Every home-set sibling is cold (or none is sendable): the hold
        // below takes it when this site may hold it.
        Choice::HoldHere | Choice::Stay => None,
    }
}
