//! Fairness among priority classes (`min_share`) and tenants
//! (`tenant_headroom`, the fair order of issue 32), the request's side:
//! the facts the decision reads ([`held_back`]) and the bookkeeping at
//! the driver's fixed hooks: [`ClassRunning`] from a
//! forward's start to its end, [`waited`] when a request leaves the
//! capacity queue, [`true_up`] when its usage is known. Its counters and
//! metric families are the model's
//! ([`crate::runtime::state::model::fairness`]). The per-tenant state itself is
//! the capacity queue's ([`crate::runtime::state::model::Waiters`]); the
//! pure parts are in [`crate::logic::routing::wait_queue::tenant_slots`] and
//! [`crate::logic::routing::wait_queue`].

use std::time::Duration;

use crate::logic::routing::decision::Pool;
use crate::logic::routing::wait_queue::{Class, Fair};
use crate::runtime::state::model::{tenant_ended, ModelRef, ModelState};
use crate::runtime::state::tenancy::Principal;

/// Who asks, for the fairness facts.
#[derive(Debug, Clone, Copy)]
pub struct Asker<'a> {
    /// Its priority class.
    pub class: Class,
    /// Its policy's `min_share` per class.
    pub min_share: &'a [f64; 3],
    /// Its tenant, hashed.
    pub tenant: u64,
    /// Its policy's `tenant_headroom`.
    pub headroom: u32,
}

/// Facts hook: whether the model's free slots are reserved for other
/// classes (`min_share`), and whether they are calm tenants' headroom
/// while the asker's tenant floods (`tenant_headroom`). Counted only when
/// one of them may apply (a few additions).
pub fn held_back(m: &ModelState, a: Asker<'_>) -> (bool, bool) {
    let shares = a.min_share.iter().any(|s| *s > 0.0);
    // The tenant runs a request and so does another: the others'
    // headroom may bind (otherwise it is under its share, or alone).
    let tenants = a.headroom > 0 && {
        let q = m.queue.borrow();
        q.tenants.tenants() > 1 && q.tenants.running(a.tenant) > 0
    };
    if !(shares || tenants) {
        return (false, false);
    }
    let pool = &m.agents[..];
    let (mut capacity, mut in_flight) = (0u64, 0u64);
    for i in 0..pool.agent_count() {
        if let Some(f) = pool.facts(i).filter(|f| f.healthy) {
            capacity += u64::from(f.capacity);
            in_flight += u64::from(f.active);
        }
    }
    let by_tenant = tenants && {
        let mut q = m.queue.borrow_mut();
        q.tenants.set_view(capacity, a.headroom);
        // Woken waiters on their way to a slot count too.
        let free = capacity.saturating_sub(in_flight.max(q.tenants.in_flight()));
        !q.tenants.may_start(a.tenant, capacity, free, a.headroom)
    };
    let by_class = shares
        && crate::logic::routing::policy::reserved_for_others(
            a.min_share,
            a.class.index(),
            capacity,
            in_flight,
            &m.running,
        );
    (by_class, by_tenant)
}

/// The tenant's share of the model's running requests, for its trace:
/// (its requests running, all tenants' requests running, tenants running).
pub fn tenant_share(m: &ModelState, tenant: u64) -> (u32, u32, usize) {
    let q = m.queue.borrow();
    let all = m.running.iter().copied().sum::<u32>();
    (q.tenants.running(tenant), all, q.tenants.tenants())
}

/// Hook: the request left the capacity queue for a forward after `w`.
pub fn waited(m: &mut ModelState, class: Class, principal: &Principal, w: Duration) {
    let s = &mut m.stats;
    s.classes.observe_wait(class, w.as_secs_f64());
    let (tenant, key) = principal.names();
    if let Some(t) = s.tenant(tenant, key) {
        t.queue_waits += 1;
        t.queue_wait_us += u64::try_from(w.as_micros()).unwrap_or(u64::MAX);
    }
}

/// Hook: the request that waited as `who` used `tokens`: its tenant's
/// fair order is trued up with the real usage.
pub fn true_up(m: &ModelState, who: Fair, tokens: u64) {
    m.queue.borrow_mut().true_up(who, tokens);
}

/// A request of a class and tenant in flight on its model, for
/// `min_share` and `tenant_headroom` (counted from the forward's start
/// to its end, whichever way it ends).
pub struct ClassRunning {
    model: ModelRef,
    class: Class,
    tenant: u64,
}

impl ClassRunning {
    /// `who`: its class and tenant. `claimed`: its wake already counted it
    /// in its tenant's requests. `first`: the request's first forward,
    /// counted admitted in its class.
    pub fn start(model: &ModelRef, who: Fair, claimed: bool, first: bool) -> Self {
        let (class, tenant) = (who.class, who.tenant);
        let mut m = model.borrow_mut();
        if let Some(n) = m.running.get_mut(class.index()) {
            *n += 1;
        }
        if !claimed {
            m.queue.borrow_mut().tenants.start(tenant);
        }
        if let Some(n) = m.stats.classes.admitted.get_mut(class.index()) {
            *n += u64::from(first);
        }
        ClassRunning {
            model: model.clone(),
            class,
            tenant,
        }
    }
}

impl Drop for ClassRunning {
    fn drop(&mut self) {
        let queue = match self.model.try_borrow_mut() {
            Ok(mut m) => {
                if let Some(n) = m.running.get_mut(self.class.index()) {
                    *n = n.saturating_sub(1);
                }
                Some(m.queue.clone())
            }
            Err(_) => None,
        };
        // The slot was freed before its tenant's count fell: a waiter
        // passed by for its tenant meanwhile may take a slot now.
        if let Some(queue) = queue {
            tenant_ended(&queue, self.tenant);
        }
    }
}
