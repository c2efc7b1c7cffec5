//! The threads beside the shards, and what the shards send them: the
//! store thread's messages ([`store_api`]), the audit writer ([`audit`]),
//! the shared-state thread (`--shared-state`: Redis) with its quota leases
//! and affinity notes ([`shared_state`], [`shared_quota`],
//! [`shared_affinity`]), and the fallback providers' accounts
//! ([`providers`]). A shard never waits on one of them: it sends without
//! blocking and reads what they publish.

pub mod audit;
pub mod buckets;
pub mod otlp;
pub mod providers;
pub mod shared_affinity;
pub mod shared_quota;
pub mod shared_state;
pub mod store_api;
