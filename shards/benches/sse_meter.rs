//! The SSE meter's cost per relayed event (issue 51 #10: it now counts
//! the events that carry text, so a stream cut before its usage is
//! charged for what it delivered): `SseUsage::feed` on a vLLM-shaped
//! content chunk, and on the final usage chunk, against copying the same
//! bytes (the relay's own minimum). Plain output; run with
//! `cargo bench -p shards --bench sse_meter`.
#![forbid(unsafe_code)]

use std::hint::black_box;
use std::time::Instant;

use shards::logic::http::api::usage::SseUsage;

const CONTENT: &[u8] = br#"data: {"id":"chatcmpl-7f3a","object":"chat.completion.chunk","created":1733400000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":" river"},"logprobs":null,"finish_reason":null}]}

"#;
const USAGE: &[u8] = br#"data: {"id":"chatcmpl-7f3a","object":"chat.completion.chunk","created":1733400000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[],"usage":{"prompt_tokens":812,"completion_tokens":256,"total_tokens":1068}}

"#;

fn per_event(label: &str, event: &[u8], n: u32, mut f: impl FnMut(&[u8])) {
    let t = Instant::now();
    for _ in 0..n {
        f(black_box(event));
    }
    let ns = t.elapsed().as_nanos() as f64 / f64::from(n);
    println!("{label:<40} {ns:>8.1} ns/event");
}

fn main() {
    let n = 2_000_000;
    let mut meter = SseUsage::default();
    let mut sink = Vec::with_capacity(4096);
    for round in 0..2 {
        println!("round {round}");
        per_event("copy (the relay's minimum)", CONTENT, n, |e| {
            sink.clear();
            sink.extend_from_slice(e);
            black_box(&sink);
        });
        per_event("feed: content chunk", CONTENT, n, |e| {
            let mut m = SseUsage::default();
            m.feed(e);
            black_box(m.content_events);
        });
        per_event("feed: usage chunk", USAGE, n / 4, |e| {
            let mut m = SseUsage::default();
            m.feed(e);
            black_box(m.tokens);
        });
    }
    meter.feed(CONTENT);
    assert_eq!(meter.content_events, 1);
}
