//! The input-token estimate's cost per request body size: the one-pass
//! probe (model, stream, declared output and the estimate's sums, no DOM)
//! plus `estimate()`, against what a second full JSON parse of the same
//! body (a `serde_json::Value`) would add. Bodies of 1 KiB, 32 KiB and
//! 1 MiB of chat messages. Plain output; run with
//! `cargo bench -p shards --bench estimate`.
#![forbid(unsafe_code)]

use std::hint::black_box;
use std::time::Instant;

use shards::logic::http::api::probe::{self, COLD_TOKENS_PER_BYTE};

/// A chat body of about `size` bytes: messages of ~200 bytes of text.
fn body(size: usize) -> Vec<u8> {
    let text = "The quick brown fox jumps over the lazy dog, and \\\"quotes\\\" too. ".repeat(3);
    let mut msgs = Vec::new();
    let mut len = 0;
    let mut i = 0;
    while len < size {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        let m = format!(r#"{{"role":"{role}","content":"{text}"}}"#);
        len += m.len() + 1;
        msgs.push(m);
        i += 1;
    }
    format!(
        r#"{{"model":"meta-llama/Llama-3.1-8B-Instruct","stream":true,"max_tokens":256,"messages":[{}]}}"#,
        msgs.join(",")
    )
    .into_bytes()
}

fn per_op(name: &str, iters: u32, mut f: impl FnMut()) -> f64 {
    for _ in 0..iters / 10 + 1 {
        f();
    }
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    let ns = t.elapsed().as_nanos() as f64 / f64::from(iters);
    println!("{name:<44} {ns:>12.0} ns");
    ns
}

fn main() {
    for (label, size, iters) in [
        ("1 KiB", 1024usize, 200_000u32),
        ("32 KiB", 32 * 1024, 10_000),
        ("1 MiB", 1024 * 1024, 300),
    ] {
        let b = body(size);
        println!("-- body {label} ({} bytes)", b.len());
        let probe_ns = per_op("probe + estimate (the request path)", iters, || {
            let m = probe::probe(black_box(&b)).ok();
            black_box(m.map(|m| m.estimate(COLD_TOKENS_PER_BYTE)));
        });
        let value_ns = per_op("second full parse (serde_json::Value)", iters, || {
            black_box(serde_json::from_slice::<serde_json::Value>(black_box(&b)).ok());
        });
        println!(
            "   probe {:.2} ns/byte; a second DOM parse would add {:.1}x the probe's cost",
            probe_ns / b.len() as f64,
            value_ns / probe_ns
        );
    }
}
