//! Stream continuation (issue 33), the shell: when an agent's event
//! stream breaks mid-answer, the rest is asked of another agent of the
//! model and spliced into the client's stream, which never saw the break.
//! Which agent, and whether to wait for one, is the decision machine's
//! ([`crate::logic::routing::decision::Decision::stream_broke`]); this
//! room keeps the answer's transcript and carries out one try at a time
//! ([`Continuity::try_on`]). The pure parts (eligibility, the engines'
//! prefill, the transcript, the continuation body, the splice) are in
//! [`crate::logic::http::api::continuation`].
//!
//! Cost on the request path: a streamed chat or messages request keeps a
//! copy of the events it relayed (a pooled buffer, one copy per event);
//! nothing is parsed unless the stream breaks.

use std::rc::Rc;

use tracing::{info, warn};

use super::exchange;
use super::fairness::ClassRunning;
use super::forward::{attempt, build_request_with, Ask, Outcome};
use super::spans;
use crate::logic::http::api::continuation::{self, Api, Prefill, Splice, Transcript};
use crate::logic::http::endpoint::Endpoint;
use crate::logic::http::framing::http_write;
use crate::logic::routing::decision::AttemptEnd;
use crate::logic::routing::failure::Failure;
use crate::runtime::state::model::admission::Reservation;
use crate::runtime::state::model::agent::Agent;
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

/// An attempt not yet counted: its agent, policy step, outcome and
/// latency sample.
pub type Pending = (Rc<Agent>, usize, Outcome, Option<f64>);

/// What a break leaves.
pub enum Broke {
    /// The answer was whole; only its framing's end was lost (written).
    Whole,
    /// It cannot be continued (the client's stream is cut): the label.
    Cut(&'static str),
    /// It can: its transcript so far.
    Continuable(Transcript),
}

/// Read what the client received of a broken stream (`kept`), and say
/// whether it can be continued; a whole answer is ended, an answer that
/// cannot be continued is cut.
pub async fn broke(c: &mut Client, api: Api, request: &[u8], kept: &[u8], why: &Failure) -> Broke {
    let mut t = Transcript::default();
    t.feed(api, kept);
    if t.done {
        let _ = c.write_all(http_write::LAST_CHUNK.to_vec()).await;
        return Broke::Whole;
    }
    let refused = continuation::eligible(api, body_of(request))
        .err()
        .or(t.not_text.then_some(continuation::Refusal::NotText));
    if let Some(r) = refused {
        exchange::cut_stream(c, &why.to_string()).await;
        return Broke::Cut(r.label());
    }
    // The head is out: every continuation's body is relayed as chunks.
    c.scope.committed = true;
    Broke::Continuable(t)
}

/// A broken stream under continuation.
pub struct Continuity<'a> {
    shard: &'a Shard,
    p: &'a PendingRequest,
    api: Api,
    t: Transcript,
    /// The agent whose stream broke first (for the log).
    first: std::sync::Arc<str>,
    /// Why the last try failed (what a cut stream says).
    last_why: String,
    /// The last attempt, counted when the next one is made or the
    /// continuation ends.
    last: Option<Pending>,
    /// The `outcome` label so far.
    label: &'static str,
    /// The first forward's policy step: every try is counted in it.
    step: usize,
    /// The first forward's class count, kept across the continuation.
    _running: Option<ClassRunning>,
    /// Relayed by the process this one replaced (issue 54).
    resumed: bool,
}

impl<'a> Continuity<'a> {
    /// Continue `t` after the first agent's attempt `first` broke.
    pub fn new(
        shard: &'a Shard,
        p: &'a PendingRequest,
        api: Api,
        t: Transcript,
        first: Pending,
        why: &Failure,
        running: Option<ClassRunning>,
    ) -> Self {
        Continuity {
            shard,
            p,
            api,
            t,
            first: first.0.peer.clone(),
            step: first.1,
            last_why: why.to_string(),
            last: Some(first),
            label: "failed",
            _running: running,
            resumed: false,
        }
    }

    /// Continue `t`, a stream the process this one replaced relayed from
    /// agent `from` until its drain timeout (issue 54): no attempt here
    /// yet.
    pub fn resumed(
        shard: &'a Shard,
        p: &'a PendingRequest,
        api: Api,
        t: Transcript,
        from: &str,
    ) -> Self {
        Continuity {
            shard,
            p,
            api,
            t,
            first: std::sync::Arc::from(from),
            step: 0,
            resumed: true,
            last_why: "the router relaying it was replaced".into(),
            last: None,
            label: "failed",
            _running: None,
        }
    }

    /// This process is being replaced and its drain timeout passed: the
    /// stream goes to the new process with what its client received (its
    /// request's bytes from `request`, the agent's copy); the connection
    /// loop sends it. Its daily tokens are settled there, its attempts
    /// are not counted here.
    pub fn carry_over(self, c: &mut Client, request: &[u8]) {
        let daily = c.scope.ending.ticket.take().and_then(|t| t.reserved());
        let stream = crate::logic::system::upgrade::CarriedStream {
            request_id: c.scope.request_id.as_str().to_string(),
            model: self.p.meta.model.to_string(),
            daily,
            transcript: self.t,
            from: self.first.to_string(),
        };
        let bytes = self.p.wire_bytes(body_of(request));
        c.carry_stream = Some(Box::new((bytes, stream)));
    }

    /// One try on `agent` (the machine's [`Action::Continue`]). Returns
    /// how it ended for the machine, and the attempt it replaced as the
    /// last one (to be counted now, as failed: its agent is one the
    /// answer continued from).
    ///
    /// [`Action::Continue`]: crate::logic::routing::decision::Action::Continue
    pub async fn try_on(
        &mut self,
        c: &mut Client,
        request: &[u8],
        agent: Rc<Agent>,
        prefill: Prefill,
        deadline: clock::Instant,
        held: Option<&Reservation>,
    ) -> Option<(AttemptEnd, Option<Pending>)> {
        let (shard, p) = (self.shard, self.p);
        let t = &mut self.t;
        let Ok(next) = continuation::continuation_body(
            self.api,
            body_of(request),
            prefill,
            t.prefill(),
            t.produced(),
        ) else {
            return None;
        };
        let mut next = build_request_with(p, &next);
        spans::continuation_begins(c, &agent, &self.last_why, t.deltas, &mut next);
        let mut splice = Splice::new(self.api, t, prefill);
        let mut kept = crate::runtime::wire::bufpool::take(16 * 1024);
        let ask = Ask {
            request: &next,
            deadline,
            held,
            kept: Some(&mut kept),
            splice: Some(&mut splice),
            turn: None,
        };
        let (outcome, sample) = attempt(shard, c, p, &agent, ask, &mut None).await;
        spans::attempt_ended(c, &outcome, sample, None);
        let end = match &outcome {
            Outcome::Served { .. } if self.resumed => {
                info!(model = %p.meta.model, from = %self.first, to = %agent.peer, delivered_tokens = t.deltas, "a stream the replaced router relayed until its drain timeout continued here");
                self.label = "continued";
                AttemptEnd::Responded
            }
            Outcome::Served { .. } => {
                if let Some(n) = shard.peer_line(&self.first, "continued") {
                    info!(model = %p.meta.model, from = %self.first, to = %agent.peer, delivered_tokens = t.deltas, continued = n, "stream continued on another agent ({n} stream(s) of this agent continued since the previous line)");
                }
                self.label = "continued";
                AttemptEnd::Responded
            }
            Outcome::ClientGone => AttemptEnd::Responded,
            Outcome::Broken(f) | Outcome::Failed(f) => {
                // A try that broke: what it delivered is part of the text
                // the next one continues.
                if matches!(outcome, Outcome::Broken(_)) {
                    t.feed(self.api, &kept);
                }
                self.last_why = f.to_string();
                AttemptEnd::Failed(f.clone())
            }
            Outcome::Full => {
                self.last_why = "the agent was full".into();
                AttemptEnd::Full
            }
        };
        crate::runtime::wire::bufpool::give(kept);
        // A try that broke is counted as a failure like any other.
        let outcome = match outcome {
            Outcome::Broken(f) => Outcome::Failed(f),
            o => o,
        };
        let before = self.last.replace((agent, self.step, outcome, sample));
        Some((end, before))
    }

    /// The machine cut the stream (`label`): the client is told.
    pub async fn cut(&mut self, c: &mut Client, label: &'static str) {
        self.label = label;
        if let Some(n) = self.shard.peer_line(&self.first, "cut") {
            warn!(model = %self.p.meta.model, peer_id = %self.first, outcome = label, cut = n, "stream broke and could not be continued: {} ({n} stream(s) of this agent cut since the previous line)", self.last_why);
        }
        exchange::cut_stream(c, &self.last_why).await;
    }

    /// The continuation is over: its `outcome` label, its last attempt
    /// to be counted as the request's, and the class count to drop after.
    pub fn finish(mut self) -> (&'static str, Option<Pending>, Option<ClassRunning>) {
        (self.label, self.last.take(), self._running.take())
    }
}

/// The body of a request's bytes (after its head).
fn body_of(request: &[u8]) -> &[u8] {
    request
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .and_then(|i| request.get(i + 4..))
        .unwrap_or(&[])
}
