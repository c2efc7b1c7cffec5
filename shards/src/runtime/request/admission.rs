//! The admission gate on the model's owner shard: the pure gates of
//! [`crate::logic::routing::admission`] applied to the model's live facts (healthy
//! replicas, engine signals) and its state
//! ([`crate::runtime::state::model::admission`]). All of it is state of the owner
//! shard: no lock and no cross-core message on the request path.
//!
//! Entry point: [`admit`], with a [`Park`] that says how long a request
//! may wait for room (the park timeout; the hold budget after a wake) and
//! how often the room is recomputed meanwhile; it ends as the decision
//! machine's [`AdmitEnd`].

use crate::logic::routing::admission::{self, Ask, Grant, Pressure, Reason, Room};
use crate::logic::routing::decision::{AdmitEnd, Park};
use crate::logic::routing::policy::{AdmissionPolicy, Mode};
use crate::logic::tenancy::auth::Limits;
use crate::runtime::state::model::admission::{self as state, Admitted, Entry, Shared};
use crate::runtime::state::scope::Client;
use crate::runtime::state::shard::Shard;
use crate::runtime::state::tenancy::Principal;
use crate::runtime::wire::clock;

/// What a request brings to admission.
pub struct Request<'a> {
    /// The effective policy's admission fields.
    pub policy: &'a AdmissionPolicy,
    /// Who sent it (B4 reads the key).
    pub principal: &'a Principal,
    /// Input-token estimate.
    pub estimate: u64,
    /// Declared output (`max_completion_tokens`, else `max_tokens`).
    pub declared_output: u64,
    /// Image parts.
    pub images: u64,
    /// `HIVENET_ROUTER_ADMIT_FRACTION`.
    pub fraction: f64,
    /// Its class and tenant (the park's order).
    pub fair: crate::logic::routing::wait_queue::Fair,
}

/// Healthy agents of the model and the pressure of its pool.
fn pool_facts(shard: &Shard, model: &str) -> (u64, Pressure) {
    let Some(m) = shard.model(model) else {
        return (0, Pressure::default());
    };
    let m = m.borrow();
    let healthy = m.agents.iter().filter(|a| a.healthy()).count() as u64;
    let pr = admission::pressure(m.agents.iter().map(|a| (a.healthy(), a.signals.get())));
    (healthy, pr)
}

fn state_of(shard: &Shard, model: &str) -> Option<Shared> {
    shard.model(model).map(|m| m.borrow().admission.clone())
}

/// Run the gates for `r` on `model` (an LLM request other than
/// count_tokens): B1, B3, B2 (waiting per `wait`), B4 occupancy share,
/// B4 OTPM and ITPM.
pub async fn admit(
    shard: &Shard,
    c: &mut Client,
    model: &str,
    r: Request<'_>,
    wait: Park,
) -> Result<Admitted, AdmitEnd> {
    let p = r.policy;
    admission::caps(p, r.estimate, r.images).map_err(|e| AdmitEnd::Refused(Reason::B1, e))?;
    // No agent state here: the decision machine answers 404 next.
    let Some(state) = state_of(shard, model) else {
        return Ok(Admitted::default());
    };
    let (replicas, pressure) = pool_facts(shard, model);
    if admission::shed(p, &pressure) {
        return Err(AdmitEnd::Refused(Reason::B3, Reason::B3.error()));
    }
    let key = match r.principal {
        Principal::Key(c) if p.mode == Mode::Serverless => Some(&c.key),
        _ => None,
    };
    let mut out = Admitted::default();
    if p.occupancy() {
        let share = key.and_then(|k| {
            admission::share_budget(p, k.max_occupancy_share, replicas)
                .map(|b| (k.key_id.clone(), b))
        });
        let ask = Ask {
            footprint: admission::footprint(r.estimate, r.declared_output),
            share,
            fair: r.fair,
        };
        let room = admission::room(p, r.fraction, replicas);
        // What a later recompute needs (no allocation: `shed_if` stays empty).
        state.borrow_mut().last = Some((
            AdmissionPolicy {
                admit_budget_tokens: p.admit_budget_tokens,
                max_inflight: p.max_inflight,
                ..AdmissionPolicy::default()
            },
            r.fraction,
        ));
        let id = occupy(shard, c, model, &state, ask, room, wait).await?;
        out.reservation = Some(state::reservation(
            &state,
            id,
            r.estimate,
            r.declared_output,
        ));
    }
    if let Some(k) = key {
        if let Limits::Flat { itpm, otpm, .. } = k.limits {
            if itpm > 0 || otpm > 0 {
                let now = clock::mono_ns();
                state::take_rates(&state, &k.key_id, itpm, otpm, r.estimate, now)
                    .map_err(|reason| AdmitEnd::Refused(reason, reason.error()))?;
            }
            if otpm > 0 {
                out.otpm = Some((state.clone(), k.key_id.clone(), otpm));
            }
        }
    }
    Ok(out)
}

/// B4 rates before a hold (issue 56, seed B4): a serverless key whose
/// per-minute input or output tokens would refuse the request after the
/// wake is refused now, before the request counts in the pending demand.
/// A request larger than a whole minute of its key's ITPM never fits.
pub fn rates_before_hold(
    shard: &Shard,
    model: &str,
    policy: &AdmissionPolicy,
    principal: &Principal,
    estimate: u64,
) -> Result<(), Reason> {
    let Principal::Key(c) = principal else {
        return Ok(());
    };
    let Limits::Flat { itpm, otpm, .. } = c.key.limits else {
        return Ok(());
    };
    if policy.mode != Mode::Serverless || (itpm == 0 && otpm == 0) {
        return Ok(());
    }
    if itpm > 0 && estimate > itpm {
        return Err(Reason::B4Itpm);
    }
    match state_of(shard, model) {
        Some(s) => state::rates_allow(&s, &c.key.key_id, itpm, otpm, estimate, clock::mono_ns()),
        // Never served here: its buckets are full.
        None => Ok(()),
    }
}

/// B2 (+ B4 share): a reservation id, at once or after a wait.
async fn occupy(
    shard: &Shard,
    c: &mut Client,
    model: &str,
    state: &Shared,
    ask: Ask,
    room: Room,
    wait: Park,
) -> Result<u64, AdmitEnd> {
    use futures::future::{select, Either};
    let refused = |reason: Reason| AdmitEnd::Refused(reason, reason.error());
    let may_park = wait.until > clock::now();
    let mut place = match state::enter(state, ask, room, may_park) {
        Entry::Granted(id) => return Ok(id),
        Entry::Refused(reason) => return Err(refused(reason)),
        Entry::Parked(place) => place,
    };
    loop {
        let now = clock::now();
        let until = match wait.recompute {
            Some(every) => wait.until.min(now + every),
            None => wait.until,
        };
        let timer = monoio::time::sleep(until.saturating_duration_since(now));
        futures::pin_mut!(timer);
        match c.unless_gone(select(&mut place.rx, timer)).await {
            None => return Err(AdmitEnd::ClientGone),
            Some(Either::Left((Ok(g), _))) => {
                place.done = true;
                return match g {
                    Grant::Granted(id) => Ok(id),
                    Grant::TooLarge => Err(refused(Reason::B2)),
                    Grant::ShareExceeded => Err(refused(Reason::B4Occupancy)),
                };
            }
            // The sender went without a word (cannot happen: grants are
            // always sent); treated as no room.
            Some(Either::Left((Err(_), _))) => return Err(AdmitEnd::WaitEnded),
            Some(Either::Right(_)) => {
                if clock::now() >= wait.until {
                    // `place` drops: the ticket is cancelled, a grant
                    // that raced the timer is released.
                    return Err(AdmitEnd::WaitEnded);
                }
                let (replicas, _) = pool_facts(shard, model);
                state.borrow_mut().replicas_changed(replicas);
            }
        }
    }
}
