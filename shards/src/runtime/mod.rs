//! The I/O shell: pinned monoio runtimes, cross-core mesh, client HTTP
//! ingress, libp2p agent links, per-shard agent pools and metrics.
//!
//! Key types: [`shared::Shared`] (the few things every shard reads),
//! [`shard::Shard`] (what one core owns), [`mesh::ShardMsg`] (the only
//! cross-core messages), [`link`] (the agent link stack, used by both the
//! router and the agent).

pub mod admin;
pub mod clock;
pub mod conn;
pub mod executor;
pub mod handoff;
pub mod ingress;
pub mod io;
pub mod link;
pub mod mesh;
pub mod metrics;
pub mod proxy;
pub mod shard;
pub mod shared;
pub mod store_api;
