//! HTTP/1.1 and the request's bytes: [`http_parse`] and [`http_write`]
//! (strict framing, fuzzed), [`probe`] (model, stream and token sums from
//! the JSON body without a DOM), [`errors`] (the spec's envelope),
//! [`request_id`], [`trace_context`] (W3C), [`usage`] (token counts from
//! responses and SSE), [`endpoint`], [`inline_str`].

pub mod chunked;
pub mod continuation;
pub mod endpoint;
pub mod errors;
pub mod http_parse;
pub mod http_write;
pub mod inline_str;
pub mod probe;
pub mod prompt_hash;
pub mod provider;
pub mod request_id;
pub mod trace_context;
pub mod usage;
