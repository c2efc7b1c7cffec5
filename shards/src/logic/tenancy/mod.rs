//! Who sends a request and what it may spend: [`auth`] (`auth.yaml`, key
//! records, allow-sets), [`quota`] (GCRA request buckets and daily token
//! counters, one word each), [`registry`] (dynamic keys).

pub mod auth;
pub mod quota;
pub mod registry;
