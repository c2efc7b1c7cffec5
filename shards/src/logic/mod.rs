//! Pure logic: no I/O, no clock, no randomness of its own.
//!
//! Every function here takes the time (`now`) and any randomness as
//! arguments so it can be unit- and property-tested.
//!
//! Folders by concern, top down (imports only run down):
//! - [`routing`]: the request's decision machine and the order of its
//!   gates, policies and their evaluation, admission, the SRTT
//!   estimator, failures, the capacity queue, the model directory, agent
//!   history;
//! - [`sites`]: the sibling map, the redirect choice, "not served here",
//!   hold at zero;
//! - [`http`]: HTTP/1.1 framing, the JSON probe, error envelopes, request
//!   IDs, trace context, usage, endpoints;
//! - [`link`]: the agent link's codecs (control stream, preamble,
//!   multistream-select, yamux frames) and what agents report (engine
//!   metrics, hardware);
//! - [`tenancy`]: `auth.yaml` and key records, quotas, the dynamic key
//!   registry;
//! - [`system`]: the core plan, `/proc` parsers, log gating, time formats;
//! - [`trace`]: the spans exported over OTLP, their encoding, sampling.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::indexing_slicing))]

pub mod http;
pub mod link;
pub mod routing;
pub mod sites;
pub mod system;
pub mod tenancy;
pub mod trace;
