//! Who sends a request and what it may spend: [`auth`] (`auth.yaml`, key
//! records, allow-sets), [`quota`] (GCRA request buckets and daily token
//! counters, one word each), [`lease`] (their share drawn from a quota
//! several routers hold), [`registry`] (dynamic keys), [`class`] (the
//! priority class a key grants and a request may lower).

pub mod auth;
pub mod class;
pub mod lease;
pub mod quota;
pub mod registry;
