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
    /// Delete every record and persist.
    ResetAll {
        /// Outcome.
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// Persist and stop.
    Shutdown {
        /// Signalled when stopped.
        done: oneshot::Sender<()>,
    },
}

/// Sender side held by every shard.
pub type StoreTx = std::sync::mpsc::Sender<StoreMsg>;
