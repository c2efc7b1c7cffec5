//! The event-by-event translation of a provider's SSE stream into the
//! client's API ([`StreamTranslator`]), as bytes arrive, bounded by
//! [`MAX_EVENT`].

use serde_json::{json, Value};

use super::{finish_of_stop, stop_of_finish, Api, Engine, ShapeError};
/// Longest SSE event buffered while translating (a longer one fails the
/// stream rather than growing without bound).
pub const MAX_EVENT: usize = 1024 * 1024;

/// Translates a provider's SSE stream into the client's API, event by
/// event, as bytes arrive.
#[derive(Debug)]
pub struct StreamTranslator {
    /// The provider's API (`Messages`: Anthropic events in, OpenAI
    /// chunks out; `Chat`: the other way round).
    from: Api,
    pending: Vec<u8>,
    id: String,
    model: String,
    input: u64,
    output: u64,
    finish: Option<String>,
    started: bool,
    done: bool,
}

impl StreamTranslator {
    /// A translator from `engine`'s events to the other API's.
    pub fn new(engine: Engine) -> Self {
        StreamTranslator {
            from: engine.api(),
            pending: Vec::new(),
            id: String::new(),
            model: String::new(),
            input: 0,
            output: 0,
            finish: None,
            started: false,
            done: false,
        }
    }

    /// The provider's stream ended cleanly (its last event seen).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Feed provider bytes; appends the client's events to `out`.
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<u8>) -> Result<(), ShapeError> {
        self.pending.extend_from_slice(bytes);
        while let Some((end, sep)) = event_end(&self.pending) {
            let event: Vec<u8> = self.pending.drain(..end + sep).collect();
            let text = String::from_utf8_lossy(event.get(..end).unwrap_or(&[])).into_owned();
            let data: String = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(str::trim_start)
                .collect::<Vec<_>>()
                .join("\n");
            if !data.is_empty() {
                self.event(&data, out);
            }
        }
        if self.pending.len() > MAX_EVENT {
            return Err(ShapeError::from(format!("an event over {MAX_EVENT} bytes")));
        }
        Ok(())
    }

    fn event(&mut self, data: &str, out: &mut Vec<u8>) {
        match self.from {
            Api::Messages => self.anthropic_event(data, out),
            Api::Chat => self.openai_event(data, out),
        }
    }

    fn chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        json!({
            "id": self.id, "object": "chat.completion.chunk", "created": 0, "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })
    }

    /// Anthropic events to OpenAI chunks.
    fn anthropic_event(&mut self, data: &str, out: &mut Vec<u8>) {
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return;
        };
        match v.get("type").and_then(Value::as_str) {
            Some("message_start") => {
                let m = v.get("message").cloned().unwrap_or_default();
                self.id = m.get("id").and_then(Value::as_str).unwrap_or("").into();
                self.model = m.get("model").and_then(Value::as_str).unwrap_or("").into();
                self.input = m
                    .pointer("/usage/input_tokens")
                    .and_then(Value::as_u64)
                    .unwrap_or(0);
                sse_data(
                    out,
                    &self.chunk(json!({"role": "assistant", "content": ""}), None),
                );
            }
            Some("content_block_delta") => {
                if let Some(t) = v.pointer("/delta/text").and_then(Value::as_str) {
                    sse_data(out, &self.chunk(json!({"content": t}), None));
                }
            }
            Some("message_delta") => {
                if let Some(n) = v.pointer("/usage/output_tokens").and_then(Value::as_u64) {
                    self.output = n;
                }
                if let Some(n) = v.pointer("/usage/input_tokens").and_then(Value::as_u64) {
                    self.input = self.input.max(n);
                }
                let stop = v.pointer("/delta/stop_reason").and_then(Value::as_str);
                sse_data(out, &self.chunk(json!({}), Some(finish_of_stop(stop))));
            }
            Some("message_stop") => {
                let usage = json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": 0, "model": self.model,
                    "choices": [],
                    "usage": {"prompt_tokens": self.input, "completion_tokens": self.output,
                              "total_tokens": self.input + self.output},
                });
                sse_data(out, &usage);
                out.extend_from_slice(b"data: [DONE]\n\n");
                self.done = true;
            }
            Some("error") => {
                let e = v.get("error").cloned().unwrap_or_default();
                sse_data(out, &json!({"error": e}));
            }
            _ => {}
        }
    }

    fn begin_message(&mut self, out: &mut Vec<u8>) {
        if self.started {
            return;
        }
        self.started = true;
        sse_event(
            out,
            "message_start",
            &json!({
                "type": "message_start",
                "message": {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                            "content": [], "stop_reason": null, "stop_sequence": null,
                            "usage": {"input_tokens": 0, "output_tokens": 0}},
            }),
        );
        sse_event(
            out,
            "content_block_start",
            &json!({
                "type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""},
            }),
        );
    }

    /// OpenAI chunks to Anthropic events.
    fn openai_event(&mut self, data: &str, out: &mut Vec<u8>) {
        if data.trim() == "[DONE]" {
            self.begin_message(out);
            sse_event(
                out,
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": 0}),
            );
            sse_event(
                out,
                "message_delta",
                &json!({
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_of_finish(self.finish.as_deref()), "stop_sequence": null},
                    "usage": {"input_tokens": self.input, "output_tokens": self.output},
                }),
            );
            sse_event(out, "message_stop", &json!({"type": "message_stop"}));
            self.done = true;
            return;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return;
        };
        if let Some(e) = v.get("error") {
            sse_event(out, "error", &json!({"type": "error", "error": e}));
            return;
        }
        if self.id.is_empty() {
            self.id = v.get("id").and_then(Value::as_str).unwrap_or("").into();
            self.model = v.get("model").and_then(Value::as_str).unwrap_or("").into();
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.input = u
                .get("prompt_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(self.input);
            self.output = u
                .get("completion_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(self.output);
        }
        let choice = v.pointer("/choices/0");
        if let Some(t) = choice
            .and_then(|c| c.pointer("/delta/content"))
            .and_then(Value::as_str)
        {
            self.begin_message(out);
            if !t.is_empty() {
                sse_event(
                    out,
                    "content_block_delta",
                    &json!({
                        "type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": t},
                    }),
                );
            }
        }
        if let Some(f) = choice
            .and_then(|c| c.get("finish_reason"))
            .and_then(Value::as_str)
        {
            self.finish = Some(f.to_string());
        }
    }
}

/// Where the first complete SSE event of `b` ends, and its separator's
/// length.
fn event_end(b: &[u8]) -> Option<(usize, usize)> {
    let lf = b.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(c)) => Some(if a.0 <= c.0 { a } else { c }),
        (a, c) => a.or(c),
    }
}

fn sse_data(out: &mut Vec<u8>, v: &Value) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(v.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

fn sse_event(out: &mut Vec<u8>, name: &str, v: &Value) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\n");
    sse_data(out, v);
}
