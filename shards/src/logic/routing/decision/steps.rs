//! The decision machine's policy steps: what the step in use offers a
//! request ([`Decision::choose`]: the selector's pick, bent by the holder
//! wait, the class and tenant reservations and the line already waiting),
//! the action that follows ([`Decision::act`]), and why the steps ran out.

use std::time::Instant;

use super::{Action, Decision, ModelFacts, Pool, Rejection};
use crate::logic::routing::affinity::miss_cost;
use crate::logic::routing::affinity::{AffinityPick, Outcome};
use crate::logic::routing::policy::{self, GateCounts, StepPick};
use crate::logic::routing::wait_queue::Prefer;

/// What one policy step offers a request at one decision.
pub(super) struct Choice {
    pick: StepPick,
    outcome: Option<Outcome>,
    holders: crate::logic::routing::affinity::Holders,
    /// A hit on the holders is worth waiting or reordering for.
    worth: bool,
    /// A wait for the holders only.
    pinned: bool,
    /// A newcomer saw this agent free while others wait.
    wake_first: Option<u64>,
}

// === impl Decision ===

impl Decision {
    /// Each agent's verdict at the step in use (the gate that removes it
    /// for this request, or `eligible`), the first `max` agents of `pool`
    /// by id: what a traced request's attempt shows.
    pub fn verdicts<P: Pool + ?Sized>(&self, pool: &P, max: usize) -> Vec<(u64, &'static str)> {
        let Some(step) = self.policy.steps.get(self.session.step) else {
            return Vec::new();
        };
        let cap = self.request.endpoint.capability();
        (0..pool.agent_count().min(max))
            .filter_map(|i| pool.facts(i))
            .map(|a| (a.id, policy::verdict(step, cap, &a, &self.session.failed)))
            .collect()
    }

    /// What the step in use offers this request now: the selector's pick,
    /// bent by the holder wait (`holder_wait_ms`), the class and tenant
    /// reservations, and the line of requests already waiting.
    pub(super) fn choose<P: Pool + ?Sized>(
        &mut self,
        step: &policy::Step,
        model: &ModelFacts<'_, P>,
        now: Instant,
    ) -> Choice {
        let cap = self.request.endpoint.capability();
        let n = model.pool.agent_count();
        let holders = match (&step.affinity, model.affinity) {
            (Some(cfg), Some(src)) => src.lookup(cfg),
            _ => Default::default(),
        };
        let (mut pick, mut outcome) = policy::select_with(
            step,
            cap,
            n,
            |i| model.pool.facts(i),
            &self.session.failed,
            model.rotation,
            &holders,
        );
        // What a hit saves: the holders' prefix, or for a session key
        // (no depth) half of this prompt, as `check_prediction`.
        let depth = holders.iter().map(|h| h.depth).max().unwrap_or(0);
        let bytes = if depth > 0 {
            depth as f64
        } else {
            self.request.body_bytes as f64 / 2.0
        };
        let saving = model.miss.map(|m| m.saving(bytes));
        let worth = saving.is_none_or(|(_, w)| w);
        // Every holder full: wait for one of them a while rather than
        // pay the prefill again elsewhere (`holder_wait_ms`); a request
        // that waited takes a holder's free slot whatever the band.
        let mut pinned = false;
        if let (Some(Outcome::Overloaded), Some(cfg), true) =
            (outcome, step.affinity.as_ref(), worth)
        {
            let wait = miss_cost::holder_wait(cfg.holder_wait_ms, saving.map(|(s, _)| s));
            match self.hold_for_holders(step, model, &holders, wait, now) {
                Some(Some(h)) => {
                    pick = StepPick::Agent(h);
                    outcome = Some(Outcome::hit(holders.kind));
                }
                Some(None) => {
                    pick = StepPick::Full(GateCounts::default());
                    pinned = true;
                }
                None => {}
            }
        }
        let mut wake_first = None;
        let held_back =
            model.reserved_for_others || (model.headroom_for_others && self.place.is_none());
        if matches!(pick, StepPick::Agent(_)) && held_back {
            pick = StepPick::Full(GateCounts::default());
        }
        if let StepPick::Agent(i) = pick {
            let depth = self.limits.queue_depth;
            if self.place.is_none() && depth > 0 && (1..depth).contains(&model.queue_len) {
                // Requests already waiting came first: a newcomer joins
                // the line and the free slot goes to a waiter (the
                // head, or one that agent holds the prefix of). A full
                // line does not refuse it: a slot free while the line is
                // full is one its waiters did not take (they wait for
                // their holders), and a refusal would leave it idle.
                wake_first = model.pool.facts(i).map(|f| f.id);
                pick = StepPick::Full(GateCounts::default());
            }
        }
        Choice {
            pick,
            outcome,
            holders,
            worth,
            pinned,
            wake_first,
        }
    }

    /// Its holders are all full and a hit is worth `wait`: `Some(Some(i))`
    /// when it already waited and holder `i` is free now, `Some(None)` to
    /// wait for them (until the pin's end), `None` when it may not wait
    /// (no queue, the pin or the deadline passed).
    fn hold_for_holders<P: Pool + ?Sized>(
        &mut self,
        step: &policy::Step,
        model: &ModelFacts<'_, P>,
        holders: &crate::logic::routing::affinity::Holders,
        wait: std::time::Duration,
        now: Instant,
    ) -> Option<Option<usize>> {
        let until = self.pin_until.unwrap_or(now + wait);
        let may_wait = (self.pin_until.is_some() || !wait.is_zero())
            && (self.place.is_some() || self.limits.queue_depth > 0)
            && now < until
            && now < self.request.deadline;
        if !may_wait {
            return None;
        }
        let (cap, n) = (self.request.endpoint.capability(), model.pool.agent_count());
        let get = |i| model.pool.facts(i);
        let failed = &self.session.failed;
        let free = self
            .pin_until
            .and_then(|_| policy::free_holder(step, cap, n, get, failed, holders));
        if free.is_some() {
            return Some(free);
        }
        if policy::holder_full(step, cap, n, get, failed, holders) {
            self.pin_until = Some(until);
            return Some(None);
        }
        None
    }

    /// The action of a step's choice: a forward, a wait, or `None` when
    /// the step is used up and the next one is asked.
    pub(super) fn act<P: Pool + ?Sized>(
        &mut self,
        step: &policy::Step,
        model: &ModelFacts<'_, P>,
        c: Choice,
        now: Instant,
    ) -> Option<Action> {
        match c.pick {
            StepPick::Agent(i) => {
                let Some(agent_id) = model.pool.facts(i).map(|f| f.id) else {
                    return Some(self.reject(Rejection::Exhausted, now));
                };
                self.last_full = false;
                // Kept aside: a full refusal sends it back there.
                self.forwarded_from = self.place.take();
                let waited = self
                    .queued_at
                    .take()
                    .map(|t| now.saturating_duration_since(t));
                let affinity =
                    match (c.outcome, &step.affinity) {
                        (Some(outcome), Some(cfg)) => Some(AffinityPick {
                            outcome,
                            block_bytes: cfg.block_bytes,
                            hit: c.holders.find(agent_id).copied().filter(|_| {
                                matches!(outcome, Outcome::KeyHit | Outcome::PrefixHit)
                            }),
                            predicted: c.holders.iter().max_by_key(|h| h.depth).copied(),
                            held: self.pin_until.is_some(),
                        }),
                        _ => None,
                    };
                Some(Action::Forward {
                    agent: i,
                    agent_id,
                    step: self.session.step,
                    waited,
                    affinity,
                })
            }
            StepPick::Full(counts) => {
                self.last_full = true;
                // A waiter that lost a race keeps its original place;
                // a newcomer needs room under `--queue-depth`, or a
                // place ahead of the last waiter of a full queue (the
                // queue decides: [`WaitEnd::Refused`] when it has none).
                if self.place.is_some() || self.limits.queue_depth > 0 {
                    self.waiting_counts = counts;
                    self.pinned = c.pinned;
                    let until = match (c.pinned, self.pin_until) {
                        (true, Some(p)) => p.min(self.request.deadline),
                        _ => self.request.deadline,
                    };
                    let worth = c.worth;
                    return Some(Action::Wait {
                        until,
                        place: self.place,
                        wake_first: c.wake_first,
                        // A slot freed on a holder may go to it ahead
                        // of the line, where the hit is worth it.
                        prefer: Prefer::of(c.holders.iter().filter(|_| worth).map(|h| h.agent)),
                        pinned: c.pinned,
                        head: false,
                        pass_on: false,
                    });
                }
                self.session.trail.push((self.session.step, counts));
                self.session.advance();
                None
            }
            StepPick::Empty(counts) => {
                self.last_full = false;
                self.session.trail.push((self.session.step, counts));
                self.session.advance();
                None
            }
        }
    }

    /// Why every step ran out: no agent with the endpoint's capability,
    /// none of those healthy, every candidate full, or no eligible agent.
    pub(super) fn out_of_steps<P: Pool + ?Sized>(&self, model: &ModelFacts<'_, P>) -> Rejection {
        let n = model.pool.agent_count();
        let cap = self.request.endpoint.capability();
        if n > 0 && (0..n).all(|i| model.pool.facts(i).is_none_or(|f| f.capability != cap)) {
            Rejection::CapabilityMismatch(cap)
        } else if (0..n).all(|i| {
            model
                .pool
                .facts(i)
                .is_none_or(|f| !f.healthy || f.capability != cap)
        }) {
            // Every agent that could serve it is down.
            Rejection::NoAgentsAvailable
        } else if self.last_full {
            Rejection::NoCapacity
        } else {
            Rejection::Exhausted
        }
    }
}
