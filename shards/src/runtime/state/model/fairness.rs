//! Fairness among priority classes (`min_share`) and tenants
//! (`tenant_headroom`, the fair order of issue 32), the model's sub-state:
//! its per-class counters and their metric families ([`ClassStats`],
//! [`render`]), the facts the decision reads ([`held_back`]) and the
//! bookkeeping at the driver's fixed hooks: [`ClassRunning`] from a
//! forward's start to its end, [`waited`] when a request leaves the
//! capacity queue, [`true_up`] when its usage is known. The per-tenant state itself is
//! the capacity queue's ([`crate::runtime::state::model::Waiters`]); the
//! pure parts are in [`crate::logic::routing::wait_queue::tenant_slots`] and
//! [`crate::logic::routing::wait_queue`].

use std::time::Duration;

use super::stats::QUEUE_BUCKETS;
use super::{tenant_ended, ModelRef, ModelState};
use crate::logic::routing::decision::Pool;
use crate::logic::routing::wait_queue::{Class, Fair};
use crate::runtime::state::tenancy::Principal;
use crate::runtime::wire::exposition::Kind::{Counter, Histogram as Hist};
use crate::runtime::wire::exposition::{Family, Histogram};

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

/// The model's requests by priority class: waits that ended with a slot,
/// admitted and refused (`hivenet_queue_wait_seconds`,
/// `hivenet_class_requests_total`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ClassStats {
    /// Waits in the capacity queue that ended with a slot, per class.
    pub wait: [Histogram; 3],
    /// Requests sent to an agent (once per request), per class.
    pub admitted: [u64; 3],
    /// Requests refused (no capacity, queue, quota or admission), per
    /// class.
    pub refused: [u64; 3],
}

impl ClassStats {
    /// Add another shard's counters of the model.
    pub fn add(&mut self, o: &ClassStats) {
        for (a, b) in self.wait.iter_mut().zip(&o.wait) {
            a.merge(b);
        }
        for (a, b) in self.admitted.iter_mut().zip(&o.admitted) {
            *a += b;
        }
        for (a, b) in self.refused.iter_mut().zip(&o.refused) {
            *a += b;
        }
    }

    /// Record one wait of a request of `class` that ended with a slot.
    pub fn observe_wait(&mut self, class: Class, secs: f64) {
        if let Some(h) = self.wait.get_mut(class.index()) {
            h.observe(&QUEUE_BUCKETS, secs);
        }
    }

    /// Count a refusal of a request of `class`.
    pub fn refuse(&mut self, class: Class) {
        if let Some(n) = self.refused.get_mut(class.index()) {
            *n += 1;
        }
    }
}

/// The class families: the standard class's series always (the series a
/// model had before classes), the others once they had a request.
pub fn render<'m, I>(o: &mut String, models: I)
where
    I: Iterator<Item = (&'m String, &'m ClassStats)> + Clone,
{
    let mut f = Family::new(
        o,
        "hivenet_queue_wait_seconds",
        Hist,
        "Waits in the capacity queue that ended with a slot, by priority class.",
        ["model", "class"],
    );
    for (m, st) in models.clone() {
        for (class, h) in Class::ALL.iter().zip(&st.wait) {
            if h.count > 0 || *class == Class::Standard {
                f.histogram([m, &class.as_str()], &QUEUE_BUCKETS, h);
            }
        }
    }
    let mut f = Family::new(
        o,
        "hivenet_class_requests_total",
        Counter,
        "Requests by priority class: admitted (sent to an agent, once per request) or refused (no capacity, queue, quota or admission).",
        ["model", "class", "outcome"],
    );
    for (m, st) in models {
        for (i, class) in Class::ALL.iter().enumerate() {
            let admitted = st.admitted.get(i).copied().unwrap_or(0);
            let refused = st.refused.get(i).copied().unwrap_or(0);
            if admitted + refused > 0 || *class == Class::Standard {
                f.series([m, &class.as_str(), &"admitted"], admitted);
                f.series([m, &class.as_str(), &"refused"], refused);
            }
        }
    }
}
