//! What a shard owns and reads: [`shard`] (one core's state), [`model`]
//! (per-model agents, slots, queue, statistics, admission state),
//! [`router`] (what every shard reads: config, versioned [`snapshot`]s,
//! mesh senders, identity), [`tenancy`] (keys and quota buckets),
//! [`hold_book`] (pending demand), [`scope`] (one client request's
//! context), [`pending`] and [`mesh`] (the messages between shards),
//! [`views`] (snapshots for admin and metrics), [`audit`] (the audit
//! writer thread), [`store_api`] (the store thread's messages),
//! [`shared_state`], [`shared_quota`] and [`shared_affinity`]
//! (`--shared-state`: Redis).

pub mod audit;
pub mod hold_book;
pub mod mesh;
pub mod model;
pub mod pending;
pub mod providers;
pub mod router;
pub mod scope;
pub mod shard;
pub mod shared_affinity;
pub mod shared_quota;
pub mod shared_state;
pub mod snapshot;
pub mod store_api;
pub mod tenancy;
pub mod views;
