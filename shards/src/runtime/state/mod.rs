//! What a shard owns and reads: [`shard`] (one core's state), [`model`]
//! (per-model agents, slots, queue, statistics, admission state),
//! [`router`] (what every shard reads: config, versioned [`snapshot`]s,
//! mesh senders, identity), [`tenancy`] (keys and quota buckets),
//! [`hold_book`] (pending demand), [`scope`] (one client request's
//! context), [`pending`] and [`mesh`] (the messages between shards),
//! [`views`] (snapshots for admin and metrics). The threads beside the
//! shards are in [`crate::runtime::services`].

pub mod carry_out;
pub mod hold_book;
pub mod mesh;
pub mod model;
pub mod peer_log;
pub mod pending;
pub mod readiness;
pub mod router;
pub mod scope;
pub mod shard;
pub mod snapshot;
pub mod tenancy;
pub mod views;
