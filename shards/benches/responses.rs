//! The Responses API's added cost on the router (issue 52), pure parts:
//! reading a turn, rebuilding a 5-turn conversation into the engine's
//! body, and the tap on a stream's events (a delta passes, the final
//! `response.completed` is rewritten and kept), a conversation of the
//! same 5 turns read, rebuilt and written back with the next turn's
//! items (the Conversations API), against what chat pays
//! (the probe of a chat body of the same conversation). Plain output;
//! run with `cargo bench -p shards --bench responses`.
#![forbid(unsafe_code)]

use std::hint::black_box;
use std::time::Instant;

use serde_json::json;
use shards::logic::http::api::conversations::{as_turn, Conversation};
use shards::logic::http::api::probe;
use shards::logic::http::api::responses::{expanded_body, parse_request, Record, Tap};

fn timed(label: &str, n: u32, mut f: impl FnMut()) {
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    let us = t.elapsed().as_secs_f64() * 1e6 / f64::from(n);
    println!("{label:<58} {us:>8.2} us");
}

/// A turn as the router keeps it: ~60 words in, ~60 out.
fn record(i: usize) -> Record {
    let said = format!(
        "Turn {i}: {}",
        "tell me more about the rivers of Europe ".repeat(8)
    );
    let answered = "The Danube flows through ten countries and four capitals. ".repeat(6);
    Record {
        id: format!("resp_{i:032x}"),
        model: "m".into(),
        created_at: 1,
        previous_response_id: (i > 0).then(|| format!("resp_{:032x}", i - 1)),
        instructions: None,
        input: vec![json!({"role": "user", "content": said})],
        output: vec![
            json!({"type": "message", "id": format!("msg_{i}"), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": answered}]}),
        ],
        usage: Some(json!({"input_tokens": 100, "output_tokens": 60, "total_tokens": 160})),
        status: "completed".into(),
    }
}

fn main() {
    let chain: Vec<Record> = (0..5).map(record).collect();
    let body =
        json!({"model": "m", "input": "And the longest?", "previous_response_id": chain[4].id,
        "instructions": "Be brief.", "max_output_tokens": 64, "stream": true})
        .to_string();
    // Chat's equivalent: the same conversation as messages, probed.
    let mut msgs = vec![json!({"role": "system", "content": "Be brief."})];
    for r in &chain {
        msgs.push(json!({"role": "user", "content": r.input[0]["content"]}));
        msgs.push(json!({"role": "assistant", "content": r.output[0]["content"][0]["text"]}));
    }
    msgs.push(json!({"role": "user", "content": "And the longest?"}));
    let chat =
        json!({"model": "m", "messages": msgs, "max_tokens": 64, "stream": true}).to_string();
    let raw: Vec<Vec<u8>> = chain
        .iter()
        .map(|r| serde_json::to_vec(r).expect("json"))
        .collect();
    let per_turn: usize = raw.iter().map(Vec::len).sum::<usize>() / raw.len();
    let delta = b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"item_id\":\"msg_1\",\"delta\":\" river\"}\n\n";
    let completed = format!(
        "event: response.completed\ndata: {}\n\n",
        json!({"type": "response.completed", "response": {"id": "resp_engine", "object": "response",
            "status": "completed", "output": chain[4].output, "usage": chain[4].usage}})
    );
    // The same 5 turns as one conversation (its items, in order).
    let items: Vec<serde_json::Value> = chain
        .iter()
        .flat_map(|r| r.input.iter().chain(r.output.iter()).cloned())
        .collect();
    let conv = Conversation::new(format!("conv_{:032x}", 7), 1, json!({}), items);
    let conv_raw = serde_json::to_vec(&conv).expect("json");
    let conv_body = json!({"model": "m", "input": "And the longest?", "conversation": conv.id,
        "instructions": "Be brief.", "max_output_tokens": 64, "stream": true})
    .to_string();
    let next_items = vec![chain[4].input[0].clone(), chain[4].output[0].clone()];
    let n = 20_000;
    for round in 0..2 {
        println!(
            "round {round} (state bytes per turn kept: {per_turn}; the 5-turn conversation: {} bytes)",
            conv_raw.len()
        );
        timed(
            "chat: probe of the whole conversation (baseline)",
            n,
            || {
                black_box(probe::probe(black_box(chat.as_bytes())).ok());
            },
        );
        timed("responses: parse the turn", n, || {
            black_box(parse_request(black_box(body.as_bytes())).ok());
        });
        let req = parse_request(body.as_bytes()).expect("turn");
        timed(
            "responses: rebuild 5 stored turns into the engine's body",
            n,
            || {
                black_box(expanded_body(black_box(&req), black_box(&raw)).ok());
            },
        );
        let rebuilt = expanded_body(&req, &raw).expect("rebuilt").0;
        timed(
            "responses: probe of the rebuilt body (as chat's)",
            n,
            || {
                black_box(probe::probe(black_box(&rebuilt)).ok());
            },
        );
        let conv_req = parse_request(conv_body.as_bytes()).expect("turn");
        timed(
            "conversation: read it and rebuild it into the engine's body",
            n,
            || {
                let c: Conversation = serde_json::from_slice(black_box(&conv_raw)).expect("conv");
                black_box(expanded_body(black_box(&conv_req), &[as_turn(&c)]).ok());
            },
        );
        timed(
            "conversation: add the turn's items and encode it (written back)",
            n,
            || {
                let mut c: Conversation =
                    serde_json::from_slice(black_box(&conv_raw)).expect("conv");
                c.add(next_items.clone());
                black_box(serde_json::to_vec(&c).ok());
            },
        );
        let mut out = Vec::with_capacity(64 * 1024);
        timed("tap: one delta event (passes)", n * 10, || {
            let mut t = Tap::new("resp_x".into(), None, true);
            out.clear();
            t.feed(black_box(delta), &mut out);
            black_box(&out);
        });
        timed("tap: response.completed (rewritten, kept)", n, || {
            let mut t = Tap::new("resp_x".into(), None, true);
            out.clear();
            t.feed(black_box(completed.as_bytes()), &mut out);
            black_box(t.done.is_some());
        });
    }
}
