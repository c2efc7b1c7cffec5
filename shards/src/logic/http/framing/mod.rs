//! HTTP/1.1 framing, strict and fuzzed: [`http_parse`] (request and
//! response heads, body framing), [`http_write`] (heads and chunks the
//! router writes), [`chunked`] (the decoder), [`inline_str`] (short
//! header values without an allocation).

pub mod chunked;
pub mod http_parse;
pub mod http_write;
pub mod inline_str;
