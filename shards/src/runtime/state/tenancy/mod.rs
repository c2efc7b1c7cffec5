//! Client keys and quotas at run time: the lookup snapshot every shard
//! reads ([`keys`]: [`AuthState`], SHA-256 of the token -> [`Credential`])
//! and the admission of one request against the quota buckets
//! ([`quota`]: [`admit`] -> [`Ticket`], settled once when the request
//! ends). The buckets themselves are shared with the shared-state thread
//! ([`crate::runtime::services::buckets`]).
//!
//! Buckets are carried over when the snapshot is rebuilt (SIGHUP, a
//! registry change), so a reload forgets neither today's token usage nor
//! a minute's requests; they are also restored from the store at start.

pub mod keys;
pub mod quota;

pub use self::keys::*;
pub use self::quota::*;
pub use crate::runtime::services::buckets::{Bucket, BucketKey, Lease, QuotaLink};

#[cfg(test)]
mod tests;
