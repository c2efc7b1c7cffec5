//! Messages to the store thread. Shards never touch the database: they
//! send batches and lookups over a channel and never wait on the request
//! path (lookups happen at registration, flushes are fire-and-forget).

use futures::channel::oneshot;

use crate::logic::routing::history::History;

/// A request to the store thread.
pub enum StoreMsg {
    /// Write these records (each stamped with the write time) and persist.
    Flush {
        /// Peer ID and record.
        records: Vec<(String, History)>,
        /// Signalled after the persist (None: fire and forget).
        done: Option<oneshot::Sender<()>>,
    },
    /// Write today's daily token usage per bucket (tenant, model) and persist.
    QuotaFlush {
        /// Bucket name and packed (day, used) state.
        states: Vec<((String, String), u64)>,
        /// Signalled after the persist.
        done: Option<oneshot::Sender<()>>,
    },
    /// Read one record (None when absent or expired).
    Lookup {
        /// Peer ID.
        peer_id: String,
        /// Where to answer.
        reply: oneshot::Sender<Option<History>>,
    },
    /// What the store holds (`GET /admin/storage`).
    Stats {
        /// Where to answer.
        reply: oneshot::Sender<StoreStats>,
    },
    /// Delete every record and persist.
    ResetAll {
        /// Outcome.
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// Keep a Responses API record of `tenant` (issue 52), under the
    /// conversation bounds (oldest evicted first).
    ResponsePut {
        /// The tenant that created it.
        tenant: String,
        /// The router's response ID.
        id: String,
        /// Unix seconds (the expiry and eviction order).
        created_at: u64,
        /// The record, serialized.
        record: Vec<u8>,
    },
    /// One record of `tenant` (`None`: absent, expired, or another
    /// tenant's).
    ResponseGet {
        /// The tenant asking.
        tenant: String,
        /// The response ID.
        id: String,
        /// Where to answer.
        reply: oneshot::Sender<Option<Vec<u8>>>,
    },
    /// The chain of `tenant` ending at `id`, oldest first, walked in the
    /// store thread (one round trip for any length).
    ResponseChain {
        /// The tenant asking.
        tenant: String,
        /// The newest response of the chain.
        id: String,
        /// Where to answer: the records, or which ID was missing / why
        /// the chain is refused.
        reply: oneshot::Sender<Result<Vec<Vec<u8>>, ChainError>>,
    },
    /// Delete one record of `tenant`; answers whether it was there.
    ResponseDelete {
        /// The tenant asking.
        tenant: String,
        /// The response ID.
        id: String,
        /// Where to answer.
        reply: oneshot::Sender<bool>,
    },
    /// Records kept and their bytes, per tenant (the metrics).
    ResponseTenants {
        /// Where to answer: (tenant, records, bytes).
        reply: oneshot::Sender<Vec<(String, u64, u64)>>,
    },
    /// Give the store to the process replacing this one (issue 54):
    /// flush, persist and close it; every later message goes to
    /// `forward` until `Resume`.
    Release {
        /// Where later messages go.
        forward: Box<dyn FnMut(StoreMsg) + Send>,
        /// Signalled once the store is closed.
        done: oneshot::Sender<()>,
    },
    /// Open the store again (the process that was to replace this one
    /// failed before it took over).
    Resume {
        /// Whether it opened.
        done: oneshot::Sender<Result<(), String>>,
    },
    /// Persist and stop.
    Shutdown {
        /// Signalled when stopped.
        done: oneshot::Sender<()>,
    },
}

/// Why a `previous_response_id` chain cannot be rebuilt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChainError {
    /// This ID is unknown to the tenant (absent, expired, evicted, or
    /// another tenant's: the same answer).
    NotFound(String),
    /// Longer than the bound, or a cycle.
    TooLong(usize),
}

/// The store's figures for `GET /admin/storage` (spec 02 §6).
#[derive(Debug, Clone, Default)]
pub struct StoreStats {
    /// Latency-history records on disk (one per peer ID).
    pub history_count: u64,
    /// Daily token-usage buckets on disk.
    pub quota_count: u64,
    /// Responses API records kept (issue 52).
    pub responses_count: u64,
    /// Their bytes (keys and values), what the bounds count.
    pub responses_bytes: u64,
    /// Bytes of the LSM tables (every keyspace).
    pub lsm_size_bytes: u64,
    /// Bytes of the write-ahead journal (what Badger's value log was).
    pub journal_size_bytes: u64,
    /// `--disk-db-ttl` days.
    pub ttl_days: u64,
    /// Period of the expiry sweep, seconds.
    pub sweep_every_secs: u64,
    /// Unix seconds of the last expiry sweep (`None`: never).
    pub last_sweep_unix: Option<u64>,
    /// The store is open (not running on memory after a failure).
    pub open: bool,
}

/// Sender side held by every shard.
pub type StoreTx = std::sync::mpsc::Sender<StoreMsg>;
