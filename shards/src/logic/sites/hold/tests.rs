use super::*;
use proptest::prelude::*;

fn t(identity: &str, model: &str, bytes: u64, id: Option<u128>) -> Ticket {
    Ticket {
        identity: identity.into(),
        model: model.into(),
        bytes,
        client_id: id,
    }
}

#[test]
fn demand_counts_a_key_and_uuid_once() {
    let mut l = Ledger::default();
    let lim = Limits::default();
    let a1 = t("k1", "m", 10, Some(7));
    let a2 = t("k1", "m", 10, Some(7));
    let b = t("k2", "m", 10, Some(7));
    let c = t("k1", "m", 10, None);
    let d = t("k1", "m", 10, None);
    for x in [&a1, &a2, &b, &c, &d] {
        l.hold(x, lim).expect("room");
    }
    assert_eq!(l.demand("m"), 4, "k1/7 once, k2/7, and two without an ID");
    l.unhold(&a1);
    assert_eq!(l.demand("m"), 4, "released but no slot yet: still pending");
    l.undemand(&a1);
    assert_eq!(l.demand("m"), 4, "its twin still waits");
    l.undemand(&a2);
    assert_eq!(l.demand("m"), 3);
    for x in [&b, &c, &d] {
        l.undemand(x);
    }
    assert_eq!(l.demand("m"), 0);
}

#[test]
fn ids_another_router_counts_leave_the_demand_here() {
    let mut l = Ledger::default();
    let lim = Limits::default();
    for x in [
        t("k1", "m", 1, Some(7)),
        t("k2", "m", 1, Some(8)),
        t("k1", "n", 1, Some(7)),
        t("k1", "m", 1, None),
    ] {
        l.hold(&x, lim).expect("room");
    }
    let ids = l.demanded_ids();
    assert_eq!(ids.len(), 3, "{ids:?}");
    assert!(ids.contains(&("m".into(), "k1".into(), 7)));
    assert_eq!(l.demand("m"), 3);
    // Another router counts k1/7 of m (not of n): one fewer here.
    l.set_foreign(
        [("m".to_string(), "k1".to_string(), 7u128)]
            .into_iter()
            .collect(),
    );
    assert_eq!((l.demand("m"), l.demand("n")), (2, 1));
    // It left there: counted here again.
    l.set_foreign(Default::default());
    assert_eq!(l.demand("m"), 3);
}

#[test]
fn limits_refuse_and_free() {
    let mut l = Ledger::default();
    let lim = Limits {
        per_key: 2,
        per_model: 3,
        total_bytes: 100,
    };
    l.hold(&t("k", "m", 10, None), lim).expect("1");
    l.hold(&t("k", "m", 10, None), lim).expect("2");
    assert_eq!(l.hold(&t("k", "m", 10, None), lim), Err(Full::PerKey));
    l.hold(&t("j", "m", 10, None), lim).expect("3");
    assert_eq!(l.hold(&t("i", "m", 10, None), lim), Err(Full::PerModel));
    assert_eq!(l.hold(&t("i", "n", 71, None), lim), Err(Full::Total));
    l.hold(&t("i", "n", 70, None), lim)
        .expect("exactly the total");
    assert_eq!(l.held(), (4, 100));
    assert_eq!(l.demand("m"), 3, "refused holds are not in the demand");
    l.unhold(&t("k", "m", 10, None));
    l.hold(&t("k", "m", 0, None), lim).expect("room again");
}

#[test]
fn client_ids_are_uuids_only() {
    let u = b"123e4567-E89B-12d3-a456-426614174000";
    assert_eq!(
        client_id(Some(u), None),
        Some(0x123e4567_e89b_12d3_a456_426614174000)
    );
    assert_eq!(
        client_id(Some(b"not-a-uuid"), Some(u)),
        client_id(None, Some(u)),
        "falls back to X-Request-ID"
    );
    assert_eq!(
        client_id(Some(b"123e4567e89b12d3a456426614174000"), None),
        None,
        "canonical form only"
    );
    assert_eq!(client_id(None, None), None);
}

#[test]
fn answers_and_bytes() {
    assert_eq!(retry_after(Duration::from_secs(300), None), 30);
    assert_eq!(retry_after(Duration::from_secs(10), None), 5, "at least 5");
    assert_eq!(
        retry_after(Duration::from_secs(3600), None),
        60,
        "at most 60"
    );
    assert_eq!(
        retry_after(
            Duration::from_secs(300),
            Some(Duration::from_millis(12_300))
        ),
        13
    );
    let e = waking("m", Waking::Expired, Duration::from_secs(240));
    assert_eq!((e.status, e.code.as_str()), (503, "model_waking"));
    assert_eq!(
        e.message,
        "model m is waking: not ready within hold budget 4m"
    );
    assert!(waking("m", Waking::Full(Full::Total), Duration::ZERO)
        .message
        .contains("(--wake-hold-max-total)"));
    let v: serde_json::Value = serde_json::from_slice(&waking_body(&e, 24)).expect("json");
    assert_eq!(v["error"]["retry_after"], 24);
    assert_eq!(v["error"]["code"], "model_waking");
    assert_eq!(keepalive(true), b": keep-alive\n\n");
    assert_eq!(keepalive(false), b" ");
    let s = String::from_utf8(late_error(&e, true, false, Some(24))).expect("utf8");
    assert!(
        s.starts_with("data: {\"error\":") && s.ends_with("\n\n"),
        "{s}"
    );
    let s = String::from_utf8(late_error(&e, true, true, Some(24))).expect("utf8");
    assert!(s.starts_with("event: error\ndata: {"), "{s}");
    assert!(
        s.contains("\"overloaded_error\"") && s.contains("model_waking: model m"),
        "{s}"
    );
    let s = late_error(&e, false, false, Some(24));
    assert!(
        serde_json::from_slice::<serde_json::Value>(&s).is_ok(),
        "the envelope alone"
    );
    assert_eq!(humanize(Duration::from_secs(90)), "1m30s");
    assert_eq!(humanize(Duration::from_secs(3600)), "1h");
}

proptest! {
    /// Whatever the order of holds and releases: limits are never
    /// exceeded, and when everything has left, nothing is held or pending.
    #[test]
    fn ledger_balances(ops in proptest::collection::vec((0u8..3, 0u8..3, 0u64..60, proptest::option::of(0u128..3)), 1..200)) {
        let lim = Limits { per_key: 3, per_model: 5, total_bytes: 150 };
        let mut l = Ledger::default();
        let mut live: Vec<Ticket> = Vec::new();
        for (k, m, b, id) in ops {
            let x = t(&format!("k{k}"), &format!("m{m}"), b, id);
            if l.hold(&x, lim).is_ok() {
                live.push(x);
            } else if let Some(y) = live.pop() {
                l.unhold(&y);
                l.undemand(&y);
            }
            let (n, bytes) = l.held();
            prop_assert!(bytes <= lim.total_bytes);
            prop_assert!(n <= 3 * lim.per_model);
        }
        for y in live.drain(..) {
            l.unhold(&y);
            l.undemand(&y);
        }
        prop_assert_eq!(l.held(), (0, 0));
        for m in 0..3 {
            prop_assert_eq!(l.demand(&format!("m{m}")), 0);
        }
    }
}

#[test]
fn release_order_is_by_class_then_fair_between_tenants() {
    use crate::logic::routing::wait_queue::Class::{Batch, Interactive, Standard};
    // Arrival order: a flood of 5 from tenant 1, then batch, then tenant
    // 2's one, then an interactive one.
    let held = [
        (Standard, 1, 100),
        (Standard, 1, 100),
        (Standard, 1, 100),
        (Standard, 1, 100),
        (Standard, 1, 100),
        (Batch, 3, 10),
        (Standard, 2, 100),
        (Interactive, 3, 10),
    ];
    assert_eq!(release_order(&held), vec![7, 0, 6, 1, 2, 3, 4, 5]);
    // By tokens, not by count: tenant 1's one large request weighs as
    // much as tenant 2's four small ones.
    let held = [
        (Standard, 1, 400),
        (Standard, 1, 400),
        (Standard, 2, 100),
        (Standard, 2, 100),
        (Standard, 2, 100),
        (Standard, 2, 100),
        (Standard, 2, 100),
    ];
    assert_eq!(release_order(&held), vec![0, 2, 3, 4, 5, 1, 6]);
}

proptest! {
    /// Every held request is released exactly once, classes never
    /// interleave, and one tenant's requests keep their arrival order.
    #[test]
    fn release_order_is_a_permutation_keeping_each_tenants_order(
        held in proptest::collection::vec((0u8..3, 0u64..4, 1u64..1000), 0..200)
    ) {
        use crate::logic::routing::wait_queue::Class;
        let held: Vec<(Class, u64, u64)> = held
            .into_iter()
            .map(|(c, t, k)| (match c { 0 => Class::Interactive, 1 => Class::Standard, _ => Class::Batch }, t, k))
            .collect();
        let order = release_order(&held);
        let mut seen = order.clone();
        seen.sort_unstable();
        prop_assert_eq!(seen, (0..held.len()).collect::<Vec<_>>());
        for w in order.windows(2) {
            let (a, b) = (held[w[0]], held[w[1]]);
            prop_assert!(a.0 <= b.0, "class order");
            if a.0 == b.0 && a.1 == b.1 {
                prop_assert!(w[0] < w[1], "a tenant's own order");
            }
        }
    }
}
