//! The I/O shell: pinned monoio runtimes, cross-core mesh, client HTTP
//! ingress, libp2p agent links, per-model state and metrics.
//!
//! Folders by concern, top down (imports only run down):
//! - [`front`]: what a shard listens to: its event loop, client HTTP
//!   ingress (authentication, aliases, allowlist, where a request is
//!   served), hold at zero, the agents' control protocol;
//! - [`admin`] (`/admin/*`, policies, keys, the sibling map) and
//!   [`metrics`] (`/metrics`: Prometheus families from shard snapshots);
//! - [`request`]: one inference request on its model's shard: the driver
//!   of the pure decision machine, the admission gate, one exchange with
//!   an agent, every response the router writes, the one ending;
//! - [`state`]: what a shard owns and reads: the shard, per-model state,
//!   the router-wide config and snapshots, tenancy, holds, the request
//!   scope, the messages between shards;
//! - [`services`]: the threads beside the shards (store messages, audit,
//!   Redis shared state, quota leases, affinity notes, providers);
//! - [`wire`]: bytes and time: the buffered connection, the libp2p stack
//!   (link, own yamux, socket), hand-off, buffers, budgets, executor,
//!   clock.

pub mod admin;
pub mod front;
pub mod metrics;
pub mod request;
pub mod services;
pub mod state;
pub mod wire;
