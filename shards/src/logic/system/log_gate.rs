//! At most one log line per period for a repeated event, with the count
//! of the events it stands for (an overloaded model sheds thousands of
//! requests a second; one line a second says the same).

use std::time::{Duration, Instant};

/// One repeated event's gate.
#[derive(Debug, Clone, Default)]
pub struct LogGate {
    last: Option<Instant>,
    pending: u64,
}

impl LogGate {
    /// Count one event at `now`; returns how many events the line to
    /// write now stands for (this one included), or None: stay quiet.
    pub fn hit(&mut self, now: Instant, period: Duration) -> Option<u64> {
        self.pending += 1;
        let due = self
            .last
            .is_none_or(|t| now.saturating_duration_since(t) >= period);
        if !due {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.pending))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_period_with_the_count() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut g = LogGate::default();
        assert_eq!(g.hit(t0, s), Some(1));
        let mut lines = Vec::new();
        for k in 1..=2500u64 {
            if let Some(n) = g.hit(t0 + Duration::from_millis(k), s) {
                lines.push(n);
            }
        }
        assert_eq!(
            lines,
            vec![1000, 1000],
            "one line per second, counting every event"
        );
        assert_eq!(g.hit(t0 + Duration::from_secs(10), s), Some(501));
    }
}
