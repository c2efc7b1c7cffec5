//! The one capacity wait: every [`Action::Wait`] the decision machine
//! yields (a request for a slot, a continuation at the head of the line)
//! is carried out here, watching the client socket: a client that closes
//! its connection leaves the queue at once and never reaches a backend.
//!
//! [`Action::Wait`]: crate::logic::routing::decision::Action::Wait

use std::cell::RefCell;
use std::rc::Rc;

use futures::future::{select, Either};
use tracing::debug;

use crate::logic::routing::decision::{Decision, WaitEnd};
use crate::logic::routing::wait_queue::{Fair, Place, Prefer};
use crate::runtime::state::model::{tenant_ended, wake_for, wake_head, Claim, Waiter, Waiters};
use crate::runtime::state::scope::Client;
use crate::runtime::wire::clock;

/// One wait as the machine asked for it.
pub struct Wait {
    /// Give up at this instant.
    pub until: clock::Instant,
    /// Its original place (a waiter that lost a race).
    pub place: Option<Place>,
    /// The queue bound for a newcomer.
    pub depth: usize,
    /// Wake this agent's waiter first once in line.
    pub wake_first: Option<u64>,
    /// The holders of its prefix.
    pub prefer: Prefer,
    /// Only its holders may wake it.
    pub pinned: bool,
    /// A continuation: at the head, charged to no tenant.
    pub head: bool,
    /// Pass its last unanswered wake on first.
    pub pass_on: bool,
    /// Its place in the fair order.
    pub fair: Fair,
}

/// Queue the request in its model's capacity queue (`None`: the model
/// has none here) as `w` says and wait for a slot until `w.until`; report
/// the end to `d`. Returns the slot a wake claimed for its tenant.
pub async fn wait_for_capacity(
    c: &mut Client,
    model: &str,
    queue: Option<Rc<RefCell<Waiters>>>,
    d: &mut Decision,
    w: Wait,
) -> Option<Claim> {
    let (end, claim) = wait(c, model, queue, d, w).await;
    d.wait_ended(end, clock::now());
    claim
}

async fn wait(
    c: &mut Client,
    model: &str,
    queue: Option<Rc<RefCell<Waiters>>>,
    d: &mut Decision,
    w: Wait,
) -> (WaitEnd, Option<Claim>) {
    let Some(queue) = queue else {
        return (WaitEnd::TimedOut, None);
    };
    let (tx, mut rx) = futures::channel::oneshot::channel();
    // A continuation is charged to no tenant: never held back for the
    // others' headroom.
    let tenant = if w.head { 0 } else { w.fair.tenant };
    let waiter = Waiter {
        tx,
        prefer: w.prefer,
        pinned: w.pinned,
        tenant,
    };
    let Some(seq) = join(&queue, &w, waiter) else {
        return (WaitEnd::Refused, None);
    };
    // A newcomer that saw a free slot wakes the waiter it goes to once
    // this one is in line: itself when it comes first (a higher class; or
    // the only one the free slot's reservation admits).
    if let Some(agent) = w.wake_first {
        wake_for(&queue, agent);
    }
    let now = clock::now();
    d.queued(seq, now);
    let timer = monoio::time::sleep(w.until.saturating_duration_since(now));
    futures::pin_mut!(timer);
    let (end, claimed) = match c.unless_gone(select(&mut rx, timer)).await {
        Some(Either::Left((Ok(claimed), _))) => (WaitEnd::Woken, claimed),
        Some(Either::Left((Err(_), _))) => (WaitEnd::Refused, false),
        Some(Either::Right(_)) => (WaitEnd::TimedOut, false),
        None => (WaitEnd::ClientGone, false),
    };
    let claim = claimed.then(|| Claim::new(queue.clone(), tenant));
    if end != WaitEnd::Woken {
        leave(&queue, seq, tenant, &mut rx);
    }
    if end == WaitEnd::ClientGone {
        debug!(
            model,
            "client closed its connection while queued; left the queue"
        );
    }
    (end, claim)
}

/// Join the line as `w` says: a continuation at the head, a waiter that
/// lost a race at its original place, a newcomer under the bound (`None`:
/// a full queue had no place for it).
fn join(queue: &RefCell<Waiters>, w: &Wait, waiter: Waiter) -> Option<Place> {
    let tenant = waiter.tenant;
    if w.head {
        // Woken for a slot another took, or one it may not take: the
        // next waiter is told.
        if w.pass_on {
            wake_head(queue);
        }
        return Some(queue.borrow_mut().push_head(waiter));
    }
    let mut q = queue.borrow_mut();
    if let Some(seq) = w.place {
        q.tenants.wait(tenant);
        q.requeue(seq, waiter);
        return Some(seq);
    }
    // A full queue: a higher class goes ahead and nobody leaves (up to
    // twice the bound); within a class, an arrival served before the last
    // waiter takes its place, and the displaced waiter's wait ends (its
    // sender dropped): refused as a full queue, as if it had come last.
    let (seq, displaced) = q.push_displacing(waiter, w.depth, w.fair).ok()?;
    q.tenants.wait(tenant);
    if let Some((_, d)) = displaced {
        q.tenants.unwait(d.tenant);
    }
    Some(seq)
}

/// Leave the line at `seq` after a wait that was not a wake; a wake that
/// came in the same turn passes its slot (and its claim) on.
fn leave(
    queue: &Rc<RefCell<Waiters>>,
    seq: Place,
    tenant: u64,
    rx: &mut futures::channel::oneshot::Receiver<bool>,
) {
    let mut q = queue.borrow_mut();
    if let Some(w) = q.remove(seq) {
        q.tenants.unwait(w.tenant);
    }
    drop(q);
    if let Ok(Some(claimed)) = rx.try_recv() {
        if claimed {
            tenant_ended(queue, tenant);
        }
        wake_head(queue);
    }
}
