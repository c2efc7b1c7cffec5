//! The arrival plan of an open-loop run: intended send offsets from a seed.
//! Pure: the same seed, rate and duration give the same schedule.

use std::time::Duration;

/// Arrival process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrivals {
    /// Evenly spaced at 1/rate.
    Constant,
    /// Exponential gaps with mean 1/rate.
    Poisson,
}

impl Arrivals {
    /// Parse `constant|poisson`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "constant" => Some(Arrivals::Constant),
            "poisson" => Some(Arrivals::Poisson),
            _ => None,
        }
    }
}

/// SplitMix64: small, seedable, good enough for arrival jitter.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded generator.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in [lo, hi].
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }
}

/// Intended send offsets (from the run start) of every request.
pub fn schedule(kind: Arrivals, rate: f64, duration: Duration, seed: u64) -> Vec<Duration> {
    if rate <= 0.0 || !rate.is_finite() {
        return Vec::new();
    }
    let end = duration.as_secs_f64();
    let mut out = Vec::with_capacity((rate * end) as usize + 16);
    match kind {
        Arrivals::Constant => {
            let n = (rate * end).floor() as u64;
            for i in 0..n {
                out.push(Duration::from_secs_f64(i as f64 / rate));
            }
        }
        Arrivals::Poisson => {
            let mut rng = Rng::new(seed);
            let mut t = 0.0f64;
            loop {
                // Inverse transform; 1 - u is in (0, 1].
                let u = 1.0 - rng.next_f64();
                t += -u.ln() / rate;
                if t >= end {
                    break;
                }
                out.push(Duration::from_secs_f64(t));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn constant_has_the_rate() {
        let s = schedule(Arrivals::Constant, 100.0, Duration::from_secs(10), 1);
        assert_eq!(s.len(), 1000);
        assert_eq!(s[1] - s[0], Duration::from_millis(10));
    }

    #[test]
    fn poisson_is_deterministic_and_near_the_rate() {
        let a = schedule(Arrivals::Poisson, 500.0, Duration::from_secs(20), 42);
        let b = schedule(Arrivals::Poisson, 500.0, Duration::from_secs(20), 42);
        assert_eq!(a, b, "same seed, same schedule");
        let c = schedule(Arrivals::Poisson, 500.0, Duration::from_secs(20), 43);
        assert_ne!(a, c);
        // 10000 expected; Poisson sd = 100: allow 5 sd.
        assert!((a.len() as i64 - 10_000).abs() < 500, "{}", a.len());
        // Mean gap near 2 ms.
        let mean = a
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64())
            .sum::<f64>()
            / (a.len() - 1) as f64;
        assert!((mean - 0.002).abs() < 0.0002, "{mean}");
    }

    proptest! {
        #[test]
        fn sorted_and_within_duration(rate in 1.0f64..2000.0, secs in 1u64..5, seed in any::<u64>(), poisson in any::<bool>()) {
            let kind = if poisson { Arrivals::Poisson } else { Arrivals::Constant };
            let s = schedule(kind, rate, Duration::from_secs(secs), seed);
            prop_assert!(s.windows(2).all(|w| w[0] <= w[1]));
            prop_assert!(s.iter().all(|t| *t < Duration::from_secs(secs)));
        }
    }
}
