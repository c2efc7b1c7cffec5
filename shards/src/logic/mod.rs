//! Pure logic: no I/O, no clock, no randomness of its own.
//!
//! Every function here takes the time (`now`) and any randomness as
//! arguments so it can be unit- and property-tested.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::indexing_slicing))]

pub mod admission;
pub mod auth;
pub mod control;
pub mod core_plan;
pub mod decision;
pub mod directory;
pub mod endpoint;
pub mod engine_metrics;
pub mod errors;
pub mod failure;
pub mod hardware;
pub mod history;
pub mod hold;
pub mod http_parse;
pub mod http_write;
pub mod inline_str;
pub mod log_gate;
pub mod multistream;
pub mod mux_frame;
pub mod policy;
pub mod policy_set;
pub mod preamble;
pub mod probe;
pub mod procfs;
pub mod quota;
pub mod registry;
pub mod request_id;
pub mod sites;
pub mod srtt;
pub mod timefmt;
pub mod trace_context;
pub mod usage;
pub mod wait_queue;
