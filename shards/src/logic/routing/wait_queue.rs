//! The per-model capacity queue's ordering (pure): priority classes
//! first, then fair queuing by tokens between tenants inside a class
//! (start-time fair queuing: a waiter's tag is its tenant's virtual
//! finish time, so a tenant that sent ten times its share waits behind
//! the others' requests, not in front of them), then arrival. Bounded on
//! entry; a waiter that loses the race for a freed slot goes back to its
//! original place.
//!
//! A slot freed on one agent may go to a later waiter that agent serves
//! from its cache ([`WaitQueue::pop_for`]): only within the first
//! [`LOOK_AHEAD`] waiters, and the head is passed over at most
//! [`MAX_PASSES`] times, so the order bends by a bounded amount. A waiter
//! passed over by more than [`AGE_POPS`] pops and four times the queue's
//! length (a batch request under a stream of interactive ones) is served
//! next whatever its class: nobody waits forever, short of the request's
//! own wait budget.

use std::collections::{BTreeMap, HashMap};

/// A waiter's place: class (2 bits), virtual start tag (62 bits), arrival
/// sequence (64 bits), compared as one number.
pub type Place = u128;

pub mod tenant_slots;

pub use crate::logic::tenancy::class::{request_class, Class, PRIORITY_HEADER};

/// Who queues and what it will cost: its class, its tenant (a hash) and
/// its token estimate (input plus declared output).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fair {
    /// Priority class.
    pub class: Class,
    /// The tenant, hashed.
    pub tenant: u64,
    /// Estimated tokens (0 counts as 1).
    pub cost: u64,
}

const TAG_BITS: u32 = 62;
const TAG_MAX: u64 = (1 << TAG_BITS) - 1;

fn pack(class: Class, tag: u64, seq: u64) -> Place {
    (u128::from(class as u8) << 126) | (u128::from(tag.min(TAG_MAX)) << 64) | u128::from(seq)
}

/// The class of a place.
pub fn class_of(p: Place) -> Class {
    match (p >> 126) as u8 {
        0 => Class::Interactive,
        1 => Class::Standard,
        _ => Class::Batch,
    }
}

fn tag_of(p: Place) -> u64 {
    ((p >> 64) as u64) & TAG_MAX
}

fn seq_of(p: Place) -> u64 {
    p as u64
}

/// Pops after which the oldest waiter is served whatever its class and
/// tag (aging).
pub const AGE_POPS: u64 = 256;

/// How many of the oldest waiters a freed slot looks at for one its
/// agent holds the prefix of.
pub const LOOK_AHEAD: usize = 64;

/// How many times the head may be passed over before a freed slot goes
/// to it whoever holds what.
pub const MAX_PASSES: u32 = 32;

/// The agents a waiter would rather take a slot on (the holders of its
/// cached prefix, at most four; none when it has no cache affinity).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prefer {
    agents: [u32; 4],
    len: u8,
}

impl Prefer {
    /// Up to four agents (truncated ids, as the affinity index keeps
    /// them); more are ignored.
    pub fn of(agents: impl IntoIterator<Item = u32>) -> Self {
        let mut p = Prefer::default();
        for a in agents {
            if let Some(s) = p.agents.get_mut(usize::from(p.len)) {
                *s = a;
                p.len += 1;
            }
        }
        p
    }

    /// Whether `agent` (a full id) is one of them.
    pub fn contains(&self, agent: u64) -> bool {
        self.agents
            .iter()
            .take(usize::from(self.len))
            .any(|&a| u64::from(a) == agent & 0xffff_ffff)
    }

    /// Whether it names no agent.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Waiters ordered by class, fair tag, arrival.
#[derive(Debug, Clone)]
pub struct WaitQueue<T> {
    items: BTreeMap<Place, T>,
    /// Arrival sequence -> (place, pops when it arrived): the oldest, for aging.
    arrivals: BTreeMap<u64, (Place, u64)>,
    next: u64,
    /// The head and how often it was passed over.
    passes: (Place, u32),
    /// Virtual time: the largest tag served so far.
    /// Virtual time per class: the largest tag served so far in it. Per
    /// class, or a tenant's request of one class would move the others'
    /// clock (and a tenant's backlog in one class would push its request
    /// of another behind it).
    vtime: [u64; 3],
    /// Each (tenant, class)'s virtual finish time (those with waiters or ahead
    /// of the virtual time only).
    finish: HashMap<(u64, Class), u64>,
    /// Waiters popped so far.
    pops: u64,
}

impl<T> Default for WaitQueue<T> {
    fn default() -> Self {
        WaitQueue {
            items: BTreeMap::new(),
            arrivals: BTreeMap::new(),
            next: 0,
            passes: (0, 0),
            vtime: [0; 3],
            finish: HashMap::new(),
            pops: 0,
        }
    }
}

impl<T> WaitQueue<T> {
    /// Waiters queued.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Waiters of each class.
    pub fn by_class(&self) -> [usize; 3] {
        let mut n = [0; 3];
        for p in self.items.keys() {
            if let Some(c) = n.get_mut(class_of(*p).index()) {
                *c += 1;
            }
        }
        n
    }

    /// A new arrival of the standard class, in arrival order, unless
    /// `bound` waiters are already queued (0: no queue).
    pub fn push(&mut self, item: T, bound: usize) -> Result<Place, T> {
        self.push_fair(item, bound, Fair::default())
    }

    /// A new arrival placed by `who`: its class, then its tenant's fair
    /// tag (start-time fair queuing over token estimates), then arrival.
    /// Refused when `bound` waiters are queued (0: no queue).
    pub fn push_fair(&mut self, item: T, bound: usize, who: Fair) -> Result<Place, T> {
        if self.items.len() >= bound {
            return Err(item);
        }
        self.push_displacing(item, bound, who)
            .map(|(place, _)| place)
    }

    /// [`WaitQueue::push_fair`], except for a full queue and an arrival
    /// that would be served before its last waiter:
    /// - a higher class than that waiter goes ahead of it and nobody
    ///   leaves (preemption of a waiting request: the lower class keeps
    ///   its place at the head of its class); the queue may then hold up
    ///   to twice `bound`, past which the last waiter is displaced;
    /// - in the same class (the tenant furthest ahead of its share), the
    ///   arrival takes its place: the last waiter is returned, displaced;
    ///   a flooding tenant then loses its newest waiter instead of the
    ///   others being refused.
    pub fn push_displacing(
        &mut self,
        item: T,
        bound: usize,
        who: Fair,
    ) -> Result<(Place, Option<(Place, T)>), T> {
        if bound == 0 {
            return Err(item);
        }
        let finish = self
            .finish
            .get(&(who.tenant, who.class))
            .copied()
            .unwrap_or(0);
        let vtime = self.vtime.get(who.class.index()).copied().unwrap_or(0);
        let start = finish.max(vtime);
        let seq = self.next;
        let place = pack(who.class, start, seq);
        let mut displaced = None;
        if self.items.len() >= bound {
            let last = self.items.keys().next_back().copied();
            match last {
                Some(l) if place < l => {
                    let preempts = class_of(l) > who.class;
                    if !preempts || self.items.len() >= bound.saturating_mul(2) {
                        displaced = self.remove(l).map(|v| (l, v));
                    }
                }
                _ => return Err(item),
            }
        }
        self.next += 1;
        self.finish.insert(
            (who.tenant, who.class),
            start.saturating_add(who.cost.max(1)).min(TAG_MAX),
        );
        self.items.insert(place, item);
        self.arrivals.insert(seq, (place, self.pops));
        Ok((place, displaced))
    }

    /// A waiter whose request was served before and must go on (a stream
    /// continued on another agent): ahead of every request not yet begun
    /// (the interactive class at the lowest tag; among such waiters in
    /// arrival order), not bounded (there are never more than the streams
    /// in flight) and charged to no tenant (its tokens were counted when
    /// it was admitted).
    pub fn push_head(&mut self, item: T) -> Place {
        let seq = self.next;
        self.next += 1;
        let place = pack(Class::Interactive, 0, seq);
        self.items.insert(place, item);
        self.arrivals.insert(seq, (place, self.pops));
        place
    }

    /// A request of `who` that waited was served with `real` tokens (its
    /// usage): its tenant's finish time in the class moves by what the
    /// estimate (`who.cost`) missed, up or down (never below the class's
    /// virtual time: a tenant is not owed service for its past), so
    /// tenants are ordered by the tokens they really used.
    pub fn true_up(&mut self, who: Fair, real: u64) {
        let vtime = self.vtime.get(who.class.index()).copied().unwrap_or(0);
        if let Some(f) = self.finish.get_mut(&(who.tenant, who.class)) {
            let est = who.cost.max(1);
            *f = if real >= est {
                f.saturating_add(real - est).min(TAG_MAX)
            } else {
                f.saturating_sub(est - real).max(vtime)
            };
        }
    }

    /// Put a waiter back at its original place (not bounded: it was admitted).
    pub fn requeue(&mut self, place: Place, item: T) {
        self.items.insert(place, item);
        self.arrivals.insert(seq_of(place), (place, self.pops));
    }

    /// Bookkeeping of a waiter leaving at `place` (served; `aged`: out of
    /// the fair order).
    fn served(&mut self, place: Place, aged: bool) {
        self.arrivals.remove(&seq_of(place));
        self.pops += 1;
        // An aged waiter is out of order: its tag (far ahead, for a
        // tenant that sent much) must not move the virtual time, or every
        // other tenant would start behind it.
        if !aged {
            if let Some(v) = self.vtime.get_mut(class_of(place).index()) {
                *v = (*v).max(tag_of(place));
            }
        }
        // Tenants at or behind the virtual time start from it anyway:
        // forget them (the map stays the size of the backlog).
        if self.finish.len() > 64 + 2 * self.items.len() {
            let v = self.vtime;
            self.finish
                .retain(|(_, class), f| *f > v.get(class.index()).copied().unwrap_or(0));
        }
    }

    /// The oldest waiter when it has been passed over more than
    /// [`AGE_POPS`] times and four times the queue's length (a waiter
    /// served in fair order is passed over by at most about the queue's
    /// length; one passed over far more is starved by higher classes).
    fn aged(&self) -> Option<Place> {
        let (_, (place, at)) = self.arrivals.iter().next()?;
        let limit = AGE_POPS.max(4 * self.items.len() as u64);
        (self.pops.saturating_sub(*at) >= limit).then_some(*place)
    }

    fn take(&mut self, place: Place, aged: bool) -> Option<(Place, T)> {
        let v = self.items.remove(&place)?;
        self.served(place, aged);
        Some((place, v))
    }

    /// The waiter [`WaitQueue::pop_head`] would take, left in place.
    pub fn head(&self) -> Option<(Place, &T)> {
        let p = match self.aged() {
            Some(p) => p,
            None => *self.items.keys().next()?,
        };
        self.items.get(&p).map(|v| (p, v))
    }

    /// The first waiter (an aged one first).
    pub fn pop_head(&mut self) -> Option<(Place, T)> {
        match self.aged() {
            Some(p) => self.take(p, true),
            None => {
                let p = *self.items.keys().next()?;
                self.take(p, false)
            }
        }
    }

    /// The first waiter of `class` (a reserved share to honour).
    pub fn pop_class(&mut self, class: Class) -> Option<(Place, T)> {
        let lo = pack(class, 0, 0);
        let place = *self
            .items
            .range(lo..)
            .next()
            .filter(|(p, _)| class_of(**p) == class)?
            .0;
        self.take(place, false)
    }

    /// The waiter a slot freed on one agent goes to: the first of the
    /// first `look_ahead` that `wants` it, unless the head was already
    /// passed over `max_passes` times; otherwise (or when none wants it)
    /// the first of them that is `movable`, the head when it is. A waiter
    /// that is not movable (held for its cache holders: `holder_wait_ms`)
    /// takes only a slot it wants, and passing it over is no pass; with
    /// none movable the slot stays free. An aged waiter goes first.
    pub fn pop_for(
        &mut self,
        look_ahead: usize,
        max_passes: u32,
        mut wants: impl FnMut(&T) -> bool,
        mut movable: impl FnMut(&T) -> bool,
    ) -> Option<(Place, T)> {
        if let Some(p) = self.aged() {
            if self.items.get(&p).is_some_and(|v| movable(v) || wants(v)) {
                return self.take(p, true);
            }
        }
        let (&head, first) = self.items.iter().next()?;
        let head_movable = movable(first);
        if self.passes.0 != head {
            self.passes = (head, 0);
        }
        if self.passes.1 < max_passes || !head_movable {
            let found = self
                .items
                .iter()
                .take(look_ahead)
                .find(|(_, v)| wants(v))
                .map(|(k, _)| *k);
            if let Some(place) = found {
                if place != head && head_movable {
                    self.passes.1 += 1;
                }
                return self.take(place, false);
            }
        }
        if head_movable {
            return self.take(head, false);
        }
        let next = self
            .items
            .iter()
            .take(look_ahead)
            .find(|(_, v)| movable(v))
            .map(|(k, _)| *k)?;
        self.take(next, false)
    }

    /// Everyone, in order.
    pub fn drain(&mut self) -> Vec<(Place, T)> {
        self.arrivals.clear();
        std::mem::take(&mut self.items).into_iter().collect()
    }

    /// Remove a waiter that gave up (its tenant's tag is not given back:
    /// a client that gives up is rare, and the next arrival of that
    /// tenant resumes from the virtual time once it passes).
    pub fn remove(&mut self, place: Place) -> Option<T> {
        self.arrivals.remove(&seq_of(place));
        self.items.remove(&place)
    }
}

#[cfg(test)]
mod tests;
