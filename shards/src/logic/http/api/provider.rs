//! Provider fallback, the pure part (spec 04 §7): the policy's
//! `fallback_provider`, provider base URLs, the request a provider gets
//! (the client's own API passed through with the model replaced, or
//! translated between the OpenAI and Anthropic shapes), the answer the
//! client gets (stamped `processed_by`, translated back), and the
//! event-by-event translation of streams. No I/O: the shell is
//! `runtime::request::provider`.
//!
//! Key types: [`Engine`], [`FallbackProvider`], [`BaseUrl`],
//! [`StreamTranslator`].

use crate::logic::system::config_error::ConfigError;
use serde::Serialize;
use serde_json::{json, Map, Value};

/// A body that could not be translated between the two API shapes: the
/// client's request (its side) or the provider's answer (the provider's
/// side, a 502), with the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeError(pub String);

impl std::fmt::Display for ShapeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ShapeError {}

impl From<String> for ShapeError {
    fn from(m: String) -> Self {
        ShapeError(m)
    }
}

impl From<&str> for ShapeError {
    fn from(m: &str) -> Self {
        ShapeError(m.to_string())
    }
}

/// A provider's API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// `POST /v1/chat/completions`, `Authorization: Bearer`.
    #[serde(rename = "openai")]
    OpenAi,
    /// `POST /v1/messages`, `x-api-key`, `anthropic-version`.
    Anthropic,
}

impl Engine {
    /// Parse a policy's `engine`.
    pub fn parse(s: &str) -> Option<Engine> {
        match s {
            "openai" => Some(Engine::OpenAi),
            "anthropic" => Some(Engine::Anthropic),
            _ => None,
        }
    }

    /// Its name in labels and messages.
    pub fn name(self) -> &'static str {
        match self {
            Engine::OpenAi => "openai",
            Engine::Anthropic => "anthropic",
        }
    }

    /// The environment variable of its key.
    pub fn key_env(self) -> &'static str {
        match self {
            Engine::OpenAi => "HIVENET_ROUTER_OPENAI_API_KEY",
            Engine::Anthropic => "HIVENET_ROUTER_ANTHROPIC_API_KEY",
        }
    }

    /// The environment variable of its base URL override.
    pub fn base_env(self) -> &'static str {
        match self {
            Engine::OpenAi => "HIVENET_ROUTER_OPENAI_BASE_URL",
            Engine::Anthropic => "HIVENET_ROUTER_ANTHROPIC_BASE_URL",
        }
    }

    /// Its public base URL.
    pub fn default_base(self) -> &'static str {
        match self {
            Engine::OpenAi => "https://api.openai.com",
            Engine::Anthropic => "https://api.anthropic.com",
        }
    }

    fn api(self) -> Api {
        match self {
            Engine::OpenAi => Api::Chat,
            Engine::Anthropic => Api::Messages,
        }
    }
}

/// A policy's `fallback_provider`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FallbackProvider {
    /// Which API.
    pub engine: Engine,
    /// The provider's model name.
    pub model: String,
}

/// The client API of a request that may fall back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/messages`.
    Messages,
}

/// An `http://` or `https://` base URL, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl {
    /// `https`.
    pub tls: bool,
    /// Host name or address (brackets stripped).
    pub host: String,
    /// Port (443 or 80 when absent).
    pub port: u16,
    /// Path prefix without a trailing `/` (`""` for none).
    pub prefix: String,
}

impl BaseUrl {
    /// Parse `s`: an absolute http(s) URL of visible ASCII, no query,
    /// fragment or user info.
    pub fn parse(s: &str) -> Result<BaseUrl, ConfigError> {
        if !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError::from(format!(
                "base URL {s:?}: only visible ASCII characters are allowed"
            )));
        }
        let (tls, rest) = if let Some(r) = s.strip_prefix("https://") {
            (true, r)
        } else if let Some(r) = s.strip_prefix("http://") {
            (false, r)
        } else {
            return Err(ConfigError::from(format!(
                "base URL {s:?}: must start with http:// or https://"
            )));
        };
        if rest.contains(['?', '#', '@']) {
            return Err(ConfigError::from(format!(
                "base URL {s:?}: no query, fragment or user info allowed"
            )));
        }
        let (authority, path) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || authority.starts_with('[') => {
                match p.parse::<u16>() {
                    Ok(p) if p > 0 => (h, p),
                    _ => return Err(ConfigError::from(format!("base URL {s:?}: bad port {p:?}"))),
                }
            }
            _ => (authority, if tls { 443 } else { 80 }),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(ConfigError::from(format!("base URL {s:?}: no host")));
        }
        Ok(BaseUrl {
            tls,
            host: host.to_string(),
            port,
            prefix: path.trim_end_matches('/').to_string(),
        })
    }

    /// The `Host` header's value.
    pub fn host_header(&self) -> String {
        let h = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        match (self.tls, self.port) {
            (true, 443) | (false, 80) => h,
            _ => format!("{h}:{}", self.port),
        }
    }
}

/// What a provider is sent.
#[derive(Debug, Clone, PartialEq)]
pub struct ProviderRequest {
    /// The whole HTTP/1.1 request (head and body).
    pub bytes: Vec<u8>,
    /// The client asked for a stream.
    pub stream: bool,
    /// The answer must be translated back (the provider speaks the other
    /// API than the client).
    pub translated: bool,
}

/// The provider request for a client request of `api` with JSON `body`.
pub fn build_request(
    engine: Engine,
    model: &str,
    base: &BaseUrl,
    key: &str,
    api: Api,
    body: &[u8],
) -> Result<ProviderRequest, ShapeError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("request is not JSON: {e}"))?;
    let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let translated = engine.api() != api;
    let out = match (engine, api) {
        (Engine::OpenAi, Api::Chat) => with_model(v, model, true),
        (Engine::Anthropic, Api::Messages) => with_model(v, model, false),
        (Engine::Anthropic, Api::Chat) => chat_to_messages(&v, model)?,
        (Engine::OpenAi, Api::Messages) => messages_to_chat(&v, model)?,
    };
    let payload = serde_json::to_vec(&out).map_err(|e| e.to_string())?;
    let (path, auth) = match engine {
        Engine::OpenAi => (
            "/v1/chat/completions",
            format!("Authorization: Bearer {key}\r\n"),
        ),
        Engine::Anthropic => (
            "/v1/messages",
            format!("x-api-key: {key}\r\nanthropic-version: 2023-06-01\r\n"),
        ),
    };
    let mut bytes = format!(
        "POST {}{path} HTTP/1.1\r\nHost: {}\r\n{auth}Content-Type: application/json\r\nAccept: {}\r\nContent-Length: {}\r\nConnection: close\r\nUser-Agent: hivenet-router\r\n\r\n",
        base.prefix,
        base.host_header(),
        if stream { "text/event-stream" } else { "application/json" },
        payload.len()
    )
    .into_bytes();
    bytes.extend_from_slice(&payload);
    Ok(ProviderRequest {
        bytes,
        stream,
        translated,
    })
}

/// The client's own request with the provider's model; an OpenAI stream
/// asks for its usage (the quotas need it).
fn with_model(mut v: Value, model: &str, openai: bool) -> Value {
    if let Some(o) = v.as_object_mut() {
        o.insert("model".into(), Value::String(model.into()));
        if openai && o.get("stream").and_then(Value::as_bool) == Some(true) {
            let so = o.entry("stream_options").or_insert_with(|| json!({}));
            if let Some(so) = so.as_object_mut() {
                so.insert("include_usage".into(), Value::Bool(true));
            }
        }
    }
    v
}

/// The text of a message's `content`: a string, or the `text` of its
/// parts joined.
fn text_of(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

fn copy(from: &Value, to: &mut Map<String, Value>, fields: &[&str]) {
    for f in fields {
        if let Some(x) = from.get(*f) {
            to.insert((*f).to_string(), x.clone());
        }
    }
}

/// An OpenAI chat request as an Anthropic messages request (spec 04 §7):
/// system texts joined by `\n`, text content only, `max_tokens` the
/// request's or 4096.
fn chat_to_messages(v: &Value, model: &str) -> Result<Value, ShapeError> {
    let msgs = v
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("request has no messages")?;
    let mut system = Vec::new();
    let mut out = Vec::new();
    for m in msgs {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        let text = text_of(m.get("content"));
        match role {
            "system" | "developer" => system.push(text),
            "assistant" => out.push(json!({"role": "assistant", "content": text})),
            _ => out.push(json!({"role": "user", "content": text})),
        }
    }
    if out.is_empty() {
        return Err("the request has no non-system message".into());
    }
    let max_tokens = v
        .get("max_tokens")
        .or_else(|| v.get("max_completion_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(4096);
    let mut o = Map::new();
    o.insert("model".into(), json!(model));
    o.insert("max_tokens".into(), json!(max_tokens));
    if !system.is_empty() {
        o.insert("system".into(), json!(system.join("\n")));
    }
    o.insert("messages".into(), Value::Array(out));
    copy(v, &mut o, &["temperature", "top_p", "stream"]);
    if let Some(stop) = v.get("stop") {
        let list = match stop {
            Value::String(s) => json!([s]),
            other => other.clone(),
        };
        o.insert("stop_sequences".into(), list);
    }
    Ok(Value::Object(o))
}

/// An Anthropic messages request as an OpenAI chat request.
fn messages_to_chat(v: &Value, model: &str) -> Result<Value, ShapeError> {
    let msgs = v
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("request has no messages")?;
    let mut out = Vec::new();
    let system = text_of(v.get("system"));
    if !system.is_empty() {
        out.push(json!({"role": "system", "content": system}));
    }
    for m in msgs {
        let role = match m.get("role").and_then(Value::as_str) {
            Some("assistant") => "assistant",
            _ => "user",
        };
        out.push(json!({"role": role, "content": text_of(m.get("content"))}));
    }
    let mut o = Map::new();
    o.insert("model".into(), json!(model));
    o.insert("messages".into(), Value::Array(out));
    copy(v, &mut o, &["max_tokens", "temperature", "top_p", "stream"]);
    if let Some(stop) = v.get("stop_sequences") {
        o.insert("stop".into(), stop.clone());
    }
    if v.get("stream").and_then(Value::as_bool) == Some(true) {
        o.insert("stream_options".into(), json!({"include_usage": true}));
    }
    Ok(Value::Object(o))
}

/// The `processed_by` stamp of an engine.
pub fn processed_by(engine: Engine) -> String {
    format!("provider:{}", engine.name())
}

/// The client's body from a provider's whole (non-streamed) 2xx answer:
/// translated to the client's API when needed, stamped `processed_by`
/// (spec 04 §7; never the empty 200 of 08 A1).
pub fn response_body(engine: Engine, api: Api, body: &[u8]) -> Result<Vec<u8>, ShapeError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("answer is not JSON: {e}"))?;
    let mut out = match (engine, api) {
        (Engine::OpenAi, Api::Chat) | (Engine::Anthropic, Api::Messages) => v,
        (Engine::Anthropic, Api::Chat) => message_to_completion(&v)?,
        (Engine::OpenAi, Api::Messages) => completion_to_message(&v)?,
    };
    match (api, &out) {
        (Api::Chat, v)
            if v.get("choices")
                .and_then(Value::as_array)
                .is_none_or(Vec::is_empty) =>
        {
            return Err("answer has no choices".into())
        }
        (Api::Messages, v) if v.get("content").and_then(Value::as_array).is_none() => {
            return Err("answer has no content".into())
        }
        _ => {}
    }
    if let Some(o) = out.as_object_mut() {
        o.insert("processed_by".into(), json!(processed_by(engine)));
    }
    serde_json::to_vec(&out).map_err(|e| ShapeError(e.to_string()))
}

pub(crate) fn finish_of_stop(stop: Option<&str>) -> &'static str {
    match stop {
        Some("max_tokens") => "length",
        Some("tool_use") => "tool_calls",
        _ => "stop",
    }
}

pub(crate) fn stop_of_finish(finish: Option<&str>) -> &'static str {
    match finish {
        Some("length") => "max_tokens",
        Some("tool_calls") => "tool_use",
        _ => "end_turn",
    }
}

/// An Anthropic message as an OpenAI chat completion (first text block).
fn message_to_completion(v: &Value) -> Result<Value, ShapeError> {
    let text = v
        .get("content")
        .and_then(Value::as_array)
        .and_then(|blocks| {
            blocks
                .iter()
                .find(|b| b.get("type").and_then(Value::as_str) == Some("text"))
        })
        .and_then(|b| b.get("text").and_then(Value::as_str))
        .ok_or("answer has no text block")?;
    let input = v
        .pointer("/usage/input_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let output = v
        .pointer("/usage/output_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    Ok(json!({
        "id": v.get("id").cloned().unwrap_or(json!("")),
        "object": "chat.completion",
        "created": 0,
        "model": v.get("model").cloned().unwrap_or(json!("")),
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_of_stop(v.get("stop_reason").and_then(Value::as_str)),
        }],
        "usage": {"prompt_tokens": input, "completion_tokens": output, "total_tokens": input + output},
    }))
}

/// An OpenAI chat completion as an Anthropic message.
fn completion_to_message(v: &Value) -> Result<Value, ShapeError> {
    let choice = v
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
        .ok_or("answer has no choices")?;
    let text = choice
        .pointer("/message/content")
        .and_then(Value::as_str)
        .unwrap_or("");
    let input = v
        .pointer("/usage/prompt_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let output = v
        .pointer("/usage/completion_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    Ok(json!({
        "id": v.get("id").cloned().unwrap_or(json!("")),
        "type": "message",
        "role": "assistant",
        "model": v.get("model").cloned().unwrap_or(json!("")),
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_of_finish(choice.get("finish_reason").and_then(Value::as_str)),
        "stop_sequence": null,
        "usage": {"input_tokens": input, "output_tokens": output},
    }))
}

mod stream;
pub use stream::{StreamTranslator, MAX_EVENT};

#[cfg(test)]
mod tests;
