use super::*;
use std::collections::HashMap;
use std::sync::atomic::Ordering;

use sha2::{Digest, Sha256};

use crate::logic::http::api::usage::Tokens;
use crate::logic::http::endpoint::Endpoint;
use crate::logic::http::errors::ErrorCode;
use crate::logic::tenancy::auth;
use crate::logic::tenancy::auth::parse_config;
use crate::logic::tenancy::quota::{self as quota_math};

const KEY: &str = "sk-test-1";

fn state(quota: &str) -> AuthState {
    let h = auth::hex(&Sha256::digest(KEY.as_bytes()));
    let c = parse_config(
        "auth.yaml",
        &format!("api:\n  mode: api-key\n  keys:\n    - key_hash: \"{h}\"\n      metadata: {{name: n, owner: acme}}\n      quota: {quota}\n"),
    )
    .expect("config");
    AuthState::build(c.api, c.keys, None, &HashMap::new())
}

fn facts(model: &str) -> QuotaFacts<'_> {
    QuotaFacts {
        model,
        endpoint: Endpoint::ChatCompletions,
        estimate: 10,
        declared_output: 5,
        replicas: &|| 1,
        burst_secs: 0,
    }
}

#[test]
fn digits() {
    assert_eq!(num(0), b"0");
    assert_eq!(num(7), b"7");
    assert_eq!(num(1_000_000), b"1000000");
    assert_eq!(num(u64::MAX), u64::MAX.to_string().as_bytes());
}

#[test]
fn authenticates_by_hash_only() {
    let s = state("{requests_per_minute: 2}");
    let p = s
        .authenticate(Some(b"Bearer sk-test-1"), None, 0)
        .expect("valid");
    assert_eq!(p.tenant(), "acme");
    assert!(p.key_id().starts_with("sk_"));
    assert!(s.authenticate(None, Some(b"sk-test-1"), 0).is_ok());
    assert!(s.authenticate(Some(b"Bearer sk-test-2"), None, 0).is_err());
    assert!(s.authenticate(None, None, 0).is_err());
}

#[test]
fn rpm_then_daily_then_settle() {
    let s = state("{requests_per_minute: 2, tokens_per_day: 40}");
    let p = s.authenticate(Some(b"sk-test-1"), None, 0).expect("valid");
    let t1 = admit(&p, facts("m"), 1_000, || 7).expect("first");
    assert!(
        t1.headers
            .iter()
            .any(|(n, v)| *n == "X-RateLimit-Remaining-Tokens" && v == b"25"),
        "estimate 10 and declared output 5 reserved"
    );
    let t2 = admit(&p, facts("m"), 1_000, || 7).expect("second");
    let r = admit(&p, facts("m"), 1_000, || 7).expect_err("third: rpm");
    assert_eq!(r.limit, QuotaLimit::Requests);
    assert_eq!(r.error.retry_after, Some(30));
    // Failure before output: refund.
    t1.settle(Settle::NothingSent);
    // Exact usage: 3 in + 4 out instead of the estimate 10.
    t2.settle(Settle::Usage(Tokens {
        input: 3,
        output: 4,
        cached: 0,
        cache_reported: false,
    }));
    let b = s.buckets.values().next().expect("bucket");
    assert_eq!(quota_math::used_on(b.daily.load(Ordering::Relaxed), 7), 7);
    // 33 left: a request needing 15 passes later, one needing 34 does not.
    let later = 1_000 + 60_000_000_000;
    let mut big = facts("m");
    big.estimate = 30;
    big.declared_output = 4;
    let r = admit(&p, big, later, || 7).expect_err("tokens");
    assert_eq!(r.limit, QuotaLimit::Tokens);
    assert_eq!(r.error.code, ErrorCode::TokenLimitExceeded);
    assert!(r
        .headers
        .iter()
        .any(|(n, v)| *n == "X-RateLimit-Remaining-Tokens" && v == b"33"));
    // Rebuilding the snapshot keeps the usage (reload).
    let h = auth::hex(&Sha256::digest(KEY.as_bytes()));
    let c = parse_config("a", &format!("api:\n  mode: api-key\n  keys:\n    - key_hash: \"{h}\"\n      metadata: {{name: n, owner: acme}}\n      quota: {{tokens_per_day: 40}}\n")).expect("c");
    let s2 = AuthState::build(c.api, c.keys, Some(&s), &HashMap::new());
    let b2 = s2.buckets.values().next().expect("bucket");
    assert_eq!(quota_math::used_on(b2.daily.load(Ordering::Relaxed), 7), 7);
}

#[test]
fn per_model_scales_with_replicas_and_refuses_undeclared() {
    let s = state("{per_model: {m: {requests_per_minute_per_replica: 1, tokens_per_day: 0}}}");
    let p = s.authenticate(Some(b"sk-test-1"), None, 0).expect("valid");
    let r = admit(&p, facts("other"), 0, || 1).expect_err("undeclared");
    assert!(r
        .error
        .message
        .contains("no quota declared for model other"));
    let mut two = facts("m");
    two.replicas = &|| 2;
    admit(&p, two, 5, || 1).expect("1");
    admit(&p, two, 5, || 1).expect("2");
    assert!(admit(&p, two, 5, || 1).is_err());
    // No healthy replica: still one replica's worth (never unlimited).
    let mut zero = facts("m");
    zero.replicas = &|| 0;
    assert!(admit(&p, zero, 5, || 1).is_err());
}

/// Issue 29 #8: the daily charge reserves estimate plus declared output,
/// so concurrent requests cannot all pass on the estimate alone; an
/// answer without usage keeps only the estimate.
#[test]
fn the_declared_output_is_reserved_then_given_back() {
    let s = state("{tokens_per_day: 45}");
    let p = s.authenticate(Some(b"sk-test-1"), None, 0).expect("valid");
    // 15 each (10 + 5): three fit in 45, a fourth does not, whatever
    // order they settle in.
    let held: Vec<_> = (0..3)
        .map(|i| admit(&p, facts("m"), i, || 7).expect("fits"))
        .collect();
    let r = admit(&p, facts("m"), 4, || 7).expect_err("over");
    assert_eq!(r.limit, QuotaLimit::Tokens);
    let b = s.buckets.values().next().expect("bucket").clone();
    assert_eq!(quota_math::used_on(b.daily.load(Ordering::Relaxed), 7), 45);
    for t in held {
        t.settle(Settle::Unknown);
    }
    assert_eq!(
        quota_math::used_on(b.daily.load(Ordering::Relaxed), 7),
        30,
        "estimates stand"
    );
}
