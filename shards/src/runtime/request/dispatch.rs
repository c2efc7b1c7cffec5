//! The driver of the decision machine on the model's shard: it asks
//! [`Decision::next`] what to do and carries the action out (take the
//! quota, admit, charge, forward over the agent's link, continue a broken
//! stream, wait in the capacity queue, call the fallback provider, write
//! the refusal), then tells the machine how it ended.
//!
//! The rule of this room: it stays a short loop. The machine is the only
//! decider (no selector and no wait loop here); a feature keeps its
//! bookkeeping in its own room ([`super::affinity`], [`super::fairness`],
//! [`super::continuation`], [`super::provider`]; `dispatch/refusals.rs`,
//! `dispatch/wait.rs`) and its counters and metric families in the
//! model's ([`crate::runtime::state::model::affinity`],
//! [`crate::runtime::state::model::fairness`],
//! [`crate::runtime::state::model::continuity`]), and is called at the
//! fixed hooks: facts for the decision (`Run::decide`), forwarded
//! (`Run::forward`), ended (`Run::settle`). A new feature adds a line
//! here, never a block.
//!
//! Entry point: [`serve_inference`].

mod entry;
mod refusals;
mod upgrade;
mod wait;

use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, warn};

use self::wait::Wait;
use super::affinity::{IndexView, RequestAffinity};
use super::continuation::{self, Broke, Continuity, Pending};
use super::fairness::{self, ClassRunning};
use super::forward::{attempt, record_attempt, Ask, Outcome};
use super::provider;
use super::respond;
use super::responses;
use super::spans;
use crate::logic::http::api::continuation::Prefill;
use crate::logic::http::api::usage::Tokens;
use crate::logic::http::errors::ApiError;
use crate::logic::routing::affinity::AffinitySource;
use crate::logic::routing::decision::{Action, CutReason, Decision, ModelFacts, Rejection};
use crate::logic::routing::policy::Policy;
use crate::logic::routing::refusal::Refusal;
use crate::logic::routing::wait_queue::{Class, Fair};
use crate::runtime::state::model::admission::Admitted;
use crate::runtime::state::model::agent::Agent;
use crate::runtime::state::model::{Claim, ModelRef, ModelState};
use crate::runtime::state::pending::{Held, PendingRequest};
use crate::runtime::state::scope::Client;
use crate::runtime::state::shard::{inc, Shard};
use crate::runtime::state::tenancy::Ticket;
use crate::runtime::wire::bufpool::{self, Pooled};
use crate::runtime::wire::clock;

/// Serve one inference request on its model's shard. Returns whether the
/// client connection stays open; how it ended is left in the client's
/// scope for [`super::ending::finish`].
pub async fn serve_inference(shard: &Rc<Shard>, c: &mut Client, mut p: PendingRequest) -> bool {
    c.scope.reply_headers = std::mem::take(&mut p.reply_headers);
    if let Some(h) = p.held.as_mut() {
        // Released by a wake: keepalives go on here without a longer gap.
        c.scope.keepalive = h.keepalive.take();
        c.scope.committed = h.committed;
    }
    c.scope.ending.dispatched = true;
    serve(shard, c, &mut p).await
}

/// One request's driver state on its model's shard: what the steps of
/// the decision machine read and leave (the quota ticket, the admission
/// reservation, the hold's pending demand), and each feature's part.
struct Run<'a> {
    shard: &'a Shard,
    p: &'a PendingRequest,
    /// Its model's name.
    model: &'a str,
    /// Its model, held from the run's start ([`Run::with_model`]).
    state: Option<ModelRef>,
    policy: Arc<Policy>,
    /// Chat or messages: the estimator learns from their usage.
    llm: bool,
    /// The request's input-token estimate (admission and the daily
    /// budget both read it).
    estimate: u64,
    /// The request bytes as the agent receives them.
    request: Pooled,
    /// Released from a hold: its pending demand and keepalive state.
    held: Option<Held>,
    /// The request quota taken, until it moves into the scope's ending.
    ticket: Option<Ticket>,
    /// The admission reservation: released when the run ends.
    admitted: Admitted,
    queue_depth: usize,
    /// The last backend 502-504 answer: what the client gets when the
    /// tries run out on such answers (issue 28 #8).
    last_backend: Option<ApiError>,
    /// Its priority class (the key's, or lower as its header asked).
    class: Class,
    /// Sent to an agent at least once (counted admitted once).
    sent: bool,
    /// How it waited in the capacity queue, if it did: its tenant's
    /// order is trued up with the real usage when it is served.
    fair: Option<Fair>,
    /// Its tenant, hashed (fair order, headroom).
    tenant: u64,
    /// The slot its last wake claimed for its tenant, until it starts.
    claim: Option<Claim>,
    /// Cache affinity: its keys and its last forward's pick.
    affinity: RequestAffinity<'a>,
    /// A broken stream under continuation.
    cont: Option<Continuity<'a>>,
    /// A Responses turn (issue 52).
    conv: Option<responses::Conversation>,
    /// A stream the process this one replaced carried over (issue 54).
    resumed: Option<Box<crate::logic::system::upgrade::CarriedStream>>,
}

/// The decision machine's loop: it says what comes next, the [`Run`]
/// carries it out and reports back.
async fn serve(shard: &Rc<Shard>, c: &mut Client, p: &mut PendingRequest) -> bool {
    inc(&shard.counters.requests);
    // A refusal before routing keeps the connection only when the client
    // asked for it (one that said `Connection: close` waited for the close).
    let keep = p.head.keep_alive;
    let conv = match responses::prepare(shard, p).await {
        Ok(conv) => conv,
        Err(e) => return respond::send_error(c, &e, keep).await,
    };
    let (mut run, mut d) = match Run::new(shard, p, conv) {
        Ok(r) => r,
        Err(e) => return respond::send_error(c, &e, keep).await,
    };
    let model = run.model;
    run.resume(c, &mut d);
    c.scope.ending.input_estimate = run.estimate;
    debug!(shard = shard.id, model, "serving request");
    loop {
        let done = match run.decide(&mut d) {
            (Action::TakeQuota, _) => {
                d.quota_taken(run.take_quota());
                None
            }
            (Action::Admit(park), _) => {
                let end = run.admit(c, park).await;
                d.admitted(end);
                None
            }
            (Action::ChargeDaily, _) => {
                let charged = run.charge_daily(c).await;
                d.daily_charged(charged, clock::now());
                None
            }
            (Action::Forward { step, waited, .. }, Some(agent)) => {
                run.forward(c, &mut d, agent, step, waited).await
            }
            (Action::Continue { prefill, .. }, Some(agent)) => {
                run.continue_on(c, &mut d, agent, prefill).await
            }
            (wait @ Action::Wait { .. }, _) => {
                run.wait(c, &mut d, wait).await;
                None
            }
            (Action::Cut(reason), _) => Some(run.cut(c, &mut d, reason).await),
            (Action::Provider, _) => Some(run.provider(c, &d).await),
            (Action::Reject(r), _) => Some(run.refuse(c, &d, r).await),
            // The pool changed under the decision (it cannot: one borrow).
            (Action::Forward { .. } | Action::Continue { .. }, None) => {
                Some(run.refuse(c, &d, Rejection::Exhausted.into()).await)
            }
        };
        if let Some(keep) = done {
            return keep;
        }
    }
}

// === impl Run ===

impl<'a> Run<'a> {
    /// The run's model: held from its start (`None`: no agent ever
    /// registered it here then; looked up again, as it is refused at its
    /// gate unless one came since).
    fn model_ref(&self) -> Option<ModelRef> {
        match &self.state {
            Some(m) => Some(m.clone()),
            None => self.shard.model(self.model),
        }
    }

    /// Run `f` on the run's model.
    fn with_model<R>(&self, f: impl FnOnce(&mut ModelState) -> R) -> Option<R> {
        match &self.state {
            Some(m) => Some(f(&mut m.borrow_mut())),
            None => self.shard.model(self.model).map(|m| f(&mut m.borrow_mut())),
        }
    }

    /// Facts hook: ask the machine with the model's current facts (one
    /// borrow), each feature adding its own; a forward moves the model's
    /// tie-break rotation on and tells the affinity room. Returns the
    /// action and, for a forward or a continuation, its agent.
    fn decide(&mut self, d: &mut Decision) -> (Action, Option<Rc<Agent>>) {
        let now = clock::now();
        let keys = self.affinity.keys;
        let asker = fairness::Asker {
            class: self.class,
            min_share: &self.policy.min_share,
            tenant: self.tenant,
            headroom: self.policy.tenant_headroom,
        };
        // The index is made on first use (prefix-aware policies only),
        // before the models are borrowed: making it reads them.
        let index = keys.map(|_| self.shard.affinity_index());
        let model = self.model_ref();
        let mut guard = model.as_ref().map(|m| m.borrow_mut());
        let Some(m) = guard.as_deref_mut() else {
            // No agent ever registered here: the gates answer 404.
            let none: &[Rc<Agent>] = &[];
            let facts = ModelFacts {
                pool: none,
                rotation: 0,
                queue_len: 0,
                affinity: None,
                reserved_for_others: false,
                headroom_for_others: false,
                miss: None,
            };
            return (d.next(&facts, now), None);
        };
        let (reserved, headroom) = fairness::held_back(m, asker);
        let action = {
            let view = match (keys, index.as_deref()) {
                (Some(k), Some(ix)) => Some(IndexView::new(ix, k, clock::unix_secs() as u32)),
                _ => None,
            };
            let facts = ModelFacts {
                pool: &m.agents[..],
                rotation: m.rotation,
                queue_len: m.queue.borrow().len(),
                affinity: view.as_ref().map(|v| v as &dyn AffinitySource),
                reserved_for_others: reserved,
                headroom_for_others: headroom,
                // Prefix-aware policies only (a few flops).
                miss: keys.and_then(|_| {
                    let per_byte = m.admission.borrow().tokens_per_byte;
                    m.miss_cost.get().learned(per_byte)
                }),
            };
            d.next(&facts, now)
        };
        // The affinity room records into the index below.
        drop(index);
        let agent = match &action {
            Action::Forward { agent, .. } | Action::Continue { agent, .. } => {
                m.agents.get(*agent).cloned()
            }
            _ => None,
        };
        // The tie rotation moves on once per forward, never on a wait or a
        // refusal: a request that timed out must not move it twice and send
        // the next one back to the same (hung) agent (issue 29 #10).
        if let (Action::Forward { affinity, .. }, Some(a)) = (&action, &agent) {
            m.rotation = m.rotation.wrapping_add(1);
            self.affinity.forwarded(self.shard, m, a, *affinity);
        }
        (action, agent)
    }

    /// The machine's [`Action::Wait`], through the one capacity wait.
    async fn wait(&mut self, c: &mut Client, d: &mut Decision, a: Action) {
        let Action::Wait {
            until,
            place,
            wake_first,
            prefer,
            pinned,
            head,
            pass_on,
        } = a
        else {
            return;
        };
        let fair = self.fair_of();
        if !head {
            self.fair = Some(fair);
        }
        let w = Wait {
            until,
            place,
            depth: self.queue_depth,
            wake_first,
            prefer,
            pinned,
            head,
            pass_on,
            fair,
        };
        // A slot claimed by an earlier wake and lost to another request is
        // given back before waiting again.
        self.claim = None;
        let queue = self.with_model(|m| m.queue.clone());
        self.claim = wait::wait_for_capacity(c, self.model, queue, d, w).await;
    }

    /// Forwarded hook: one forward to `agent`, counted and reported to
    /// the machine; `Some(keep)` when the request is finished. A stream
    /// that breaks mid-answer and can be continued is left to the machine.
    async fn forward(
        &mut self,
        c: &mut Client,
        d: &mut Decision,
        agent: Rc<Agent>,
        step: usize,
        waited: Option<Duration>,
    ) -> Option<bool> {
        let (shard, p, class) = (self.shard, self.p, self.class);
        let claimed = self.claim.take().map(Claim::started).is_some();
        if let Some(w) = waited {
            self.with_model(|m| fairness::waited(m, class, &p.principal, w));
        }
        let (who, first) = (self.fair_of(), !self.sent);
        let running = self
            .model_ref()
            .map(|m| ClassRunning::start(&m, who, claimed, first));
        self.sent = true;
        // A slot on an agent: a released request leaves the pending demand.
        if let Some(h) = self.held.as_mut() {
            h.demand.leave();
        }
        // A stream that may be continued keeps what it relayed.
        let api = continuation::api_of(shard, p);
        let mut kept = api.map(|_| bufpool::take(16 * 1024));
        let step_name = self.policy.steps.get(step).map_or("", |s| s.name.as_str());
        let queued = waited.map(|w| (w, class));
        spans::attempt_begins(c, d, step_name, &agent, queued, &mut self.request);
        let tenant = self.tenant;
        self.with_model(|m| spans::verdicts(c, d, m, tenant));
        let ask = Ask {
            request: &self.request,
            deadline: d.request().deadline,
            held: self.admitted.reservation.as_ref(),
            kept: kept.as_mut(),
            splice: None,
            turn: self.conv.as_mut(),
        };
        let (outcome, sample) = attempt(shard, c, p, &agent, ask, &mut self.last_backend).await;
        spans::attempt_ended(c, &outcome, sample, self.affinity.traced());
        let (why, api, kept) = match (outcome, api, kept) {
            (Outcome::Broken(why), Some(api), Some(kept)) => (why, api, kept),
            (o, _, kept) => {
                if let Some(k) = kept {
                    bufpool::give(k);
                }
                return self.settle(c, d, (agent, step, o, sample), false);
            }
        };
        let broke = continuation::broke(c, api, &self.request, &kept, &why).await;
        bufpool::give(kept);
        let last = match broke {
            Broke::Continuable(t) => {
                // Its budget counts from the break: a stream of any age
                // can be continued (issue 56).
                let until = clock::now() + shard.router.cfg.request_timeout;
                d.stream_broke(agent.id, shard.router.cfg.stream_migrations, until);
                let first = (agent, step, Outcome::Failed(why.clone()), sample);
                self.cont = Some(Continuity::new(shard, p, api, t, first, &why, running));
                return self.carry_if_upgrading(c);
            }
            Broke::Whole => {
                self.count_migration("finished");
                let whole = Outcome::Served {
                    status: 200,
                    tokens: None,
                };
                (agent, step, whole, sample)
            }
            Broke::Cut(label) => {
                self.count_migration(label);
                (agent, step, Outcome::Failed(why), sample)
            }
        };
        self.settle(c, d, last, true)
    }

    /// One continuation try (the machine's [`Action::Continue`]).
    async fn continue_on(
        &mut self,
        c: &mut Client,
        d: &mut Decision,
        agent: Rc<Agent>,
        prefill: Prefill,
    ) -> Option<bool> {
        if let Some(done) = self.carry_if_upgrading(c) {
            return Some(done);
        }
        let (shard, p) = (self.shard, self.p);
        let cont = self.cont.as_mut()?;
        let deadline = d.continuation_deadline();
        let held = self.admitted.reservation.as_ref();
        let tried = cont
            .try_on(c, &self.request, agent, prefill, deadline, held)
            .await;
        let Some((end, before)) = tried else {
            cont.cut(c, "malformed").await;
            return Some(self.end_continuation(c, d));
        };
        // The attempt it replaced: counted as failed, its agent one the
        // answer continued from.
        if let Some((a, step, o, s)) = before {
            c.scope.ending.continued_from.push(a.peer.clone());
            record_attempt(
                shard,
                self.model,
                &a,
                step,
                p,
                p.principal.tenant_arc(),
                o,
                s,
            );
        }
        if d.continuation_ended(&end) {
            return None;
        }
        Some(self.end_continuation(c, d))
    }

    /// The machine cut the broken stream.
    async fn cut(&mut self, c: &mut Client, d: &mut Decision, reason: CutReason) -> bool {
        if let Some(cont) = self.cont.as_mut() {
            cont.cut(c, reason.label()).await;
        }
        self.end_continuation(c, d)
    }

    /// The continuation is over: counted once, its last attempt as the
    /// request's. After it the client's stream has ended one way or the
    /// other.
    fn end_continuation(&mut self, c: &mut Client, d: &mut Decision) -> bool {
        let Some(cont) = self.cont.take() else {
            return false;
        };
        let (label, last, _running) = cont.finish();
        self.count_migration(label);
        last.and_then(|l| self.settle(c, d, l, true))
            .unwrap_or(false)
    }

    fn count_migration(&self, label: &'static str) {
        self.with_model(|m| m.stats.continuity.ended(label));
    }

    /// Ended hook: what an attempt leaves (usage bounded, the features'
    /// bookkeeping, the ending, the counters) and the machine's verdict;
    /// `Some(keep)` when the request is finished (`continued`: always).
    fn settle(
        &mut self,
        c: &mut Client,
        d: &mut Decision,
        (agent, step, mut outcome, sample): Pending,
        continued: bool,
    ) -> Option<bool> {
        let (shard, p) = (self.shard, self.p);
        // Registered since the run began, if it was not then.
        let model = self.model_ref();
        if let Outcome::Served {
            tokens: Some(t), ..
        } = &mut outcome
        {
            self.bound_usage(&agent, t);
            let (fair, affinity) = (self.fair.take(), &mut self.affinity);
            if let Some(model) = model.as_ref() {
                let m = &mut *model.borrow_mut();
                affinity.ended(m, &agent, t, continued);
                // Only a request that waited: an idle queue costs nothing.
                if let Some(who) = fair {
                    fairness::true_up(m, who, t.input.saturating_add(t.output));
                }
            }
        }
        if let Outcome::Failed(_) = &outcome {
            self.affinity.failed(shard, &agent);
        }
        let keep = matches!(outcome, Outcome::Served { .. }) && p.head.keep_alive;
        served(
            model.as_ref(),
            c,
            p,
            &agent,
            &outcome,
            &mut self.admitted,
            self.llm,
        );
        let tenant = p.principal.tenant_arc();
        let ended = record_attempt(shard, self.model, &agent, step, p, tenant, outcome, sample);
        (continued || !d.attempt_ended(agent.id, &ended)).then_some(keep)
    }

    /// A backend's usage is bounded by what the request could produce
    /// (issue 29 #3): a claim of 10^15 tokens must not lock the tenant out.
    fn bound_usage(&self, agent: &Agent, t: &mut Tokens) {
        let bound = crate::logic::http::api::usage::UsageBound {
            // The whole request's bytes: every endpoint's text is in them
            // (embedding inputs, rerank documents too).
            text_bytes: self.request.len() as u64,
            messages: self.p.meta.messages,
            images: self.p.meta.images,
            declared_output: self.p.meta.declared_output,
        };
        let (kept, cut) = bound.clamp(*t);
        if cut {
            if let Some(n) = agent.request_line(clock::now()) {
                warn!(model = self.model, peer_id = %agent.reg.peer_id, claimed_input = t.input, claimed_output = t.output, clamped = n, "usage beyond what the request could produce: clamped");
            }
            *t = kept;
            self.with_model(|m| m.stats.usage_clamped += 1);
        }
    }

    /// The machine's [`Action::Provider`]: the request ends there.
    async fn provider(&mut self, c: &mut Client, d: &Decision) -> bool {
        // Local occupancy is not used by a provider call.
        self.admitted = Admitted::default();
        let call = provider::Call {
            model: self.model,
            endpoint: self.p.endpoint,
            provider: self.policy.fallback_provider.as_ref(),
            request: &self.request,
            deadline: d.request().deadline,
            tenant: self.p.principal.tenant_arc(),
            keep: self.p.head.keep_alive,
        };
        provider::serve(self.shard, c, call).await
    }

    /// The machine's [`Action::Reject`]: counted once, written once (the
    /// backends' own 502-504 answer rather than a generic 503 when the
    /// tries ran out on such answers).
    async fn refuse(&mut self, c: &mut Client, d: &Decision, r: Refusal) -> bool {
        let exhausted = matches!(&r, Refusal::Routing(x) if x.exhausted_policy());
        let (p, class, model) = (self.p, self.class, self.model);
        self.with_model(|m| refusals::record(m, model, d, &r, &p.principal, class));
        spans::refused(c, &r, model);
        let keep = p.head.keep_alive;
        if let Some(e) = self.last_backend.take().filter(|_| exhausted) {
            return respond::send_error(c, &e, keep).await;
        }
        respond::send_refusal(c, r, model, keep).await
    }
}

/// What an attempt leaves in the request's ending (the agent, status,
/// tokens), and what the model learns from its usage.
fn served(
    model: Option<&ModelRef>,
    c: &mut Client,
    p: &PendingRequest,
    agent: &Rc<Agent>,
    outcome: &Outcome,
    admitted: &mut Admitted,
    llm: bool,
) {
    let end = &mut c.scope.ending;
    end.agent = Some(agent.clone());
    match outcome {
        Outcome::Served { status, tokens } => {
            end.status = *status;
            end.error_code = "";
            end.tokens = *tokens;
            end.relayed = true;
            if let Some(t) = tokens {
                admitted.charge_output(t.output);
                if llm && p.meta.images == 0 && *status < 400 {
                    learn(model, t.input, p.meta.text_bytes);
                }
            }
        }
        Outcome::ClientGone => {
            end.client_gone();
            end.relayed = true;
        }
        Outcome::Failed(_) | Outcome::Broken(_) | Outcome::Full => {}
    }
}

/// Teach the model's estimator one exact prompt count.
fn learn(model: Option<&ModelRef>, prompt_tokens: u64, text_bytes: u64) {
    if let Some(m) = model {
        m.borrow()
            .admission
            .borrow_mut()
            .learn(prompt_tokens, text_bytes);
    }
}
