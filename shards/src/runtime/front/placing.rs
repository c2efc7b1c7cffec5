//! Where a read request is served ([`serving`], once): here on the
//! model's owner shard, held at zero, redirected to a sibling site, sent
//! on to the fallback provider, or answered 404 ([`place`] carries it
//! out).

use crate::logic::http::endpoint::Endpoint;
use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::http::framing::http_parse::RequestHead;
use crate::logic::sites::serving::{self, LocalAgents, Serving};
use crate::logic::sites::Kind;
use crate::runtime::request::respond;
use crate::runtime::state::pending::PendingRequest;
use crate::runtime::state::scope::Client;
use crate::runtime::state::shard::Shard;
use crate::runtime::state::tenancy::Principal;
use crate::runtime::wire::clock;

/// What the connection does after a request.
pub(super) enum Next {
    /// Read the next request.
    KeepAlive,
    /// Close it.
    Close,
    /// Give it to the model's shard with this request.
    HandOff(Box<PendingRequest>, usize),
    /// Hold this request here, its model's hold shard (`hold_for` set).
    Hold(Box<PendingRequest>),
    /// The process replacing this one takes the connection (issue 54),
    /// with this held request and its state.
    Carry(
        Option<(
            Box<PendingRequest>,
            crate::logic::system::upgrade::CarriedHold,
        )>,
    ),
}

impl From<bool> for Next {
    /// A response was written; `keep`: the connection stays open.
    fn from(keep: bool) -> Self {
        if keep {
            Next::KeepAlive
        } else {
            Next::Close
        }
    }
}

/// A chat or messages request whose model's policy names a fallback
/// provider.
pub(super) fn provider_serves(shard: &Shard, ep: Endpoint, model: &str) -> bool {
    crate::runtime::request::provider::api_of(ep).is_some()
        && shard.policy(model).fallback_provider.is_some()
}

/// Carry out where [`serving`] sent the request: `Ok(None)` served here,
/// `Ok(Some(budget))` held, `Err` after a redirect or a 404.
pub(super) async fn place(
    shard: &Shard,
    c: &mut Client,
    serving: Serving,
    model: &str,
    keep: bool,
) -> Result<Option<std::time::Duration>, Next> {
    match serving {
        Serving::Here => Ok(None),
        Serving::Hold(budget) => Ok(Some(budget)),
        Serving::Redirect {
            site,
            location,
            count,
        } => {
            crate::runtime::request::spans::redirected(&mut c.scope, &site, &location);
            let done = respond::send_redirect(c, &location, count, &site, keep).await;
            *shard
                .redirects
                .borrow_mut()
                .entry((model.to_string(), site))
                .or_default() += 1;
            Err(done.into())
        }
        // Unknown model, or no agent registered now: answered here; no
        // directory entry, no metric series.
        Serving::NotFound => {
            let e = ApiError::new(
                ErrorCode::ModelNotFound,
                "No agents registered for this model",
            );
            Err(respond::send_error(c, &e, keep).await.into())
        }
    }
}

/// Where a request for `model` goes ([`serving::decide`], once):
/// `registered`: the directory has an owner for it. Its agents' health is
/// the owner shard's to know; ingress counts a registered model as
/// healthy, and the owner answers 503 when none is.
pub(super) fn serving(
    shard: &Shard,
    head: &RequestHead,
    ep: Endpoint,
    model: &str,
    principal: &Principal,
    agents: LocalAgents,
) -> Serving {
    let cfg = &shard.router.cfg;
    // A model with a healthy agent is served here before the map is read:
    // no map lookup on the common path.
    let healthy = agents == LocalAgents::Registered { healthy: true };
    let map = if healthy { None } else { shard.site_map() };
    let sites = match (cfg.site_id.as_deref(), map.as_deref()) {
        (Some(local), Some(map)) => Some(serving::Sites {
            map,
            local,
            fresh: map.fresh(clock::unix_secs(), cfg.sibling_hints_max_age.as_secs()),
        }),
        _ => None,
    };
    let (identity, scopes) = match principal {
        Principal::Key(c) => (
            &*c.key.key_id,
            Some(c.key.site_scopes.as_slice()).filter(|s| !s.is_empty()),
        ),
        _ => ("anonymous", None),
    };
    serving::decide(&serving::Facts {
        model,
        kind: Kind::of(ep),
        agents,
        sites,
        identity,
        scopes,
        path: &head.path,
        default_budget: cfg.wake_hold_budget,
    })
}
