//! Caps on agent links (issue 29 #1): in total and per source address,
//! taken at TCP accept, before any byte is read, and given back when the
//! link ends wherever it ends (a permit rides along a hand-over). 10,000
//! fresh identities once took the router to 2 GiB: beyond the caps a link
//! is refused and counted (`reason="link_cap"` / `"address_cap"`).
//!
//! The budget of connections before their handshake evicts instead of
//! refusing at its per-address cap: the oldest connection of that address
//! still waiting is cut (issue 51 #2: 140 silent connections from an
//! agent's own address kept it out; a flood of any size from one address
//! now cannot hold a place for longer than it takes newer connections to
//! arrive, and an agent's connection, which finishes its handshake in
//! milliseconds, gets through).
//!
//! Key types: [`LinkBudget`], [`LinkPermit`].

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::Poll;

use futures::task::AtomicWaker;

/// Agent links open now, in all and per address, and their caps.
#[derive(Debug, Default)]
pub struct LinkBudget {
    total: AtomicUsize,
    max_total: usize,
    per_address: Mutex<HashMap<IpAddr, Place>>,
    max_per_address: usize,
    /// At the per-address cap, cut the address's oldest waiting link
    /// instead of refusing the new one.
    evicts: bool,
}

/// One address's links: how many, and (evicting budgets) the order they
/// came in.
#[derive(Debug, Default)]
struct Place {
    n: usize,
    order: VecDeque<Weak<Eviction>>,
}

/// The signal that cuts an evicted link.
#[derive(Debug, Default)]
pub struct Eviction {
    evicted: AtomicBool,
    waker: AtomicWaker,
}

impl Eviction {
    fn evict(&self) -> bool {
        let first = !self.evicted.swap(true, Ordering::AcqRel);
        self.waker.wake();
        first
    }
}

/// Why a link was refused at accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkCap {
    /// `--max-agent-links` reached.
    Total(usize),
    /// `--max-agent-links-per-address` reached for this address.
    Address(usize),
}

impl LinkBudget {
    /// Caps (0: none).
    pub fn new(max_total: usize, max_per_address: usize) -> Arc<Self> {
        Arc::new(LinkBudget {
            max_total,
            max_per_address,
            ..LinkBudget::default()
        })
    }

    /// Caps (0: none) whose per-address cap evicts the address's oldest
    /// link instead of refusing (connections before their handshake).
    pub fn evicting(max_total: usize, max_per_address: usize) -> Arc<Self> {
        Arc::new(LinkBudget {
            max_total,
            max_per_address,
            evicts: true,
            ..LinkBudget::default()
        })
    }

    /// Links open now.
    pub fn open(&self) -> usize {
        self.total.load(Ordering::Relaxed)
    }

    /// A place for a link from `addr`, or the cap that refuses it.
    pub fn take(self: &Arc<Self>, addr: Option<IpAddr>) -> Result<LinkPermit, LinkCap> {
        let prev = self.total.fetch_add(1, Ordering::AcqRel);
        if self.max_total > 0 && prev >= self.max_total {
            self.total.fetch_sub(1, Ordering::AcqRel);
            return Err(LinkCap::Total(self.max_total));
        }
        let mut eviction = None;
        if let Some(a) = addr {
            let mut m = match self.per_address.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            let place = m.entry(a).or_default();
            if self.max_per_address > 0 && place.n >= self.max_per_address {
                // The oldest still waiting goes (its permit is given back
                // as soon as its task sees the signal).
                let evicted = self.evicts && evict_oldest(&mut place.order);
                if !evicted {
                    drop(m);
                    self.total.fetch_sub(1, Ordering::AcqRel);
                    return Err(LinkCap::Address(self.max_per_address));
                }
            }
            place.n += 1;
            if self.evicts {
                let e = Arc::new(Eviction::default());
                if place.order.len() >= self.max_per_address.saturating_mul(2).max(16) {
                    place.order.retain(|w| w.strong_count() > 0);
                }
                place.order.push_back(Arc::downgrade(&e));
                eviction = Some(e);
            }
        }
        Ok(LinkPermit {
            budget: self.clone(),
            addr,
            eviction,
        })
    }
}

/// Signal the oldest link of `order` not yet evicted; false when none is
/// left to evict.
fn evict_oldest(order: &mut VecDeque<Weak<Eviction>>) -> bool {
    while let Some(w) = order.pop_front() {
        if let Some(e) = w.upgrade() {
            if e.evict() {
                return true;
            }
        }
    }
    false
}

/// One link's place under the caps, given back when dropped.
#[derive(Debug)]
pub struct LinkPermit {
    budget: Arc<LinkBudget>,
    addr: Option<IpAddr>,
    eviction: Option<Arc<Eviction>>,
}

impl LinkPermit {
    /// `fut`, or `None` when the budget evicted this link meanwhile.
    pub async fn or_evicted<T>(&self, fut: impl std::future::Future<Output = T>) -> Option<T> {
        use futures::future::{select, Either};
        futures::pin_mut!(fut);
        let gone = self.evicted();
        futures::pin_mut!(gone);
        match select(fut, gone).await {
            Either::Left((v, _)) => Some(v),
            Either::Right(_) => None,
        }
    }

    /// Resolves when the budget evicted this link (never for a budget that
    /// does not evict).
    pub async fn evicted(&self) {
        let Some(e) = &self.eviction else {
            return futures::future::pending().await;
        };
        futures::future::poll_fn(|cx| {
            if e.evicted.load(Ordering::Acquire) {
                return Poll::Ready(());
            }
            e.waker.register(cx.waker());
            if e.evicted.load(Ordering::Acquire) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await
    }
}

impl Drop for LinkPermit {
    fn drop(&mut self) {
        self.budget.total.fetch_sub(1, Ordering::AcqRel);
        if let Some(a) = self.addr {
            let mut m = match self.budget.per_address.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            if let Some(place) = m.get_mut(&a) {
                place.n = place.n.saturating_sub(1);
                if place.n == 0 {
                    m.remove(&a);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_in_total_and_per_address_give_back_on_drop() {
        let b = LinkBudget::new(3, 2);
        let a: IpAddr = [10, 0, 0, 1].into();
        let c: IpAddr = [10, 0, 0, 2].into();
        let p1 = b.take(Some(a)).expect("1");
        let p2 = b.take(Some(a)).expect("2");
        assert_eq!(b.take(Some(a)).err(), Some(LinkCap::Address(2)));
        let p3 = b.take(Some(c)).expect("3");
        assert_eq!(b.take(Some(c)).err(), Some(LinkCap::Total(3)));
        assert_eq!(b.open(), 3);
        drop(p1);
        let p4 = b.take(Some(a)).expect("room again");
        drop((p2, p3, p4));
        assert_eq!(b.open(), 0);
        assert!(b.per_address.lock().map(|m| m.is_empty()).unwrap_or(false));
        let open = LinkBudget::new(0, 0);
        let many: Vec<_> = (0..100)
            .map(|_| open.take(Some(a)).expect("no cap"))
            .collect();
        assert_eq!(open.open(), 100);
        drop(many);
    }

    #[test]
    fn an_evicting_budget_cuts_the_oldest_of_the_address_at_its_cap() {
        let b = LinkBudget::evicting(10, 2);
        let a: IpAddr = [10, 0, 0, 1].into();
        let p1 = b.take(Some(a)).expect("1");
        let p2 = b.take(Some(a)).expect("2");
        let fired = |p: &LinkPermit| {
            p.eviction
                .as_ref()
                .is_some_and(|e| e.evicted.load(Ordering::Acquire))
        };
        // At the cap: the oldest is told to go, the new one admitted.
        let p3 = b.take(Some(a)).expect("3 evicts 1");
        assert!(fired(&p1) && !fired(&p2) && !fired(&p3));
        let p4 = b.take(Some(a)).expect("4 evicts 2");
        assert!(fired(&p2));
        // Both evicted ones still hold their place until dropped: a third
        // eviction takes 3, never one already told.
        let p5 = b.take(Some(a)).expect("5 evicts 3");
        assert!(fired(&p3) && !fired(&p4) && !fired(&p5));
        drop((p1, p2, p3, p4, p5));
        assert_eq!(b.open(), 0);
        assert!(b.per_address.lock().map(|m| m.is_empty()).unwrap_or(false));
        // A plain budget still refuses.
        let plain = LinkBudget::new(10, 1);
        let _q = plain.take(Some(a)).expect("1");
        assert_eq!(plain.take(Some(a)).err(), Some(LinkCap::Address(1)));
    }

    #[test]
    fn eviction_wakes_the_waiting_task() {
        let b = LinkBudget::evicting(10, 1);
        let a: IpAddr = [10, 0, 0, 1].into();
        let p1 = b.take(Some(a)).expect("1");
        let _p2 = b.take(Some(a)).expect("2");
        futures::executor::block_on(p1.evicted());
    }
}
