//! Quota arithmetic (spec 04 §12), pure: a requests-per-minute bucket
//! kept as one `u64` (GCRA: the theoretical arrival time), and a daily
//! token counter kept as one `u64` (UTC day index and tokens used). One
//! word each so the runtime can share a bucket across shards with a
//! single compare-and-swap: a decision is exact, never "N over the limit
//! under a burst".
//!
//! Clocks come in as arguments: `now_ns` (monotonic nanoseconds) for
//! buckets, `day` (Unix seconds / 86 400) for daily counters.

const MINUTE_NS: u64 = 60_000_000_000;

/// A request rate: `per_minute` requests per minute with a burst of `burst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    /// Requests per minute (> 0).
    pub per_minute: u64,
    /// Requests admitted at once from a full bucket (>= 1).
    pub burst: u64,
}

impl Rate {
    /// `per_minute` with the spec's burst: the whole minute, or
    /// `max(1, per_minute × burst_secs / 60)` when `burst_secs` ∈ [1, 59]
    /// (`HIVENET_ROUTER_RPM_BURST_SECONDS`).
    pub fn per_minute(per_minute: u64, burst_secs: u64) -> Rate {
        let burst = if (1..60).contains(&burst_secs) {
            (per_minute.saturating_mul(burst_secs) / 60).max(1)
        } else {
            per_minute
        };
        Rate {
            per_minute: per_minute.max(1),
            burst: burst.max(1),
        }
    }

    /// Nanoseconds between two requests at the steady rate.
    fn interval(self) -> u64 {
        (MINUTE_NS / self.per_minute.max(1)).max(1)
    }
}

/// A bucket's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Admitted: store `tat`; `remaining` requests could follow at once.
    Admit {
        /// The bucket's new state.
        tat: u64,
        /// Whole requests left in the bucket after this one.
        remaining: u64,
    },
    /// Refused: the next request fits in `retry_after_ns`.
    Deny {
        /// Nanoseconds until one request fits.
        retry_after_ns: u64,
    },
}

/// Take one request from the bucket whose state is `tat` at `now_ns`
/// (GCRA, equivalent to a token bucket of `burst` refilled at the rate).
/// A state of 0 is a full bucket.
pub fn take(tat: u64, now_ns: u64, rate: Rate) -> Verdict {
    // u64 throughout: interval x burst is at most about a minute of
    // nanoseconds (burst <= per_minute), far from overflow.
    let t = rate.interval();
    let capacity = t.saturating_mul(rate.burst);
    let new_tat = tat.max(now_ns).saturating_add(t);
    let ahead = new_tat - now_ns;
    if ahead > capacity {
        return Verdict::Deny {
            retry_after_ns: ahead - capacity,
        };
    }
    Verdict::Admit {
        tat: new_tat,
        remaining: (capacity - ahead) / t,
    }
}

/// Whole seconds a client should wait (rounded up, at least 1).
pub fn retry_after_secs(ns: u64) -> u64 {
    ns.div_ceil(1_000_000_000).max(1)
}

// === daily tokens ===

const USED_BITS: u32 = 48;
const USED_MASK: u64 = (1 << USED_BITS) - 1;

/// Pack a day index and the tokens used on it.
pub fn pack(day: u64, used: u64) -> u64 {
    (day << USED_BITS) | used.min(USED_MASK)
}

/// Tokens used on `day` according to `state` (0 when the state is of
/// another day: the counter resets at 00:00 UTC).
pub fn used_on(state: u64, day: u64) -> u64 {
    if state >> USED_BITS == day & 0xFFFF {
        state & USED_MASK
    } else {
        0
    }
}

/// A daily-budget answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Daily {
    /// Charged: store `state`; `remaining` tokens are left today.
    Charged {
        /// The counter's new state.
        state: u64,
        /// Tokens left after the charge.
        remaining: u64,
    },
    /// `need` does not fit in what is left.
    Refused {
        /// Tokens left today.
        remaining: u64,
    },
}

/// Admit a request that needs `need` tokens (estimate + declared output)
/// under `limit` per day and charge `charge` (the estimate) for it.
pub fn charge(state: u64, day: u64, limit: u64, need: u64, charge: u64) -> Daily {
    let used = used_on(state, day);
    let remaining = limit.saturating_sub(used);
    if need > remaining {
        return Daily::Refused { remaining };
    }
    let used = used.saturating_add(charge);
    Daily::Charged {
        state: pack(day & 0xFFFF, used),
        remaining: limit.saturating_sub(used),
    }
}

/// Adjust today's usage by `delta` (true-up to real usage, or a refund):
/// never below 0; a state of another day is left alone when refunding
/// (yesterday's charge is not given back to today).
pub fn adjust(state: u64, day: u64, delta: i64) -> u64 {
    let used = used_on(state, day);
    if delta < 0 {
        if state >> USED_BITS != day & 0xFFFF {
            return state;
        }
        return pack(day & 0xFFFF, used.saturating_sub(delta.unsigned_abs()));
    }
    pack(day & 0xFFFF, used.saturating_add(delta.unsigned_abs()))
}

/// The UTC day index of a Unix second.
pub fn day_of(unix_secs: u64) -> u64 {
    unix_secs / 86_400
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn a_full_bucket_admits_its_burst_then_waits_for_refill() {
        let r = Rate::per_minute(60, 0);
        let mut tat = 0;
        let now = 1_000 * S;
        for i in 0..60u64 {
            match take(tat, now, r) {
                Verdict::Admit { tat: t, remaining } => {
                    tat = t;
                    assert_eq!(remaining, 59 - i);
                }
                Verdict::Deny { .. } => panic!("request {i} refused"),
            }
        }
        match take(tat, now, r) {
            Verdict::Deny { retry_after_ns } => assert_eq!(retry_after_ns, S),
            v => panic!("{v:?}"),
        }
        assert!(matches!(
            take(tat, now + S, r),
            Verdict::Admit { remaining: 0, .. }
        ));
    }

    #[test]
    fn burst_seconds_shrink_the_burst() {
        assert_eq!(Rate::per_minute(60, 1).burst, 1);
        assert_eq!(Rate::per_minute(10, 1).burst, 1);
        assert_eq!(Rate::per_minute(600, 10).burst, 100);
        assert_eq!(Rate::per_minute(600, 60).burst, 600);
        let r = Rate::per_minute(60, 1);
        let Verdict::Admit { tat, .. } = take(0, 5 * S, r) else {
            panic!()
        };
        assert_eq!(take(tat, 5 * S, r), Verdict::Deny { retry_after_ns: S });
        assert_eq!(retry_after_secs(S), 1);
        assert_eq!(retry_after_secs(S + 1), 2);
        assert_eq!(retry_after_secs(0), 1);
    }

    #[test]
    fn daily_counter_checks_need_and_charges_the_estimate() {
        let day = 20_000;
        let s = pack(day, 0);
        let Daily::Charged { state, remaining } = charge(s, day, 1000, 600, 100) else {
            panic!()
        };
        assert_eq!((used_on(state, day), remaining), (100, 900));
        assert_eq!(
            charge(state, day, 1000, 901, 1),
            Daily::Refused { remaining: 900 }
        );
        // True-up and refund.
        let state = adjust(state, day, 250);
        assert_eq!(used_on(state, day), 350);
        let state = adjust(state, day, -1000);
        assert_eq!(used_on(state, day), 0);
        // Rollover at 00:00 UTC: yesterday's usage is gone, and a refund of
        // yesterday's charge does not touch today.
        let s = pack(day, 990);
        assert_eq!(used_on(s, day + 1), 0);
        assert!(matches!(
            charge(s, day + 1, 1000, 1000, 5),
            Daily::Charged { remaining: 995, .. }
        ));
        assert_eq!(adjust(s, day + 1, -5), s);
        assert_eq!(day_of(86_399), 0);
        assert_eq!(day_of(86_400), 1);
    }

    proptest! {
        /// Over any window, admitted <= burst + rate × window (+1 for the
        /// request at the window's start edge).
        #[test]
        fn never_more_than_rate_times_t_plus_burst(
            rpm in 1u64..10_000,
            burst_secs in 0u64..60,
            gaps in proptest::collection::vec(0u64..3 * S, 1..300),
        ) {
            let r = Rate::per_minute(rpm, burst_secs);
            let mut tat = 0u64;
            let mut now = 10 * S;
            let mut admitted: Vec<u64> = Vec::new();
            for g in gaps {
                now += g;
                if let Verdict::Admit { tat: t, .. } = take(tat, now, r) {
                    tat = t;
                    admitted.push(now);
                }
            }
            for (i, start) in admitted.iter().enumerate() {
                for (j, end) in admitted.iter().enumerate().skip(i) {
                    let n = (j - i + 1) as u128;
                    let window = u128::from(end - start);
                    let allowed = u128::from(r.burst) + window * u128::from(r.per_minute) / u128::from(MINUTE_NS);
                    prop_assert!(n <= allowed, "{n} admitted in {window} ns, allowed {allowed}");
                }
            }
        }

        /// A refused request is admitted exactly when told to come back.
        #[test]
        fn retry_after_is_exact(rpm in 1u64..100_000, n in 1usize..50) {
            let r = Rate::per_minute(rpm, 0);
            let now = 5 * S;
            let mut tat = 0;
            let mut denied = None;
            for _ in 0..(n + rpm as usize).min(200_000) {
                match take(tat, now, r) {
                    Verdict::Admit { tat: t, .. } => tat = t,
                    Verdict::Deny { retry_after_ns } => { denied = Some(retry_after_ns); break; }
                }
            }
            if let Some(w) = denied {
                let ok = matches!(take(tat, now + w, r), Verdict::Admit { .. });
                prop_assert!(ok);
                let early = matches!(take(tat, now + w - 1, r), Verdict::Deny { .. });
                prop_assert!(early);
            }
        }

        /// Usage never goes negative and never wraps.
        #[test]
        fn adjustments_never_go_negative(ops in proptest::collection::vec(-1_000_000i64..1_000_000, 0..100)) {
            let day = 20_500;
            let mut s = pack(day, 0);
            let mut model: i128 = 0;
            for d in ops {
                s = adjust(s, day, d);
                model = (model + i128::from(d)).max(0);
                prop_assert_eq!(i128::from(used_on(s, day)), model);
            }
        }
    }
}
