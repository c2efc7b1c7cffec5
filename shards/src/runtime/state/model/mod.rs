//! Per-model state on the model's shard: its agents and their slots, the
//! capacity queue, the routing statistics. The hold queue and the quota
//! buckets of later issues belong here too.
//!
//! Key types: [`ModelState`], [`agent::Agent`], [`agent::Slot`],
//! [`stats::ModelStats`].

pub mod admission;
pub mod affinity;
pub mod agent;
pub mod continuity;
pub mod conversations;
pub mod fairness;
pub mod stats;

use std::cell::RefCell;
use std::rc::Rc;

use self::agent::Agent;
use self::stats::ModelStats;
use crate::logic::routing::decision::Pool;
use crate::logic::routing::policy::AgentFacts;
use crate::logic::routing::wait_queue::tenant_slots::TenantSlots;
use crate::logic::routing::wait_queue::{Prefer, WaitQueue, LOOK_AHEAD, MAX_PASSES};
use crate::logic::system::log_gate::LogGate;

/// One request in the capacity queue.
pub struct Waiter {
    /// Woken through it: `true` when the wake claimed a slot for its
    /// tenant (see [`Claim`]).
    pub tx: futures::channel::oneshot::Sender<bool>,
    /// The agents that hold its prefix (prefix-aware steps only).
    pub prefer: Prefer,
    /// Waiting for a slot on those agents only (`holder_wait_ms`): a slot
    /// freed elsewhere passes it by.
    pub pinned: bool,
    /// Its tenant, hashed (0: none, a continued stream): a freed slot
    /// passes by a flooding tenant while calm ones keep their headroom.
    pub tenant: u64,
}

/// The capacity queue's waiters, and the requests in flight per tenant
/// that decide who may take a freed slot (`tenant_headroom`).
#[derive(Default)]
pub struct Waiters {
    /// In order: class, fair tag, arrival.
    pub line: WaitQueue<Waiter>,
    /// Requests in flight per tenant, and woken ones on their way to a
    /// slot (claimed at the wake, or several slots freed in one turn would
    /// all look free to a flooding tenant's waiters).
    pub tenants: TenantSlots,
    /// A freed slot found no waiter that could take it (every one near the
    /// head of a tenant that must leave it): the next request end tries
    /// again.
    pub skipped: bool,
}

impl std::ops::Deref for Waiters {
    type Target = WaitQueue<Waiter>;
    fn deref(&self) -> &Self::Target {
        &self.line
    }
}

impl std::ops::DerefMut for Waiters {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.line
    }
}

/// A slot claimed for a woken waiter's tenant, counted as in flight until
/// its request starts on an agent ([`Claim::started`]) or gives up (drop:
/// counted out, and a waiter passed by for it may go).
pub struct Claim {
    /// None once started.
    queue: Option<Rc<RefCell<Waiters>>>,
    tenant: u64,
}

impl Claim {
    /// A claim the wake made for `tenant` on `queue`.
    pub fn new(queue: Rc<RefCell<Waiters>>, tenant: u64) -> Self {
        Claim {
            queue: Some(queue),
            tenant,
        }
    }

    /// Its request started: the count stays, now the request's own.
    pub fn started(mut self) {
        self.queue = None;
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Some(q) = self.queue.take() {
            tenant_ended(&q, self.tenant);
        }
    }
}

/// A request of `tenant` left (ended, or gave up a claimed slot): counted
/// out; a waiter passed by while it was counted may take a slot now.
pub fn tenant_ended(queue: &RefCell<Waiters>, tenant: u64) {
    let skipped = match queue.try_borrow_mut() {
        Ok(mut q) => {
            q.tenants.end(tenant);
            std::mem::take(&mut q.skipped)
        }
        Err(_) => false,
    };
    if skipped {
        wake_head(queue);
    }
}

/// The next waiter a freed slot goes to (see [`WaitQueue::pop_for`]);
/// passing by waiters held for their cache holders and those of a tenant
/// that must leave the slot to the others' headroom. The slot is claimed
/// for its tenant.
fn pop_eligible(q: &RefCell<Waiters>, max_passes: u32, agent: Option<u64>) -> Option<Waiter> {
    let mut q = q.borrow_mut();
    let Waiters {
        line,
        tenants,
        skipped,
    } = &mut *q;
    let bound = tenants.tenants() > 1;
    let next = line.pop_for(
        LOOK_AHEAD,
        max_passes,
        |w| {
            agent.is_some_and(|a| !w.tx.is_canceled() && w.prefer.contains(a))
                && (!bound || tenants.may_take_now(w.tenant))
        },
        |w| !w.pinned && (!bound || tenants.may_take_now(w.tenant)),
    );
    *skipped = next.is_none() && !line.is_empty();
    let (_, w) = next?;
    tenants.unwait(w.tenant);
    if w.tenant != 0 {
        tenants.start(w.tenant);
    }
    Some(w)
}

/// Wake the first eligible waiter still waiting (a cancelled one passes
/// the signal and its claim on).
pub fn wake_head(q: &RefCell<Waiters>) {
    wake(q, 0, None);
}

/// A slot freed on `agent`: wake the waiter it serves from its cache
/// (within the queue's bounded look-ahead), else the oldest eligible.
pub fn wake_for(q: &RefCell<Waiters>, agent: u64) {
    wake(q, MAX_PASSES, Some(agent));
}

fn wake(q: &RefCell<Waiters>, max_passes: u32, agent: Option<u64>) {
    while let Some(w) = pop_eligible(q, max_passes, agent) {
        let claimed = w.tenant != 0;
        if w.tx.send(claimed).is_ok() {
            return;
        }
        if claimed {
            if let Ok(mut q) = q.try_borrow_mut() {
                q.tenants.end(w.tenant);
            }
        }
    }
}

/// Wake every waiter (a new or recovered agent); no slot is claimed.
pub fn wake_all(q: &RefCell<Waiters>) {
    let all = {
        let mut q = q.borrow_mut();
        let all = q.drain();
        for (_, w) in &all {
            q.tenants.unwait(w.tenant);
        }
        all
    };
    for (_, w) in all {
        let _ = w.tx.send(false);
    }
}

/// A model's state as its shard holds it: a request's run resolves it
/// once and keeps it.
pub type ModelRef = Rc<RefCell<ModelState>>;

/// One model's state on its shard.
#[derive(Default)]
pub struct ModelState {
    /// Registered agents.
    pub agents: Vec<Rc<Agent>>,
    /// Rotates the tie-break start (one step per decision).
    pub rotation: usize,
    /// Requests waiting for a slot.
    pub queue: Rc<RefCell<Waiters>>,
    /// Requests in flight per priority class (interactive, standard,
    /// batch): what `min_share` reservations count against.
    pub running: [u32; 3],
    /// Routing counters.
    pub stats: ModelStats,
    /// Rejections logged at most once a second, with their count.
    pub shed_log: LogGate,
    /// Admission: reservations, parked requests, key rate buckets, the
    /// learned tokens per byte.
    pub admission: self::admission::Shared,
    /// Since when it has had no agent (None: it has some).
    pub empty_since: Option<crate::runtime::wire::clock::Instant>,
    /// What an uncached prompt token costs on its engines, learned from
    /// prefix-aware requests (bounds `holder_wait_ms`).
    pub miss_cost: std::cell::Cell<crate::logic::routing::affinity::miss_cost::MissCost>,
}

// === impl ModelState ===

impl ModelState {
    /// Add `agent`; a re-registration of the same peer replaces its old
    /// entry. Every queued request is woken.
    pub fn add(&mut self, agent: Rc<Agent>) {
        self.agents.retain(|a| a.reg.peer_id != agent.reg.peer_id);
        self.agents.push(agent);
        self.empty_since = None;
        wake_all(&self.queue);
        self.replicas_changed();
    }

    /// Healthy replicas changed: parked admissions re-check the room.
    pub fn replicas_changed(&self) {
        let healthy = self.agents.iter().filter(|a| a.healthy()).count() as u64;
        self.admission.borrow_mut().replicas_changed(healthy);
    }

    /// Remove the agent with `id`; returns whether it was still here (a
    /// replaced registration is not). Its duration series go with it.
    pub fn remove(&mut self, id: u64) -> bool {
        let before = self.agents.len();
        self.agents.retain(|a| a.id != id);
        self.stats.durations.retain(|(a, _, _), _| *a != id);
        if self.agents.is_empty() && self.empty_since.is_none() {
            self.empty_since = Some(crate::runtime::wire::clock::now());
        }
        self.agents.len() != before
    }

    /// The agent registered for `peer_id`.
    pub fn by_peer(&self, peer_id: &str) -> Option<&Rc<Agent>> {
        self.agents.iter().find(|a| a.reg.peer_id == peer_id)
    }
}

impl Pool for [Rc<Agent>] {
    fn agent_count(&self) -> usize {
        self.len()
    }

    fn facts(&self, i: usize) -> Option<AgentFacts<'_>> {
        self.get(i).map(|a| a.facts())
    }
}
