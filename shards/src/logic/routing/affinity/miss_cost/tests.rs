use super::*;
use proptest::prelude::*;

/// A sim-like engine: 5 ms fixed, `a` per uncached token, `b` per output token.
fn engine(a: f64, b: f64, u: u64, o: u64) -> f64 {
    0.005 + a * u as f64 + b * o as f64
}

#[test]
fn prefill_and_decode_are_told_apart() {
    let mut m = MissCost::default();
    // Hits (few uncached tokens) and misses (many), outputs varying.
    for i in 0..40u64 {
        let u = if i % 3 == 0 { 800 + i * 7 } else { 10 + i };
        let o = 16 + (i * 13) % 100;
        m.learn(u, o, engine(0.00965, 0.0308, u, o));
    }
    let a = m.per_token().expect("learned");
    // The fixed 5 ms spreads over both: a little over the true 9.65 ms.
    assert!((0.00965..0.0100).contains(&a), "{a}");
}

#[test]
fn a_fast_prefill_is_seen_as_fast() {
    // A GPU-like engine: 0.1 ms a prompt token, 30 ms an output token.
    let mut m = MissCost::default();
    for i in 0..40u64 {
        let u = if i % 2 == 0 { 2000 } else { 20 };
        let o = 50 + (i * 37) % 200;
        m.learn(u, o, engine(0.0001, 0.03, u, o));
    }
    let a = m.per_token().expect("learned");
    assert!(a < 0.0002, "{a}");
    // A 2,000-token hit saves about 0.2 s: a 3 s bound shrinks to it.
    let w = holder_wait(3000, Some(a * 2000.0));
    assert!(w < Duration::from_millis(400), "{w:?}");
}

#[test]
fn too_few_or_inseparable_requests_teach_nothing() {
    let mut m = MissCost::default();
    for _ in 0..MIN_SAMPLES - 1 {
        m.learn(1000, 10, 1.0);
    }
    assert_eq!(m.per_token(), None, "under MIN_SAMPLES");
    // The same ratio of uncached to output every time: collinear.
    m.learn(2000, 20, 2.0);
    m.learn(500, 5, 0.5);
    assert_eq!(m.per_token(), None, "collinear");
    // No uncached token ever: nothing to say about prefill.
    let mut m = MissCost::default();
    for o in 1..20 {
        m.learn(0, o, 0.03 * o as f64);
    }
    assert_eq!(m.per_token(), None);
}

#[test]
fn bad_durations_are_ignored() {
    let mut m = MissCost::default();
    for s in [f64::NAN, f64::INFINITY, -1.0] {
        m.learn(100, 10, s);
    }
    m.learn(0, 0, 1.0);
    assert_eq!(m, MissCost::default());
}

#[test]
fn a_negative_decode_refits_with_prefill_alone() {
    // Decode that looks free or negative (noise): never a negative prefill.
    let mut m = MissCost::default();
    for i in 0..20u64 {
        let (u, o) = (100 + i * 50, 100 - i * 4);
        m.learn(u, o, 0.001 * u as f64 - 0.0005 * o as f64 + 0.05);
    }
    let a = m.per_token().expect("learned");
    assert!(a >= 0.0, "{a}");
}

#[test]
fn the_wait_is_the_cap_unless_the_saving_is_smaller() {
    let cap = Duration::from_millis(3000);
    assert_eq!(holder_wait(3000, None), cap);
    assert_eq!(holder_wait(3000, Some(10.0)), cap);
    assert_eq!(holder_wait(3000, Some(0.25)), Duration::from_millis(250));
    assert_eq!(holder_wait(3000, Some(f64::NAN)), cap);
    assert_eq!(holder_wait(3000, Some(-1.0)), cap);
    assert_eq!(holder_wait(0, Some(0.25)), Duration::ZERO);
    assert_eq!(holder_wait(3000, Some(f64::MAX)), cap);
}

proptest! {
    /// Exact linear timings of any engine are recovered, never negative
    /// (random counts are never collinear: the estimate must be there).
    #[test]
    fn any_linear_engine_is_recovered(
        a in 0.00001f64..0.05,
        b in 0.001f64..0.1,
        reqs in proptest::collection::vec((0u64..8000, 1u64..512), 16..80),
    ) {
        let mut m = MissCost::default();
        for (u, o) in &reqs {
            m.learn(*u, *o, a * *u as f64 + b * *o as f64);
        }
        let got = m.per_token();
        prop_assert!(got.is_some(), "nothing learned from {:?}", reqs);
        let got = got.unwrap_or(-1.0);
        prop_assert!(got >= 0.0);
        prop_assert!((got - a).abs() <= a * 1e-3 + 1e-9, "a {} got {}", a, got);
    }

    /// Whatever is learned, the wait never exceeds its cap.
    #[test]
    fn the_wait_never_exceeds_its_cap(
        cap in 0u32..60_000,
        reqs in proptest::collection::vec((0u64..100_000, 0u64..100_000, -10.0f64..1000.0), 0..50),
        depth in 0.0f64..1e9,
    ) {
        let mut m = MissCost::default();
        for (u, o, s) in reqs {
            m.learn(u, o, s);
        }
        let w = holder_wait(cap, m.per_token().map(|a| a * depth));
        prop_assert!(w <= Duration::from_millis(u64::from(cap)));
    }
}

#[test]
fn a_saving_is_worth_it_from_a_fifth_of_a_request() {
    let mut m = MissCost::default();
    assert_eq!(m.learned(0.5), None);
    // 10 ms a prompt token, 30 ms an output token, requests of 2.5 s on
    // average (hits of 1 s, misses of 4 s).
    for i in 0..40u64 {
        let (u, o) = if i % 2 == 0 { (370, 10) } else { (70, 10) };
        m.learn(u, o, 0.01 * u as f64 + 0.03 * o as f64);
    }
    let l = m.learned(0.5).expect("learned");
    assert!((l.secs_per_byte - 0.005).abs() < 1e-9, "{l:?}");
    assert!((2.0..2.5).contains(&l.mean_request_secs), "{l:?}");
    // 200 bytes save 1 s: worth it; 50 bytes save 0.25 s: not.
    let (s, worth) = l.saving(200.0);
    assert!((s - 1.0).abs() < 1e-6 && worth);
    assert!(!l.saving(50.0).1);
}
