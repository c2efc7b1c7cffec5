//! The two API dialects (OpenAI, Anthropic), their bodies read and
//! written without I/O: [`probe`] (model, stream and token sums from the
//! JSON body without a DOM), [`prompt_hash`] (the prompt's prefix hashes),
//! [`usage`] (token counts from responses and SSE), [`continuation`] (a
//! broken stream's transcript and continuation body), [`provider`] (the
//! fallback provider's request and answer, translated between dialects).

pub mod continuation;
pub mod conversations;
pub mod probe;
pub mod prompt_hash;
pub mod provider;
pub mod responses;
pub mod usage;
