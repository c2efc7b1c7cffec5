//! What every shard reads: configuration, the model directory, the mesh
//! senders and the router's identity. Immutable after start except the
//! directory (single writer at a time, read-mostly).

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::channel::mpsc::UnboundedSender;
use libp2p_identity::Keypair;
use libp2p_pnet::PreSharedKey;

use super::mesh::ShardMsg;
use crate::logic::directory::Directory;

/// Router settings the shards need.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Client HTTP listen address.
    pub http_addr: SocketAddr,
    /// Prometheus listen address.
    pub metrics_addr: SocketAddr,
    /// libp2p listen address.
    pub p2p_addr: SocketAddr,
    /// Request body limit in bytes; 0 disables.
    pub max_request_bytes: u64,
    /// Time allowed to receive a request head.
    pub header_timeout: Duration,
    /// Time allowed to receive a whole request body.
    pub body_timeout: Duration,
    /// Time allowed from forward to the agent's response head.
    pub request_timeout: Duration,
    /// Heartbeat period agents are told to use.
    pub heartbeat_interval: Duration,
    /// Time allowed for the preamble.
    pub preamble_timeout: Duration,
    /// Time allowed for the pnet + noise handshake and registration.
    pub handshake_timeout: Duration,
    /// Period of the history flush to the store.
    pub flush_interval: Duration,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            http_addr: SocketAddr::from(([0, 0, 0, 0], 8080)),
            metrics_addr: SocketAddr::from(([0, 0, 0, 0], 2112)),
            p2p_addr: SocketAddr::from(([127, 0, 0, 1], 9000)),
            max_request_bytes: 10 * 1024 * 1024,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(60),
            heartbeat_interval: Duration::from_secs(5),
            preamble_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(10),
            flush_interval: Duration::from_secs(30),
        }
    }
}

/// State shared by all shards.
pub struct Shared {
    /// Settings.
    pub cfg: RouterConfig,
    /// Model -> owning shard.
    pub directory: RwLock<Directory>,
    /// One sender per shard, indexed by shard id.
    pub mesh: Vec<UnboundedSender<ShardMsg>>,
    /// The router's libp2p identity.
    pub keypair: Keypair,
    /// Fleet secret for the private network; `None`: noise only.
    pub psk: Option<PreSharedKey>,
    /// The store thread (None: no persistence).
    pub store: Option<super::store_api::StoreTx>,
    /// Failed store operations.
    pub storage_errors: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// SHA-256 of each admin key; empty with `insecure_admin`.
    pub admin_keys: Vec<[u8; 32]>,
    /// Admin routes open without a key (explicit opt-in).
    pub insecure_admin: bool,
}

impl Shared {
    /// Owner of a model, if known.
    pub fn owner(&self, model: &str) -> Option<usize> {
        self.directory.read().ok().and_then(|d| d.owner(model))
    }

    /// The owner for a registering agent's model: known owner, or the
    /// shard a new model would get.
    pub fn owner_or_tentative(&self, model: &str) -> usize {
        match self.directory.write() {
            Ok(mut d) => d.reserve(model),
            Err(_) => 0,
        }
    }

    /// Record `preferred` as the owner of `model` unless it already has one;
    /// returns the owner.
    pub fn assign(&self, model: &str, preferred: usize) -> usize {
        match self.directory.write() {
            Ok(mut d) => d.assign(model, preferred),
            Err(_) => preferred,
        }
    }
}

/// Shorthand.
pub type SharedRef = Arc<Shared>;
