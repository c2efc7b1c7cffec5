//! Counting a refusal, the one place that does: quota refusals and
//! admission gates per reason and on the tenant, a refusal on its class,
//! an exhausted policy on the model (and logged at most once a second).

use std::time::Duration;

use tracing::warn;

use crate::logic::http::errors::ErrorCode;
use crate::logic::routing::decision::{Decision, Rejection};
use crate::logic::routing::refusal::{QuotaLimit, Refusal};
use crate::logic::routing::wait_queue::Class;
use crate::runtime::state::model::ModelState;
use crate::runtime::state::tenancy::Principal;
use crate::runtime::wire::clock;

/// Count `r`, the refusal that ends the request `d` of `principal` in
/// `class` on model `m`.
pub fn record(
    m: &mut ModelState,
    model: &str,
    d: &Decision,
    r: &Refusal,
    principal: &Principal,
    class: Class,
) {
    if !matches!(r, Refusal::Routing(Rejection::ClientGone)) {
        m.stats.classes.refuse(class);
    }
    let (limited, tokens) = match r {
        Refusal::Routing(rejection) => {
            return record_rejection(m, model, d, *rejection, principal.tenant_arc())
        }
        Refusal::HoldNoRoom { .. } => return,
        Refusal::Quota(q) => (
            q.limit == QuotaLimit::Requests,
            q.limit == QuotaLimit::Tokens,
        ),
        Refusal::Admission { error, .. } => (error.code == ErrorCode::RateLimitExceeded, false),
    };
    let s = &mut m.stats;
    if !tokens {
        *s.admission_rejections.entry(r.reason()).or_default() += 1;
    }
    let (tenant, key) = principal.names();
    if let Some(t) = s.tenant(tenant, key) {
        t.rate_limited += u64::from(limited);
        t.token_limited += u64::from(tokens);
    }
}

/// Count a rejection and log it (an exhausted policy at most once a
/// second per model, with the count it stands for).
fn record_rejection(
    m: &mut ModelState,
    model: &str,
    d: &Decision,
    r: Rejection,
    tenant: std::sync::Arc<str>,
) {
    if !r.exhausted_policy() {
        return;
    }
    m.stats.exhausted += 1;
    if r != Rejection::QueueTimeout {
        *m.stats
            .failed
            .entry(("".into(), "".into(), tenant))
            .or_default() += 1;
    }
    if let Some(n) = m.shed_log.hit(clock::now(), Duration::from_secs(1)) {
        warn!(
            model,
            capability = d.request().endpoint.capability().as_str(),
            rejected = n,
            code = r.error().code.as_str(),
            "policy_exhausted: {} (this line stands for {n} rejections since the previous one)",
            d.trail()
        );
    }
}
