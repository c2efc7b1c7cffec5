//! One forward of a request to an agent: the bytes the agent receives
//! ([`build_request`]), the attempt under the request deadline with its
//! relay ([`attempt`]), and its counting ([`record_attempt`]: the latency
//! sample, the agent's counters, the model's routing counters).

use std::rc::Rc;

use tracing::{debug, warn};

use super::exchange::{self, Progress, RelayEnd};
use crate::logic::http::api::usage::Tokens;
use crate::logic::http::errors::{self, ApiError};
use crate::logic::http::framing::http_write::{self, OutFraming};
use crate::logic::link::control::AGENT_FULL_HEADER;
use crate::logic::routing::decision::AttemptEnd;
use crate::logic::routing::failure::{Failure, Side, Stage};
use crate::runtime::state::model::admission::Reservation;
use crate::runtime::state::model::agent::{Agent, Slot};
use crate::runtime::state::model::stats::ModelStats;
use crate::runtime::state::pending::PendingRequest;
use crate::runtime::state::scope::Client;
use crate::runtime::state::shard::Shard;
use crate::runtime::wire::clock;

/// Client headers never forwarded to agents (credentials stay at the router).
fn forwardable(name: &str) -> bool {
    !(name.eq_ignore_ascii_case("authorization")
        || name.eq_ignore_ascii_case("cookie")
        || name.eq_ignore_ascii_case("x-api-key")
        || name.eq_ignore_ascii_case("x-request-id"))
}

/// The request as the agent receives it: the client's headers minus
/// credentials, our `X-Request-ID` and `traceparent` (the client's
/// `tracestate` only with the client's valid `traceparent`), the body
/// unchanged.
pub fn build_request(p: &PendingRequest) -> crate::runtime::wire::bufpool::Pooled {
    build_request_with(p, &p.body)
}

/// [`build_request`] with another body (a continuation's).
pub fn build_request_with(
    p: &PendingRequest,
    body: &[u8],
) -> crate::runtime::wire::bufpool::Pooled {
    let keep_state = p.trace.keep_state;
    let headers = p
        .head
        .headers
        .iter()
        .filter(|(n, _)| forwardable(n))
        .filter(|(n, _)| {
            !(n.eq_ignore_ascii_case("traceparent")
                || (!keep_state && n.eq_ignore_ascii_case("tracestate")))
        })
        .chain([
            ("X-Request-ID", p.request_id.as_bytes()),
            ("traceparent", &p.trace.header[..]),
        ]);
    // Back to the pool when the request is done (retries resend it).
    let mut out = crate::runtime::wire::bufpool::Pooled::with_capacity(512 + body.len());
    // `hn_*` redirect parameters stay at the router.
    http_write::write_request_head_from(
        &mut out,
        &p.head.method,
        &crate::logic::sites::strip_hn(&p.head.path),
        "agent",
        headers,
        OutFraming::Length(body.len()),
    );
    out.extend_from_slice(body);
    out
}

/// How one forward ended, before it is counted.
pub enum Outcome {
    /// The response reached the client with this status.
    Served { status: u16, tokens: Option<Tokens> },
    /// The client left while the response was relayed.
    ClientGone,
    /// The exchange failed.
    Failed(Failure),
    /// The agent's event stream broke after its head; the client's stream
    /// is still open and was told nothing (a continuation may follow).
    Broken(Failure),
    /// The agent serves several routers and was full (the others held
    /// its capacity): not a failure; another agent, or a wait.
    Full,
}

/// Most of a failing backend's body kept for the client.
const BACKEND_BODY_MAX: u64 = 64 * 1024;
/// Longest wait for it (the head is there; the body follows at once).
const BACKEND_BODY_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// What one attempt sends and is bound by.
pub struct Ask<'a> {
    /// The request bytes as the agent receives them.
    pub request: &'a [u8],
    /// The request's deadline.
    pub deadline: clock::Instant,
    /// The admission reservation an SSE stream trues up.
    pub held: Option<&'a Reservation>,
    /// Where the relayed event stream is kept for a continuation (`None`:
    /// a break cuts the client's stream at once).
    pub kept: Option<&'a mut Vec<u8>>,
    /// A continuation: the answer must be an event stream (anything else
    /// fails the try), spliced into the client's.
    pub splice: Option<&'a mut crate::logic::http::api::continuation::Splice>,
    /// A Responses turn (issue 52).
    pub turn: Option<&'a mut super::responses::Conversation>,
}

/// Take a slot, exchange with the agent under the request deadline, relay.
/// Returns the outcome and the latency sample (only for a request
/// written); a backend's 502-504 answer is left in `last_backend`.
pub async fn attempt(
    shard: &Shard,
    c: &mut Client,
    p: &PendingRequest,
    agent: &Rc<Agent>,
    ask: Ask<'_>,
    last_backend: &mut Option<ApiError>,
) -> (Outcome, Option<f64>) {
    let Ask {
        request,
        deadline,
        held,
        kept,
        splice,
        turn,
    } = ask;
    let _slot = Slot::take(agent.clone());
    let progress = Progress::default();
    // Restarted by the agent's progress reports (an answer not yet
    // started that its engine is working on).
    let exchange = exchange::until_head(
        deadline,
        shard.router.cfg.request_timeout,
        &progress,
        exchange::exchange_head(&agent.link, request, &progress),
    );
    let exchanged = if c.scope.keepalive.is_some() {
        // A released request keeps its keepalives until its response
        // starts (seed 2), through the agent's whole non-streamed answer
        // too; a client that leaves meanwhile drops the exchange (the
        // stream's reset stops the agent). Only held requests pay for
        // the watch.
        match c.unless_gone(exchange).await {
            Some(r) => r,
            None => return (Outcome::ClientGone, None),
        }
    } else {
        exchange.await
    };
    let head = match exchanged {
        Some(Ok(h)) => h,
        Some(Err((f, sample))) => return (Outcome::Failed(f), sample),
        None => {
            let (f, sample) = progress.deadline();
            return (Outcome::Failed(f), sample);
        }
    };
    let sample = Some(head.sample_ms);
    debug!(peer_id = %agent.reg.peer_id, status = head.head.status, sample_ms = head.sample_ms, "agent response head");
    if head.head.status == 503 && head.head.header(AGENT_FULL_HEADER).is_some() {
        agent_full(agent);
        return (Outcome::Full, None);
    }
    // Backend overloaded or unreachable behind this agent: retryable.
    if matches!(head.head.status, 502..=504) {
        let failed = backend_failed(shard, p, agent, head, deadline, last_backend).await;
        return (failed, sample);
    }
    if splice.is_some() && !(head.head.status == 200 && head.head.is_event_stream()) {
        // Nothing of it may reach the client's event stream.
        let why = format!(
            "the continuation was answered {} without an event stream",
            head.head.status
        );
        return (
            Outcome::Failed(Failure::new(Side::Backend, Stage::AwaitingHead, why)),
            sample,
        );
    }
    let up = exchange::Upstream {
        conn: head.upstream,
        idle: shard.router.cfg.stream_idle_timeout,
        cut: agent.cuts.watch(),
        held,
        link: &agent.link,
        kept,
        splice,
        turn,
    };
    let relayed = exchange::relay(c, up, &head.head, p.head.keep_alive).await;
    (relay_outcome(head.head.status, relayed), sample)
}

/// The agent answered full: other routers hold its capacity, so it looks
/// full here until its next load report (this slot is released on return).
fn agent_full(agent: &Agent) {
    let own = agent.active.get().saturating_sub(1);
    let others = agent.reg.capacity.saturating_sub(own);
    agent.others.set(agent.others.get().max(others));
    agent.full_refusals.set(agent.full_refusals.get() + 1);
}

/// A backend's 502-504 behind the agent: counted, and its body (bounded,
/// briefly, never past the request's deadline) kept in `last_backend`:
/// what the client gets if every try ends like this (issue 28 #8).
async fn backend_failed(
    shard: &Shard,
    p: &PendingRequest,
    agent: &Agent,
    head: exchange::Head,
    deadline: clock::Instant,
    last_backend: &mut Option<ApiError>,
) -> Outcome {
    let status = head.head.status;
    if status == 503 {
        agent.rejected.set(agent.rejected.get() + 1);
    }
    with_stats(shard, p.meta.model.as_str(), |s| {
        *s.backend_errors.entry(status).or_default() += 1;
    });
    let mut up = head.upstream;
    let wait = BACKEND_BODY_WAIT.min(deadline.saturating_duration_since(clock::now()));
    let body = monoio::time::timeout(wait, up.read_body(head.head.framing, BACKEND_BODY_MAX)).await;
    let body = match body {
        Ok(Ok(b)) => b,
        _ => Vec::new(),
    };
    *last_backend = Some(errors::backend_exhausted(status, &body));
    let why = format!("backend answered {status}");
    Outcome::Failed(Failure::new(Side::Backend, Stage::AwaitingHead, why))
}

/// How a relay of an answer with `status` ended, as an attempt's outcome.
fn relay_outcome(status: u16, relayed: RelayEnd) -> Outcome {
    match relayed {
        RelayEnd::Done(tokens) => Outcome::Served { status, tokens },
        RelayEnd::ClientGone => Outcome::ClientGone,
        RelayEnd::UpstreamFailed(why) => {
            Outcome::Failed(Failure::new(Side::Agent, Stage::Relaying, why))
        }
        RelayEnd::Broken(why) => Outcome::Broken(Failure::new(Side::Agent, Stage::Relaying, why)),
        // Nothing reached the client: tried again like an answer whose
        // head never came (the client gets one whole answer or an error).
        RelayEnd::FailedUnsent(why) => Outcome::Failed(Failure::new(
            Side::Agent,
            Stage::AwaitingHead,
            format!("{why} (before any of the body reached the client)"),
        )),
    }
}

/// Count one attempt (the one place that does): the latency sample, the
/// agent's counters, the model's routing counters and duration histogram.
#[allow(clippy::too_many_arguments)]
pub fn record_attempt(
    shard: &Shard,
    model: &str,
    agent: &Agent,
    step: usize,
    p: &PendingRequest,
    tenant: std::sync::Arc<str>,
    outcome: Outcome,
    sample: Option<f64>,
) -> AttemptEnd {
    // Applied on this (the model's) shard before the next routing decision.
    if let Some(ms) = sample {
        agent.observe(ms);
    }
    let labels = || {
        (
            agent.labels.0.clone(),
            agent.labels.1.clone(),
            tenant.clone(),
        )
    };
    match outcome {
        Outcome::Served { status, tokens } => {
            if status == 429 {
                agent.rejected.set(agent.rejected.get() + 1);
            }
            // Client-visible duration, at the real end of the response.
            let secs = p.received_at.elapsed().as_secs_f64();
            let ok = status < 400;
            // A client's own error relayed from the backend (4xx: a prompt
            // over the context, a bad field) is not the agent's: only 5xx,
            // transport failures and timeouts count against it (and its
            // consecutive_failures / success_rate gates).
            if status < 500 {
                agent.succeed();
            } else {
                agent.fail();
            }
            if let Some(t) = tokens {
                agent.add_tokens(t);
            }
            with_stats(shard, model, |s| {
                s.observe_duration(agent.id, &agent.reg.peer_id, status, tenant.clone(), secs);
                if !ok {
                    *s.failed.entry(labels()).or_default() += 1;
                } else {
                    *s.routed.entry(labels()).or_default() += 1;
                    if step == 0 {
                        s.primary_routed += 1;
                    } else {
                        s.fallback_routed += 1;
                    }
                }
            });
            AttemptEnd::Responded
        }
        Outcome::ClientGone => AttemptEnd::Responded,
        Outcome::Full => AttemptEnd::Full,
        Outcome::Failed(f) | Outcome::Broken(f) => {
            agent.fail();
            // The transport's failures (not a backend's 502-504 answer).
            let reset = match (f.side, f.stage) {
                (Side::Backend, _) => None,
                (Side::Router, _) => Some("deadline"),
                (_, Stage::Relaying) => Some("stream_cut"),
                _ => Some("forward_failure"),
            };
            with_stats(shard, model, |s| {
                *s.failed.entry(labels()).or_default() += 1;
                if let Some(r) = reset {
                    *s.connection_resets.entry(r).or_default() += 1;
                }
            });
            if let Some(n) = agent.request_line(clock::now()) {
                warn!(peer_id = %agent.reg.peer_id, failures = n, "forward to agent failed: {f} ({n} failure(s) of this agent since the previous line)");
            }
            AttemptEnd::Failed(f)
        }
    }
}

fn with_stats(shard: &Shard, model: &str, f: impl FnOnce(&mut ModelStats)) {
    if let Some(m) = shard.model(model) {
        let m = &mut *m.borrow_mut();
        f(&mut m.stats);
    }
}
