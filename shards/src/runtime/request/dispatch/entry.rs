//! The request's entry into the machine: the facts it starts from
//! ([`request_facts`], [`Run::new`]) and the steps before routing it
//! carries out (the request quota, the admission gates, the daily token
//! budget).

use std::time::Duration;

use super::Run;
use crate::logic::http::api::probe::COLD_TOKENS_PER_BYTE;
use crate::logic::http::errors::ApiError;
use crate::logic::routing::decision::{
    AdmitEnd, Decision, Entry, Limits, Park, Released, RequestFacts,
};
use crate::logic::routing::refusal::QuotaRefusal;
use crate::logic::routing::wait_queue::Fair;
use crate::logic::tenancy::quota;
use crate::runtime::request::admission;
use crate::runtime::request::affinity::RequestAffinity;
use crate::runtime::request::forward::build_request;
use crate::runtime::state::model::admission::Admitted;
use crate::runtime::state::model::ModelRef;
use crate::runtime::state::pending::{Held, PendingRequest};
use crate::runtime::state::scope::Client;
use crate::runtime::state::shard::Shard;
use crate::runtime::state::tenancy::{self, Principal, QuotaFacts};
use crate::runtime::wire::bufpool;
use crate::runtime::wire::clock;

/// What applies to `p` before routing, and its deadline.
fn request_facts(
    shard: &Shard,
    p: &PendingRequest,
    held: Option<&Held>,
    gated: bool,
) -> RequestFacts {
    let cfg = &shard.router.cfg;
    let keyed = matches!(p.principal, Principal::Key(_));
    let admission = gated.then(|| match held {
        // Room may come until the hold budget ends (new replicas used).
        Some(h) => Park {
            until: h.until,
            recompute: Some(Duration::from_secs(1)),
        },
        None => Park {
            until: clock::now() + cfg.admit_park_timeout,
            recompute: None,
        },
    });
    RequestFacts {
        endpoint: p.endpoint,
        stream: p.meta.stream,
        body_bytes: p.body.len(),
        // A released request's deadline starts when its routing does.
        deadline: p.received_at + cfg.request_timeout,
        entry: Entry {
            // A released request's quota was taken before its hold.
            quota: keyed && held.is_none(),
            admission,
            daily: keyed,
            released: held.map(|h| Released {
                budget: h.budget,
                retry_after: h.retry_after,
                timeout: cfg.request_timeout,
            }),
        },
    }
}

// === impl Run ===

impl<'a> Run<'a> {
    /// The run of `p` on its model's shard and its decision; `Err`: its
    /// priority header is invalid.
    pub(super) fn new(
        shard: &'a Shard,
        p: &'a mut PendingRequest,
        conv: Option<crate::runtime::request::responses::Conversation>,
    ) -> Result<(Self, Decision), ApiError> {
        let cfg = &shard.router.cfg;
        let policy = shard.policy(&p.meta.model);
        // Chat and messages: the estimator learns from their usage, and
        // the admission gates apply to them when the policy has any.
        let llm = p.endpoint.generates();
        let mut held = p.held.take();
        let resumed = p.resumed.take();
        let facts = request_facts(shard, p, held.as_ref(), llm && policy.admission.any());
        let request = build_request(p);
        // The request bytes carry the body from here on: one copy is held
        // for the whole exchange (streams included), not two; the body
        // permit still counts it until the request is done.
        bufpool::give(std::mem::take(&mut p.body));
        let p: &'a PendingRequest = p;
        let model = p.meta.model.as_str();
        let state = shard.model(model);
        let class = p.class()?;
        let limits = Limits {
            max_tries_per_step: cfg.max_tries_per_step,
            // A released request: the hold limits already bound how many;
            // `--queue-depth 0` still means no queue at all (seed 2).
            queue_depth: if held.is_some() && cfg.queue_depth > 0 {
                usize::MAX
            } else {
                cfg.queue_depth
            },
        };
        let d = Decision::new(policy.clone(), facts, limits);
        let run = Run {
            shard,
            p,
            model,
            affinity: RequestAffinity::of(&policy, p),
            policy,
            llm,
            // From the probe's sums and the model's learned ratio.
            estimate: p.meta.estimate(tokens_per_byte(state.as_ref())),
            state,
            request,
            ticket: held.as_mut().and_then(|h| h.quota.take()),
            held,
            admitted: Admitted::default(),
            queue_depth: limits.queue_depth,
            last_backend: None,
            class,
            sent: false,
            tenant: p.principal.tenant_hash(),
            claim: None,
            fair: None,
            cont: None,
            conv,
            resumed,
        };
        Ok((run, d))
    }

    /// Its place in a fair order (the capacity queue, the admission
    /// park): class, tenant, and the tokens it is expected to use.
    pub(super) fn fair_of(&self) -> Fair {
        Fair {
            class: self.class,
            tenant: self.tenant,
            cost: self.estimate.saturating_add(self.p.meta.declared_output),
        }
    }

    /// What the quotas read of this request.
    pub(super) fn quota_facts<'f>(&'f self, replicas: &'f dyn Fn() -> u64) -> QuotaFacts<'f> {
        QuotaFacts {
            model: self.model,
            endpoint: self.p.endpoint,
            estimate: self.estimate,
            declared_output: self.p.meta.declared_output,
            replicas,
            burst_secs: self.shard.router.cfg.rpm_burst_secs,
        }
    }

    /// The request quota (RPM).
    pub(super) fn take_quota(&mut self) -> Result<(), QuotaRefusal> {
        let state = self.model_ref();
        let replicas = || healthy_replicas(state.as_ref());
        let facts = self.quota_facts(&replicas);
        let t = tenancy::take_requests(&self.p.principal, &facts, clock::mono_ns())?;
        self.ticket = Some(t);
        Ok(())
    }

    /// The admission gates (B1-B4), parking as `park` says.
    pub(super) async fn admit(&mut self, c: &mut Client, park: Park) -> AdmitEnd {
        let asked = admission::Request {
            policy: &self.policy.admission,
            principal: &self.p.principal,
            estimate: self.estimate,
            declared_output: self.p.meta.declared_output,
            images: self.p.meta.images,
            fraction: self.shard.router.cfg.admit_fraction,
            fair: self.fair_of(),
        };
        let t0 = clock::now();
        let end = match admission::admit(self.shard, c, self.model, asked, park).await {
            Ok(a) => {
                self.admitted = a;
                AdmitEnd::Admitted
            }
            Err(end) => end,
        };
        crate::runtime::request::spans::admitted(&mut c.scope, &end, t0.elapsed());
        end
    }

    /// The daily token budget; the ticket and its `X-RateLimit-*`
    /// headers move into the request's scope when it passes.
    pub(super) async fn charge_daily(&mut self, c: &mut Client) -> Result<(), QuotaRefusal> {
        let mut ticket = self.ticket.take();
        let state = self.model_ref();
        let replicas = || healthy_replicas(state.as_ref());
        let facts = self.quota_facts(&replicas);
        let today = || quota::day_of(clock::unix_secs());
        if let Some(t) = ticket.as_mut() {
            // A request larger than this router's lease waits briefly for
            // the draw it reserves (issue 51 #5).
            tenancy::take_daily_reserving(t, &facts, today).await?;
        }
        if let Some(mut t) = ticket {
            c.scope.reply_headers.append(&mut t.headers);
            c.scope.ending.ticket = Some(t);
        }
        Ok(())
    }
}

/// The model's learned input tokens per body text byte.
fn tokens_per_byte(model: Option<&ModelRef>) -> f64 {
    model.map_or(COLD_TOKENS_PER_BYTE, |m| {
        m.borrow().admission.borrow().tokens_per_byte
    })
}

/// Agents of `model` on this (its owner) shard that count as replicas
/// (healthy, and served at least once).
fn healthy_replicas(model: Option<&ModelRef>) -> u64 {
    model.map_or(0, |m| {
        m.borrow()
            .agents
            .iter()
            .filter(|a| a.counts_as_replica())
            .count() as u64
    })
}
