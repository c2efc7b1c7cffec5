//! The Responses API's conversation state, owned by the router (issue 52),
//! pure: what a request asks ([`parse_request`]), the body an engine that
//! keeps no state receives ([`expanded_body`]: the chain's input and
//! output items, then the new input), what is kept of a response
//! ([`Record`]) and the tap that gives the client the router's response
//! ID and keeps the engine's output ([`Tap`]).
//!
//! The engine is always asked with `store: false` and without
//! `previous_response_id`: llama-server refuses the latter, vLLM keeps
//! stored responses in one process's memory. The router issues the ID,
//! keeps the turn's input and output items, and rebuilds the conversation
//! for the next turn, whichever engine serves it.
//!
//! Key items: [`parse_request`], [`expanded_body`], [`Record`], [`Tap`].

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Most turns a `previous_response_id` chain may reach back.
pub const MAX_CHAIN: usize = 256;
/// Longest response ID accepted from a client.
pub const MAX_ID_BYTES: usize = 128;
/// Longest SSE line the tap rewrites (a `response.completed` event holds
/// the whole output); a longer one passes unchanged and the turn is not
/// kept.
pub const MAX_EVENT_BYTES: usize = 8 << 20;

/// What a Responses request asks of the router's state.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The turn it continues.
    pub previous: Option<String>,
    /// The conversation it belongs to (`conversations`): its items come
    /// first, and this turn's are added to it.
    pub conversation: Option<String>,
    /// Keep this turn (the API's default: true).
    pub store: bool,
    /// This turn's input, as items.
    pub input: Vec<Value>,
    /// `instructions` as given (not carried to the next turn, as the API
    /// has it).
    pub instructions: Option<Value>,
    body: Map<String, Value>,
}

/// Parse a `POST /v1/responses` body: `Err` carries the client's error
/// message (400).
pub fn parse_request(body: &[u8]) -> Result<Request, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("Invalid request: {e}"))?;
    let Value::Object(body) = v else {
        return Err("the request body must be a JSON object".into());
    };
    let previous = match body.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if valid_id(s) => Some(s.clone()),
        Some(Value::String(_)) => {
            return Err(format!(
                "'previous_response_id' must be a response ID of at most {MAX_ID_BYTES} bytes"
            ))
        }
        Some(_) => return Err("'previous_response_id' must be a string".into()),
    };
    let store = match body.get("store") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("'store' must be a boolean".into()),
    };
    let conversation = match body.get("conversation") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Object(o)) => match o.get("id") {
            Some(Value::String(s)) => Some(s.clone()),
            _ => return Err("'conversation.id' must be a string".into()),
        },
        Some(_) => {
            return Err("'conversation' must be a conversation ID or an object with 'id'".into())
        }
    };
    if conversation
        .as_deref()
        .is_some_and(|c| !(c.starts_with("conv_") && valid_id(c)))
    {
        return Err("'conversation' must be a conversation ID ('conv_...')".into());
    }
    if conversation.is_some() && previous.is_some() {
        return Err("'previous_response_id' and 'conversation' cannot be used together".into());
    }
    let input = match body.get("input") {
        Some(Value::String(s)) => vec![serde_json::json!({"role": "user", "content": s})],
        Some(Value::Array(items)) => {
            if let Some(i) = items.iter().position(|i| !i.is_object()) {
                return Err(format!("'input[{i}]' must be an object"));
            }
            items.clone()
        }
        None | Some(Value::Null) => return Err("'input' is required".into()),
        Some(_) => return Err("'input' must be a string or an array of items".into()),
    };
    let instructions = body.get("instructions").filter(|v| !v.is_null()).cloned();
    Ok(Request {
        previous,
        conversation,
        store,
        input,
        instructions,
        body,
    })
}

/// An ID a client may name: printable ASCII without quotes or slashes.
pub fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_ID_BYTES
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A new response ID from 128 random bits.
pub fn new_id(random: u128) -> String {
    format!("resp_{random:032x}")
}

/// What the router keeps of one response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// The router's ID.
    pub id: String,
    /// The model the client named.
    pub model: String,
    /// Unix seconds.
    pub created_at: u64,
    /// The turn it continued.
    #[serde(default)]
    pub previous_response_id: Option<String>,
    /// Its instructions (shown, never carried on).
    #[serde(default)]
    pub instructions: Option<Value>,
    /// This turn's input items.
    pub input: Vec<Value>,
    /// The engine's output items.
    pub output: Vec<Value>,
    /// The engine's usage.
    #[serde(default)]
    pub usage: Option<Value>,
    /// `completed`, `incomplete` or `failed`.
    pub status: String,
}

/// The response a stored record continued (`Err`: not a record); reads
/// nothing else (a chain is walked without decoding its items).
pub fn previous_of(record: &[u8]) -> Result<Option<String>, serde_json::Error> {
    #[derive(Deserialize)]
    struct Prev {
        #[serde(default)]
        previous_response_id: Option<String>,
        #[allow(dead_code)]
        status: serde::de::IgnoredAny,
    }
    serde_json::from_slice::<Prev>(record).map(|p| p.previous_response_id)
}

/// What the rebuild reads of a stored record: its ID and its items, as
/// raw JSON borrowed from the store's bytes (never decoded into trees:
/// a 5-turn chain costs a validation pass and a copy).
#[derive(Deserialize)]
struct Turn<'a> {
    #[serde(borrow)]
    id: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    input: Vec<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    output: Vec<&'a serde_json::value::RawValue>,
}

/// The body sent to the engine: the chain's items (oldest first, input
/// then output of each turn, as the store holds them), then this turn's
/// input; no `previous_response_id`; `store: false` (the router keeps the
/// state). Also the chain's first response ID (the conversation's
/// session key). `Err`: a stored record that is not one.
pub fn expanded_body(
    req: &Request,
    chain: &[Vec<u8>],
) -> Result<(Vec<u8>, Option<String>), String> {
    let mut body = req.body.clone();
    body.remove("previous_response_id");
    body.remove("conversation");
    body.insert("store".into(), Value::Bool(false));
    if chain.is_empty() {
        return Ok((
            serde_json::to_vec(&Value::Object(body)).unwrap_or_default(),
            None,
        ));
    }
    let turns: Vec<Turn<'_>> = chain
        .iter()
        .map(|r| {
            serde_json::from_slice(r).map_err(|e| format!("a stored response is unreadable: {e}"))
        })
        .collect::<Result<_, _>>()?;
    body.remove("input");
    let head = serde_json::to_vec(&Value::Object(body)).unwrap_or_default();
    let size: usize = chain.iter().map(Vec::len).sum();
    let mut out = Vec::with_capacity(head.len() + size + 256);
    // `{...}` without its closing brace, then the input, then the brace.
    out.extend_from_slice(head.get(..head.len().saturating_sub(1)).unwrap_or(&[]));
    if head.len() > 2 {
        out.push(b',');
    }
    out.extend_from_slice(b"\"input\":[");
    let mut first = true;
    let raw = turns
        .iter()
        .flat_map(|t| t.input.iter().chain(t.output.iter()))
        .map(|v| v.get().as_bytes().to_vec());
    let new = req
        .input
        .iter()
        .map(|v| serde_json::to_vec(v).unwrap_or_default());
    for item in raw.chain(new) {
        if !first {
            out.push(b',');
        }
        first = false;
        out.extend_from_slice(&item);
    }
    out.extend_from_slice(b"]}");
    Ok((out, turns.first().map(|t| t.id.to_string())))
}

/// A stored response as `GET /v1/responses/{id}` shows it.
pub fn render(r: &Record) -> Value {
    serde_json::json!({
        "id": r.id,
        "object": "response",
        "created_at": r.created_at,
        "status": r.status,
        "model": r.model,
        "output": r.output,
        "usage": r.usage,
        "previous_response_id": r.previous_response_id,
        "instructions": r.instructions,
        "store": true,
    })
}

/// `GET /v1/responses/{id}/input_items`: the turn's input items, each
/// with an ID and a type (an easy input message is shown as the message
/// item it stands for).
pub fn input_items(r: &Record) -> Value {
    let data: Vec<Value> = r
        .input
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let mut item = item.clone();
            if let Value::Object(m) = &mut item {
                if !m.contains_key("id") {
                    let tail = r.id.trim_start_matches("resp_");
                    m.insert("id".into(), Value::String(format!("msg_{tail}_{i}")));
                }
                if !m.contains_key("type") && m.contains_key("role") {
                    m.insert("type".into(), Value::String("message".into()));
                }
                if let Some(Value::String(text)) = m.get("content").cloned() {
                    m.insert(
                        "content".into(),
                        serde_json::json!([{"type": "input_text", "text": text}]),
                    );
                }
            }
            item
        })
        .collect();
    let id_of = |v: Option<&Value>| v.and_then(|i| i.get("id")).cloned();
    serde_json::json!({
        "object": "list",
        "data": data,
        "first_id": id_of(data.first()),
        "last_id": id_of(data.last()),
        "has_more": false,
    })
}

/// The end of a response, as the engine gave it.
#[derive(Debug, Clone, PartialEq)]
pub struct Done {
    /// Output items.
    pub output: Vec<Value>,
    /// Usage.
    pub usage: Option<Value>,
    /// Terminal status.
    pub status: String,
}

/// Rewrites the engine's response objects on their way to the client
/// (the router's ID, the client's `previous_response_id` and `store`)
/// and keeps the terminal one. Streams are rewritten line by line, so an
/// event split across reads is whole when it is looked at.
#[derive(Debug, Default)]
pub struct Tap {
    ours: String,
    previous: Option<String>,
    store: bool,
    line: Vec<u8>,
    overlong: bool,
    /// The terminal response (completed, incomplete or failed), once seen.
    pub done: Option<Done>,
}

impl Tap {
    /// A tap giving the client `ours` as the response's ID.
    pub fn new(ours: String, previous: Option<String>, store: bool) -> Self {
        Tap {
            ours,
            previous,
            store,
            ..Tap::default()
        }
    }

    /// The router's ID.
    pub fn id(&self) -> &str {
        &self.ours
    }

    /// Fix one response object; keep it when terminal.
    fn response(&mut self, r: &mut Map<String, Value>) {
        r.insert("id".into(), Value::String(self.ours.clone()));
        r.insert(
            "previous_response_id".into(),
            self.previous.clone().map_or(Value::Null, Value::String),
        );
        if r.contains_key("store") {
            r.insert("store".into(), Value::Bool(self.store));
        }
        let status = r
            .get("status")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if matches!(status.as_str(), "completed" | "incomplete" | "failed") {
            let output = match r.get("output") {
                Some(Value::Array(items)) => items.clone(),
                _ => Vec::new(),
            };
            self.done = Some(Done {
                output,
                usage: r.get("usage").cloned(),
                status,
            });
        }
    }

    /// A whole (non-streamed) body: the rewritten body when it is a
    /// response object, else `None` (pass it unchanged).
    pub fn body(&mut self, body: &[u8]) -> Option<Vec<u8>> {
        let mut v: Value = serde_json::from_slice(body).ok()?;
        let r = v.as_object_mut()?;
        if r.get("object").and_then(Value::as_str) != Some("response") {
            return None;
        }
        self.response(r);
        serde_json::to_vec(&v).ok()
    }

    /// Decoded stream bytes: the complete lines, rewritten, appended to
    /// `out`; a partial line waits for the rest.
    pub fn feed(&mut self, mut data: &[u8], out: &mut Vec<u8>) {
        while let Some(nl) = memchr::memchr(b'\n', data) {
            let (head, rest) = data.split_at(nl + 1);
            if self.overlong {
                // The rest of a line too long to rewrite.
                out.extend_from_slice(head);
                self.overlong = false;
            } else if self.line.is_empty() {
                self.line_done(head, out);
            } else {
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(head);
                self.line_done(&line, out);
                line.clear();
                self.line = line;
            }
            data = rest;
        }
        if data.is_empty() {
            return;
        }
        if self.overlong || self.line.len() + data.len() > MAX_EVENT_BYTES {
            out.append(&mut self.line);
            out.extend_from_slice(data);
            self.overlong = true;
        } else {
            self.line.extend_from_slice(data);
        }
    }

    /// The stream ended: what waits is given as it is.
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        out.append(&mut self.line);
    }

    /// One line, `\n` included.
    fn line_done(&mut self, line: &[u8], out: &mut Vec<u8>) {
        let fixed = line
            .strip_prefix(b"data:")
            .filter(|d| memchr::memmem::find(d, b"\"response\"").is_some())
            .and_then(|d| {
                let mut v: Value = serde_json::from_slice(d.trim_ascii()).ok()?;
                let r = v.get_mut("response")?.as_object_mut()?;
                self.response(r);
                serde_json::to_vec(&v).ok()
            });
        match fixed {
            Some(json) => {
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(&json);
                out.push(b'\n');
            }
            None => out.extend_from_slice(line),
        }
    }
}

#[cfg(test)]
mod tests;
