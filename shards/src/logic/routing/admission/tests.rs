use super::*;
use crate::logic::routing::policy::{Op, Rule};
use crate::logic::routing::wait_queue::Fair;
use proptest::prelude::*;

fn policy(budget: u64, inflight: u64) -> AdmissionPolicy {
    AdmissionPolicy {
        admit_budget_tokens: budget,
        max_inflight: inflight,
        ..Default::default()
    }
}

fn ask(fp: u64) -> Ask {
    Ask {
        footprint: fp,
        share: None,
        fair: Fair::default(),
    }
}

#[test]
fn b1_names_the_numbers() {
    let p = AdmissionPolicy {
        max_input_tokens: 100,
        images_max: 2,
        ..Default::default()
    };
    assert!(caps(&p, 100, 2).is_ok(), "at the cap is accepted");
    let e = caps(&p, 101, 0).expect_err("over");
    assert_eq!((e.status, e.code.as_str()), (400, "input_too_long"));
    assert_eq!(
        e.message,
        "input is 101 tokens, over the model limit of 100"
    );
    let e = caps(&p, 1, 3).expect_err("images");
    assert_eq!(
        e.message,
        "request carries 3 images, over the model limit of 2"
    );
    assert!(caps(&AdmissionPolicy::default(), u64::MAX, u64::MAX).is_ok());
}

#[test]
fn b3_means_over_healthy_reporters() {
    let s = |kv: Option<f64>, w: Option<f64>| EngineSignals {
        kv_cache_utilization: kv,
        waiting_requests: w,
        ..Default::default()
    };
    let pr = pressure(
        [
            (true, s(Some(0.9), None)),
            (true, s(Some(0.5), Some(30.0))),
            (false, s(Some(0.0), Some(0.0))),
            (true, s(None, None)),
        ]
        .into_iter(),
    );
    assert_eq!(pr.kv_cache_utilization, Some(0.7));
    assert_eq!(
        pr.waiting_requests,
        Some(30.0),
        "the unhealthy one is not counted"
    );
    let p = AdmissionPolicy {
        shed_if: vec![Rule {
            field: Field::KvCacheUtilization,
            op: Op::Gt,
            value: 0.8,
        }],
        ..Default::default()
    };
    assert!(!shed(&p, &pr), "mean 0.7 is under 0.8");
    assert!(shed(
        &p,
        &Pressure {
            kv_cache_utilization: Some(0.95),
            waiting_requests: None
        }
    ));
    assert!(!shed(&p, &Pressure::default()), "nobody reports: passes");
}

#[test]
fn room_scales_with_replicas_and_floors() {
    let p = policy(1000, 2);
    assert_eq!(
        room(&p, 0.9, 0),
        Room {
            budget: Some(900),
            inflight: Some(2)
        },
        "0 replicas count as 1"
    );
    assert_eq!(room(&p, 0.9, 3).budget, Some(2700));
    assert_eq!(room(&p, 0.9, 3).inflight, Some(6));
    assert_eq!(room(&policy(1, 0), 0.5, 1).budget, Some(1), "floored at 1");
    assert_eq!(room(&policy(0, 0), 0.9, 4), Room::default());
    let serverless = AdmissionPolicy {
        mode: Mode::Serverless,
        ..policy(1000, 0)
    };
    assert_eq!(share_budget(&serverless, 0.25, 2), Some(500));
    assert_eq!(
        share_budget(&serverless, 0.0001, 1),
        Some(1),
        "A17: floored"
    );
    assert_eq!(share_budget(&policy(1000, 0), 0.25, 2), None, "reserved");
}

#[test]
fn too_large_is_refused_at_once_full_parks_in_order() {
    let mut o = Occupancy::default();
    let r = Room {
        budget: Some(100),
        inflight: Some(2),
    };
    assert_eq!(o.admit(ask(101), r, true), Admit::TooLarge);
    let Admit::Granted(a) = o.admit(ask(60), r, true) else {
        panic!("first fits")
    };
    assert_eq!(o.admit(ask(50), r, false), Admit::Full, "no park");
    let Admit::Parked(t1) = o.admit(ask(50), r, true) else {
        panic!("parks")
    };
    // A small one fits but must not overtake the parked one.
    let Admit::Parked(t2) = o.admit(ask(10), r, true) else {
        panic!("parks behind")
    };
    let g = o.release(a).expect("held");
    assert_eq!(g.len(), 2, "both fit once 60 is freed: {g:?}");
    assert_eq!(g[0].0, t1);
    assert_eq!(g[1].0, t2);
    assert_eq!((o.sum(), o.count(), o.parked()), (60, 2, 0));
    assert_eq!(o.release(a), None, "a second release is a no-op");
    assert_eq!(o.sum(), 60);
}

/// The park grants in the capacity queue's order (issue 32): an
/// interactive request before batch parked earlier, and a tenant that
/// parked five requests does not push another tenant's one behind all
/// five.
#[test]
fn the_park_grants_by_class_then_fairly_between_tenants() {
    use crate::logic::routing::wait_queue::Class;
    let mut o = Occupancy::default();
    let r = Room {
        budget: None,
        inflight: Some(1),
    };
    let who = |class, tenant| Ask {
        footprint: 100,
        share: None,
        fair: Fair {
            class,
            tenant,
            cost: 100,
        },
    };
    let Admit::Granted(mut running) = o.admit(who(Class::Standard, 1), r, true) else {
        panic!("first fits")
    };
    let mut tickets = Vec::new();
    for (label, class, tenant) in [
        ("batch", Class::Batch, 3),
        ("f1", Class::Standard, 1),
        ("f2", Class::Standard, 1),
        ("f3", Class::Standard, 1),
        ("f4", Class::Standard, 1),
        ("f5", Class::Standard, 1),
        ("calm", Class::Standard, 2),
        ("int", Class::Interactive, 3),
    ] {
        let Admit::Parked(t) = o.admit(who(class, tenant), r, true) else {
            panic!("{label} parks")
        };
        tickets.push((t, label));
    }
    let mut order = Vec::new();
    while o.parked() > 0 {
        let g = o.release(running).expect("held");
        assert_eq!(g.len(), 1, "one slot: {g:?}");
        let (t, Grant::Granted(id)) = g[0] else {
            panic!("granted")
        };
        order.extend(tickets.iter().filter(|(x, _)| *x == t).map(|(_, l)| *l));
        running = id;
    }
    assert_eq!(
        order,
        vec!["int", "f1", "calm", "f2", "f3", "f4", "f5", "batch"]
    );
}

#[test]
fn inflight_cap_and_room_growth() {
    let mut o = Occupancy::default();
    let one = Room {
        budget: None,
        inflight: Some(2),
    };
    assert!(matches!(o.admit(ask(1), one, true), Admit::Granted(_)));
    assert!(matches!(o.admit(ask(1), one, true), Admit::Granted(_)));
    let Admit::Parked(t) = o.admit(ask(1), one, true) else {
        panic!("third parks")
    };
    let two = Room {
        budget: None,
        inflight: Some(4),
    };
    let g = o.set_room(two);
    assert!(matches!(g.as_slice(), [(x, Grant::Granted(_))] if *x == t));
    assert_eq!(o.count(), 3);
}

#[test]
fn shrinking_pool_answers_a_parked_head_that_can_never_fit() {
    let mut o = Occupancy::default();
    let big = Room {
        budget: Some(200),
        inflight: None,
    };
    let Admit::Granted(a) = o.admit(ask(150), big, true) else {
        panic!()
    };
    let Admit::Parked(t) = o.admit(ask(150), big, true) else {
        panic!()
    };
    let g = o.set_room(Room {
        budget: Some(100),
        inflight: None,
    });
    assert_eq!(g, vec![(t, Grant::TooLarge)]);
    assert!(o.release(a).is_some_and(|g| g.is_empty()));
}

#[test]
fn share_never_waits_and_is_rechecked_at_grant() {
    let mut o = Occupancy::default();
    let r = Room {
        budget: Some(100),
        inflight: None,
    };
    let k: Arc<str> = "sk_a".into();
    let mine = |fp| Ask {
        footprint: fp,
        share: Some((k.clone(), 50)),
        fair: Fair::default(),
    };
    let Admit::Granted(a) = o.admit(mine(40), r, true) else {
        panic!()
    };
    assert_eq!(o.admit(mine(20), r, true), Admit::ShareExceeded, "no wait");
    assert_eq!(o.key_sum("sk_a"), 40);
    let other = Ask {
        footprint: 65,
        share: Some(("sk_b".into(), 70)),
        fair: Fair::default(),
    };
    let Admit::Parked(tb) = o.admit(other, r, true) else {
        panic!("b parks: 40 + 65 > 100")
    };
    let g = o.adjust(a, -40);
    assert!(matches!(g.as_slice(), [(t, Grant::Granted(_))] if *t == tb));
    assert_eq!(o.key_sum("sk_a"), 0);
    assert_eq!(o.key_sum("sk_b"), 65);
}

#[test]
fn bucket_refills_per_minute_exactly() {
    let mut b = TokenBucket::default();
    let cap = 600; // 10 per second
    assert!(b.take(cap, 600, 0), "starts full");
    assert!(!b.take(cap, 1, 0));
    assert!(!b.take(cap, 10, 999_999_999), "just under a second: 9.99");
    assert!(b.take(cap, 10, 1_000_000_000), "a second later: 10");
    let mut o = TokenBucket::default();
    assert!(o.has_one(20, 0));
    o.charge(20, 16, 0);
    assert!(o.has_one(20, 0), "4 left");
    o.charge(20, 1_000, 0);
    assert_eq!(o.tokens(20, 0), -16, "a charge is capped at one bucket");
    assert!(!o.has_one(20, 0));
    assert!(o.has_one(20, 60_000_000_000), "a minute refills it to full");
}

#[test]
fn learning_blends_and_clamps() {
    let r0 = 1.0 / 3.2;
    let r1 = learn(r0, 250, 1000);
    assert!((r1 - (0.2 * 0.25 + 0.8 * r0)).abs() < 1e-12);
    assert_eq!(learn(r0, 0, 1000), r0);
    assert_eq!(learn(r0, 10, 0), r0);
    assert!(
        (learn(r0, 10_000, 10) - (0.2 + 0.8 * r0)).abs() < 1e-12,
        "clamped at 1"
    );
}

#[test]
fn cross_check_names_the_key_and_policy() {
    let sv = AdmissionPolicy {
        mode: Mode::Serverless,
        max_input_tokens: 4096,
        ..Default::default()
    };
    let keys = [("ok", 10_000u64), ("unset", 0), ("small", 1000)];
    let e = cross_check(
        keys.iter().map(|(k, v)| (*k, *v)),
        [("llama", &sv)].into_iter(),
    )
    .expect_err("small");
    assert!(
        e.message().contains("\"small\"") && e.message().contains("llama"),
        "{e}"
    );
    let reserved = AdmissionPolicy {
        max_input_tokens: 4096,
        ..Default::default()
    };
    assert!(cross_check(
        keys.iter().map(|(k, v)| (*k, *v)),
        [("g", &reserved)].into_iter()
    )
    .is_ok());
}

/// One operation of a random schedule.
#[derive(Debug, Clone)]
enum Op2 {
    Admit { fp: u64, key: u8, park: bool },
    Release(usize),
    Adjust(usize, i64),
    Cancel(usize),
    Room(u64, u64),
}

fn op() -> impl Strategy<Value = Op2> {
    prop_oneof![
        4 => (0u64..120, 0u8..3, any::<bool>()).prop_map(|(fp, key, park)| Op2::Admit { fp, key, park }),
        3 => (0usize..16).prop_map(Op2::Release),
        2 => (0usize..16, -80i64..80).prop_map(|(i, d)| Op2::Adjust(i, d)),
        1 => (0usize..16).prop_map(Op2::Cancel),
        1 => (1u64..400, 1u64..6).prop_map(|(b, n)| Op2::Room(b, n)),
    ]
}

proptest! {
    /// Under any schedule: every grant fits the budget and in-flight cap
    /// at the moment it is made; parked requests are granted in arrival
    /// order; every reservation releases exactly once; true-ups never go
    /// negative; once all is released the books are empty.
    #[test]
    fn occupancy_books_balance(ops in proptest::collection::vec(op(), 1..200)) {
        let mut o = Occupancy::default();
        let mut room = Room { budget: Some(200), inflight: Some(3) };
        let mut held: Vec<u64> = Vec::new();
        let mut parked: Vec<u64> = Vec::new();
        let keys: [Arc<str>; 3] = ["a".into(), "b".into(), "c".into()];
        let check = |o: &Occupancy, grants: Vec<(u64, Grant)>, held: &mut Vec<u64>, parked: &mut Vec<u64>| {
            // A grant is made only when it fits: after any, the books fit.
            if grants.iter().any(|(_, g)| matches!(g, Grant::Granted(_))) {
                let r = o.room();
                prop_assert!(r.budget.is_none_or(|b| o.sum() <= b));
                prop_assert!(r.inflight.is_none_or(|n| o.count() <= n));
            }
            for (t, g) in grants {
                // Arrival order: the granted ticket is the oldest still parked.
                prop_assert_eq!(parked.first().copied(), Some(t));
                parked.remove(0);
                if let Grant::Granted(id) = g {
                    held.push(id);
                }
            }
            prop_assert_eq!(o.count() as usize, held.len());
            prop_assert_eq!(o.parked(), parked.len());
            let sum: u64 = held.iter().filter_map(|id| o.footprint(*id)).sum();
            prop_assert_eq!(o.sum(), sum);
            Ok(())
        };
        for op in ops {
            match op {
                Op2::Admit { fp, key, park } => {
                    let share = (key > 0).then(|| (keys[key as usize].clone(), 150));
                    let before = o.sum();
                    match o.admit(Ask { footprint: fp, share, fair: Fair::default() }, room, park) {
                        Admit::Granted(id) => {
                            prop_assert!(room.budget.is_none_or(|b| before + fp <= b));
                            prop_assert!(room.inflight.is_none_or(|n| o.count() <= n));
                            held.push(id);
                        }
                        Admit::Parked(t) => parked.push(t),
                        Admit::TooLarge => prop_assert!(room.budget.is_some_and(|b| fp > b)),
                        Admit::Full | Admit::ShareExceeded => {}
                    }
                    check(&o, Vec::new(), &mut held, &mut parked)?;
                }
                Op2::Release(i) => {
                    if held.is_empty() { continue; }
                    let id = held.remove(i % held.len());
                    let g = o.release(id);
                    prop_assert!(g.is_some(), "first release succeeds");
                    prop_assert!(o.release(id).is_none(), "second is a no-op");
                    let g = g.unwrap_or_default();
                    check(&o, g, &mut held, &mut parked)?;
                }
                Op2::Adjust(i, d) => {
                    if held.is_empty() { continue; }
                    let id = held[i % held.len()];
                    let before = o.footprint(id).unwrap_or(0);
                    let g = o.adjust(id, d);
                    let after = o.footprint(id).unwrap_or(0);
                    prop_assert_eq!(after as i128, (before as i128 + d as i128).max(0));
                    check(&o, g, &mut held, &mut parked)?;
                }
                Op2::Cancel(i) => {
                    if parked.is_empty() { continue; }
                    let t = parked.remove(i % parked.len());
                    let (was, g) = o.cancel(t);
                    prop_assert!(was);
                    check(&o, g, &mut held, &mut parked)?;
                }
                Op2::Room(b, n) => {
                    room = Room { budget: Some(b), inflight: Some(n) };
                    let g = o.set_room(room);
                    check(&o, g, &mut held, &mut parked)?;
                }
            }
        }
        // Drain: release what is held (which may grant parked ones), cancel the rest.
        loop {
            if let Some(id) = held.first().copied() {
                held.remove(0);
                let g = o.release(id).unwrap_or_default();
                check(&o, g, &mut held, &mut parked)?;
            } else if let Some(t) = parked.first().copied() {
                parked.remove(0);
                let (was, g) = o.cancel(t);
                prop_assert!(was);
                check(&o, g, &mut held, &mut parked)?;
            } else {
                break;
            }
        }
        prop_assert_eq!((o.sum(), o.count(), o.parked()), (0, 0, 0));
        prop_assert_eq!(o.key_sum("a") + o.key_sum("b") + o.key_sum("c"), 0);
    }

    /// Grants made when room frees never push the sum over the budget
    /// (growth of held reservations aside, which only delays grants).
    #[test]
    fn grants_fit_the_budget(fps in proptest::collection::vec(1u64..100, 1..40), budget in 100u64..300) {
        let mut o = Occupancy::default();
        let room = Room { budget: Some(budget), inflight: None };
        let mut held = Vec::new();
        for fp in fps {
            if let Admit::Granted(id) = o.admit(ask(fp), room, true) {
                held.push(id);
            }
            prop_assert!(o.sum() <= budget);
        }
        while let Some(id) = held.pop() {
            for (_, g) in o.release(id).unwrap_or_default() {
                if let Grant::Granted(n) = g { held.insert(0, n); }
                prop_assert!(o.sum() <= budget);
            }
        }
        prop_assert_eq!(o.parked(), 0, "everything parked is eventually granted");
    }

    /// The bucket never hands out more than its capacity plus what a
    /// minute refills, whatever the request pattern.
    #[test]
    fn itpm_bounded(cap in 1u64..5000, asks in proptest::collection::vec((1u64..500, 0u64..2_000_000_000), 1..100)) {
        let mut b = TokenBucket::default();
        let mut now = 0u64;
        let mut taken: u128 = 0;
        for (need, dt) in asks {
            now += dt;
            if b.take(cap, need, now) { taken += u128::from(need); }
        }
        let refill = u128::from(cap) * u128::from(now) / 60_000_000_000;
        prop_assert!(taken <= u128::from(cap) + refill);
    }
}
