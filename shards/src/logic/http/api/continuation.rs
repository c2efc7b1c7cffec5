//! Stream continuation (issue 33), pure: the parts that let a stream cut
//! by a dying agent go on exactly on another one. The shell that uses
//! them is `runtime::request::continuation`.
//!
//! - [`eligible`]: whether a request may be continued at all (streamed
//!   chat or messages, plain text: no tools, logprobs, several choices
//!   or images).
//! - [`prefill_for`]: how an engine continues a final assistant message
//!   (vLLM and SGLang: `continue_final_message` with
//!   `add_generation_prompt: false`; llama.cpp: an assistant message last
//!   is a prefill by default); other engines cannot, and are refused.
//! - [`Transcript`]: what the client has received so far, fed the relayed
//!   SSE bytes: the response ID, the text delivered, how many content
//!   deltas, whether the stream ended.
//! - [`continuation_body`]: the request to send to the next agent: the
//!   original messages plus the delivered text (less its trailing
//!   whitespace, [`Transcript::prefill`]) as the assistant message to
//!   continue, `max_tokens` reduced by what was produced.
//! - [`Splice`]: the continuation's events made part of the first stream:
//!   its opening events dropped (the role and the message start were
//!   already sent), llama.cpp's echo of the prefill and the regenerated
//!   trailing whitespace dropped, its ID replaced by the first one's, its
//!   usage made the whole answer's.

use serde_json::{Map, Value};

/// The client's API of the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/chat/completions`.
    OpenAi,
    /// `POST /v1/messages`.
    Anthropic,
}

/// How an engine continues a final assistant message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefill {
    /// vLLM, SGLang: `continue_final_message: true` and
    /// `add_generation_prompt: false`.
    ContinueFinalMessage,
    /// llama.cpp: an assistant message last is continued as it is.
    LastAssistant,
}

/// Why a stream cannot be continued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    NotStreamed,
    Tools,
    Logprobs,
    SeveralChoices,
    Images,
    /// The engine has no way to continue an assistant message.
    Engine,
    /// The stream carried something other than text (a tool call).
    NotText,
    /// The request body is not a JSON object.
    Malformed,
}

impl Refusal {
    /// The `outcome` label of `hivenet_stream_migrations_total`.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::NotStreamed => "not_streamed",
            Refusal::Tools => "tools",
            Refusal::Logprobs => "logprobs",
            Refusal::SeveralChoices => "several_choices",
            Refusal::Images => "images",
            Refusal::Engine => "engine_cannot_continue",
            Refusal::NotText => "not_text",
            Refusal::Malformed => "malformed",
        }
    }
}

/// How `engine` (its registered name) continues an assistant message;
/// `None`: it cannot (Ollama's and other OpenAI-compatible servers'
/// chat endpoints start a new turn after one).
pub fn prefill_for(engine: &str) -> Option<Prefill> {
    match engine {
        "vllm" | "sglang" => Some(Prefill::ContinueFinalMessage),
        "llamacpp" | "llama.cpp" | "llama-cpp" => Some(Prefill::LastAssistant),
        _ => None,
    }
}

/// Whether the request `body` of `api` may be continued.
pub fn eligible(api: Api, body: &[u8]) -> Result<(), Refusal> {
    let v: Value = serde_json::from_slice(body).map_err(|_| Refusal::Malformed)?;
    let o = v.as_object().ok_or(Refusal::Malformed)?;
    if o.get("stream").and_then(Value::as_bool) != Some(true) {
        return Err(Refusal::NotStreamed);
    }
    let non_empty = |k: &str| match o.get(k) {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    };
    if non_empty("tools") || non_empty("functions") {
        return Err(Refusal::Tools);
    }
    if o.get("logprobs").and_then(Value::as_bool) == Some(true) || non_empty("top_logprobs") {
        return Err(Refusal::Logprobs);
    }
    if o.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return Err(Refusal::SeveralChoices);
    }
    let images = o
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|m| m.get("content").and_then(Value::as_array))
        .flatten()
        .any(|part| {
            let t = part.get("type").and_then(Value::as_str).unwrap_or("");
            t != "text"
        });
    if images {
        return Err(Refusal::Images);
    }
    // Both APIs name these fields alike; `api` is kept for the fields
    // one of them may add.
    let _ = api;
    Ok(())
}

/// What the client received of a stream, fed its SSE bytes. Carried
/// with a stream an upgrading router hands over (issue 54): the partial
/// line is not (a break ends at a relayed chunk).
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Transcript {
    #[serde(skip)]
    line: Vec<u8>,
    /// The response ID of the first event that had one.
    pub id: Option<String>,
    /// The assistant text delivered.
    pub text: String,
    /// Content deltas delivered (the produced-token count when the
    /// engine reported no usage before the cut: one token per delta).
    pub deltas: u64,
    /// Of them, the last ones that were whitespace only.
    pub blank_deltas: u64,
    /// The stream reached its final event.
    pub done: bool,
    /// Input tokens the first part reported (Anthropic's `message_start`;
    /// an OpenAI stream reports usage only at its end).
    pub input: Option<u64>,
    /// Something other than text was streamed (a tool call).
    pub not_text: bool,
}

/// Longest SSE line examined (a longer one makes the stream not text).
const MAX_LINE: usize = 256 * 1024;

impl Transcript {
    /// The text the continuation is asked to continue: the delivered text
    /// less its trailing whitespace, which is [`Transcript::held`] back.
    /// A text ending in whitespace tokenizes differently as a prompt than
    /// it was generated (`"all.\n\n"` is one token as a prompt, two as
    /// generated), and the engine then continues from another state;
    /// from `"all."` it generates the same newlines again, and the splice
    /// drops them (perf/2026-12-05-continuity-batch-invariant).
    pub fn prefill(&self) -> &str {
        let trimmed = self.text.trim_end();
        if trimmed.is_empty() {
            &self.text
        } else {
            trimmed
        }
    }

    /// The delivered whitespace the continuation regenerates.
    pub fn held(&self) -> &str {
        &self.text[self.prefill().len()..]
    }

    /// Tokens produced for the prefill: the deltas less the whitespace
    /// ones held back, which the continuation produces (and counts) again.
    pub fn produced(&self) -> u64 {
        if self.held().is_empty() {
            self.deltas
        } else {
            self.deltas.saturating_sub(self.blank_deltas)
        }
    }

    fn delivered(&mut self, t: &str) {
        if t.is_empty() {
            return;
        }
        self.text.push_str(t);
        self.deltas += 1;
        if t.trim().is_empty() {
            self.blank_deltas += 1;
        } else {
            self.blank_deltas = 0;
        }
    }

    /// Feed decoded body bytes of `api`'s stream.
    pub fn feed(&mut self, api: Api, data: &[u8]) {
        for b in data {
            if *b == b'\n' {
                let line = std::mem::take(&mut self.line);
                self.line_done(api, &line);
            } else if self.line.len() < MAX_LINE {
                self.line.push(*b);
            } else {
                self.not_text = true;
            }
        }
    }

    fn line_done(&mut self, api: Api, line: &[u8]) {
        let Some(rest) = line.strip_prefix(b"data:") else {
            return;
        };
        let rest = rest.trim_ascii();
        if rest == b"[DONE]" {
            self.done = true;
            return;
        }
        let Ok(v) = serde_json::from_slice::<Value>(rest) else {
            return;
        };
        if self.id.is_none() {
            let id = match api {
                Api::OpenAi => v.get("id"),
                Api::Anthropic => v.get("message").and_then(|m| m.get("id")),
            };
            self.id = id.and_then(Value::as_str).map(str::to_string);
        }
        match api {
            Api::OpenAi => self.openai_event(&v),
            Api::Anthropic => self.anthropic_event(&v),
        }
    }

    /// An OpenAI chunk: its text delta, a tool call, the finish.
    fn openai_event(&mut self, v: &Value) {
        let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else {
            return;
        };
        let delta = choice.get("delta");
        if delta.and_then(|d| d.get("tool_calls")).is_some()
            || delta.and_then(|d| d.get("function_call")).is_some()
        {
            self.not_text = true;
        }
        if let Some(t) = delta.and_then(|d| d.get("content")).and_then(Value::as_str) {
            self.delivered(t);
        }
        if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
            self.done = true;
        }
    }

    /// An Anthropic event: the input count, a block that is not text, a
    /// text delta, the stop.
    fn anthropic_event(&mut self, v: &Value) {
        match v.get("type").and_then(Value::as_str) {
            Some("message_start") => {
                self.input = v
                    .get("message")
                    .and_then(|m| m.get("usage"))
                    .and_then(|u| u.get("input_tokens"))
                    .and_then(Value::as_u64);
            }
            Some("content_block_start") => {
                let kind = v
                    .get("content_block")
                    .and_then(|b| b.get("type"))
                    .and_then(Value::as_str);
                if kind != Some("text") {
                    self.not_text = true;
                }
            }
            Some("content_block_delta") => {
                let d = v.get("delta");
                match d.and_then(|d| d.get("type")).and_then(Value::as_str) {
                    Some("text_delta") => {
                        if let Some(t) = d.and_then(|d| d.get("text")).and_then(Value::as_str) {
                            self.delivered(t);
                        }
                    }
                    _ => self.not_text = true,
                }
            }
            Some("message_stop") => self.done = true,
            _ => {}
        }
    }
}

/// The request that continues `body` (of `api`) on an engine continuing
/// as `prefill` says, after `delivered` text that took `produced` tokens:
/// the delivered text as the final assistant message, the output limit
/// reduced by `produced` (at least 1).
pub fn continuation_body(
    api: Api,
    body: &[u8],
    prefill: Prefill,
    delivered: &str,
    produced: u64,
) -> Result<Vec<u8>, Refusal> {
    let mut v: Value = serde_json::from_slice(body).map_err(|_| Refusal::Malformed)?;
    let o = v.as_object_mut().ok_or(Refusal::Malformed)?;
    let messages = o
        .get_mut("messages")
        .and_then(Value::as_array_mut)
        .ok_or(Refusal::Malformed)?;
    let mut m = Map::new();
    m.insert("role".into(), Value::from("assistant"));
    m.insert("content".into(), Value::from(delivered));
    messages.push(Value::Object(m));
    for key in ["max_tokens", "max_completion_tokens"] {
        if let Some(n) = o.get(key).and_then(Value::as_u64) {
            o.insert(key.into(), Value::from(n.saturating_sub(produced).max(1)));
        }
    }
    if api == Api::OpenAi && prefill == Prefill::ContinueFinalMessage {
        o.insert("continue_final_message".into(), Value::from(true));
        o.insert("add_generation_prompt".into(), Value::from(false));
    }
    serde_json::to_vec(&v).map_err(|_| Refusal::Malformed)
}

/// The continuation's stream made part of the first one: its opening
/// events are dropped, its response ID is the first one's, and its usage
/// counts the whole answer (the first part's output tokens added; the
/// input is the first part's when it reported one, else the
/// continuation's less the delivered text it was sent back).
#[derive(Debug, Clone)]
pub struct Splice {
    api: Api,
    id: Option<String>,
    produced: u64,
    input: Option<u64>,
    line: Vec<u8>,
    /// The last event was dropped: its closing blank line goes with it.
    dropped: bool,
    /// Delivered text the continuation is expected to stream back first
    /// (llama.cpp sends its prefill before what it generates), not yet
    /// seen.
    echo: String,
    /// Delivered whitespace left out of the prefill ([`Transcript::held`]),
    /// dropped from the start of the new text as far as it matches.
    held: String,
}

impl Splice {
    /// Splice into the stream of `api` that `first` transcribed, from an
    /// engine continuing as `prefill` says.
    pub fn new(api: Api, first: &Transcript, prefill: Prefill) -> Self {
        Splice {
            api,
            id: first.id.clone(),
            produced: first.produced(),
            input: first.input,
            line: Vec::new(),
            dropped: false,
            echo: match prefill {
                Prefill::LastAssistant => first.prefill().to_string(),
                Prefill::ContinueFinalMessage => String::new(),
            },
            held: first.held().to_string(),
        }
    }

    /// What of a content piece the client has not seen: the echo dropped,
    /// then the held-back whitespace the engine generates again.
    fn fresh(&mut self, t: &str) -> String {
        let t = self.unechoed(t);
        if !self.echo.is_empty() || self.held.is_empty() || t.is_empty() {
            return t;
        }
        let same = t
            .char_indices()
            .zip(self.held.chars())
            .take_while(|((_, a), b)| a == b)
            .last()
            .map_or(0, |((i, a), _)| i + a.len_utf8());
        if same == t.len() {
            self.held.drain(..same);
            return String::new();
        }
        // New text (or other whitespace): what was held is the client's.
        self.held.clear();
        t[same..].to_string()
    }

    /// What of a content piece is new: the echoed prefill is dropped (a
    /// piece may end it and begin the new text); a piece that does not
    /// match it means the engine does not echo, and is kept whole.
    fn unechoed(&mut self, t: &str) -> String {
        if self.echo.is_empty() || t.is_empty() {
            return t.to_string();
        }
        if let Some(rest) = self.echo.strip_prefix(t) {
            self.echo = rest.to_string();
            return String::new();
        }
        let echo = std::mem::take(&mut self.echo);
        t.strip_prefix(echo.as_str()).unwrap_or(t).to_string()
    }

    /// The text of a content event, to be checked against the echo.
    fn content_of(api: Api, v: &mut Value) -> Option<&mut Value> {
        match api {
            Api::OpenAi => v
                .get_mut("choices")
                .and_then(|c| c.get_mut(0))
                .and_then(|c| c.get_mut("delta"))
                .and_then(|d| d.get_mut("content")),
            Api::Anthropic => v
                .get_mut("delta")
                .filter(|d| d.get("type").and_then(Value::as_str) == Some("text_delta"))
                .and_then(|d| d.get_mut("text")),
        }
        .filter(|t| t.is_string())
    }

    /// Feed the continuation's decoded body bytes; returns the bytes to
    /// relay to the client (whole SSE lines; a partial line waits for its
    /// end).
    pub fn feed(&mut self, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        for b in data {
            self.line.push(*b);
            if *b == b'\n' {
                let line = std::mem::take(&mut self.line);
                self.line_done(&line, &mut out);
            }
        }
        out
    }

    fn line_done(&mut self, line: &[u8], out: &mut Vec<u8>) {
        let Some(rest) = line.strip_prefix(b"data:") else {
            // `event:` lines are written with their data (an Anthropic
            // event's name precedes it, and it may be dropped).
            if line.starts_with(b"event:") {
                return;
            }
            if line.trim_ascii().is_empty() && std::mem::take(&mut self.dropped) {
                return;
            }
            out.extend_from_slice(line);
            return;
        };
        let payload = rest.trim_ascii();
        let Ok(mut v) = serde_json::from_slice::<Value>(payload) else {
            out.extend_from_slice(line);
            return;
        };
        let api = self.api;
        if !self.echo.is_empty() || !self.held.is_empty() {
            if let Some(t) = Self::content_of(api, &mut v) {
                let new = self.fresh(t.as_str().unwrap_or(""));
                *t = Value::from(new);
            }
        }
        let keep = Self::carries_news(self.api, &v);
        if !keep {
            self.dropped = true;
            return;
        }
        self.dropped = false;
        if self.api == Api::OpenAi {
            // An engine may send the role with the first content: it was
            // the first part's to send.
            if let Some(d) = v
                .get_mut("choices")
                .and_then(|c| c.get_mut(0))
                .and_then(|c| c.get_mut("delta"))
                .and_then(Value::as_object_mut)
            {
                d.remove("role");
            }
        }
        if let (Some(id), Api::OpenAi) = (&self.id, self.api) {
            if let Some(o) = v.as_object_mut() {
                o.insert("id".into(), Value::from(id.as_str()));
            }
        }
        self.merge_usage(&mut v);
        if let Api::Anthropic = self.api {
            if let Some(name) = v.get("type").and_then(Value::as_str) {
                out.extend_from_slice(format!("event: {name}\n").as_bytes());
            }
        }
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(&serde_json::to_vec(&v).unwrap_or_default());
        out.push(b'\n');
    }

    /// Whether a continuation's event carries anything the client has
    /// not had from the first part (its opening events, empty deltas and
    /// pings are dropped).
    fn carries_news(api: Api, v: &Value) -> bool {
        match api {
            Api::OpenAi => {
                let delta = v
                    .get("choices")
                    .and_then(|c| c.get(0))
                    .and_then(|c| c.get("delta"));
                let content = delta
                    .and_then(|d| d.get("content"))
                    .and_then(Value::as_str)
                    .is_some_and(|t| !t.is_empty());
                let finish = v
                    .get("choices")
                    .and_then(|c| c.get(0))
                    .and_then(|c| c.get("finish_reason"))
                    .is_some_and(|f| !f.is_null());
                let usage = v.get("usage").is_some_and(|u| !u.is_null());
                // The opening role-only delta was sent by the first part.
                content || finish || usage
            }
            Api::Anthropic => {
                let empty = v
                    .get("delta")
                    .filter(|d| d.get("type").and_then(Value::as_str) == Some("text_delta"))
                    .and_then(|d| d.get("text"))
                    .and_then(Value::as_str)
                    .is_some_and(str::is_empty);
                !empty
                    && !matches!(
                        v.get("type").and_then(Value::as_str),
                        Some("message_start") | Some("content_block_start") | Some("ping")
                    )
            }
        }
    }

    /// The whole answer's usage in an event that reports one.
    fn merge_usage(&self, v: &mut Value) {
        let Some(u) = v.get_mut("usage").and_then(Value::as_object_mut) else {
            return;
        };
        let get = |u: &Map<String, Value>, k: &str| u.get(k).and_then(Value::as_u64);
        match self.api {
            Api::OpenAi => {
                let (Some(prompt), Some(completion)) =
                    (get(u, "prompt_tokens"), get(u, "completion_tokens"))
                else {
                    return;
                };
                let prompt = self
                    .input
                    .unwrap_or_else(|| prompt.saturating_sub(self.produced));
                let completion = completion.saturating_add(self.produced);
                u.insert("prompt_tokens".into(), Value::from(prompt));
                u.insert("completion_tokens".into(), Value::from(completion));
                u.insert(
                    "total_tokens".into(),
                    Value::from(prompt.saturating_add(completion)),
                );
            }
            Api::Anthropic => {
                if let Some(n) = get(u, "output_tokens") {
                    let n = n.saturating_add(self.produced);
                    u.insert("output_tokens".into(), Value::from(n));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
