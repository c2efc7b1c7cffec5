//! HTTP/1.1 and the request's bytes, in two rooms: [`framing`] (HTTP/1.1
//! heads, bodies and chunked encoding, strict and fuzzed) and [`api`] (the
//! two API dialects' bodies: the probe, prompt hashes, usage, stream
//! continuation, the provider translation between OpenAI and Anthropic);
//! beside them [`errors`] (the spec's envelope), [`endpoint`],
//! [`request_id`] and [`trace_context`] (W3C).

pub mod api;
pub mod endpoint;
pub mod errors;
pub mod framing;
pub mod request_id;
pub mod trace_context;
