//! One registered agent on its model's shard, and the capacity slot a
//! request holds on it.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use super::Waiters;
use crate::logic::http::api::usage::Tokens;
use crate::logic::link::control::Registration;
use crate::logic::link::engine_metrics::EngineSignals;
use crate::logic::link::hardware::HardwareSignals;
use crate::logic::routing::history::History;
use crate::logic::routing::policy::AgentFacts;
use crate::logic::routing::srtt::Estimator;
use crate::logic::system::log_gate::LogGate;
use crate::runtime::wire::link::LinkHandle;

/// One registered agent, owned by its model's shard.
pub struct Agent {
    /// Shard-local id (stable while registered).
    pub id: u64,
    /// What it declared.
    pub reg: Registration,
    /// Its region and engine as counter labels (shared, not copied per
    /// request).
    pub labels: (Arc<str>, Arc<str>),
    /// Its peer ID, shared with the audit records (not copied per request).
    pub peer: Arc<str>,
    /// Opens request streams.
    pub link: LinkHandle,
    /// Heartbeats arrive in time.
    pub live: Cell<bool>,
    /// The agent's own check of its backend.
    pub backend_healthy: Cell<bool>,
    /// The agent is stopping: nothing new is sent to it.
    pub draining: Cell<bool>,
    /// Drained by `POST /admin/agents/{peer_id}/drain` (until `DELETE`):
    /// nothing new is sent to it, whatever its heartbeats say.
    pub admin_drained: Cell<bool>,
    /// Its health as the model directory counts it (synced on every
    /// change, so the counts never drift).
    pub counted_healthy: Cell<bool>,
    /// Requests in flight (slot held until the response ends).
    pub active: Cell<u32>,
    /// Requests other routers have in flight on it (an agent serving
    /// several routers reports them); they count against its capacity.
    pub others: Cell<u32>,
    /// Requests it turned away as full (its other routers held its
    /// capacity) since registration.
    pub full_refusals: Cell<u64>,
    /// The lines its own frames cause in the log (state flips), at most
    /// one a second with the count it stands for: a peer cannot flood the
    /// log (issue 51 #6).
    pub peer_log: RefCell<LogGate>,
    /// Paces the lines its requests' failures cause (a failed forward, a
    /// usage claim clamped): a peer failing every request logs one line a
    /// second with the count.
    pub request_log: RefCell<LogGate>,
    /// Lifetime successful requests.
    pub success: Cell<u64>,
    /// Lifetime failed requests.
    pub failed: Cell<u64>,
    /// Unix milliseconds of registration or last heartbeat.
    pub last_seen_ms: Cell<u64>,
    /// Latency estimator (live: updated before the next routing decision).
    pub est: Cell<Estimator>,
    /// Lifetime input tokens (from response usage).
    pub input_tokens: Cell<u64>,
    /// Lifetime output tokens.
    pub output_tokens: Cell<u64>,
    /// Of `prompt_tokens`, those the engine read from its prompt cache
    /// (since registration: not in the persisted history).
    pub cached_prompt_tokens: Cell<u64>,
    /// Input tokens of the responses that reported a cached count.
    pub prompt_tokens: Cell<u64>,
    /// Cached tokens the affinity index predicted on this agent (it was
    /// a request's deepest holder), since registration.
    pub cache_predicted: Cell<u64>,
    /// Of those, the ones of requests sent to it (captured).
    pub cache_captured: Cell<u64>,
    /// Times the agent left routing (restored from history).
    pub disconnections: Cell<u64>,
    /// Requests its backend turned away as busy (429 or 503) since
    /// registration.
    pub rejected: Cell<u64>,
    /// Signals it sent out of range (dropped: absent, not believed).
    pub signals_dropped: Cell<u64>,
    /// Healthy -> unhealthy transitions from missed heartbeats.
    pub agent_failures: Cell<u64>,
    /// Healthy -> unhealthy transitions of reported backend health.
    pub backend_failures: Cell<u64>,
    /// Failures since the last success (this registration only).
    pub consecutive_failures: Cell<u64>,
    /// When an agent with failures was last sent a request or failed: its
    /// next probe is due a backoff later (issue 51 #12).
    pub tried_at: Cell<Option<crate::runtime::wire::clock::Instant>>,
    /// The model's capacity queue (a freed slot wakes its head).
    pub queue: Rc<RefCell<Waiters>>,
    /// Latest engine signals from the agent.
    pub signals: Cell<EngineSignals>,
    /// Latest host signals from the agent.
    pub hardware: Cell<HardwareSignals>,
    /// Whether this agent's record may be written to the store: false when
    /// the warm-start lookup failed, so a stored history we could not read
    /// is never overwritten with a fresh one.
    pub persist: bool,
    /// Cuts every relayed response at once when the agent is declared dead.
    pub cuts: Cuts,
}

/// The signal that cuts an agent's relayed responses, without a channel
/// per response (a oneshot was one heap allocation per request): each
/// relay watches an epoch and parks its waker in a slot it gives back
/// when it ends, so the slots are reused from request to request.
#[derive(Default)]
pub struct Cuts {
    /// Bumped by each cut; a watch made before it fires.
    epoch: Cell<u64>,
    /// Parked wakers, by slot; `None` is a free or already woken slot.
    slots: RefCell<Vec<Option<Waker>>>,
    /// Slots no watch holds.
    free: RefCell<Vec<usize>>,
    /// Watches alive.
    watching: Cell<usize>,
}

impl Cuts {
    /// A future that completes at the next cut.
    pub fn watch(&self) -> CutWatch<'_> {
        self.watching.set(self.watching.get() + 1);
        CutWatch {
            cuts: self,
            epoch: self.epoch.get(),
            slot: None,
        }
    }

    /// Fire every watch alive; returns how many there were.
    pub fn cut_all(&self) -> usize {
        self.epoch.set(self.epoch.get().wrapping_add(1));
        let woken: Vec<Waker> = self
            .slots
            .borrow_mut()
            .iter_mut()
            .filter_map(Option::take)
            .collect();
        // Woken outside the borrow: a waker may poll at once.
        for w in woken {
            w.wake();
        }
        self.watching.get()
    }
}

/// Completes when its agent's responses are cut.
pub struct CutWatch<'a> {
    cuts: &'a Cuts,
    epoch: u64,
    slot: Option<usize>,
}

impl std::future::Future for CutWatch<'_> {
    type Output = ();

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if this.cuts.epoch.get() != this.epoch {
            return Poll::Ready(());
        }
        let mut slots = this.cuts.slots.borrow_mut();
        let i = match this.slot {
            Some(i) => i,
            None => {
                let i = this.cuts.free.borrow_mut().pop().unwrap_or_else(|| {
                    slots.push(None);
                    slots.len() - 1
                });
                this.slot = Some(i);
                i
            }
        };
        if let Some(s) = slots.get_mut(i) {
            match s {
                Some(w) if w.will_wake(cx.waker()) => {}
                _ => *s = Some(cx.waker().clone()),
            }
        }
        Poll::Pending
    }
}

impl Drop for CutWatch<'_> {
    fn drop(&mut self) {
        let c = self.cuts;
        c.watching.set(c.watching.get().saturating_sub(1));
        if let Some(i) = self.slot {
            if let Some(s) = c.slots.borrow_mut().get_mut(i) {
                *s = None;
            }
            c.free.borrow_mut().push(i);
        }
    }
}

// === impl Agent ===

impl Agent {
    /// A freshly registered agent, seeded from its history.
    pub fn new(
        id: u64,
        reg: Registration,
        link: LinkHandle,
        queue: Rc<RefCell<Waiters>>,
        history: Option<History>,
        now_unix_ms: u64,
        persist: bool,
    ) -> Self {
        let h = history.unwrap_or_default();
        let est = match (h.srtt, h.rttvar) {
            (Some(s), Some(v)) => Estimator::restored(s, v),
            _ => Estimator::new(),
        };
        Agent {
            id,
            labels: (reg.region.as_str().into(), reg.engine.as_str().into()),
            peer: reg.peer_id.as_str().into(),
            reg,
            link,
            live: Cell::new(true),
            backend_healthy: Cell::new(true),
            draining: Cell::new(false),
            admin_drained: Cell::new(false),
            counted_healthy: Cell::new(true),
            active: Cell::new(0),
            others: Cell::new(0),
            full_refusals: Cell::new(0),
            peer_log: RefCell::default(),
            request_log: RefCell::default(),
            success: Cell::new(h.success),
            failed: Cell::new(h.failed),
            last_seen_ms: Cell::new(now_unix_ms),
            est: Cell::new(est),
            input_tokens: Cell::new(h.input_tokens),
            output_tokens: Cell::new(h.output_tokens),
            cached_prompt_tokens: Cell::new(0),
            cache_predicted: Cell::new(0),
            cache_captured: Cell::new(0),
            prompt_tokens: Cell::new(0),
            disconnections: Cell::new(h.disconnections),
            rejected: Cell::new(0),
            signals_dropped: Cell::new(0),
            agent_failures: Cell::new(h.agent_failures),
            backend_failures: Cell::new(h.backend_failures),
            consecutive_failures: Cell::new(0),
            tried_at: Cell::new(None),
            queue,
            signals: Cell::new(EngineSignals::default()),
            hardware: Cell::new(HardwareSignals::default()),
            persist,
            cuts: Cuts::default(),
        }
    }

    /// Whether a line its frames cause may be written now: `Some(n)`, the
    /// events it stands for (this one included), at most once a second.
    pub fn peer_line(&self, now: crate::runtime::wire::clock::Instant) -> Option<u64> {
        self.peer_log
            .try_borrow_mut()
            .ok()?
            .hit(now, std::time::Duration::from_secs(1))
    }

    /// Whether a line one of its requests causes may be written now
    /// (`Some(n)`: the events it stands for), at most once a second.
    pub fn request_line(&self, now: crate::runtime::wire::clock::Instant) -> Option<u64> {
        self.request_log
            .try_borrow_mut()
            .ok()?
            .hit(now, std::time::Duration::from_secs(1))
    }

    /// Cut every in-flight response (the agent stopped heartbeating: a
    /// frozen agent must not hold its clients until the request timeout).
    /// Returns how many were cut.
    pub fn cut_streams(&self) -> usize {
        self.cuts.cut_all()
    }

    /// Record one latency sample (ms) and log the update.
    pub fn observe(&self, sample_ms: f64) {
        let mut e = self.est.get();
        if let Some(u) = e.observe(sample_ms) {
            self.est.set(e);
            tracing::debug!(
                target: "router",
                peer_id = %self.reg.peer_id, model = %self.reg.model, sample_ms = u.sample,
                old_srtt_ms = ?u.old_srtt, old_rttvar_ms = ?u.old_rttvar, srtt_ms = u.srtt, rttvar_ms = u.rttvar,
                "SRTT update"
            );
        }
    }

    /// Count one success.
    pub fn succeed(&self) {
        self.success.set(self.success.get() + 1);
        self.consecutive_failures.set(0);
    }

    /// Count one failure.
    pub fn fail(&self) {
        self.tried_at.set(Some(crate::runtime::wire::clock::now()));
        self.failed.set(self.failed.get() + 1);
        self.consecutive_failures
            .set(self.consecutive_failures.get() + 1);
    }

    /// Add usage tokens.
    pub fn add_tokens(&self, t: Tokens) {
        self.input_tokens.set(self.input_tokens.get() + t.input);
        self.output_tokens.set(self.output_tokens.get() + t.output);
        if t.cache_reported {
            self.prompt_tokens.set(self.prompt_tokens.get() + t.input);
            self.cached_prompt_tokens
                .set(self.cached_prompt_tokens.get() + t.cached);
        }
    }

    /// The record to persist.
    pub fn history(&self) -> History {
        let e = self.est.get();
        History {
            srtt: e.srtt(),
            rttvar: e.rttvar(),
            success: self.success.get(),
            failed: self.failed.get(),
            input_tokens: self.input_tokens.get(),
            output_tokens: self.output_tokens.get(),
            disconnections: self.disconnections.get(),
            agent_failures: self.agent_failures.get(),
            backend_failures: self.backend_failures.get(),
            written_at: 0,
        }
    }

    /// Clear the lifetime metrics and the failure streak (admin reset, spec 02).
    pub fn reset_metrics(&self) {
        self.est.set(Estimator::new());
        for c in [
            &self.success,
            &self.failed,
            &self.input_tokens,
            &self.output_tokens,
            &self.cached_prompt_tokens,
            &self.prompt_tokens,
            &self.disconnections,
            &self.rejected,
            &self.agent_failures,
            &self.backend_failures,
            &self.consecutive_failures,
        ] {
            c.set(0);
        }
    }

    /// Routable: live, backend healthy, not draining.
    pub fn healthy(&self) -> bool {
        self.live.get()
            && self.backend_healthy.get()
            && !self.draining.get()
            && !self.admin_drained.get()
    }

    /// It counts as a replica for per-replica request quotas: healthy, and
    /// it has served at least once (its lifetime history counts). A bare
    /// registration that never answered raises no key's limit (issue 51
    /// #9: 50 silent links raised one from 10 to 510 a minute). Admission
    /// room still counts healthy agents: a new agent must be able to take
    /// the traffic that makes it count.
    pub fn counts_as_replica(&self) -> bool {
        self.healthy() && self.success.get() > 0
    }

    /// An agent with failures whose probe is due: a backoff after its last
    /// try (only such agents read the clock here).
    fn probe_due(&self) -> bool {
        if self.failed.get() == 0 {
            return false;
        }
        let wait = crate::logic::routing::policy::probe_backoff(self.consecutive_failures.get());
        self.tried_at
            .get()
            .is_none_or(|t| crate::runtime::wire::clock::now() >= t + wait)
    }

    /// What the policy gates read of it.
    pub fn facts(&self) -> AgentFacts<'_> {
        let total = self.success.get() + self.failed.get();
        AgentFacts {
            id: self.id,
            healthy: self.healthy(),
            capability: self.reg.capability,
            engine: &self.reg.engine,
            region: &self.reg.region,
            organization: &self.reg.organization,
            machine: &self.reg.machine,
            tags: &self.reg.tags,
            active: self.active.get().saturating_add(self.others.get()),
            capacity: self.reg.capacity,
            srtt: self.est.get().srtt(),
            success_rate: (total > 0).then(|| self.success.get() as f64 / total as f64),
            consecutive_failures: (total > 0).then(|| self.consecutive_failures.get()),
            probe_due: self.probe_due(),
            signals: self.signals.get(),
            hardware: self.hardware.get(),
            gpu_model: &self.reg.gpu_model,
        }
    }
}

/// A capacity slot on an agent, released on drop (stream end, error or
/// client disconnect alike: no slot leaks).
pub struct Slot(Rc<Agent>);

impl Slot {
    /// Take a slot.
    pub fn take(agent: Rc<Agent>) -> Self {
        agent.active.set(agent.active.get() + 1);
        // A failing agent's probe is spent: the next is a backoff later.
        if agent.failed.get() > 0 {
            agent.tried_at.set(Some(crate::runtime::wire::clock::now()));
        }
        Slot(agent)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.active.set(self.0.active.get().saturating_sub(1));
        // A freed slot wakes a waiter of the model's queue: one this agent
        // holds the prefix of when there is one near the head, else the head.
        super::wake_for(&self.0.queue, self.0.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Count(AtomicUsize);
    impl futures::task::ArcWake for Count {
        fn wake_by_ref(me: &Arc<Self>) {
            me.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn poll(w: &mut CutWatch<'_>, waker: &Waker) -> Poll<()> {
        std::pin::Pin::new(w).poll(&mut Context::from_waker(waker))
    }

    #[test]
    fn a_cut_wakes_and_fires_every_live_watch() {
        let cuts = Cuts::default();
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = futures::task::waker(count.clone());
        let mut a = cuts.watch();
        let mut b = cuts.watch();
        assert!(poll(&mut a, &waker).is_pending());
        assert!(poll(&mut b, &waker).is_pending());
        // A dropped watch is neither counted nor woken.
        drop(cuts.watch());
        assert_eq!(cuts.cut_all(), 2);
        assert_eq!(count.0.load(Ordering::SeqCst), 2);
        assert!(poll(&mut a, &waker).is_ready());
        assert!(poll(&mut b, &waker).is_ready());
        drop((a, b));
        // A watch made after the cut waits for the next one.
        let mut c = cuts.watch();
        assert!(poll(&mut c, &waker).is_pending());
        assert_eq!(cuts.cut_all(), 1);
        assert!(poll(&mut c, &waker).is_ready());
    }

    #[test]
    fn slots_are_reused_from_watch_to_watch() {
        let cuts = Cuts::default();
        let waker = futures::task::noop_waker();
        for _ in 0..100 {
            let mut w = cuts.watch();
            assert!(poll(&mut w, &waker).is_pending());
            assert!(poll(&mut w, &waker).is_pending());
        }
        assert_eq!(cuts.slots.borrow().len(), 1);
        assert_eq!(cuts.cut_all(), 0);
    }
}
