//! Per-model state on the model's shard: its agents and their slots, the
//! capacity queue, the routing statistics. The hold queue and the quota
//! buckets of later issues belong here too.
//!
//! Key types: [`ModelState`], [`agent::Agent`], [`agent::Slot`],
//! [`stats::ModelStats`].

pub mod admission;
pub mod agent;
pub mod stats;

use std::cell::RefCell;
use std::rc::Rc;

use self::agent::Agent;
use self::stats::ModelStats;
use crate::logic::routing::decision::Pool;
use crate::logic::routing::policy::AgentFacts;
use crate::logic::routing::wait_queue::{Prefer, WaitQueue, LOOK_AHEAD, MAX_PASSES};
use crate::logic::system::log_gate::LogGate;

/// One request in the capacity queue.
pub struct Waiter {
    /// Woken through it.
    pub tx: futures::channel::oneshot::Sender<()>,
    /// The agents that hold its prefix (prefix-aware steps only).
    pub prefer: Prefer,
    /// Waiting for a slot on those agents only (`holder_wait_ms`): a slot
    /// freed elsewhere passes it by.
    pub pinned: bool,
}

/// The capacity queue's waiters.
pub type Waiters = WaitQueue<Waiter>;

/// Wake the oldest waiter still waiting (a cancelled one passes the signal on).
pub fn wake_head(q: &RefCell<Waiters>) {
    loop {
        // A waiter held for its cache holders is passed by (see wake_for).
        let next = q
            .borrow_mut()
            .pop_for(LOOK_AHEAD, 0, |_| false, |w: &Waiter| !w.pinned);
        match next {
            Some((_, w)) => {
                if w.tx.send(()).is_ok() {
                    return;
                }
            }
            None => return,
        }
    }
}

/// A slot freed on `agent`: wake the waiter it serves from its cache
/// (within the queue's bounded look-ahead), else the oldest.
pub fn wake_for(q: &RefCell<Waiters>, agent: u64) {
    loop {
        let next = q.borrow_mut().pop_for(
            LOOK_AHEAD,
            MAX_PASSES,
            |w| !w.tx.is_canceled() && w.prefer.contains(agent),
            |w| !w.pinned,
        );
        match next {
            Some((_, w)) => {
                if w.tx.send(()).is_ok() {
                    return;
                }
            }
            None => return,
        }
    }
}

/// Wake every waiter (a new or recovered agent).
pub fn wake_all(q: &RefCell<Waiters>) {
    let all = q.borrow_mut().drain();
    for (_, w) in all {
        let _ = w.tx.send(());
    }
}

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
    pub miss_cost: std::cell::Cell<crate::logic::routing::miss_cost::MissCost>,
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
