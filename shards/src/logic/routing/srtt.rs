//! Per-agent latency estimator: RFC 6298's SRTT/RTTVAR with asymmetric
//! smoothing (seed "latency tracking"). Pure: the caller passes each sample
//! in milliseconds (sub-millisecond precision kept).
//!
//! - First valid sample R: SRTT = R, RTTVAR = R/2 (state KNOWN).
//! - Later samples: RTTVAR = 0.75·RTTVAR + 0.25·|SRTT − R| first, then
//!   SRTT = (1−α)·SRTT + α·R with α = 0.5 when R < SRTT (improving) and
//!   α = 0.125 when R ≥ SRTT (worsening).
//! - Samples that are not finite or not positive are ignored: a failure
//!   before any measurement must not fabricate one.

use serde::{Deserialize, Serialize};

/// Smoothing factor for an improving sample.
pub const ALPHA_IMPROVING: f64 = 0.5;
/// Smoothing factor for a worsening (or equal) sample.
pub const ALPHA_WORSENING: f64 = 0.125;
/// RTTVAR's smoothing factor (RFC 6298 β).
pub const BETA: f64 = 0.25;

/// SRTT and RTTVAR in milliseconds once initialised.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Estimator {
    state: Option<(f64, f64)>,
}

/// One applied update (for debug logs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Update {
    /// The sample, ms.
    pub sample: f64,
    /// SRTT before (None: first sample).
    pub old_srtt: Option<f64>,
    /// RTTVAR before.
    pub old_rttvar: Option<f64>,
    /// SRTT after.
    pub srtt: f64,
    /// RTTVAR after.
    pub rttvar: f64,
}

impl Estimator {
    /// An estimator in state UNKNOWN.
    pub fn new() -> Self {
        Estimator { state: None }
    }

    /// Restore persisted values (warm start). Invalid values leave it UNKNOWN.
    pub fn restored(srtt: f64, rttvar: f64) -> Self {
        if srtt.is_finite() && srtt > 0.0 && rttvar.is_finite() && rttvar >= 0.0 {
            Estimator {
                state: Some((srtt, rttvar)),
            }
        } else {
            Estimator::new()
        }
    }

    /// Whether a sample has initialised it.
    pub fn known(&self) -> bool {
        self.state.is_some()
    }

    /// Smoothed RTT, ms.
    pub fn srtt(&self) -> Option<f64> {
        self.state.map(|s| s.0)
    }

    /// RTT variation, ms.
    pub fn rttvar(&self) -> Option<f64> {
        self.state.map(|s| s.1)
    }

    /// Apply one sample in ms; `None` when the sample is ignored.
    pub fn observe(&mut self, sample: f64) -> Option<Update> {
        if !sample.is_finite() || sample <= 0.0 {
            return None;
        }
        let (old_srtt, old_rttvar) = (self.srtt(), self.rttvar());
        let next = match self.state {
            None => (sample, sample / 2.0),
            Some((srtt, rttvar)) => {
                let rttvar = (1.0 - BETA) * rttvar + BETA * (srtt - sample).abs();
                let alpha = if sample < srtt {
                    ALPHA_IMPROVING
                } else {
                    ALPHA_WORSENING
                };
                let srtt = (1.0 - alpha) * srtt + alpha * sample;
                (srtt, rttvar)
            }
        };
        self.state = Some(next);
        Some(Update {
            sample,
            old_srtt,
            old_rttvar,
            srtt: next.0,
            rttvar: next.1,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn first_sample_initialises() {
        let mut e = Estimator::new();
        assert!(!e.known());
        e.observe(200.0);
        assert_eq!(e.srtt(), Some(200.0));
        assert_eq!(e.rttvar(), Some(100.0));
    }

    #[test]
    fn seed_worked_example() {
        let mut e = Estimator::restored(200.0, 50.0);
        e.observe(5000.0);
        assert_eq!(e.rttvar(), Some(1237.5));
        assert_eq!(e.srtt(), Some(800.0));
        let mut seen = Vec::new();
        for _ in 0..5 {
            e.observe(200.0);
            seen.push(e.srtt().unwrap_or(0.0));
        }
        assert_eq!(seen, vec![500.0, 350.0, 275.0, 237.5, 218.75]);
    }

    #[test]
    fn warm_start_example() {
        let mut e = Estimator::restored(195.0, 20.0);
        e.observe(190.0);
        assert_eq!(e.srtt(), Some(192.5));
    }

    #[test]
    fn sub_millisecond_and_invalid_samples() {
        let mut e = Estimator::new();
        assert!(e.observe(0.0).is_none());
        assert!(e.observe(-1.0).is_none());
        assert!(e.observe(f64::NAN).is_none());
        assert!(!e.known());
        e.observe(0.25);
        assert_eq!(e.srtt(), Some(0.25));
        assert!(!Estimator::restored(f64::NAN, 1.0).known());
    }

    proptest! {
        #[test]
        fn never_nan_never_negative_within_range(samples in proptest::collection::vec(0.001f64..1e7, 1..200)) {
            let mut e = Estimator::new();
            let (mut lo, mut hi) = (f64::MAX, 0.0f64);
            for s in &samples {
                e.observe(*s);
                lo = lo.min(*s);
                hi = hi.max(*s);
                let (srtt, var) = (e.srtt().unwrap_or(f64::NAN), e.rttvar().unwrap_or(f64::NAN));
                prop_assert!(srtt.is_finite() && var.is_finite());
                prop_assert!(srtt >= 0.0 && var >= 0.0);
                prop_assert!(srtt >= lo * (1.0 - 1e-12) && srtt <= hi * (1.0 + 1e-12), "srtt {} outside [{}, {}]", srtt, lo, hi);
            }
        }

        #[test]
        fn constant_samples_converge(v in 0.01f64..1e6, start in 0.01f64..1e6) {
            let mut e = Estimator::restored(start, start / 2.0);
            for _ in 0..400 {
                e.observe(v);
            }
            let srtt = e.srtt().unwrap_or(f64::NAN);
            prop_assert!((srtt - v).abs() <= v * 1e-6 + 1e-9, "{} vs {}", srtt, v);
            prop_assert!(e.rttvar().unwrap_or(f64::NAN) <= (start - v).abs() * 1e-6 + 1e-9 + v * 1e-6);
        }
    }
}
