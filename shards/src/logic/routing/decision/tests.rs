use super::*;
use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::link::control::Capability;
use crate::logic::routing::admission::Reason;
use crate::logic::routing::failure::Stage;
use crate::logic::routing::policy::{Field, Match, Op, Rule, Step};
use crate::logic::routing::refusal::{QuotaLimit, QuotaRefusal, Refusal};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct Agent {
    id: u64,
    healthy: bool,
    active: u32,
    capacity: u32,
    srtt: Option<f64>,
    capability: Capability,
    engine: &'static str,
}

impl Pool for Vec<Agent> {
    fn agent_count(&self) -> usize {
        self.len()
    }
    fn facts(&self, i: usize) -> Option<AgentFacts<'_>> {
        self.get(i).map(|a| AgentFacts {
            id: a.id,
            healthy: a.healthy,
            capability: a.capability,
            engine: a.engine,
            region: "",
            organization: "",
            machine: "",
            tags: &[],
            active: a.active,
            capacity: a.capacity,
            srtt: a.srtt,
            success_rate: None,
            consecutive_failures: None,
            probe_due: false,
            signals: Default::default(),
            hardware: Default::default(),
            gpu_model: "",
        })
    }
}

fn agent(id: u64, active: u32, capacity: u32, srtt: Option<f64>) -> Agent {
    Agent {
        id,
        healthy: true,
        active,
        capacity,
        srtt,
        capability: Capability::Llm,
        engine: "vllm",
    }
}

fn step(name: &str, srtt_gt: Option<f64>, max_tries: u32) -> Step {
    Step {
        name: name.into(),
        matcher: Match::default(),
        exclude_if: srtt_gt
            .map(|v| {
                vec![Rule {
                    field: Field::Srtt,
                    op: Op::Gt,
                    value: v,
                }]
            })
            .unwrap_or_default(),
        max_tries,
        affinity: None,
    }
}

fn policy(steps: Vec<Step>) -> Arc<Policy> {
    Arc::new(Policy {
        models: Vec::new(),
        steps,
        aliases: Default::default(),
        admission: Default::default(),
        fallback_provider: None,
        min_share: [0.0; 3],
        tenant_headroom: 0,
    })
}

fn request(t0: Instant) -> RequestFacts {
    RequestFacts {
        endpoint: Endpoint::ChatCompletions,
        stream: false,
        body_bytes: 10,
        deadline: t0 + Duration::from_secs(60),
        entry: Entry::default(),
    }
}

const LIMITS: Limits = Limits {
    max_tries_per_step: 3,
    queue_depth: 30,
};

fn facts(pool: &Vec<Agent>, queue_len: usize) -> ModelFacts<'_, Vec<Agent>> {
    ModelFacts {
        pool,
        rotation: 0,
        queue_len,
        affinity: None,
        reserved_for_others: false,
        headroom_for_others: false,
        miss: None,
    }
}

fn retryable() -> AttemptEnd {
    AttemptEnd::Failed(Failure::new(Side::Agent, Stage::AwaitingHead, "cut"))
}

#[test]
fn no_agents_is_model_not_found() {
    let t0 = Instant::now();
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), request(t0), LIMITS);
    assert_eq!(
        d.next(&facts(&Vec::new(), 0), t0),
        Action::Reject(Rejection::ModelNotFound.into())
    );
    assert_eq!(Rejection::ModelNotFound.error().status, 404);
}

#[test]
fn unhealthy_pool_is_no_agents_available_and_full_is_no_capacity() {
    let t0 = Instant::now();
    let mut sick = agent(1, 0, 2, None);
    sick.healthy = false;
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), request(t0), LIMITS);
    assert_eq!(
        d.next(&facts(&vec![sick], 0), t0),
        Action::Reject(Rejection::NoAgentsAvailable.into())
    );
    let full = vec![agent(1, 2, 2, None)];
    let mut d = Decision::new(
        policy(vec![step("p", None, 0)]),
        request(t0),
        Limits {
            queue_depth: 0,
            ..LIMITS
        },
    );
    assert_eq!(
        d.next(&facts(&full, 0), t0),
        Action::Reject(Rejection::NoCapacity.into())
    );
}

/// Issue 28 #10: a chat model asked on an endpoint none of its agents
/// serves is a clear 404 naming the capability, not "all policy steps
/// exhausted"; one agent with the capability (even unhealthy) is not.
#[test]
fn a_capability_no_agent_has_is_named() {
    let t0 = Instant::now();
    let mut emb = request(t0);
    emb.endpoint = Endpoint::Embeddings;
    let pool = vec![agent(1, 0, 2, None), agent(2, 0, 2, None)];
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), emb.clone(), LIMITS);
    let want = Rejection::CapabilityMismatch(Capability::Embedding);
    assert_eq!(d.next(&facts(&pool, 0), t0), Action::Reject(want.into()));
    let e = want.error();
    assert_eq!((e.status, e.code), (404, ErrorCode::ModelNotFound));
    assert!(e.message.contains("capability embedding"), "{}", e.message);
    let mut sick = agent(3, 0, 2, None);
    sick.capability = Capability::Embedding;
    sick.healthy = false;
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), emb, LIMITS);
    assert_eq!(
        d.next(&facts(&vec![agent(1, 0, 2, None), sick], 0), t0),
        Action::Reject(Rejection::NoAgentsAvailable.into())
    );
}

#[test]
fn full_waits_then_forwards_with_its_wait_and_keeps_its_place() {
    let t0 = Instant::now();
    let mut pool = vec![agent(7, 1, 1, None)];
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), request(t0), LIMITS);
    let a = d.next(&facts(&pool, 0), t0);
    assert_eq!(
        a,
        Action::Wait {
            until: t0 + Duration::from_secs(60),
            place: None,
            wake_first: None,
            prefer: Prefer::default(),
            pinned: false,
            head: false,
            pass_on: false,
        }
    );
    d.queued(4, t0);
    d.wait_ended(WaitEnd::Woken, t0 + Duration::from_millis(5));
    // Lost the race: the same place again.
    assert!(matches!(
        d.next(&facts(&pool, 3), t0 + Duration::from_millis(5)),
        Action::Wait { place: Some(4), .. }
    ));
    pool[0].active = 0;
    let later = t0 + Duration::from_millis(30);
    assert_eq!(
        d.next(&facts(&pool, 3), later),
        Action::Forward {
            agent: 0,
            agent_id: 7,
            step: 0,
            waited: Some(Duration::from_millis(30)),
            affinity: None,
        }
    );
}

#[test]
fn newcomer_joins_the_line_when_others_wait() {
    let t0 = Instant::now();
    let pool = vec![agent(1, 0, 1, None)];
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), request(t0), LIMITS);
    assert!(matches!(
        d.next(&facts(&pool, 2), t0),
        Action::Wait {
            wake_first: Some(1),
            place: None,
            ..
        }
    ));
}

#[test]
fn a_newcomer_takes_a_free_slot_when_the_line_is_full() {
    // The line is full of waiters that did not take the free slot
    // (waiting for their cache holders): joining would refuse it.
    let t0 = Instant::now();
    let pool = vec![agent(1, 0, 1, None)];
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), request(t0), LIMITS);
    assert!(matches!(
        d.next(&facts(&pool, LIMITS.queue_depth), t0),
        Action::Forward { agent_id: 1, .. }
    ));
}

#[test]
fn queue_timeout_at_the_deadline_only() {
    let t0 = Instant::now();
    let pool = vec![agent(1, 1, 1, None)];
    let two = policy(vec![step("p", None, 0), step("f", None, 0)]);
    let mut d = Decision::new(two, request(t0), LIMITS);
    assert!(matches!(d.next(&facts(&pool, 0), t0), Action::Wait { .. }));
    d.queued(0, t0);
    // Released early (not at the deadline): the next step is tried.
    d.wait_ended(WaitEnd::TimedOut, t0 + Duration::from_secs(1));
    assert!(matches!(
        d.next(&facts(&pool, 0), t0 + Duration::from_secs(1)),
        Action::Wait { place: None, .. }
    ));
    d.queued(1, t0);
    d.wait_ended(WaitEnd::TimedOut, t0 + Duration::from_secs(60));
    assert_eq!(
        d.next(&facts(&pool, 0), t0 + Duration::from_secs(60)),
        Action::Reject(Rejection::QueueTimeout.into())
    );
}

#[test]
fn a_client_gone_while_waiting_is_never_forwarded() {
    let t0 = Instant::now();
    let mut pool = vec![agent(1, 1, 1, None)];
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), request(t0), LIMITS);
    assert!(matches!(d.next(&facts(&pool, 0), t0), Action::Wait { .. }));
    d.queued(0, t0);
    d.wait_ended(WaitEnd::ClientGone, t0);
    pool[0].active = 0;
    assert_eq!(
        d.next(&facts(&pool, 0), t0),
        Action::Reject(Rejection::ClientGone.into()),
        "a free slot later does not revive it"
    );
    assert!(!Rejection::ClientGone.exhausted_policy());
}

#[test]
fn deadline_while_contacting_is_agent_timeout_and_relay_failure_ends() {
    let t0 = Instant::now();
    let pool = vec![agent(1, 0, 4, None), agent(2, 0, 4, None)];
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), request(t0), LIMITS);
    let Action::Forward { agent_id, .. } = d.next(&facts(&pool, 0), t0) else {
        panic!("forward expected");
    };
    let late = AttemptEnd::Failed(Failure::new(Side::Router, Stage::AwaitingHead, "deadline"));
    assert!(d.attempt_ended(agent_id, &late));
    assert_eq!(
        d.next(&facts(&pool, 0), t0),
        Action::Reject(Rejection::AgentTimeout.into())
    );
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), request(t0), LIMITS);
    let Action::Forward { agent_id, .. } = d.next(&facts(&pool, 0), t0) else {
        panic!("forward expected");
    };
    let mid = AttemptEnd::Failed(Failure::new(Side::Agent, Stage::Relaying, "cut"));
    assert!(!d.attempt_ended(agent_id, &mid), "nothing more to do");
    assert!(!d.attempt_ended(agent_id, &AttemptEnd::Responded));
}

fn arb_agent() -> impl Strategy<Value = Agent> {
    (
        0u64..40,
        any::<bool>(),
        0u32..4,
        0u32..4,
        proptest::option::of(1.0f64..2000.0),
        0u8..3,
    )
        .prop_map(|(id, healthy, active, capacity, srtt, c)| Agent {
            id,
            healthy,
            active,
            capacity,
            srtt,
            capability: match c {
                0 | 1 => Capability::Llm,
                _ => Capability::Embedding,
            },
            engine: "vllm",
        })
}

/// Drive a decision where every attempt fails (retryable) and every wait
/// times out; returns the actions in order.
fn run_all_failing(
    pool: &Vec<Agent>,
    p: Arc<Policy>,
    limits: Limits,
    queue_len: usize,
    t0: Instant,
) -> Vec<Action> {
    let mut d = Decision::new(p, request(t0), limits);
    let mut out = Vec::new();
    for k in 0..200u64 {
        let now = t0 + Duration::from_millis(k);
        let a = d.next(
            &ModelFacts {
                pool,
                rotation: k as usize,
                queue_len,
                affinity: None,
                reserved_for_others: false,
                headroom_for_others: false,
                miss: None,
            },
            now,
        );
        out.push(a.clone());
        match a {
            Action::TakeQuota | Action::Admit(_) | Action::ChargeDaily => {
                panic!("no entry step applies: {a:?}")
            }
            Action::Forward { agent_id, .. } => {
                assert!(d.attempt_ended(agent_id, &retryable()));
            }
            Action::Wait { .. } => {
                d.queued(u128::from(k), now);
                d.wait_ended(WaitEnd::TimedOut, now);
            }
            Action::Reject(_) => break,
            Action::Provider | Action::Continue { .. } | Action::Cut(_) => {
                panic!("no provider and no broken stream: {a:?}")
            }
        }
    }
    out
}

proptest! {
    /// Never forwards to an unhealthy, full, wrong-capability, gated or
    /// already-failed agent; at most the step's tries per step, steps in
    /// order, and it always ends with a rejection; same inputs, same actions.
    #[test]
    fn machine_properties(
        pool in proptest::collection::vec(arb_agent(), 0..12),
        th in 1.0f64..2000.0,
        tries in 0u32..4,
        default_tries in 1u32..4,
        depth in 0usize..3,
        queue_len in 0usize..3,
        fallback in any::<bool>(),
    ) {
        let mut steps = vec![step("primary", Some(th), tries)];
        if fallback {
            steps.push(step("relaxed", None, 0));
        }
        let p = policy(steps);
        let limits = Limits { max_tries_per_step: default_tries, queue_depth: depth };
        let t0 = Instant::now();
        let actions = run_all_failing(&pool, p.clone(), limits, queue_len, t0);
        prop_assert_eq!(&actions, &run_all_failing(&pool, p.clone(), limits, queue_len, t0));
        prop_assert!(matches!(actions.last(), Some(Action::Reject(_))));
        let mut per_step: Vec<Vec<u64>> = vec![Vec::new(); p.steps.len()];
        let mut last_step = 0usize;
        for a in &actions {
            if let Action::Forward { agent, agent_id, step, .. } = a {
                let x = &pool[*agent];
                prop_assert_eq!(x.id, *agent_id);
                prop_assert!(x.healthy && x.capability == Capability::Llm);
                prop_assert!(x.capacity > 0 && x.active < x.capacity);
                if *step == 0 {
                    prop_assert!(x.srtt.map(|s| s <= th).unwrap_or(true), "gated agent used");
                }
                prop_assert!(*step >= last_step, "steps go forward only");
                last_step = *step;
                prop_assert!(!per_step[*step].contains(agent_id), "a failed agent is retried in its step");
                per_step[*step].push(*agent_id);
            }
        }
        for (i, used) in per_step.iter().enumerate() {
            let max = p.steps[i].max_tries;
            let max = if max > 0 { max } else { default_tries };
            prop_assert!(used.len() as u32 <= max, "step {} used {} tries (max {})", i, used.len(), max);
        }
    }

    /// Time only from the argument: a queue timeout rejects exactly when the
    /// `now` given is at or past the deadline (or no step is left).
    #[test]
    fn queue_timeout_depends_only_on_now(offset_ms in 0u64..120_000) {
        let t0 = Instant::now();
        let pool = vec![agent(1, 1, 1, None)];
        let mut d = Decision::new(policy(vec![step("p", None, 0), step("f", None, 0)]), request(t0), LIMITS);
        let Action::Wait { .. } = d.next(&facts(&pool, 0), t0) else { panic!("wait expected") };
        d.queued(0, t0);
        let now = t0 + Duration::from_millis(offset_ms);
        d.wait_ended(WaitEnd::TimedOut, now);
        let a = d.next(&facts(&pool, 0), now);
        if offset_ms >= 60_000 {
            prop_assert_eq!(a, Action::Reject(Rejection::QueueTimeout.into()));
        } else {
            let is_wait = matches!(a, Action::Wait { .. });
            prop_assert!(is_wait);
        }
    }
}

// === the owner-side order ===

fn quota_refusal(limit: QuotaLimit) -> QuotaRefusal {
    QuotaRefusal {
        limit,
        error: ApiError::new(ErrorCode::RateLimitExceeded, "rate limit exceeded").retry_after(7),
        headers: vec![("X-RateLimit-Remaining-Requests", b"0".to_vec())],
    }
}

fn entry(quota: bool, admission: bool, daily: bool, released: bool, t0: Instant) -> Entry {
    Entry {
        quota,
        admission: admission.then_some(Park {
            until: t0 + Duration::from_secs(5),
            recompute: None,
        }),
        daily,
        released: released.then_some(Released {
            budget: Duration::from_secs(120),
            retry_after: 9,
            timeout: Duration::from_secs(60),
        }),
    }
}

fn entered(e: Entry, t0: Instant) -> Decision {
    let r = RequestFacts {
        entry: e,
        ..request(t0)
    };
    Decision::new(policy(vec![step("p", None, 0)]), r, LIMITS)
}

#[test]
fn quota_then_admission_then_daily_then_routing() {
    let t0 = Instant::now();
    let pool = vec![agent(1, 0, 2, None)];
    let mut d = entered(entry(true, true, true, false, t0), t0);
    assert_eq!(d.next(&facts(&pool, 0), t0), Action::TakeQuota);
    // Asked again before the report: the same step.
    assert_eq!(d.next(&facts(&pool, 0), t0), Action::TakeQuota);
    d.quota_taken(Ok(()));
    let Action::Admit(park) = d.next(&facts(&pool, 0), t0) else {
        panic!("admission next")
    };
    assert_eq!(park.until, t0 + Duration::from_secs(5));
    d.admitted(AdmitEnd::Admitted);
    assert_eq!(d.next(&facts(&pool, 0), t0), Action::ChargeDaily);
    d.daily_charged(Ok(()), t0);
    assert!(matches!(
        d.next(&facts(&pool, 0), t0),
        Action::Forward { agent_id: 1, .. }
    ));
    // A report out of order changes nothing.
    d.quota_taken(Err(quota_refusal(QuotaLimit::Requests)));
    assert!(matches!(
        d.next(&facts(&pool, 0), t0),
        Action::Forward { .. }
    ));
}

#[test]
fn each_refusal_before_routing_ends_the_request_with_its_reason() {
    let t0 = Instant::now();
    let pool = vec![agent(1, 0, 2, None)];
    let mut d = entered(entry(true, true, true, false, t0), t0);
    let _ = d.next(&facts(&pool, 0), t0);
    d.quota_taken(Err(quota_refusal(QuotaLimit::Requests)));
    let Action::Reject(r) = d.next(&facts(&pool, 0), t0) else {
        panic!("refused")
    };
    assert_eq!(r.reason(), "b4_rpm");
    assert_eq!(r.error("m").retry_after, Some(7));
    // Sticky: the same refusal, whatever is reported after it.
    d.admitted(AdmitEnd::Admitted);
    assert_eq!(d.next(&facts(&pool, 0), t0), Action::Reject(r));

    let mut d = entered(entry(false, true, false, false, t0), t0);
    let _ = d.next(&facts(&pool, 0), t0);
    d.admitted(AdmitEnd::WaitEnded);
    let Action::Reject(r) = d.next(&facts(&pool, 0), t0) else {
        panic!("refused")
    };
    assert_eq!(r.reason(), "b2", "a park that ends without room is B2");
    assert_eq!(r.error("m").retry_after, Some(1));

    let mut d = entered(entry(false, true, false, true, t0), t0);
    let _ = d.next(&facts(&pool, 0), t0);
    d.admitted(AdmitEnd::WaitEnded);
    let Action::Reject(r) = d.next(&facts(&pool, 0), t0) else {
        panic!("refused")
    };
    assert_eq!(
        r,
        Refusal::HoldNoRoom {
            budget: Duration::from_secs(120),
            retry_after: 9
        }
    );
    let e = r.error("m");
    assert_eq!(
        (e.status, e.code, e.retry_after),
        (503, ErrorCode::ModelWaking, Some(9))
    );

    let mut d = entered(entry(false, true, false, false, t0), t0);
    let _ = d.next(&facts(&pool, 0), t0);
    d.admitted(AdmitEnd::ClientGone);
    let Action::Reject(r) = d.next(&facts(&pool, 0), t0) else {
        panic!("refused")
    };
    assert!(r.client_gone());

    let mut d = entered(entry(false, false, true, false, t0), t0);
    assert_eq!(d.next(&facts(&pool, 0), t0), Action::ChargeDaily);
    d.daily_charged(Err(quota_refusal(QuotaLimit::Tokens)), t0);
    let Action::Reject(r) = d.next(&facts(&pool, 0), t0) else {
        panic!("refused")
    };
    assert_eq!(r.reason(), "tokens_per_day");
}

#[test]
fn a_released_requests_deadline_starts_with_its_routing() {
    let t0 = Instant::now();
    let pool = vec![agent(1, 1, 1, None)];
    let mut d = entered(entry(false, true, true, true, t0), t0);
    let _ = d.next(&facts(&pool, 0), t0);
    // Admission waited 30 s of the hold budget.
    let t1 = t0 + Duration::from_secs(30);
    d.admitted(AdmitEnd::Admitted);
    let _ = d.next(&facts(&pool, 0), t1);
    d.daily_charged(Ok(()), t1);
    assert_eq!(d.request().deadline, t1 + Duration::from_secs(60));
    let Action::Wait { until, .. } = d.next(&facts(&pool, 0), t1) else {
        panic!("full: wait")
    };
    assert_eq!(until, t1 + Duration::from_secs(60));
}

/// How the driver's side of each step ends, in a generated run.
#[derive(Debug, Clone)]
struct Outcomes {
    quota_ok: bool,
    admit: u8,
    daily_ok: bool,
    attempts: Vec<u8>,
    waits: Vec<bool>,
}

fn arb_outcomes() -> impl Strategy<Value = Outcomes> {
    (
        any::<bool>(),
        0u8..4,
        any::<bool>(),
        proptest::collection::vec(0u8..4, 0..8),
        proptest::collection::vec(any::<bool>(), 0..8),
    )
        .prop_map(|(quota_ok, admit, daily_ok, attempts, waits)| Outcomes {
            quota_ok,
            admit,
            daily_ok,
            attempts,
            waits,
        })
}

/// The rank of an action in the documented order (routing actions share
/// one rank; a refusal may come at any point).
fn rank(a: &Action) -> Option<u8> {
    match a {
        Action::TakeQuota => Some(0),
        Action::Admit(_) => Some(1),
        Action::ChargeDaily => Some(2),
        Action::Forward { .. } | Action::Wait { .. } => Some(3),
        Action::Continue { .. } | Action::Cut(_) => Some(4),
        Action::Reject(_) | Action::Provider => None,
    }
}

proptest! {
    /// For any combination of quota, admission, daily-budget, capacity and
    /// policy outcomes: the steps come in the documented order, each step
    /// before routing at most once and only when it applies, nothing comes
    /// after a refused step but its refusal, and every request ends exactly
    /// once (a response, or one refusal that stays).
    #[test]
    fn the_order_of_a_request(
        quota in any::<bool>(),
        admission in any::<bool>(),
        daily in any::<bool>(),
        released in any::<bool>(),
        pool in proptest::collection::vec(arb_agent(), 0..6),
        depth in 0usize..3,
        o in arb_outcomes(),
    ) {
        let t0 = Instant::now();
        let e = entry(quota, admission, daily, released, t0);
        let limits = Limits { max_tries_per_step: 2, queue_depth: depth };
        let steps = vec![step("p", None, 0), step("f", None, 0)];
        let r = RequestFacts { entry: e, ..request(t0) };
        let mut d = Decision::new(policy(steps), r, limits);
        let mut actions: Vec<Action> = Vec::new();
        let mut ended: Option<&'static str> = None;
        let (mut attempts, mut waits) = (o.attempts.iter(), o.waits.iter());
        for k in 0..100u64 {
            let now = t0 + Duration::from_millis(k);
            let a = d.next(&ModelFacts { pool: &pool, rotation: k as usize, queue_len: 0, affinity: None, reserved_for_others: false, headroom_for_others: false, miss: None }, now);
            actions.push(a.clone());
            match a {
                Action::TakeQuota => d.quota_taken(if o.quota_ok {
                    Ok(())
                } else {
                    Err(quota_refusal(QuotaLimit::Requests))
                }),
                Action::Admit(_) => d.admitted(match o.admit {
                    0 => AdmitEnd::Admitted,
                    1 => AdmitEnd::Refused(Reason::B3, Reason::B3.error()),
                    2 => AdmitEnd::WaitEnded,
                    _ => AdmitEnd::ClientGone,
                }),
                Action::ChargeDaily => d.daily_charged(
                    if o.daily_ok { Ok(()) } else { Err(quota_refusal(QuotaLimit::Tokens)) },
                    now,
                ),
                Action::Forward { agent_id, .. } => {
                    let end = match attempts.next().copied().unwrap_or(1) {
                        0 => AttemptEnd::Responded,
                        1 => retryable(),
                        2 => AttemptEnd::Failed(Failure::new(Side::Router, Stage::AwaitingHead, "deadline")),
                        _ => AttemptEnd::Failed(Failure::new(Side::Agent, Stage::Relaying, "cut")),
                    };
                    if !d.attempt_ended(agent_id, &end) {
                        ended = Some("responded");
                        break;
                    }
                }
                Action::Wait { .. } => {
                    d.queued(u128::from(k), now);
                    let woken = waits.next().copied().unwrap_or(false);
                    d.wait_ended(if woken { WaitEnd::Woken } else { WaitEnd::TimedOut }, now);
                }
                Action::Reject(ref r) => {
                    // Sticky: asked again, the same refusal.
                    let again = d.next(&ModelFacts { pool: &pool, rotation: 0, queue_len: 0, affinity: None, reserved_for_others: false, headroom_for_others: false, miss: None }, now);
                    prop_assert_eq!(&again, &Action::Reject(r.clone()));
                    ended = Some("refused");
                    break;
                }
                Action::Provider | Action::Continue { .. } | Action::Cut(_) => {
                    panic!("no provider and no broken stream: {a:?}")
                }
            }
        }
        prop_assert!(ended.is_some(), "the request ended: {:?}", actions);
        // Order: ranks never go back; steps before routing at most once.
        let ranks: Vec<u8> = actions.iter().filter_map(rank).collect();
        prop_assert!(ranks.windows(2).all(|w| w[0] <= w[1]), "{:?}", actions);
        for r in 0..3u8 {
            prop_assert!(ranks.iter().filter(|x| **x == r).count() <= 1, "{:?}", actions);
        }
        // Each applies exactly when it should.
        let has = |r: u8| ranks.contains(&r);
        prop_assert_eq!(has(0), quota);
        let past_quota = !quota || o.quota_ok;
        prop_assert_eq!(has(1), admission && past_quota);
        let past_admission = past_quota && (!admission || o.admit == 0);
        prop_assert_eq!(has(2), daily && past_admission);
        let past_daily = past_admission && (!daily || o.daily_ok);
        if has(3) {
            prop_assert!(past_daily && !pool.is_empty(), "routed only past every earlier step");
        }
        // Exactly one ending: a refusal only as the last action, and only
        // one of them.
        let rejects = actions.iter().filter(|a| matches!(a, Action::Reject(_))).count();
        match ended {
            Some("refused") => {
                prop_assert_eq!(rejects, 1);
                prop_assert!(matches!(actions.last(), Some(Action::Reject(_))));
            }
            _ => prop_assert_eq!(rejects, 0),
        }
        // A refused step before routing: its refusal next, nothing else.
        if !past_daily {
            prop_assert!(!has(3));
            let Some(Action::Reject(r)) = actions.last() else {
                return Err(TestCaseError::fail("a refusal ends it"));
            };
            let want = if !past_quota {
                "b4_rpm"
            } else if admission && o.admit != 0 {
                match o.admit { 1 => "b3", 2 if released => "hold_no_room", 2 => "b2", _ => "client_gone" }
            } else {
                "tokens_per_day"
            };
            prop_assert_eq!(r.reason(), want);
        }
    }
}

#[test]
fn a_full_refusal_is_no_failure_until_its_bound() {
    let t0 = Instant::now();
    let pool = vec![agent(7, 0, 2, None)];
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), request(t0), LIMITS);
    for _ in 1..MAX_FULL_REFUSALS {
        assert!(matches!(
            d.next(&facts(&pool, 0), t0),
            Action::Forward { agent_id: 7, .. }
        ));
        // Full, not failed: the same agent may be tried again.
        assert!(d.attempt_ended(7, &AttemptEnd::Full));
    }
    assert!(matches!(
        d.next(&facts(&pool, 0), t0),
        Action::Forward { agent_id: 7, .. }
    ));
    // The bound: an agent that keeps refusing counts as failed for it.
    assert!(d.attempt_ended(7, &AttemptEnd::Full));
    assert!(!matches!(
        d.next(&facts(&pool, 0), t0),
        Action::Forward { .. }
    ));
}

#[test]
fn a_full_refusal_goes_back_to_its_place_in_the_line() {
    let t0 = Instant::now();
    let mut pool = vec![agent(7, 1, 1, None)];
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), request(t0), LIMITS);
    assert!(matches!(
        d.next(&facts(&pool, 0), t0),
        Action::Wait { place: None, .. }
    ));
    d.queued(4, t0);
    d.wait_ended(WaitEnd::Woken, t0);
    pool[0].active = 0;
    assert!(matches!(
        d.next(&facts(&pool, 2), t0),
        Action::Forward { agent_id: 7, .. }
    ));
    assert!(d.attempt_ended(7, &AttemptEnd::Full));
    // The router now counts the other routers' requests: full again.
    pool[0].active = 1;
    assert!(matches!(
        d.next(&facts(&pool, 2), t0),
        Action::Wait { place: Some(4), .. }
    ));
}

/// A step whose agent has a free slot is full for a request whose class
/// must leave it to others (`min_share`); the pure rule behind it.
#[test]
fn a_reserved_slot_is_left_to_its_class() {
    let t0 = Instant::now();
    let pool = vec![agent(1, 0, 4, None)];
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), request(t0), LIMITS);
    let mut f = facts(&pool, 0);
    f.reserved_for_others = true;
    assert!(matches!(d.next(&f, t0), Action::Wait { .. }));
    // interactive 25 % of 8 slots: 2 reserved; 6 in flight, none interactive.
    let share = [0.25, 0.0, 0.0];
    assert!(crate::logic::routing::policy::reserved_for_others(
        &share,
        2,
        8,
        6,
        &[0, 0, 6]
    ));
    assert!(!crate::logic::routing::policy::reserved_for_others(
        &share,
        2,
        8,
        5,
        &[0, 0, 5]
    ));
    assert!(!crate::logic::routing::policy::reserved_for_others(
        &share,
        0,
        8,
        7,
        &[0, 0, 7]
    ));
    // The class running its reservation already frees the rest.
    assert!(!crate::logic::routing::policy::reserved_for_others(
        &share,
        2,
        8,
        6,
        &[2, 0, 4]
    ));
    assert!(!crate::logic::routing::policy::reserved_for_others(
        &[0.0; 3],
        2,
        8,
        7,
        &[0, 0, 7]
    ));
}

/// The holders of every request: agent 2.
struct HeldBy2;
impl crate::logic::routing::affinity::AffinitySource for HeldBy2 {
    fn lookup(
        &self,
        _: &crate::logic::routing::affinity::AffinityCfg,
    ) -> crate::logic::routing::affinity::Holders {
        use crate::logic::routing::affinity::{HitKind, Holder, Holders};
        Holders::of(
            HitKind::Prefix,
            &[Holder {
                agent: 2,
                depth: 4096,
                age: 1,
                hash: 9,
            }],
        )
    }
}

fn prefix_step(holder_wait_ms: u32) -> Step {
    let mut s = step("p", None, 0);
    s.affinity = Some(crate::logic::routing::affinity::AffinityCfg {
        holder_wait_ms,
        ..Default::default()
    });
    s
}

#[test]
fn a_full_holder_is_waited_for_up_to_holder_wait_then_anyone_serves() {
    use crate::logic::routing::affinity::Outcome;
    let t0 = Instant::now();
    // Agent 1 idle, agent 2 (the holder) full.
    let mut pool = vec![agent(1, 0, 4, None), agent(2, 4, 4, None)];
    fn with(pool: &Vec<Agent>) -> ModelFacts<'_, Vec<Agent>> {
        ModelFacts {
            affinity: Some(&HeldBy2),
            ..facts(pool, 0)
        }
    }
    // Off (the default): the idle agent at once, counted overloaded; the
    // index's prediction (the full holder) is kept: not captured.
    let mut d = Decision::new(policy(vec![prefix_step(0)]), request(t0), LIMITS);
    let a = d.next(&with(&pool), t0);
    assert!(
        matches!(
            a,
            Action::Forward {
                agent_id: 1,
                affinity: Some(AffinityPick {
                    outcome: Outcome::Overloaded,
                    held: false,
                    hit: None,
                    predicted: Some(crate::logic::routing::affinity::Holder { agent: 2, .. }),
                    ..
                }),
                ..
            }
        ),
        "{a:?}"
    );
    // On: a wait for the holder only, bounded by holder_wait_ms.
    let mut d = Decision::new(policy(vec![prefix_step(500)]), request(t0), LIMITS);
    let a = d.next(&with(&pool), t0);
    assert_eq!(
        a,
        Action::Wait {
            until: t0 + Duration::from_millis(500),
            place: None,
            wake_first: None,
            prefer: Prefer::of([2]),
            pinned: true,
            head: false,
            pass_on: false,
        }
    );
    d.queued(7, t0);
    // A slot on the holder frees: a prefix hit there.
    pool[1].active = 3;
    d.wait_ended(WaitEnd::Woken, t0 + Duration::from_millis(100));
    assert!(matches!(
        d.next(&with(&pool), t0 + Duration::from_millis(100)),
        Action::Forward {
            agent_id: 2,
            affinity: Some(AffinityPick {
                outcome: Outcome::PrefixHit,
                held: true,
                ..
            }),
            ..
        }
    ));
    // Another request: the holder stays full past the wait; the timeout
    // ends the wait for the holder, not the request, and anyone serves it.
    pool[1].active = 4;
    let mut d = Decision::new(policy(vec![prefix_step(500)]), request(t0), LIMITS);
    assert!(matches!(
        d.next(&with(&pool), t0),
        Action::Wait { pinned: true, .. }
    ));
    d.queued(8, t0);
    let late = t0 + Duration::from_millis(500);
    d.wait_ended(WaitEnd::TimedOut, late);
    assert!(matches!(
        d.next(&with(&pool), late),
        Action::Forward {
            agent_id: 1,
            affinity: Some(AffinityPick {
                outcome: Outcome::Overloaded,
                held: true,
                ..
            }),
            ..
        }
    ));
    // Everyone full after the wait: an ordinary wait at its place, to the deadline.
    let mut d = Decision::new(policy(vec![prefix_step(500)]), request(t0), LIMITS);
    assert!(matches!(
        d.next(&with(&pool), t0),
        Action::Wait { pinned: true, .. }
    ));
    d.queued(9, t0);
    d.wait_ended(WaitEnd::TimedOut, late);
    pool[0].active = 4;
    assert_eq!(
        d.next(&with(&pool), late),
        Action::Wait {
            until: t0 + Duration::from_secs(60),
            place: Some(9),
            wake_first: None,
            prefer: Prefer::of([2]),
            pinned: false,
            head: false,
            pass_on: false,
        }
    );
    // A holder that fails a gate other than capacity is not waited for.
    pool[0].active = 0;
    pool[1].healthy = false;
    let mut d = Decision::new(policy(vec![prefix_step(500)]), request(t0), LIMITS);
    assert!(matches!(
        d.next(&with(&pool), t0),
        Action::Forward { agent_id: 1, .. }
    ));
}

#[test]
fn the_holder_wait_never_outlasts_the_prefill_it_saves() {
    let t0 = Instant::now();
    // Held by agent 2; learned: `secs` a byte of prefix, 1 s a request.
    fn learned(pool: &Vec<Agent>, secs: Option<f64>) -> ModelFacts<'_, Vec<Agent>> {
        ModelFacts {
            affinity: Some(&HeldBy2),
            miss: secs.map(
                |secs_per_byte| crate::logic::routing::affinity::miss_cost::Learned {
                    secs_per_byte,
                    mean_request_secs: 1.0,
                },
            ),
            ..facts(pool, 0)
        }
    }
    let pool = vec![agent(1, 0, 4, None), agent(2, 4, 4, None)];
    let with = |secs| learned(&pool, secs);
    let waits_until = |facts: &ModelFacts<'_, Vec<Agent>>| {
        let mut d = Decision::new(policy(vec![prefix_step(3000)]), request(t0), LIMITS);
        match d.next(facts, t0) {
            Action::Wait {
                until,
                pinned: true,
                ..
            } => Some(until - t0),
            _ => None,
        }
    };
    // Nothing learned yet: the configured bound.
    assert_eq!(waits_until(&with(None)), Some(Duration::from_millis(3000)));
    // A slow engine (1 ms a byte: the 4,096-byte prefix saves 4 s): the bound.
    assert_eq!(
        waits_until(&with(Some(0.001))),
        Some(Duration::from_millis(3000))
    );
    // A faster one (the prefix saves 410 ms of a 1 s request): no
    // longer than that.
    assert_eq!(
        waits_until(&with(Some(0.0001))),
        Some(Duration::from_secs_f64(4096.0 * 0.0001))
    );
    // Fast (it saves 41 ms, under WORTH of a request): no wait at all,
    // the idle agent at once.
    let mut d = Decision::new(policy(vec![prefix_step(3000)]), request(t0), LIMITS);
    assert!(matches!(
        d.next(&with(Some(0.00001)), t0),
        Action::Forward { agent_id: 1, .. }
    ));
    // And when every agent is full the request waits in line with no
    // preference: a slot freed on the holder goes to the head.
    let full = vec![agent(1, 4, 4, None), agent(2, 4, 4, None)];
    let prefer_of = |secs| {
        let mut d = Decision::new(policy(vec![prefix_step(3000)]), request(t0), LIMITS);
        match d.next(&learned(&full, Some(secs)), t0) {
            Action::Wait { prefer, .. } => prefer,
            a => panic!("{a:?}"),
        }
    };
    assert_eq!(prefer_of(0.00001), Prefer::default());
    assert_eq!(prefer_of(0.001), Prefer::of([2]));
}

// === the machine's continuation and provider (issue 50) ===

fn with_provider(steps: Vec<Step>) -> Arc<Policy> {
    let mut p = (*policy(steps)).clone();
    p.fallback_provider = Some(crate::logic::http::api::provider::FallbackProvider {
        engine: crate::logic::http::api::provider::Engine::OpenAi,
        model: "gpt".into(),
    });
    Arc::new(p)
}

/// Forward once to the only free agent and break its stream.
fn broken(pool: &Vec<Agent>, migrations: u32, t0: Instant) -> Decision {
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), request(t0), LIMITS);
    let Action::Forward { agent_id, .. } = d.next(&facts(pool, 0), t0) else {
        panic!("forward expected");
    };
    d.stream_broke(agent_id, migrations, t0 + Duration::from_secs(60));
    d
}

#[test]
fn a_stream_resumed_after_an_upgrade_continues_at_once_on_any_agent() {
    let t0 = Instant::now();
    let pool = vec![agent(1, 0, 2, None), agent(2, 1, 2, None)];
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), request(t0), LIMITS);
    d.stream_resumed(2, t0 + Duration::from_secs(60));
    // No quota, admission or daily step again: the old process took them;
    // the least loaded agent, none excluded.
    let a = d.next(&facts(&pool, 0), t0);
    assert!(matches!(a, Action::Continue { agent_id: 1, .. }), "{a:?}");
    // A try that fails goes to the other one, then the tries run out.
    assert!(d.continuation_ended(&retryable()));
    let a = d.next(&facts(&pool, 0), t0);
    assert!(matches!(a, Action::Continue { agent_id: 2, .. }), "{a:?}");
    assert!(d.continuation_ended(&retryable()));
    assert_eq!(d.next(&facts(&pool, 0), t0), Action::Cut(CutReason::Failed));
    // Without an agent that can continue, it is cut at once.
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), request(t0), LIMITS);
    d.stream_resumed(2, t0 + Duration::from_secs(60));
    let none: Vec<Agent> = Vec::new();
    assert_eq!(
        d.next(&facts(&none, 0), t0),
        Action::Cut(CutReason::NoAgent)
    );
}

#[test]
fn a_continuation_goes_to_an_untried_agent_that_can_prefill() {
    let t0 = Instant::now();
    let mut pool = vec![
        agent(1, 0, 2, None),
        agent(2, 0, 2, None),
        agent(3, 0, 2, None),
    ];
    pool[1].engine = "ollama";
    // Agent 1 is the least loaded: the first forward goes there.
    pool[2].active = 1;
    let mut d = broken(&pool, 3, t0);
    // Agent 2 is free but its engine cannot continue; 3 can.
    let a = d.next(&facts(&pool, 0), t0);
    assert!(matches!(a, Action::Continue { agent_id: 3, .. }), "{a:?}");
    // It broke too: 1 and 3 were tried, 2 cannot: nothing is left.
    assert!(d.continuation_ended(&retryable()));
    assert_eq!(
        d.next(&facts(&pool, 0), t0),
        Action::Cut(CutReason::NoAgent)
    );
    // The end is sticky.
    assert_eq!(
        d.next(&facts(&pool, 0), t0),
        Action::Cut(CutReason::NoAgent)
    );
}

#[test]
fn a_continuation_waits_at_the_head_when_all_are_full_and_passes_a_vain_wake_on() {
    let t0 = Instant::now();
    let mut pool = vec![agent(1, 0, 1, None), agent(2, 1, 1, None)];
    let mut d = broken(&pool, 2, t0);
    pool[0].active = 1;
    let a = d.next(&facts(&pool, 0), t0);
    assert!(
        matches!(
            a,
            Action::Wait {
                head: true,
                pass_on: false,
                place: None,
                ..
            }
        ),
        "{a:?}"
    );
    d.queued(9, t0);
    d.wait_ended(WaitEnd::Woken, t0);
    // Woken, yet still full (another took the slot): wait again, and the
    // wake goes on to the next waiter.
    assert!(matches!(
        d.next(&facts(&pool, 0), t0),
        Action::Wait {
            head: true,
            pass_on: true,
            ..
        }
    ));
    // The client left while it waited: the continuation ends, once.
    d.wait_ended(WaitEnd::ClientGone, t0);
    assert_eq!(
        d.next(&facts(&pool, 0), t0),
        Action::Cut(CutReason::ClientGone)
    );
}

#[test]
fn a_continuation_stops_after_its_tries_and_at_the_deadline() {
    let t0 = Instant::now();
    let pool = vec![
        agent(1, 0, 2, None),
        agent(2, 0, 2, None),
        agent(3, 0, 2, None),
    ];
    let mut d = broken(&pool, 1, t0);
    assert!(matches!(
        d.next(&facts(&pool, 0), t0),
        Action::Continue { .. }
    ));
    assert!(d.continuation_ended(&AttemptEnd::Full));
    assert_eq!(d.next(&facts(&pool, 0), t0), Action::Cut(CutReason::Failed));
    let mut d = broken(&pool, 3, t0);
    let late = t0 + Duration::from_secs(61);
    assert_eq!(
        d.next(&facts(&pool, 0), late),
        Action::Cut(CutReason::Deadline)
    );
    // Served: the answer is finished.
    let mut d = broken(&pool, 3, t0);
    assert!(matches!(
        d.next(&facts(&pool, 0), t0),
        Action::Continue { .. }
    ));
    assert!(!d.continuation_ended(&AttemptEnd::Responded));
}

#[test]
fn a_stream_breaking_after_the_request_deadline_is_still_continued() {
    // Issue 56: the budget counts from the break. A stream that has run
    // for ten minutes (far past the request's 60 s) breaks: continued.
    let t0 = Instant::now();
    let pool = vec![agent(1, 0, 2, None), agent(2, 0, 2, None)];
    let mut d = Decision::new(policy(vec![step("p", None, 0)]), request(t0), LIMITS);
    let Action::Forward { agent_id, .. } = d.next(&facts(&pool, 0), t0) else {
        panic!("forward expected");
    };
    let broke = t0 + Duration::from_secs(600);
    d.stream_broke(agent_id, 1, broke + Duration::from_secs(60));
    assert_eq!(d.continuation_deadline(), broke + Duration::from_secs(60));
    assert!(matches!(
        d.next(&facts(&pool, 0), broke),
        Action::Continue { .. }
    ));
    // Its own budget still ends it: every agent full past it is a cut.
    let mut d = broken(&pool, 2, t0);
    let full = vec![agent(1, 2, 2, None), agent(2, 2, 2, None)];
    assert!(matches!(
        d.next(&facts(&full, 0), t0),
        Action::Wait { head: true, until, .. } if until == t0 + Duration::from_secs(60)
    ));
    assert_eq!(
        d.next(&facts(&full, 0), t0 + Duration::from_secs(61)),
        Action::Cut(CutReason::Deadline)
    );
}

#[test]
fn the_provider_comes_only_after_the_steps_ran_out_and_once() {
    let t0 = Instant::now();
    let pool = vec![agent(1, 0, 1, None)];
    let no_queue = Limits {
        queue_depth: 0,
        ..LIMITS
    };
    let mut d = Decision::new(
        with_provider(vec![step("p", None, 1)]),
        request(t0),
        no_queue,
    );
    // A free agent: a forward, not the provider.
    let Action::Forward { agent_id, .. } = d.next(&facts(&pool, 0), t0) else {
        panic!("forward expected");
    };
    assert!(d.attempt_ended(agent_id, &retryable()));
    // Its one try failed: the steps ran out, the provider now.
    assert_eq!(d.next(&facts(&pool, 0), t0), Action::Provider);
    // Never twice: asked again, the refusal stands.
    assert!(matches!(d.next(&facts(&pool, 0), t0), Action::Reject(_)));
    // A model with no agent here: no local step can serve it, so the
    // provider (issue 56); without one, the 404.
    let mut d = Decision::new(with_provider(vec![step("p", None, 1)]), request(t0), LIMITS);
    assert_eq!(d.next(&facts(&Vec::new(), 0), t0), Action::Provider);
    let mut d = Decision::new(policy(vec![step("p", None, 1)]), request(t0), LIMITS);
    assert_eq!(
        d.next(&facts(&Vec::new(), 0), t0),
        Action::Reject(Rejection::ModelNotFound.into())
    );
    // Not for an embedding request.
    let mut emb = request(t0);
    emb.endpoint = Endpoint::Embeddings;
    let mut e = agent(1, 1, 1, None);
    e.capability = Capability::Embedding;
    let mut d = Decision::new(with_provider(vec![step("p", None, 1)]), emb, no_queue);
    assert_eq!(
        d.next(&facts(&vec![e], 0), t0),
        Action::Reject(Rejection::NoCapacity.into())
    );
    // Past the deadline: refused as timed out, the provider not tried.
    let full = vec![agent(1, 1, 1, None)];
    let mut d = Decision::new(
        with_provider(vec![step("p", None, 1)]),
        request(t0),
        no_queue,
    );
    let late = t0 + Duration::from_secs(61);
    assert_eq!(
        d.next(&facts(&full, 0), late),
        Action::Reject(Rejection::ProviderTimeout.into())
    );
}

proptest! {
    /// Whatever the pool and however each try ends, a continuation never
    /// picks an agent already tried for the answer nor one whose engine
    /// cannot prefill, makes at most its tries, and ends exactly once.
    #[test]
    fn a_continuation_never_repeats_an_agent_and_ends_once(
        pool in proptest::collection::vec((0u32..3, 1u32..3, any::<bool>()), 1..6),
        migrations in 1u32..4,
        ends in proptest::collection::vec(0u8..4, 8),
    ) {
        let t0 = Instant::now();
        let pool: Vec<Agent> = pool
            .into_iter()
            .enumerate()
            .map(|(i, (active, capacity, prefill))| {
                let mut a = agent(i as u64 + 1, active.min(capacity - 1), capacity, None);
                a.engine = if prefill { "vllm" } else { "ollama" };
                a
            })
            .collect();
        let mut d = Decision::new(policy(vec![step("p", None, 0)]), request(t0), LIMITS);
        let first = match d.next(&facts(&pool, 0), t0) {
            Action::Forward { agent_id, .. } => agent_id,
            a => panic!("a free agent exists: {a:?}"),
        };
        d.stream_broke(first, migrations, t0 + Duration::from_secs(60));
        let mut tried = vec![first];
        let mut cuts = 0;
        for e in ends {
            match d.next(&facts(&pool, 0), t0) {
                Action::Continue { agent_id, .. } => {
                    prop_assert!(!tried.contains(&agent_id));
                    let engine = pool.iter().find(|a| a.id == agent_id).map(|a| a.engine);
                    prop_assert_eq!(engine, Some("vllm"));
                    tried.push(agent_id);
                    let end = match e {
                        0 => AttemptEnd::Responded,
                        1 => AttemptEnd::Full,
                        _ => retryable(),
                    };
                    if !d.continuation_ended(&end) {
                        break;
                    }
                }
                Action::Cut(_) => {
                    cuts += 1;
                    break;
                }
                a => panic!("only continuations or a cut: {a:?}"),
            }
        }
        prop_assert!(tried.len() as u32 <= migrations + 1);
        prop_assert!(cuts <= 1);
    }

    /// For any pool and tries: a refusal ends the request exactly once
    /// (the machine answers the same refusal however often it is asked),
    /// and the provider comes at most once, only after the steps ran out.
    #[test]
    fn every_refusal_ends_exactly_once(
        pool in proptest::collection::vec((0u32..3, 1u32..3), 0..4),
        provider in any::<bool>(),
    ) {
        let t0 = Instant::now();
        let pool: Vec<Agent> = pool
            .into_iter()
            .enumerate()
            .map(|(i, (active, capacity))| agent(i as u64 + 1, active.min(capacity), capacity, None))
            .collect();
        let pol = if provider { with_provider(vec![step("p", None, 1)]) } else { policy(vec![step("p", None, 1)]) };
        let no_queue = Limits { queue_depth: 0, ..LIMITS };
        let mut d = Decision::new(pol, request(t0), no_queue);
        let mut forwards = 0;
        let mut providers = 0;
        let verdict = loop {
            match d.next(&facts(&pool, 0), t0) {
                Action::Forward { agent_id, .. } => {
                    forwards += 1;
                    prop_assert!(d.attempt_ended(agent_id, &retryable()));
                }
                Action::Provider => {
                    providers += 1;
                    prop_assert!(provider);
                }
                Action::Reject(r) => break r,
                a => panic!("unexpected: {a:?}"),
            }
        };
        prop_assert!(providers <= usize::from(provider));
        prop_assert!(forwards <= 1);
        for _ in 0..3 {
            prop_assert_eq!(d.next(&facts(&pool, 0), t0), Action::Reject(verdict.clone()));
        }
    }
}
