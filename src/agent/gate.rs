//! The agent's capacity across routers: an agent linked to several
//! routers honours its declared capacity in total, never per router. Each
//! router only knows its own requests, so the agent (the one place that
//! sees them all) refuses a request beyond its capacity with a 503 marked
//! [`AGENT_FULL_HEADER`] (the router treats it as full, not failed: it
//! tries another agent or queues), and reports its load to every router
//! when it changes, so each counts the others' requests against the
//! capacity and wakes its queue when another router's request ends.
//!
//! Fair between routers: a router whose request ends hears it first (its
//! own stream end) and would take every freed place ahead of the others,
//! which hear it from the load report a moment later. So the agent keeps
//! the routers it refused in order, and a place that frees while one is
//! owed is held for the oldest of them for [`HOLD_FOR`] (its report has
//! to arrive and its request to come back); anyone else is refused
//! meanwhile and owed in turn.
//!
//! With one router nothing is refused or reported: the router's own count
//! is exact, as before.
//!
//! [`AGENT_FULL_HEADER`]: shards::logic::link::control::AGENT_FULL_HEADER

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::time::{Duration, Instant};

use futures::channel::mpsc;

/// One router link's share.
#[derive(Default)]
struct LinkLoad {
    /// Its requests in flight here.
    own: Cell<u32>,
    /// A report is due (coalesces the changes until it is sent).
    dirty: Cell<bool>,
    /// Wakes the link's control loop (None: not connected).
    notify: RefCell<Option<mpsc::UnboundedSender<()>>>,
    /// Its router is being replaced (issue 54): the link's twin took
    /// over; this one ends with its link and does not reconnect.
    retiring: Cell<bool>,
}

/// Requests in flight at the agent, over every link.
pub struct Gate {
    capacity: u32,
    total: Cell<u32>,
    /// Two slots per router: its link, and the twin that links to the
    /// process replacing it during an upgrade (issue 54).
    links: Vec<LinkLoad>,
    routers: usize,
    /// Refusals and load reports on: several routers, or a router being
    /// replaced (two links to one address for a while).
    shared: Cell<bool>,
    /// Links registered now.
    registered: Cell<u32>,
    /// A link is warming the backend up (the others wait for it).
    warming: Cell<bool>,
    /// Links refused while full, oldest first, each once.
    owed: RefCell<VecDeque<usize>>,
    /// A freed place kept for this link until then.
    held: Cell<Option<(usize, Instant)>>,
    /// Stopping: every router is told to send nothing new.
    draining: Cell<bool>,
}

/// How long a freed place waits for the router it is held for.
pub const HOLD_FOR: Duration = Duration::from_millis(100);

/// A registered link; its drop counts it out.
pub struct Registered(Rc<Gate>);

impl Drop for Registered {
    fn drop(&mut self) {
        self.0
            .registered
            .set(self.0.registered.get().saturating_sub(1));
    }
}

/// The warm-up turn of one link; its drop ends it.
pub struct Warming(Rc<Gate>);

impl Drop for Warming {
    fn drop(&mut self) {
        self.0.warming.set(false);
    }
}

/// A request admitted on one link; its drop frees the place.
pub struct Admit {
    gate: Rc<Gate>,
    link: usize,
}

impl Gate {
    /// A gate for `links` routers sharing `capacity`.
    pub fn new(capacity: u32, links: usize) -> Rc<Self> {
        let routers = links.max(1);
        Rc::new(Gate {
            capacity,
            total: Cell::new(0),
            links: (0..routers * 2).map(|_| LinkLoad::default()).collect(),
            routers,
            shared: Cell::new(routers > 1),
            registered: Cell::new(0),
            warming: Cell::new(false),
            owed: RefCell::new(VecDeque::new()),
            held: Cell::new(None),
            draining: Cell::new(false),
        })
    }

    /// Stop taking work: every link's control loop is woken to tell its
    /// router at once (not at the next heartbeat).
    pub fn drain(&self) {
        self.draining.set(true);
        for l in &self.links {
            l.dirty.set(true);
            if let Some(tx) = l.notify.borrow().as_ref() {
                let _ = tx.unbounded_send(());
            }
        }
    }

    /// Whether the agent is stopping.
    pub fn draining(&self) -> bool {
        self.draining.get()
    }

    /// A link registered (until the guard drops).
    pub fn registered(self: &Rc<Self>) -> Registered {
        self.registered.set(self.registered.get() + 1);
        Registered(self.clone())
    }

    /// Whether another link is warming the backend up now.
    pub fn warming(&self) -> bool {
        self.warming.get()
    }

    /// The turn to warm the backend up: only when no link is registered
    /// (a backend that serves another router is warm) and no other link
    /// is warming it; None otherwise.
    pub fn warm_up_turn(self: &Rc<Self>) -> Option<Warming> {
        if self.registered.get() > 0 || self.warming.replace(true) {
            return None;
        }
        Some(Warming(self.clone()))
    }

    /// Whether several routers share it (refusals and load reports on).
    pub fn shared(&self) -> bool {
        self.shared.get()
    }

    /// The router of link slot `link` (its index in `--router-p2p`).
    pub fn router_of(&self, link: usize) -> usize {
        link % self.routers
    }

    /// The router of `link` is being replaced (issue 54): its twin slot,
    /// which links to the new process, or `None` when this link is
    /// already retiring (a second relink request is ignored). From now on
    /// the capacity is shared between both links.
    pub fn relink(&self, link: usize) -> Option<usize> {
        let l = self.links.get(link)?;
        if l.retiring.replace(true) {
            return None;
        }
        self.shared.set(true);
        let twin = (link + self.routers) % self.links.len();
        // Both routers hear the load at once.
        self.changed();
        Some(twin)
    }

    /// The session of `link` ended: whether it retires (no reconnect);
    /// the slot is free for a later upgrade.
    pub fn retired(&self, link: usize) -> bool {
        self.links
            .get(link)
            .is_some_and(|l| l.retiring.replace(false))
    }

    /// Admit a request from `link` at `now`, unless the routers together
    /// already hold the capacity or the free place is held for another
    /// router (only when shared); a refused link is owed a place.
    pub fn try_enter(self: &Rc<Self>, link: usize, now: Instant) -> Option<Admit> {
        let l = self.links.get(link)?;
        if self.shared() {
            if self.expire(now) {
                self.changed();
            }
            match self.held.get() {
                Some((h, _)) if h == link => self.held.set(None),
                held => {
                    let taken = self.total.get() + u32::from(held.is_some());
                    if taken >= self.capacity {
                        let mut owed = self.owed.borrow_mut();
                        if !owed.contains(&link) {
                            owed.push_back(link);
                        }
                        return None;
                    }
                }
            }
            self.owed.borrow_mut().retain(|&o| o != link);
        }
        self.total.set(self.total.get() + 1);
        l.own.set(l.own.get() + 1);
        self.changed();
        Some(Admit {
            gate: self.clone(),
            link,
        })
    }

    /// The channel that tells `link`'s control loop a report is due (a new
    /// one per session; the last replaces the earlier).
    pub fn subscribe(&self, link: usize) -> mpsc::UnboundedReceiver<()> {
        let (tx, rx) = mpsc::unbounded();
        if let Some(l) = self.links.get(link) {
            l.dirty.set(false);
            *l.notify.borrow_mut() = Some(tx);
        }
        rx
    }

    /// The report for `link`: in flight in total and of its own; clears
    /// its due flag.
    pub fn report(&self, link: usize) -> (u32, u32) {
        let own = self.links.get(link).map_or(0, |l| {
            l.dirty.set(false);
            l.own.get()
        });
        (self.total.get(), own)
    }

    /// In flight over every link.
    pub fn in_flight(&self) -> u32 {
        self.total.get()
    }

    /// Drop a hold past its time (the router it was kept for did not come:
    /// the next owed one gets it, or anyone). True when it changed what
    /// the routers should hear (then call [`Gate::changed`]).
    pub fn expire(&self, now: Instant) -> bool {
        match self.held.get() {
            Some((_, until)) if now >= until => {
                self.held.set(None);
                self.hold_next(now);
                true
            }
            _ => false,
        }
    }

    /// A place is free and nobody holds one: keep it for the oldest owed
    /// link.
    fn hold_next(&self, now: Instant) {
        if self.held.get().is_some() || self.total.get() >= self.capacity {
            return;
        }
        if let Some(next) = self.owed.borrow_mut().pop_front() {
            self.held.set(Some((next, now + HOLD_FOR)));
        }
    }

    /// A request of `link` ended at `now`.
    fn release(&self, link: usize, now: Instant) {
        self.total.set(self.total.get().saturating_sub(1));
        if let Some(l) = self.links.get(link) {
            l.own.set(l.own.get().saturating_sub(1));
        }
        if self.shared() {
            self.hold_next(now);
        }
        self.changed();
    }

    /// Every link's report is due (coalesced until sent).
    pub fn changed(&self) {
        if !self.shared() {
            return;
        }
        for l in &self.links {
            if !l.dirty.replace(true) {
                if let Some(tx) = l.notify.borrow().as_ref() {
                    let _ = tx.unbounded_send(());
                }
            }
        }
    }
}

impl Drop for Admit {
    fn drop(&mut self) {
        self.gate.release(self.link, Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn due(rx: &mut mpsc::UnboundedReceiver<()>) -> bool {
        rx.try_recv().is_ok()
    }

    #[test]
    fn a_router_being_replaced_shares_the_capacity_across_both_links() {
        let t = Instant::now();
        let g = Gate::new(2, 1);
        assert!(!g.shared(), "one router: nothing refused or reported");
        let a = g.try_enter(0, t).expect("first");
        let twin = g.relink(0).expect("the twin slot");
        assert_eq!((twin, g.router_of(twin)), (1, 0));
        assert!(g.relink(0).is_none(), "a second relink is ignored");
        assert!(g.shared());
        let b = g
            .try_enter(twin, t)
            .expect("second, on the new process's link");
        assert!(
            g.try_enter(twin, t).is_none(),
            "over the capacity of both links together"
        );
        assert_eq!(g.report(twin), (2, 1));
        drop(a);
        assert!(g.retired(0), "the old link does not reconnect");
        assert!(!g.retired(0), "its slot is free for a later upgrade");
        drop(b);
    }

    #[test]
    fn capacity_holds_in_total_across_links_and_reports_coalesce() {
        let t = Instant::now();
        let g = Gate::new(2, 3);
        let mut rx0 = g.subscribe(0);
        let mut rx2 = g.subscribe(2);
        let a = g.try_enter(0, t).expect("first");
        let b = g.try_enter(2, t).expect("second");
        assert!(g.try_enter(1, t).is_none(), "third over the total capacity");
        assert!(g.try_enter(7, t).is_none(), "no such link");
        assert_eq!(g.report(0), (2, 1));
        assert_eq!(g.report(2), (2, 1));
        // One wake per link per report, however many changes before it.
        assert!(due(&mut rx0));
        assert!(!due(&mut rx0), "coalesced");
        assert!(due(&mut rx2));
        drop(a);
        assert_eq!(g.report(0), (1, 0));
        assert!(due(&mut rx0));
        // The freed place is held for link 1 (refused first): link 0 is
        // refused and owed in turn; link 1 takes it.
        assert!(g.try_enter(0, t).is_none(), "held for link 1");
        let c = g.try_enter(1, t).expect("its held place");
        drop(b);
        assert!(g.try_enter(1, t).is_none(), "held for link 0 now");
        let d = g.try_enter(0, t).expect("link 0's turn");
        drop((c, d));
        assert_eq!(g.in_flight(), 0);
        assert!(due(&mut rx2));
        assert_eq!(g.report(2), (0, 0));
    }

    #[test]
    fn a_hold_nobody_claims_expires() {
        let t = Instant::now();
        let g = Gate::new(1, 2);
        let a = g.try_enter(0, t).expect("first");
        assert!(g.try_enter(1, t).is_none());
        drop(a);
        assert!(g.try_enter(0, t).is_none(), "held for link 1");
        assert!(!g.expire(t), "not yet");
        // Link 1 did not come; link 0 is owed now and gets the place.
        let t1 = Instant::now() + HOLD_FOR;
        assert!(g.expire(t1));
        assert!(g.try_enter(1, t1).is_none(), "held for link 0");
        let b = g.try_enter(0, t1).expect("link 0's hold");
        drop(b);
        assert!(
            g.try_enter(0, t1).is_none(),
            "held for link 1, refused then"
        );
        assert!(g.try_enter(1, t1).is_some());
    }

    #[test]
    fn one_warm_up_while_no_link_is_registered() {
        let g = Gate::new(4, 2);
        let turn = g.warm_up_turn().expect("the first link warms up");
        assert!(g.warming() && g.warm_up_turn().is_none(), "one at a time");
        drop(turn);
        let reg = g.registered();
        assert!(g.warm_up_turn().is_none(), "a registered link: warm");
        drop(reg);
        assert!(g.warm_up_turn().is_some());
    }

    #[test]
    fn one_router_is_never_refused_nor_told() {
        let t = Instant::now();
        let g = Gate::new(1, 1);
        let mut rx = g.subscribe(0);
        let held: Vec<_> = (0..3)
            .map(|_| g.try_enter(0, t).expect("never refused"))
            .collect();
        assert_eq!(g.in_flight(), 3);
        assert!(!due(&mut rx), "no report with one router");
        drop(held);
        assert_eq!(g.in_flight(), 0);
    }
}
