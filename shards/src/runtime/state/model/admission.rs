//! One model's admission state on its owner shard: reservations and
//! parked requests ([`Occupancy`]), the per-key ITPM/OTPM buckets and the
//! learned tokens per byte. The gate that fills it is
//! [`crate::runtime::request::admission`].
//!
//! A [`Reservation`] releases itself when dropped, so every exit of a
//! request (success, error, timeout, client gone, a later rejection)
//! returns its room exactly once, and the release grants parked requests
//! in arrival order. A [`Place`] does the same for a parked request.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use futures::channel::oneshot;

use crate::logic::http::api::probe::COLD_TOKENS_PER_BYTE;
use crate::logic::routing::admission::{
    self, Admit, Ask, Grant, Occupancy, Reason, Room, TokenBucket,
};
use crate::logic::routing::policy::AdmissionPolicy;
use crate::runtime::wire::clock;

/// One key's B4 rate buckets on one model.
#[derive(Default)]
struct KeyRates {
    itpm: TokenBucket,
    otpm: TokenBucket,
}

/// One model's admission state on its shard.
pub struct ModelAdmission {
    /// Reservations and parked requests.
    pub occupancy: Occupancy,
    waiters: HashMap<u64, oneshot::Sender<Grant>>,
    rates: HashMap<Arc<str>, KeyRates>,
    /// Learned input tokens per body text byte (spec 04 §9).
    pub tokens_per_byte: f64,
    /// The policy and admit fraction of the last admission: the room is
    /// recomputed from them when replicas come or go.
    pub last: Option<(AdmissionPolicy, f64)>,
}

impl Default for ModelAdmission {
    fn default() -> Self {
        ModelAdmission {
            occupancy: Occupancy::default(),
            waiters: HashMap::new(),
            rates: HashMap::new(),
            tokens_per_byte: COLD_TOKENS_PER_BYTE,
            last: None,
        }
    }
}

/// A model's admission state, shared by its requests' reservations.
pub type Shared = Rc<RefCell<ModelAdmission>>;

/// The `hivenet_admission_*{model}` gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Gauges {
    /// Whether an occupancy policy was ever applied (else nothing is shown).
    pub active: bool,
    /// Tokens reserved in flight.
    pub occupancy_tokens: u64,
    /// Effective token budget last seen (0: unset).
    pub budget_tokens: u64,
    /// Reservations in flight.
    pub inflight_requests: u64,
    /// Effective in-flight cap last seen (0: unset).
    pub max_inflight: u64,
    /// Requests parked waiting for room.
    pub parked_requests: u64,
}

// === impl ModelAdmission ===

impl ModelAdmission {
    /// Hand grants to their waiters; a grant whose waiter is gone is
    /// released at once (which may grant the next).
    fn deliver(&mut self, mut grants: Vec<(u64, Grant)>) {
        while !grants.is_empty() {
            let mut more = Vec::new();
            for (ticket, g) in grants {
                let undelivered = match self.waiters.remove(&ticket) {
                    Some(tx) => tx.send(g).err(),
                    None => Some(g),
                };
                if let Some(Grant::Granted(id)) = undelivered {
                    more.extend(self.occupancy.release(id).unwrap_or_default());
                }
            }
            grants = more;
        }
    }

    fn release(&mut self, id: u64) {
        let g = self.occupancy.release(id).unwrap_or_default();
        self.deliver(g);
    }

    fn adjust(&mut self, id: u64, delta: i64) {
        let g = self.occupancy.adjust(id, delta);
        self.deliver(g);
    }

    /// Healthy replicas changed (an agent registered, left or recovered):
    /// parked requests that now fit are granted.
    pub fn replicas_changed(&mut self, replicas: u64) {
        if let Some((p, fraction)) = &self.last {
            let room = admission::room(p, *fraction, replicas);
            let g = self.occupancy.set_room(room);
            self.deliver(g);
        }
    }

    /// The gauges now.
    pub fn gauges(&self) -> Gauges {
        let room = self.occupancy.room();
        Gauges {
            active: self.last.is_some(),
            occupancy_tokens: self.occupancy.sum(),
            budget_tokens: room.budget.unwrap_or(0),
            inflight_requests: self.occupancy.count(),
            max_inflight: room.inflight.unwrap_or(0),
            parked_requests: self.occupancy.parked() as u64,
        }
    }

    /// Learn tokens per byte from a completed request's exact usage.
    pub fn learn(&mut self, prompt_tokens: u64, text_bytes: u64) {
        self.tokens_per_byte = admission::learn(self.tokens_per_byte, prompt_tokens, text_bytes);
    }
}

/// Room held for one request; released when dropped.
pub struct Reservation {
    state: Shared,
    id: u64,
    /// The input estimate it was admitted with (the true-up's base).
    estimate: u64,
    /// Grows with streamed content (no declared output).
    grows: bool,
    grown: Cell<u64>,
    trued: Cell<bool>,
}

impl Reservation {
    /// Whether it grows with streamed content (no declared output).
    pub fn grows(&self) -> bool {
        self.grows
    }

    /// Content bytes streamed so far: an undeclared stream's reservation
    /// grows by a token per 4 bytes.
    pub fn streamed(&self, content_bytes: u64) {
        if !self.grows {
            return;
        }
        let want = admission::growth(content_bytes);
        let have = self.grown.get();
        if want > have {
            self.grown.set(want);
            let d = i64::try_from(want - have).unwrap_or(i64::MAX);
            self.state.borrow_mut().adjust(self.id, d);
        }
    }

    /// Exact input tokens reported by the backend: the reservation is
    /// trued up by `exact − estimate` once (never below 0).
    pub fn exact_input(&self, input: u64) {
        if input == 0 || self.trued.replace(true) {
            return;
        }
        let d = i128::from(input) - i128::from(self.estimate);
        let d = i64::try_from(d).unwrap_or(if d < 0 { i64::MIN } else { i64::MAX });
        if d != 0 {
            self.state.borrow_mut().adjust(self.id, d);
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // Never borrowed across an await: the borrow cannot be held here.
        if let Ok(mut s) = self.state.try_borrow_mut() {
            s.release(self.id);
        }
    }
}

/// A parked request's place; leaving it (any way) cancels the ticket and
/// returns a grant that arrived unclaimed.
pub struct Place {
    state: Shared,
    ticket: u64,
    /// The grant arrives here.
    pub rx: oneshot::Receiver<Grant>,
    /// Set once the grant is claimed (nothing to cancel then).
    pub done: bool,
}

impl Drop for Place {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let Ok(mut s) = self.state.try_borrow_mut() else {
            return;
        };
        s.waiters.remove(&self.ticket);
        let (_, g) = s.occupancy.cancel(self.ticket);
        s.deliver(g);
        if let Ok(Some(Grant::Granted(id))) = self.rx.try_recv() {
            s.release(id);
        }
    }
}

/// What entering the occupancy gate gave.
pub enum Entry {
    /// Room reserved under this id.
    Granted(u64),
    /// Refused at once.
    Refused(Reason),
    /// Parked: wait on the place's receiver.
    Parked(Place),
}

/// Enter the occupancy gate of `state` (B2 + B4 share).
pub fn enter(state: &Shared, ask: Ask, room: Room, may_park: bool) -> Entry {
    let mut s = state.borrow_mut();
    match s.occupancy.admit(ask, room, may_park) {
        Admit::Granted(id) => Entry::Granted(id),
        Admit::TooLarge | Admit::Full => Entry::Refused(Reason::B2),
        Admit::ShareExceeded => Entry::Refused(Reason::B4Occupancy),
        Admit::Parked(ticket) => {
            let (tx, rx) = oneshot::channel();
            s.waiters.insert(ticket, tx);
            Entry::Parked(Place {
                state: state.clone(),
                ticket,
                rx,
                done: false,
            })
        }
    }
}

/// The reservation `id` of `state`, admitted with `estimate`; it grows
/// with streamed content when no output was declared.
pub fn reservation(state: &Shared, id: u64, estimate: u64, declared_output: u64) -> Reservation {
    Reservation {
        state: state.clone(),
        id,
        estimate,
        grows: declared_output == 0,
        grown: Cell::new(0),
        trued: Cell::new(false),
    }
}

/// Take `need` input tokens from `key`'s ITPM bucket after checking its
/// OTPM bucket has a token (B4 rates); `Err` names the gate.
pub fn take_rates(
    state: &Shared,
    key: &Arc<str>,
    itpm: u64,
    otpm: u64,
    need: u64,
    now_ns: u64,
) -> Result<(), Reason> {
    let mut s = state.borrow_mut();
    let rates = s.rates.entry(key.clone()).or_default();
    rates_check(rates, itpm, otpm, need, now_ns, true)
}

/// Whether `key`'s B4 rates would let a request of `need` input tokens
/// through now, without taking anything (a request about to be held
/// checks what its admission after the wake will take).
pub fn rates_allow(
    state: &Shared,
    key: &Arc<str>,
    itpm: u64,
    otpm: u64,
    need: u64,
    now_ns: u64,
) -> Result<(), Reason> {
    let mut s = state.borrow_mut();
    match s.rates.get_mut(key) {
        Some(rates) => rates_check(rates, itpm, otpm, need, now_ns, false),
        None => Ok(()),
    }
}

/// The B4 rate gates on one key's buckets: OTPM has a token, ITPM has
/// `need` (taken when `take`).
fn rates_check(
    rates: &mut KeyRates,
    itpm: u64,
    otpm: u64,
    need: u64,
    now_ns: u64,
    take: bool,
) -> Result<(), Reason> {
    if otpm > 0 && !rates.otpm.has_one(otpm, now_ns) {
        return Err(Reason::B4Otpm);
    }
    if itpm == 0 {
        return Ok(());
    }
    let fits = if take {
        rates.itpm.take(itpm, need, now_ns)
    } else {
        rates.itpm.tokens(itpm, now_ns) >= i128::from(need)
    };
    if fits {
        Ok(())
    } else {
        Err(Reason::B4Itpm)
    }
}

/// A request admission let through.
#[derive(Default)]
pub struct Admitted {
    /// Its occupancy reservation (B2 active).
    pub reservation: Option<Reservation>,
    /// Its key's OTPM bucket, charged with the output tokens at the end.
    pub otpm: Option<(Shared, Arc<str>, u64)>,
}

impl Admitted {
    /// Charge the output of a local response to the key's OTPM bucket.
    pub fn charge_output(&self, output: u64) {
        if let Some((state, key, cap)) = &self.otpm {
            let mut s = state.borrow_mut();
            if let Some(r) = s.rates.get_mut(key) {
                r.otpm.charge(*cap, output, clock::mono_ns());
            }
        }
    }
}
