//! Stream continuation (issue 33), the shell: when an agent's event
//! stream breaks mid-answer, the rest is asked of another agent of the
//! model and spliced into the client's stream, which never saw the break.
//! The pure parts (eligibility, the engines' prefill, the transcript, the
//! continuation body, the splice) are in [`crate::logic::http::continuation`].
//!
//! Cost on the request path: a streamed chat or messages request keeps a
//! copy of the events it relayed (a pooled buffer, one copy per event);
//! nothing is parsed unless the stream breaks.

use std::rc::Rc;

use tracing::{info, warn};

use super::exchange;
use super::forward::{attempt, build_request_with, Ask, Outcome};
use crate::logic::http::continuation::{self, Api, Prefill, Splice, Transcript};
use crate::logic::http::endpoint::Endpoint;
use crate::logic::http::http_write;
use crate::logic::routing::failure::Failure;
use crate::logic::routing::policy::{self, StepPick};
use crate::logic::routing::wait_queue::Prefer;
use crate::runtime::state::model::admission::Reservation;
use crate::runtime::state::model::agent::Agent;
use crate::runtime::state::model::{wake_head, Waiter};
use crate::runtime::state::pending::PendingRequest;
use crate::runtime::state::scope::Client;
use crate::runtime::state::shard::Shard;
use crate::runtime::wire::clock;

/// The API of a request whose stream may be continued (`None`: it never
/// is, and nothing is kept): streamed chat or messages, with
/// `--stream-migrations` above 0.
pub fn api_of(shard: &Shard, p: &PendingRequest) -> Option<Api> {
    if shard.router.cfg.stream_migrations == 0 || !p.meta.stream {
        return None;
    }
    match p.endpoint {
        Endpoint::ChatCompletions => Some(Api::OpenAi),
        Endpoint::Messages => Some(Api::Anthropic),
        _ => None,
    }
}

/// A stream that broke mid-answer.
pub struct Broken<'a> {
    /// Its API.
    pub api: Api,
    /// The request as first sent (its body is the conversation).
    pub request: &'a [u8],
    /// What the client received of the answer.
    pub kept: Vec<u8>,
    /// The agent whose stream broke.
    pub first: Rc<Agent>,
    /// Why it broke.
    pub why: Failure,
    /// The request's deadline (continuations stay within it).
    pub deadline: clock::Instant,
    /// The admission reservation the answer trues up.
    pub held: Option<&'a Reservation>,
}

/// What became of a broken stream.
pub struct Continued {
    /// Each continuation try: its agent, outcome and latency sample, to be
    /// counted like any attempt (the last one served, when one did).
    pub tries: Vec<(Rc<Agent>, Outcome, Option<f64>)>,
    /// The `outcome` label of `hivenet_stream_migrations_total`.
    pub label: &'static str,
    /// The client's stream ended well (continued, or already whole).
    pub whole: bool,
}

/// The body of a request's bytes (after its head).
fn body_of(request: &[u8]) -> &[u8] {
    request
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .and_then(|i| request.get(i + 4..))
        .unwrap_or(&[])
}

/// Continue `b` on other agents of the model, at most
/// `--stream-migrations` times within the request's deadline; cut the
/// client's stream as before when none can.
pub async fn continue_stream(
    shard: &Shard,
    c: &mut Client,
    p: &PendingRequest,
    b: Broken<'_>,
) -> Continued {
    let Broken {
        api,
        request,
        kept,
        first,
        why,
        deadline,
        held,
    } = b;
    let mut t = Transcript::default();
    t.feed(api, &kept);
    let mut done = Continued {
        tries: Vec::new(),
        label: "failed",
        whole: false,
    };
    if t.done {
        // The answer was whole; only its framing's end was lost.
        let _ = c.write_all(http_write::LAST_CHUNK.to_vec()).await;
        done.label = "finished";
        done.whole = true;
        return done;
    }
    let body = body_of(request);
    let refused = continuation::eligible(api, body)
        .err()
        .or(t.not_text.then_some(continuation::Refusal::NotText));
    if let Some(r) = refused {
        done.label = r.label();
        exchange::cut_stream(c, &why.to_string()).await;
        return done;
    }
    let mut tried = vec![first.id];
    let mut last_why = why.to_string();
    // The head is out: every continuation's body is relayed as chunks.
    c.scope.committed = true;
    for _ in 0..shard.router.cfg.stream_migrations {
        if clock::now() >= deadline {
            done.label = "deadline";
            break;
        }
        let (agent, prefill) =
            match pick_or_wait(shard, p.meta.model.as_str(), &tried, deadline).await {
                Ok(a) => a,
                Err(label) => {
                    done.label = label;
                    break;
                }
            };
        tried.push(agent.id);
        let Ok(next) =
            continuation::continuation_body(api, body, prefill, t.prefill(), t.produced())
        else {
            done.label = "malformed";
            break;
        };
        let next = build_request_with(p, &next);
        let mut splice = Splice::new(api, &t, prefill);
        let mut kept = crate::runtime::wire::bufpool::take(16 * 1024);
        let ask = Ask {
            request: &next,
            deadline,
            held,
            kept: Some(&mut kept),
            splice: Some(&mut splice),
        };
        let mut unused = None;
        let (outcome, sample) = attempt(shard, c, p, &agent, ask, &mut unused).await;
        let peer = agent.peer.clone();
        match &outcome {
            Outcome::Served { .. } => {
                info!(model = %p.meta.model, from = %first.peer, to = %peer, delivered_tokens = t.deltas, "stream continued on another agent");
                done.label = "continued";
                done.whole = true;
            }
            Outcome::Broken(f) => {
                // This one broke too: what it delivered is part of the
                // text the next one continues.
                t.feed(api, &kept);
                last_why = f.to_string();
            }
            Outcome::Failed(f) => last_why = f.to_string(),
            Outcome::Full => last_why = "the agent was full".into(),
            Outcome::ClientGone => {}
        }
        crate::runtime::wire::bufpool::give(kept);
        let stop = !matches!(
            outcome,
            Outcome::Broken(_) | Outcome::Failed(_) | Outcome::Full
        );
        // A try that broke is counted as a failure like any other.
        let outcome = match outcome {
            Outcome::Broken(f) => Outcome::Failed(f),
            o => o,
        };
        done.tries.push((agent, outcome, sample));
        if stop {
            return done;
        }
    }
    warn!(model = %p.meta.model, peer_id = %first.peer, outcome = done.label, "stream broke and could not be continued: {last_why}");
    exchange::cut_stream(c, &last_why).await;
    done
}

/// Where a continuation can go now.
enum Pick {
    /// This agent has a free slot; how its engine continues.
    Agent(Rc<Agent>, Prefill),
    /// Agents that could continue exist, all at capacity.
    Full,
    /// None could.
    Nothing,
}

/// The agent to continue on: the policy's first step that has a free one
/// (its gates as for any request), never one already tried, and only an
/// engine that can continue an assistant message.
fn pick(shard: &Shard, model: &str, tried: &[u64]) -> Pick {
    let policy = shard.policy(model);
    let models = shard.models.borrow();
    let Some(m) = models.get(model) else {
        return Pick::Nothing;
    };
    let get = |i: usize| {
        m.agents
            .get(i)
            .filter(|a| continuation::prefill_for(&a.reg.engine).is_some())
            .map(|a| a.facts())
    };
    let mut full = false;
    for step in &policy.steps {
        let cap = crate::logic::link::control::Capability::Llm;
        match policy::select(step, cap, m.agents.len(), get, tried, m.rotation) {
            StepPick::Agent(i) => {
                let a = m.agents.get(i);
                if let Some((a, prefill)) =
                    a.and_then(|a| Some((a, continuation::prefill_for(&a.reg.engine)?)))
                {
                    return Pick::Agent(a.clone(), prefill);
                }
            }
            StepPick::Full(_) => full = true,
            StepPick::Empty(_) => {}
        }
    }
    if full {
        Pick::Full
    } else {
        Pick::Nothing
    }
}

/// A free agent to continue on, waiting for a slot when every one that
/// could is busy: at the head of the model's capacity queue (the answer
/// was admitted already; it goes before requests not yet begun), never
/// past the request's deadline. `Err`: the outcome label.
async fn pick_or_wait(
    shard: &Shard,
    model: &str,
    tried: &[u64],
    deadline: clock::Instant,
) -> Result<(Rc<Agent>, Prefill), &'static str> {
    loop {
        match pick(shard, model, tried) {
            Pick::Agent(a, prefill) => return Ok((a, prefill)),
            Pick::Nothing => return Err("no_agent"),
            Pick::Full => {}
        }
        let queue = shard.models.borrow().get(model).map(|m| m.queue.clone());
        let Some(queue) = queue else {
            return Err("no_agent");
        };
        let (tx, rx) = futures::channel::oneshot::channel();
        let waiter = Waiter {
            tx,
            prefer: Prefer::default(),
            pinned: false,
            // Charged to no tenant: never held back for the others' headroom.
            tenant: 0,
        };
        let place = queue.borrow_mut().push_head(waiter);
        let left = deadline.saturating_duration_since(clock::now());
        match monoio::time::timeout(left, rx).await {
            Ok(Ok(_)) => {
                // Woken for a free slot; if another took it first, or a
                // gate keeps this one away, the next waiter is told.
                if let Pick::Agent(a, prefill) = pick(shard, model, tried) {
                    return Ok((a, prefill));
                }
                wake_head(&queue);
            }
            Ok(Err(_)) => {}
            Err(_) => {
                queue.borrow_mut().remove(place);
                return Err("deadline");
            }
        }
    }
}
