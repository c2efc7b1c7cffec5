//! The I/O shell: pinned monoio runtimes, cross-core mesh, client HTTP
//! ingress, libp2p agent links, per-model state and metrics.
//!
//! Layers, top down (imports only run down):
//! - [`event_loop`]: a shard's listeners, flush timer and mesh messages;
//! - [`ingress`] (client HTTP: authentication, aliases, allowlist, the
//!   cross-site redirect),
//!   [`admin`] + [`admin_policy`] + [`admin_keys`] + [`admin_sites`] +
//!   [`models_api`],
//!   [`metrics`] + [`metrics_tenants`] (over [`exposition`]),
//!   [`agent_link`] (the agents' control protocol);
//! - [`dispatch`]: the driver of the pure decision machine
//!   ([`crate::logic::decision`]); [`admission`]: the admission gate on the
//!   owner shard; [`exchange`]: one exchange with an agent;
//! - [`respond`]: every response the router writes itself;
//! - [`shard`]: what one core owns; [`model`]: per-model state (agents,
//!   slots, queue, statistics, admission state);
//! - [`router`]: what every shard reads (config, versioned [`snapshot`]s
//!   of the directory and policies, mesh senders, identity, the memory
//!   [`budget`]); [`tenancy`] (the key snapshot and the shared quota
//!   buckets) and [`audit`] (the audit writer thread);
//! - [`mesh`], [`pending`], [`views`]: the messages between shards;
//! - [`conn`] (one buffered read-and-parse loop over TCP and yamux),
//!   [`link`] + [`mux`] + [`io`] (the libp2p stack), [`executor`], [`clock`],
//!   [`handoff`], [`store_api`].

pub mod admin;
pub mod admin_keys;
pub mod admin_policy;
pub mod admin_sites;
pub mod admission;
pub mod agent_link;
pub mod audit;
pub mod budget;
pub mod bufpool;
pub mod clock;
pub mod conn;
pub mod dispatch;
pub mod ending;
pub mod event_loop;
pub mod exchange;
pub mod executor;
pub mod exposition;
pub mod handoff;
pub mod hold;
pub mod hold_book;
pub mod http_stream;
pub mod ingress;
pub mod io;
pub mod link;
pub mod link_socket;
pub mod mesh;
pub mod metrics;
pub mod metrics_tenants;
pub mod model;
pub mod models_api;
pub mod mux;
pub mod pending;
pub mod process_metrics;
pub mod respond;
pub mod router;
pub mod scope;
pub mod shard;
pub mod snapshot;
pub mod store_api;
pub mod tenancy;
pub mod views;
