//! Caps on agent links (issue 29 #1): in total and per source address,
//! taken at TCP accept, before any byte is read, and given back when the
//! link ends wherever it ends (a permit rides along a hand-over). 10,000
//! fresh identities once took the router to 2 GiB: beyond the caps a link
//! is refused and counted (`reason="link_cap"` / `"address_cap"`).
//!
//! Key types: [`LinkBudget`], [`LinkPermit`].

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Agent links open now, in all and per address, and their caps.
#[derive(Debug, Default)]
pub struct LinkBudget {
    total: AtomicUsize,
    max_total: usize,
    per_address: Mutex<HashMap<IpAddr, usize>>,
    max_per_address: usize,
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
        if let Some(a) = addr {
            let mut m = match self.per_address.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            let n = m.entry(a).or_default();
            if self.max_per_address > 0 && *n >= self.max_per_address {
                drop(m);
                self.total.fetch_sub(1, Ordering::AcqRel);
                return Err(LinkCap::Address(self.max_per_address));
            }
            *n += 1;
        }
        Ok(LinkPermit {
            budget: self.clone(),
            addr,
        })
    }
}

/// One link's place under the caps, given back when dropped.
#[derive(Debug)]
pub struct LinkPermit {
    budget: Arc<LinkBudget>,
    addr: Option<IpAddr>,
}

impl Drop for LinkPermit {
    fn drop(&mut self) {
        self.budget.total.fetch_sub(1, Ordering::AcqRel);
        if let Some(a) = self.addr {
            let mut m = match self.budget.per_address.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            if let Some(n) = m.get_mut(&a) {
                *n = n.saturating_sub(1);
                if *n == 0 {
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
}
