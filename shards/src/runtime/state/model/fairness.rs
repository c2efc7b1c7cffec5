//! Fairness among priority classes and tenants, the model's part: its
//! per-class counters ([`ClassStats`]) and their metric families
//! ([`render`]). The facts the decision reads and the bookkeeping at the
//! driver's hooks are in [`crate::runtime::request::fairness`].

use crate::logic::routing::wait_queue::Class;
use crate::runtime::wire::exposition::Kind::{Counter, Histogram as Hist};
use crate::runtime::wire::exposition::{Family, Histogram};

/// `hivenet_queue_wait_seconds` buckets: 0.01 x 2^k, k = 0..12.
pub const QUEUE_BUCKETS: [f64; 13] = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96,
];

/// The model's requests by priority class: waits that ended with a slot,
/// admitted and refused (`hivenet_queue_wait_seconds`,
/// `hivenet_class_requests_total`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ClassStats {
    /// Waits in the capacity queue that ended with a slot, per class.
    pub wait: [Histogram; 3],
    /// Requests sent to an agent (once per request), per class.
    pub admitted: [u64; 3],
    /// Requests refused (no capacity, queue, quota or admission), per
    /// class.
    pub refused: [u64; 3],
}

impl ClassStats {
    /// Add another shard's counters of the model.
    pub fn add(&mut self, o: &ClassStats) {
        for (a, b) in self.wait.iter_mut().zip(&o.wait) {
            a.merge(b);
        }
        for (a, b) in self.admitted.iter_mut().zip(&o.admitted) {
            *a += b;
        }
        for (a, b) in self.refused.iter_mut().zip(&o.refused) {
            *a += b;
        }
    }

    /// Record one wait of a request of `class` that ended with a slot.
    pub fn observe_wait(&mut self, class: Class, secs: f64) {
        if let Some(h) = self.wait.get_mut(class.index()) {
            h.observe(&QUEUE_BUCKETS, secs);
        }
    }

    /// Count a refusal of a request of `class`.
    pub fn refuse(&mut self, class: Class) {
        if let Some(n) = self.refused.get_mut(class.index()) {
            *n += 1;
        }
    }
}

/// The class families: the standard class's series always (the series a
/// model had before classes), the others once they had a request.
pub fn render<'m, I>(o: &mut String, models: I)
where
    I: Iterator<Item = (&'m String, &'m ClassStats)> + Clone,
{
    let mut f = Family::new(
        o,
        "hivenet_queue_wait_seconds",
        Hist,
        "Waits in the capacity queue that ended with a slot, by priority class.",
        ["model", "class"],
    );
    for (m, st) in models.clone() {
        for (class, h) in Class::ALL.iter().zip(&st.wait) {
            if h.count > 0 || *class == Class::Standard {
                f.histogram([m, &class.as_str()], &QUEUE_BUCKETS, h);
            }
        }
    }
    let mut f = Family::new(
        o,
        "hivenet_class_requests_total",
        Counter,
        "Requests by priority class: admitted (sent to an agent, once per request) or refused (no capacity, queue, quota or admission).",
        ["model", "class", "outcome"],
    );
    for (m, st) in models {
        for (i, class) in Class::ALL.iter().enumerate() {
            let admitted = st.admitted.get(i).copied().unwrap_or(0);
            let refused = st.refused.get(i).copied().unwrap_or(0);
            if admitted + refused > 0 || *class == Class::Standard {
                f.series([m, &class.as_str(), &"admitted"], admitted);
                f.series([m, &class.as_str(), &"refused"], refused);
            }
        }
    }
}
