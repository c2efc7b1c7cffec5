//! When a router takes clients (issue 54), what `/ready` answers (a load
//! balancer's readiness probe): not yet while the agents it had before a
//! restart (the store's recent history) link again, at most
//! [`READY_WAIT`]; no more from the moment it stops or is replaced (what
//! it has still finishes). A pod replaced in a rolling update is thus
//! never sent clients for models whose agents have not come back yet.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::runtime::wire::clock::{self, Duration, Instant};

/// Longest a starting router waits for its former agents before it says
/// it is ready anyway (an agent that left meanwhile never comes back).
pub const READY_WAIT: Duration = Duration::from_secs(30);

/// The readiness state (see the module doc).
pub struct Readiness {
    waiting: Mutex<HashSet<String>>,
    until: Instant,
    draining: AtomicBool,
}

impl Default for Readiness {
    fn default() -> Self {
        Readiness::expecting(Vec::new(), Duration::ZERO)
    }
}

impl Readiness {
    /// Ready once every peer of `peers` registered, or after `wait`.
    pub fn expecting(peers: Vec<String>, wait: Duration) -> Self {
        Readiness {
            waiting: Mutex::new(peers.into_iter().collect()),
            until: clock::now() + wait,
            draining: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        match self.waiting.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// An agent registered.
    pub fn registered(&self, peer: &str) {
        let mut w = self.lock();
        if !w.is_empty() {
            w.remove(peer);
        }
    }

    /// From now on not ready (stopping, or replaced).
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Whether it stopped taking new clients.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Whether a load balancer should send it clients at `now`.
    pub fn ready(&self, now: Instant) -> bool {
        !self.draining() && (now >= self.until || self.lock().is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_when_the_former_agents_are_back_or_the_wait_ends() {
        let r = Readiness::expecting(vec!["a".into(), "b".into()], Duration::from_secs(30));
        let now = clock::now();
        assert!(!r.ready(now));
        r.registered("a");
        assert!(!r.ready(now));
        r.registered("b");
        assert!(r.ready(now));
        r.drain();
        assert!(!r.ready(now));
        let late = Readiness::expecting(vec!["gone".into()], Duration::from_secs(1));
        assert!(!late.ready(now));
        assert!(late.ready(now + Duration::from_secs(2)));
        assert!(Readiness::default().ready(now));
    }
}
