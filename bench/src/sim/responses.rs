//! The simulator's `POST /v1/responses` and `/v1/responses/input_tokens`
//! (issue 52), as llama-server build 11434 serves them
//! (tools/server/server-task.cpp `to_json_oaicompat_resp[_stream]`,
//! server-chat.cpp): the same event names, order and fields; the final
//! `response.completed` carries the output and the usage; a request
//! naming `previous_response_id` is refused with llama-server's 400, so a
//! test through the router proves the router rebuilt the conversation.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Deserialize;
use serde_json::{json, Value};
use shards::logic::http::framing::http_write::{self, OutFraming};
use shards::runtime::wire::conn::Conn;

use super::{generate_whole, input_tokens, prefill_text, reply_json, sleep, text_from, token, Sim};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

#[derive(Deserialize)]
struct Req {
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    max_output_tokens: Option<u32>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    instructions: Option<Value>,
}

fn bad(msg: &str) -> Value {
    json!({"error": {"code": 400, "message": msg, "type": "invalid_request_error"}})
}

/// The text of an item's content (a string, or the `text` of its parts).
fn content_text(c: &Value) -> String {
    match c {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

/// The prompt as the chat template would render the converted messages
/// (role and text of each, in order): the prefix cache's key, stable
/// across turns (turn N's is a prefix of turn N+1's).
fn prompt_text(r: &Req) -> String {
    let mut text = String::new();
    let mut turn = |role: &str, content: &str| {
        text.push_str(role);
        text.push('\n');
        text.push_str(content);
        text.push('\n');
    };
    if let Some(i) = &r.instructions {
        turn("system", &content_text(i));
    }
    match &r.input {
        Some(Value::String(s)) => turn("user", s),
        Some(Value::Array(items)) => {
            for item in items {
                let role = item.get("role").and_then(Value::as_str).unwrap_or("user");
                turn(
                    role,
                    &content_text(item.get("content").unwrap_or(&Value::Null)),
                );
            }
        }
        _ => {}
    }
    text
}

fn event(out: &mut Vec<u8>, name: &str, data: Value) {
    let ev = format!("event: {name}\ndata: {data}\n\n");
    http_write::write_chunk(out, ev.as_bytes());
}

/// `POST /v1/responses/input_tokens`.
pub(super) async fn input_tokens_of(sim: &Sim, conn: &mut Conn, body: &[u8], keep: bool) -> bool {
    let v = json!({"object": "response.input_tokens", "input_tokens": input_tokens(sim, body)});
    reply_json(conn, 200, &v, keep).await
}

/// `POST /v1/responses`.
pub(super) async fn responses(sim: &Sim, conn: &mut Conn, body: &[u8], keep: bool) -> bool {
    let req: Req = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return reply_json(conn, 400, &bad(&e.to_string()), keep).await,
    };
    if req.input.is_none() {
        return reply_json(conn, 400, &bad("'input' is required"), keep).await;
    }
    if req
        .previous_response_id
        .as_deref()
        .is_some_and(|p| !p.is_empty())
    {
        let e = bad("llama.cpp does not support 'previous_response_id'.");
        return reply_json(conn, 400, &e, keep).await;
    }
    let left = sim.cfg.output_tokens;
    let n = req.max_output_tokens.map_or(left, |m| m.min(left));
    // Counted on the rendered prompt, as llama-server counts the
    // template's tokens (the items' JSON is not what the engine reads).
    let text = prompt_text(&req);
    let prompt = crate::prefix_cache::tokens_of(text.len(), sim.cfg.bytes_per_token);
    let (cached, ttft) = prefill_text(sim, Some(text), prompt);
    let seq = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let id = format!("resp_sim{seq:024x}");
    let msg_id = format!("msg_sim{seq:024x}");
    let model = &sim.cfg.model;
    let usage = json!({"input_tokens": prompt, "output_tokens": n,
        "total_tokens": prompt.saturating_add(u64::from(n)),
        "input_tokens_details": {"cached_tokens": cached}});
    let text = text_from(0, n);
    let part = json!({"type": "output_text", "annotations": [], "logprobs": [], "text": text});
    let item = json!({"type": "message", "status": "completed", "id": msg_id,
        "content": [part], "role": "assistant"});
    let output = if n > 0 {
        vec![item.clone()]
    } else {
        Vec::new()
    };
    if !req.stream {
        generate_whole(sim, ttft, n).await;
        let v = json!({"completed_at": 0, "created_at": 0, "id": id, "model": model,
            "object": "response", "output": output, "status": "completed", "usage": usage});
        return super::answer_or_abort(sim, conn, &v, keep).await;
    }
    sleep(ttft).await;
    let mut out = Vec::with_capacity(2048);
    let headers: [(&str, &[u8]); 1] = [("Content-Type", b"text/event-stream")];
    http_write::write_response_head(&mut out, 200, headers, OutFraming::Chunked, keep, &[]);
    let open = json!({"id": id, "object": "response", "status": "in_progress"});
    event(
        &mut out,
        "response.created",
        json!({"type": "response.created", "response": open}),
    );
    event(
        &mut out,
        "response.in_progress",
        json!({"type": "response.in_progress", "response": open}),
    );
    let abort = sim.roll_abort(n);
    for i in 0..n {
        if abort == Some(i) {
            return false;
        }
        if i > 0 {
            sleep(sim.cfg.itl).await;
        } else {
            event(
                &mut out,
                "response.output_item.added",
                json!({"type": "response.output_item.added",
                "item": {"content": [], "id": msg_id, "role": "assistant", "status": "in_progress", "type": "message"}}),
            );
            event(
                &mut out,
                "response.content_part.added",
                json!({"type": "response.content_part.added",
                "item_id": msg_id, "part": {"type": "output_text", "text": ""}}),
            );
        }
        event(
            &mut out,
            "response.output_text.delta",
            json!({"type": "response.output_text.delta",
            "item_id": msg_id, "delta": token(i)}),
        );
        sim.stats.generated.fetch_add(1, Ordering::Relaxed);
        if conn.write_all(std::mem::take(&mut out)).await.is_err() {
            return false;
        }
    }
    if n > 0 {
        event(
            &mut out,
            "response.output_text.done",
            json!({"type": "response.output_text.done",
            "item_id": msg_id, "text": text}),
        );
        event(
            &mut out,
            "response.content_part.done",
            json!({"type": "response.content_part.done",
            "item_id": msg_id, "part": part}),
        );
        event(
            &mut out,
            "response.output_item.done",
            json!({"type": "response.output_item.done", "item": item}),
        );
    }
    event(
        &mut out,
        "response.completed",
        json!({"type": "response.completed", "response": {
        "id": id, "object": "response", "created_at": 0, "status": "completed", "model": model,
        "output": output, "usage": usage}}),
    );
    out.extend_from_slice(http_write::LAST_CHUNK);
    conn.write_all(out).await.is_ok()
}
