//! Minimal agent selection (policies come later): among healthy agents of
//! the model with the needed capability and a free slot, the least loaded
//! by active/capacity; ties rotate (never "lowest peer ID").
//!
//! One pass over a slice, no sort, no copy. The caller passes the rotation
//! offset (a per-model counter), so the function is pure.

/// What selection needs to know of one agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Routable (healthy link, healthy backend).
    pub healthy: bool,
    /// Serves the requested capability.
    pub capable: bool,
    /// Requests in flight.
    pub active: u32,
    /// Declared capacity (> 0).
    pub capacity: u32,
    /// Already failed for this request.
    pub excluded: bool,
}

/// Outcome of a selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// Use the agent at this index.
    Agent(usize),
    /// Eligible agents exist but all are full.
    AllFull,
    /// No healthy, capable, non-excluded agent.
    NoneEligible,
}

/// Pick the least-loaded eligible agent, starting the scan at `rotation`
/// so equal loads take turns.
pub fn pick(candidates: &[Candidate], rotation: usize) -> Pick {
    pick_with(candidates.len(), rotation, |i| candidates.get(i).copied())
}

/// [`pick`] over `n` agents read through `get`, so callers need not build
/// a candidate array per request.
pub fn pick_with(n: usize, rotation: usize, get: impl Fn(usize) -> Option<Candidate>) -> Pick {
    if n == 0 {
        return Pick::NoneEligible;
    }
    let start = rotation % n;
    let mut best: Option<(usize, u64, u64)> = None; // (index, active, capacity)
    let mut any_eligible = false;
    for k in 0..n {
        let i = (start + k) % n;
        let Some(c) = get(i) else { continue };
        if !c.healthy || !c.capable || c.excluded || c.capacity == 0 {
            continue;
        }
        any_eligible = true;
        if c.active >= c.capacity {
            continue;
        }
        let (a, cap) = (u64::from(c.active), u64::from(c.capacity));
        let better = match best {
            None => true,
            // a/cap < ba/bcap, compared without floats.
            Some((_, ba, bcap)) => a * bcap < ba * cap,
        };
        if better {
            best = Some((i, a, cap));
        }
    }
    match best {
        Some((i, _, _)) => Pick::Agent(i),
        None if any_eligible => Pick::AllFull,
        None => Pick::NoneEligible,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn c(active: u32, capacity: u32) -> Candidate {
        Candidate {
            healthy: true,
            capable: true,
            active,
            capacity,
            excluded: false,
        }
    }

    #[test]
    fn least_loaded_wins() {
        assert_eq!(pick(&[c(5, 10), c(1, 10), c(2, 10)], 0), Pick::Agent(1));
        assert_eq!(pick(&[c(1, 2), c(1, 10)], 0), Pick::Agent(1));
    }

    #[test]
    fn ties_rotate() {
        let cs = [c(0, 10), c(0, 10), c(0, 10)];
        let picks: Vec<_> = (0..3).map(|r| pick(&cs, r)).collect();
        assert_eq!(picks, vec![Pick::Agent(0), Pick::Agent(1), Pick::Agent(2)]);
    }

    #[test]
    fn full_and_none() {
        assert_eq!(pick(&[c(10, 10)], 0), Pick::AllFull);
        let mut u = c(0, 10);
        u.healthy = false;
        assert_eq!(pick(&[u], 0), Pick::NoneEligible);
        assert_eq!(pick(&[], 0), Pick::NoneEligible);
    }

    fn arb() -> impl Strategy<Value = Candidate> {
        (
            any::<bool>(),
            any::<bool>(),
            0u32..12,
            0u32..10,
            any::<bool>(),
        )
            .prop_map(|(h, cap, a, c, e)| Candidate {
                healthy: h,
                capable: cap,
                active: a,
                capacity: c,
                excluded: e,
            })
    }

    proptest! {
        /// Never picks an unhealthy, incapable, excluded or full agent, and
        /// the pick is minimal in load among eligible ones.
        #[test]
        fn never_picks_ineligible(cs in proptest::collection::vec(arb(), 0..20), rot in 0usize..100) {
            match pick(&cs, rot) {
                Pick::Agent(i) => {
                    let p = cs[i];
                    prop_assert!(p.healthy && p.capable && !p.excluded && p.active < p.capacity);
                    for o in &cs {
                        if o.healthy && o.capable && !o.excluded && o.active < o.capacity {
                            prop_assert!(u64::from(p.active) * u64::from(o.capacity) <= u64::from(o.active) * u64::from(p.capacity));
                        }
                    }
                }
                Pick::AllFull => prop_assert!(cs.iter().any(|o| o.healthy && o.capable && !o.excluded && o.capacity > 0)),
                Pick::NoneEligible => prop_assert!(!cs.iter().any(|o| o.healthy && o.capable && !o.excluded && o.capacity > 0)),
            }
            prop_assert_eq!(pick(&cs, rot), pick(&cs, rot));
        }
    }
}
