//! What a traced request costs the router's CPU (issue 53), pure parts:
//! its two spans built as the request path's hooks build them (the
//! request span with ingress, usage and outcome attributes; one attempt
//! with the decision and its outcome), the sampler's decisions, and their
//! OTLP encoding as the export thread does it (a batch of 512 requests,
//! per request). Plain output; run with
//! `cargo bench -p shards --bench trace`.
#![forbid(unsafe_code)]

use std::hint::black_box;
use std::time::Instant;

use shards::logic::trace::otlp::{encode, Resource};
use shards::logic::trace::request::RequestTrace;
use shards::logic::trace::sampler::{Notable, Sampler};
use shards::logic::trace::span::{traceparent, Kind, Span, Value};

fn timed(label: &str, n: u32, mut f: impl FnMut()) -> f64 {
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    let us = t.elapsed().as_secs_f64() * 1e6 / f64::from(n);
    println!("{label:<58} {us:>8.3} us");
    us
}

const PEER: &str = "12D3KooWK3kz94iBqFLkMYSfPA5Yjmdk1NVV4GaG25ycypihwQZm";

/// One request's spans, attribute for attribute as `request/spans.rs`
/// sets them on a served chat request.
fn request_spans(i: u64) -> Vec<Span> {
    let tid = [i as u8; 16];
    let sampler = Sampler::default();
    let head = sampler.head(&tid, None);
    let mut root = Span::new(
        tid,
        [1; 8],
        None,
        format!("{} {}", "POST", "/v1/chat/completions"),
        Kind::Server,
        1_000,
    );
    root.set("http.request.method", "POST");
    root.set("url.path", "/v1/chat/completions");
    root.set(
        "hivenet.request_id",
        "123e4567-e89b-42d3-a456-426614174000".to_string(),
    );
    let mut tp = [0u8; 55];
    traceparent(&tid, &root.span_id, &mut tp);
    black_box(&tp);
    let mut t = RequestTrace::new(root, head);
    t.root.set("hivenet.tenant", "default");
    t.root.set("hivenet.key_id", "anonymous");
    t.root.set("gen_ai.request.model", "sim-model");
    let mut a = t.child("hivenet.attempt", Kind::Client, [2; 8], 1_100);
    a.set("hivenet.agent.peer_id", PEER);
    a.set("hivenet.agent.engine", "vllm");
    a.set("hivenet.decision.step", "routing_policy");
    a.set(
        "hivenet.decision.trail",
        format!("routing_policy: pool={} unhealthy={} capability_mismatch={} unmatched={} prev_failed={} at_capacity={} exclude_if={}", 3, 0, 0, 0, 0, 0, 0),
    );
    a.set("hivenet.agent.active", 1u64);
    a.set("hivenet.agent.capacity", 10u64);
    a.set("hivenet.agent.srtt_ms", 1.25);
    traceparent(&tid, &a.span_id, &mut tp);
    black_box(&tp);
    a.set("http.response.status_code", 200u16);
    a.set("gen_ai.usage.input_tokens", 12u64);
    a.set("gen_ai.usage.output_tokens", 16u64);
    a.set("hivenet.srtt_sample_ms", 1.3);
    a.end(2_000);
    t.keep(a);
    t.root.set("http.response.status_code", 200u16);
    t.root.set("hivenet.agent.peer_id", PEER);
    t.root.set("gen_ai.usage.input_tokens", 12u64);
    t.root.set("gen_ai.usage.output_tokens", 16u64);
    let keep = sampler.keep(
        t.head,
        Notable {
            elapsed_ms: 1,
            ..Notable::default()
        },
    );
    black_box(keep);
    t.into_spans(2_100)
}

fn main() {
    let n = 200_000;
    let built = timed(
        "build one request's spans (2 spans, 24 attributes)",
        n,
        || {
            black_box(request_spans(black_box(7)));
        },
    );
    let resource = Resource {
        attrs: vec![("service.name", Value::from("hivenet-router"))],
        scope: "hivenet",
        version: "bench",
    };
    let batch: Vec<Span> = (0..512u64).flat_map(request_spans).collect();
    let mut out = Vec::with_capacity(1 << 20);
    let per_batch = timed("encode a batch of 512 requests (1024 spans)", 2_000, || {
        out.clear();
        encode(&resource, black_box(&batch), &mut out);
        black_box(&out);
    });
    let encoded = per_batch / 512.0;
    println!("{:<58} {encoded:>8.3} us", "  of which per request");
    println!(
        "{:<58} {:>8} bytes",
        "  OTLP bytes per request",
        out.len() / 512
    );
    println!(
        "{:<58} {:>8.3} us",
        "build + encode, per request",
        built + encoded
    );
}
