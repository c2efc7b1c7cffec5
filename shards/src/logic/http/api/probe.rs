//! Request body probe: in one pass over the JSON body, the top-level
//! `model` and `stream`, the declared output (`max_completion_tokens`,
//! else `max_tokens`) and what the token estimate needs (text bytes of
//! `messages` and `system`, raw `tools` length, message and image
//! counts), with borrowed serde fields and visitors that sum as they go;
//! nothing is built into a DOM, and the body bytes are forwarded
//! unchanged (spec 01 §3, 04 §9).

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use xxhash_rust::xxh64::Xxh64;

use super::prompt_hash::{raw_key_hash, seed_of, PrefixHasher, PrefixMarks};
use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::http::framing::inline_str::InlineStr;

/// Longest accepted model name (spec 01 §3).
pub const MAX_MODEL_BYTES: usize = 256;

/// A string borrowed from the body when it has no escapes. serde's own
/// `Cow<str>` borrows only as a bare field, not inside `Option`: the model
/// name was a `String`, one allocation per request.
struct BodyStr<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for BodyStr<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = BodyStr<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<BodyStr<'a>, E> {
                Ok(BodyStr(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<BodyStr<'a>, E> {
                Ok(BodyStr(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<BodyStr<'a>, E> {
                Ok(BodyStr(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V(std::marker::PhantomData))
    }
}

#[derive(Deserialize)]
struct Probe<'a> {
    #[serde(borrow, default)]
    model: Option<BodyStr<'a>>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<LenientStr<'a>>,
    #[serde(default)]
    metadata: Option<UserId>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    messages: Option<Messages>,
    #[serde(default)]
    system: Option<TextLen>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    max_completion_tokens: Option<i64>,
    /// Responses API: the input (its raw length counts) and instructions.
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(default)]
    instructions: Option<TextLen>,
    #[serde(default)]
    max_output_tokens: Option<i64>,
}

/// What routing needs from a body.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestMeta {
    /// Routing key (inline: the usual model names cost no allocation).
    pub model: InlineStr,
    /// The client asked for a stream (informational: the response's
    /// content type decides how it is relayed).
    pub stream: bool,
    /// UTF-8 bytes the estimate counts: message text, `system` text and
    /// the raw `tools` JSON.
    pub text_bytes: u64,
    /// Number of messages.
    pub messages: u64,
    /// Image parts (`image_url` or `image`).
    pub images: u64,
    /// `max_completion_tokens`, else `max_tokens` (negative: 0).
    pub declared_output: u64,
    /// What cache affinity reads: the prompt's prefix marks and the
    /// body's session key.
    pub affinity: AffinityProbe,
}

/// The cache-affinity part of a probe (issue 30).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AffinityProbe {
    /// Marks of the canonical prompt (system and tools in their seed; the
    /// model is mixed in where the index is asked).
    pub marks: PrefixMarks,
    /// Hash of `prompt_cache_key`, else of `metadata.user_id`.
    pub body_key: Option<u64>,
}

thread_local! {
    /// The prompt hashes of the body being probed: fed by the visitors of
    /// `messages` and `system` as serde walks them (a derived
    /// `Deserialize` cannot carry state), taken when the probe ends.
    /// One probe at a time per thread; no allocation.
    static HASH: std::cell::RefCell<ProbeHash> = std::cell::RefCell::new(ProbeHash::default());
}

#[derive(Default)]
struct ProbeHash {
    prefix: PrefixHasher,
    system: Option<Xxh64>,
    system_bytes: u32,
}

fn with_hash(f: impl FnOnce(&mut ProbeHash)) {
    HASH.with(|h| {
        if let Ok(mut h) = h.try_borrow_mut() {
            f(&mut h);
        }
    });
}

/// A string when the value is one, else nothing (the field is optional
/// and was never validated: a request must not fail on it now).
struct LenientStr<'a>(Option<Cow<'a, str>>);

impl<'de: 'a, 'a> Deserialize<'de> for LenientStr<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = LenientStr<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<LenientStr<'a>, E> {
                Ok(LenientStr(Some(Cow::Borrowed(v))))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<LenientStr<'a>, E> {
                Ok(LenientStr(Some(Cow::Owned(v.to_owned()))))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<LenientStr<'a>, E> {
                Ok(LenientStr(None))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<LenientStr<'a>, E> {
                Ok(LenientStr(None))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<LenientStr<'a>, E> {
                Ok(LenientStr(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<LenientStr<'a>, E> {
                Ok(LenientStr(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<LenientStr<'a>, E> {
                Ok(LenientStr(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<LenientStr<'a>, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(LenientStr(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<LenientStr<'a>, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(LenientStr(None))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// `metadata.user_id` (Anthropic) as a hash, when `metadata` is an
/// object with a string there; anything else is ignored.
struct UserId(Option<u64>);

impl<'de> Deserialize<'de> for UserId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = UserId;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<UserId, A::Error> {
                let mut out = None;
                while let Some(k) = map.next_key::<LenientStr<'de>>()? {
                    let v = map.next_value::<LenientStr<'de>>()?;
                    if k.0.as_deref() == Some("user_id") {
                        out = v.0.map(|s| raw_key_hash(s.as_bytes()));
                    }
                }
                Ok(UserId(out))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<UserId, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(UserId(None))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<UserId, E> {
                Ok(UserId(None))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<UserId, E> {
                Ok(UserId(None))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<UserId, E> {
                Ok(UserId(None))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<UserId, E> {
                Ok(UserId(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<UserId, E> {
                Ok(UserId(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<UserId, E> {
                Ok(UserId(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// Tokens per byte before anything is learned (spec 04 §9: 1/3.2).
pub const COLD_TOKENS_PER_BYTE: f64 = 1.0 / 3.2;

impl RequestMeta {
    /// Input-token estimate at `tokens_per_byte`: `ceil(text_bytes ×
    /// ratio)`, at least 4 per message.
    pub fn estimate(&self, tokens_per_byte: f64) -> u64 {
        let by_bytes = (self.text_bytes as f64 * tokens_per_byte).ceil();
        let by_bytes = if by_bytes.is_finite() && by_bytes > 0.0 {
            by_bytes as u64
        } else {
            0
        };
        by_bytes.max(self.messages.saturating_mul(4))
    }
}

/// Sums over `messages[]` without keeping them.
#[derive(Default)]
struct Messages {
    count: u64,
    text: u64,
    images: u64,
}

impl<'de> Deserialize<'de> for Messages {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Messages;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of messages")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Messages, A::Error> {
                let mut out = Messages::default();
                while let Some(m) = seq.next_element::<Message>()? {
                    out.count += 1;
                    if let Some(c) = m.content {
                        out.text += c.text;
                        out.images += c.images;
                    }
                    // The content's text was hashed as it was read; the
                    // rest of the message closes it.
                    with_hash(|h| {
                        if let Some(BodyStr(r)) = &m.role {
                            h.prefix.token(r.as_bytes());
                        }
                        if let Some(BodyStr(n)) = &m.name {
                            h.prefix.token(n.as_bytes());
                        }
                        for raw in [m.tool_calls, m.tool_call_id].into_iter().flatten() {
                            h.prefix.token(raw.get().as_bytes());
                        }
                        h.prefix.message_end();
                    });
                }
                Ok(out)
            }
        }
        d.deserialize_seq(V)
    }
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(default)]
    content: Option<Content>,
    // BodyStr, not Cow: serde's Cow allocates inside an Option.
    #[serde(borrow, default)]
    role: Option<BodyStr<'a>>,
    #[serde(borrow, default)]
    name: Option<BodyStr<'a>>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_call_id: Option<&'a RawValue>,
}

/// A message's content: a string, or an array of parts.
#[derive(Default)]
struct Content {
    text: u64,
    images: u64,
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Content;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("message content as a string or an array of parts")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Content, E> {
                with_hash(|h| h.prefix.text(v.as_bytes()));
                Ok(Content {
                    text: v.len() as u64,
                    images: 0,
                })
            }
            fn visit_unit<E: de::Error>(self) -> Result<Content, E> {
                Ok(Content::default())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Content, A::Error> {
                let mut out = Content::default();
                while let Some(p) = seq.next_element::<Part<'de>>()? {
                    with_hash(|h| {
                        if let Some(k) = &p.kind {
                            h.prefix.token(k.as_bytes());
                        }
                        if let Some(t) = &p.text {
                            h.prefix.text(t.as_bytes());
                        }
                        for raw in [p.image_url, p.source].into_iter().flatten() {
                            h.prefix.token(raw.get().as_bytes());
                        }
                    });
                    match p.kind.as_deref() {
                        Some("text") => out.text += p.text.map_or(0, |t| t.len() as u64),
                        Some("image_url" | "image") => out.images += 1,
                        _ => {}
                    }
                }
                Ok(out)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    /// OpenAI's image (hashed raw: another image is another prompt).
    #[serde(borrow, default)]
    image_url: Option<&'a RawValue>,
    /// Anthropic's image or document.
    #[serde(borrow, default)]
    source: Option<&'a RawValue>,
}

/// Text bytes of Anthropic's `system`: a string or `[{type, text}]`.
struct TextLen(u64);

impl<'de> Deserialize<'de> for TextLen {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TextLen;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an array of text blocks")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<TextLen, E> {
                system_text(v.as_bytes());
                Ok(TextLen(v.len() as u64))
            }
            fn visit_unit<E: de::Error>(self) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TextLen, A::Error> {
                let mut n = 0u64;
                while let Some(p) = seq.next_element::<Part<'de>>()? {
                    if let Some(t) = &p.text {
                        system_text(t.as_bytes());
                    }
                    n += p.text.map_or(0, |t| t.len() as u64);
                }
                Ok(TextLen(n))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TextLen, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(TextLen(0))
            }
        }
        d.deserialize_any(V)
    }
}

/// Hash Anthropic `system` text into the probe's seed.
fn system_text(t: &[u8]) {
    with_hash(|h| {
        h.system.get_or_insert_with(|| Xxh64::new(4)).update(t);
        h.system_bytes = h.system_bytes.saturating_add(t.len() as u32);
    });
}

/// Probe a JSON body. Errors carry the spec's messages.
pub fn probe(body: &[u8]) -> Result<RequestMeta, ApiError> {
    with_hash(|h| *h = ProbeHash::default());
    let parsed: Result<Probe<'_>, _> = serde_json::from_slice(body);
    let hashed = HASH.with(|h| h.try_borrow_mut().map(|mut h| std::mem::take(&mut *h)).ok());
    let p = parsed
        .map_err(|e| ApiError::new(ErrorCode::RequestInvalid, format!("Invalid request: {e}")))?;
    let model = match p.model {
        Some(BodyStr(m)) if !m.is_empty() => m,
        _ => {
            return Err(ApiError::new(
                ErrorCode::RequestInvalid,
                "model field is required",
            ))
        }
    };
    if model.len() > MAX_MODEL_BYTES {
        return Err(ApiError::new(
            ErrorCode::RequestInvalid,
            "model name exceeds maximum length of 256 characters",
        ));
    }
    let (messages, mut text, images) = p
        .messages
        .map_or((0, 0, 0), |m| (m.count, m.text, m.images));
    text += p.system.map_or(0, |s| s.0);
    text += p.tools.map_or(0, |t| t.get().len() as u64);
    text += p.input.map_or(0, |t| t.get().len() as u64);
    text += p.instructions.map_or(0, |s| s.0);
    let declared = p
        .max_completion_tokens
        .or(p.max_tokens)
        .or(p.max_output_tokens)
        .unwrap_or(0);
    let tools_raw = p.tools.map(|t| t.get().as_bytes()).unwrap_or(&[]);
    let marks = match hashed {
        Some(h) => {
            let system = h.system.as_ref().map_or(0, Xxh64::digest);
            let tools = if tools_raw.is_empty() {
                0
            } else {
                xxhash_rust::xxh64::xxh64(tools_raw, 5)
            };
            let seed_bytes = h.system_bytes.saturating_add(tools_raw.len() as u32);
            h.prefix
                .finish(seed_of(system, tools), seed_bytes, seed_bytes > 0)
        }
        None => PrefixMarks::default(),
    };
    let body_key = p
        .prompt_cache_key
        .and_then(|k| k.0)
        .filter(|k| !k.is_empty())
        .map(|k| raw_key_hash(k.as_bytes()))
        .or(p.metadata.and_then(|m| m.0));
    Ok(RequestMeta {
        model: InlineStr::from(&*model),
        stream: p.stream.unwrap_or(false),
        text_bytes: text,
        messages,
        images,
        declared_output: u64::try_from(declared).unwrap_or(0),
        affinity: AffinityProbe { marks, body_key },
    })
}

/// The body with its top-level `model` value replaced by `model` (the
/// last occurrence, as a JSON decoder reads it); every other byte is
/// kept. `None` when the body is not a JSON object with a `model` string.
pub fn replace_model(body: &[u8], model: &str) -> Option<Vec<u8>> {
    let span = model_span(body)?;
    let encoded = serde_json::to_string(model).ok()?;
    let mut out = Vec::with_capacity(body.len() + encoded.len());
    out.extend_from_slice(body.get(..span.0)?);
    out.extend_from_slice(encoded.as_bytes());
    out.extend_from_slice(body.get(span.1..)?);
    Some(out)
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// End (exclusive) of the string starting at `i` (a quote).
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        match b.get(j)? {
            b'\\' => j += 2,
            b'"' => return Some(j + 1),
            _ => j += 1,
        }
    }
}

/// End (exclusive) of the JSON value starting at `i`.
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match b.get(j)? {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while !matches!(
                b.get(j),
                None | Some(b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
            ) {
                j += 1;
            }
            Some(j)
        }
    }
}

/// Byte span of the last top-level `"model"` string value.
fn model_span(b: &[u8]) -> Option<(usize, usize)> {
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    let mut found = None;
    loop {
        i = skip_ws(b, i);
        match b.get(i)? {
            b'}' => return found,
            b',' => {
                i += 1;
                continue;
            }
            b'"' => {}
            _ => return None,
        }
        let key_end = string_end(b, i)?;
        let raw_key = b.get(i..key_end)?;
        let is_model = raw_key == b"\"model\""
            || (raw_key.contains(&b'\\')
                && serde_json::from_slice::<String>(raw_key).ok().as_deref() == Some("model"));
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(b, i + 1);
        let end = value_end(b, i)?;
        if is_model && b.get(i) == Some(&b'"') {
            found = Some((i, end));
        }
        i = end;
    }
}

#[cfg(test)]
mod tests;
