//! Who sends a request and what it may spend: [`auth`] (`auth.yaml`, key
//! records, allow-sets), [`quota`] (GCRA request buckets and daily token
//! counters, one word each), [`lease`] (their share drawn from a quota
//! several routers hold), [`registry`] (dynamic keys).

pub mod auth;
pub mod lease;
pub mod quota;
pub mod registry;
