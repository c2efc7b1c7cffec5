//! The opentelemetry SDK doing what hivenet's trace room does for one
//! request (two spans, the same 24 attributes, the batch processor's
//! hand-over), to set beside `cargo bench -p shards --bench trace`.
use std::hint::black_box;
use std::time::Instant;

use opentelemetry::trace::{SpanKind, TraceContextExt, Tracer, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};

#[derive(Debug)]
struct Sink;

impl SpanExporter for Sink {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        black_box(batch);
        Ok(())
    }
}

const PEER: &str = "12D3KooWK3kz94iBqFLkMYSfPA5Yjmdk1NVV4GaG25ycypihwQZm";

fn one(tracer: &impl Tracer<Span = impl opentelemetry::trace::Span + Send + Sync + 'static>) {
    let mut root = tracer
        .span_builder("POST /v1/chat/completions")
        .with_kind(SpanKind::Server)
        .start(tracer);
    root.set_attribute(KeyValue::new("http.request.method", "POST"));
    root.set_attribute(KeyValue::new("url.path", "/v1/chat/completions"));
    root.set_attribute(KeyValue::new("hivenet.request_id", "123e4567-e89b-42d3-a456-426614174000".to_string()));
    root.set_attribute(KeyValue::new("hivenet.tenant", "default"));
    root.set_attribute(KeyValue::new("hivenet.key_id", "anonymous"));
    root.set_attribute(KeyValue::new("gen_ai.request.model", "sim-model"));
    let cx = Context::current_with_span(root);
    let mut a = tracer
        .span_builder("hivenet.attempt")
        .with_kind(SpanKind::Client)
        .start_with_context(tracer, &cx);
    a.set_attribute(KeyValue::new("hivenet.agent.peer_id", PEER));
    a.set_attribute(KeyValue::new("hivenet.agent.engine", "vllm"));
    a.set_attribute(KeyValue::new("hivenet.decision.step", "routing_policy"));
    a.set_attribute(KeyValue::new(
        "hivenet.decision.trail",
        format!("routing_policy: pool={} unhealthy={} capability_mismatch={} unmatched={} prev_failed={} at_capacity={} exclude_if={}", 3, 0, 0, 0, 0, 0, 0),
    ));
    a.set_attribute(KeyValue::new("hivenet.agent.active", 1i64));
    a.set_attribute(KeyValue::new("hivenet.agent.capacity", 10i64));
    a.set_attribute(KeyValue::new("hivenet.agent.srtt_ms", 1.25));
    a.set_attribute(KeyValue::new("http.response.status_code", 200i64));
    a.set_attribute(KeyValue::new("gen_ai.usage.input_tokens", 12i64));
    a.set_attribute(KeyValue::new("gen_ai.usage.output_tokens", 16i64));
    a.set_attribute(KeyValue::new("hivenet.srtt_sample_ms", 1.3));
    a.end();
    let span = cx.span();
    span.set_attribute(KeyValue::new("http.response.status_code", 200i64));
    span.set_attribute(KeyValue::new("hivenet.agent.peer_id", PEER));
    span.set_attribute(KeyValue::new("gen_ai.usage.input_tokens", 12i64));
    span.set_attribute(KeyValue::new("gen_ai.usage.output_tokens", 16i64));
    span.end();
}

fn main() {
    let provider = SdkTracerProvider::builder().with_batch_exporter(Sink).build();
    let tracer = provider.tracer("bench");
    // Paced below the batch processor's queue (2,048 spans) so nothing is
    // dropped: 1,000 requests, then let it drain.
    let (mut total, mut n) = (0.0, 0u32);
    for _ in 0..200 {
        let t = Instant::now();
        for _ in 0..500 {
            one(&tracer);
        }
        total += t.elapsed().as_secs_f64();
        n += 500;
        std::thread::sleep(std::time::Duration::from_millis(30));
    }
    println!("opentelemetry_sdk: one request's two spans, 24 attributes, batch hand-over: {:.3} us", total * 1e6 / f64::from(n));
    let _ = provider.shutdown();
}
