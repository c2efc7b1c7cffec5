//! Client auth and quota cost on the request path, per request: look a
//! bearer token up among 10,000 configured keys (one SHA-256 and one map
//! lookup), take a request from its tenant's shared bucket and charge and
//! true up its daily tokens (compare-and-swap on shared words), against
//! the auth-off path (mode `none`). Also the shared-bucket CAS under two
//! threads hammering the same tenant. Plain output; run with
//! `cargo bench -p shards --bench tenancy`.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use shards::logic::http::api::usage::Tokens;
use shards::logic::http::endpoint::Endpoint;
use shards::logic::tenancy::auth::{self, ApiMode, KeyRecord, Limits};
use shards::runtime::state::tenancy::{admit, AuthState, QuotaFacts, Settle};

fn keys(n: usize) -> Vec<([u8; 32], KeyRecord)> {
    use sha2::Digest;
    (0..n)
        .map(|i| {
            let raw = format!("sk-bench-{i}");
            let h: [u8; 32] = sha2::Sha256::digest(raw.as_bytes()).into();
            (
                h,
                KeyRecord {
                    key_id: auth::static_key_id(&h).into(),
                    tenant: format!("tenant-{}", i % 500).into(),
                    name: raw,
                    preview: String::new(),
                    models: Default::default(),
                    limits: Limits::Flat {
                        rpm: 1_000_000_000,
                        tpd: 1_000_000_000_000,
                        itpm: 0,
                        otpm: 0,
                    },
                    max_occupancy_share: 0.0,
                    expires_at: None,
                    enabled: true,
                    site_scopes: Vec::new(),
                    priority: Default::default(),
                },
            )
        })
        .collect()
}

fn facts() -> QuotaFacts<'static> {
    QuotaFacts {
        model: "m",
        endpoint: Endpoint::ChatCompletions,
        estimate: 20,
        declared_output: 16,
        replicas: &|| 1,
        burst_secs: 0,
    }
}

fn per_op(name: &str, iters: u64, mut f: impl FnMut(u64)) -> f64 {
    for i in 0..iters / 10 {
        f(i);
    }
    let t = Instant::now();
    for i in 0..iters {
        f(i);
    }
    let ns = t.elapsed().as_nanos() as f64 / iters as f64;
    println!("{name:<58} {ns:>8.1} ns/request");
    ns
}

fn main() {
    let on = AuthState::build(ApiMode::ApiKey, keys(10_000), None, &HashMap::new());
    let off = AuthState::build(ApiMode::None, Vec::new(), None, &HashMap::new());
    let header = b"Bearer sk-bench-4242".to_vec();
    let iters = 1_000_000;
    let base = per_op("auth off: authenticate + admit + settle", iters, |i| {
        let p = off.authenticate(Some(black_box(&header)), None, 0).ok();
        if let Some(p) = p {
            let t = admit(&p, facts(), 1_000 + i, || 20_000).ok();
            if let Some(t) = t {
                t.settle(Settle::Usage(Tokens {
                    input: 18,
                    output: 16,
                    cached: 0,
                    cache_reported: false,
                }));
            }
        }
    });
    per_op("auth on (10,000 keys): authenticate only", iters, |_| {
        black_box(on.authenticate(Some(black_box(&header)), None, 0).is_ok());
    });
    let full = per_op(
        "auth on (10,000 keys): authenticate + admit + settle",
        iters,
        |i| {
            let p = on.authenticate(Some(black_box(&header)), None, 0).ok();
            if let Some(p) = p {
                let t = admit(&p, facts(), 1_000 + i, || 20_000).ok();
                if let Some(t) = t {
                    t.settle(Settle::Usage(Tokens {
                        input: 18,
                        output: 16,
                        cached: 0,
                        cache_reported: false,
                    }));
                }
            }
        },
    );
    println!(
        "difference on vs off: {:.2} us/request",
        (full - base) / 1000.0
    );
    // Two threads taking from one tenant's shared bucket at once.
    let on = Arc::new(on);
    let t = Instant::now();
    let n = 500_000u64;
    let hs: Vec<_> = (0..2)
        .map(|_| {
            let on = on.clone();
            let header = header.clone();
            std::thread::spawn(move || {
                for i in 0..n {
                    if let Ok(p) = on.authenticate(Some(&header), None, 0) {
                        if let Ok(t) = admit(&p, facts(), 1_000 + i, || 20_000) {
                            t.settle(Settle::Usage(Tokens {
                                input: 18,
                                output: 16,
                                cached: 0,
                                cache_reported: false,
                            }));
                        }
                    }
                }
            })
        })
        .collect();
    for h in hs {
        let _ = h.join();
    }
    let ns = t.elapsed().as_nanos() as f64 / (2 * n) as f64;
    println!(
        "{:<58} {ns:>8.1} ns/request (wall / total)",
        "2 threads, same tenant bucket (contended CAS)"
    );
}
