//! Cross-core messages. One unbounded channel per shard; a connection
//! crosses cores at most once per model change, never per chunk.

use futures::channel::oneshot;

use super::pending::HandOff;
use super::views::ShardSnapshot;

/// The messages shards exchange.
pub enum ShardMsg {
    /// Adopt a client connection and serve its pending request first.
    AdoptHttp(Box<HandOff>),
    /// Adopt an agent link after its preamble.
    AdoptLink {
        /// The socket.
        stream: std::net::TcpStream,
        /// Bytes read past the preamble.
        prefix: Vec<u8>,
        /// The model the preamble named (reserved in the directory).
        model: String,
        /// Its place under the link caps.
        permit: crate::runtime::wire::link::budget::LinkPermit,
    },
    /// Drain (or undrain) an agent by peer ID if it is on this shard; the
    /// reply is its requests in flight, `None` when it is not here.
    DrainAgent {
        /// Its peer ID.
        peer_id: String,
        /// Drain (true) or undrain.
        on: bool,
        /// The answer.
        reply: oneshot::Sender<Option<u32>>,
    },
    /// Clear every agent's lifetime metrics (admin reset).
    ResetMetrics {
        /// Signalled when done.
        reply: oneshot::Sender<()>,
    },
    /// Flush history before the process exits.
    Shutdown {
        /// Signalled when the flush was handed to the store.
        reply: oneshot::Sender<()>,
    },
    /// An agent of this model registered: release the requests held here.
    Woken(String),
    /// The sibling map changed: requests held for a model no longer
    /// placed here fail as before.
    MapChanged,
    /// The router is shutting down: answer every held request now.
    ReleaseHolds,
    /// Forwards other routers made (`--shared-state-affinity`): record
    /// their holders in this shard's affinity index.
    Affinity {
        /// The model (owned here).
        model: String,
        /// The notes.
        notes: Vec<crate::logic::routing::affinity::AffinityNote>,
    },
    /// Start (`on`) or stop accepting on this shard's listeners of a kind
    /// (an upgrade, issue 54); the reply once done.
    Accept {
        /// Which listeners.
        kind: crate::logic::system::upgrade::ListenerKind,
        /// Start or stop.
        on: bool,
        /// Signalled when done.
        reply: oneshot::Sender<()>,
    },
    /// The process replacing this one takes every held request over.
    HandOverHolds,
    /// This shard's cache-affinity index as notes per model, for the
    /// process replacing this one.
    AffinityDump {
        /// Where to answer.
        reply: oneshot::Sender<Vec<(String, crate::logic::routing::affinity::AffinityNote)>>,
    },
    /// Serve a connection the process this one replaced sent.
    AdoptCarried(Box<super::carry_out::Outgoing>),
    /// Tell every agent linked here to link to the process replacing
    /// this one; the reply is their peer IDs.
    Relink {
        /// Where to answer.
        reply: oneshot::Sender<Vec<String>>,
    },
    /// `--upgrade-drain-timeout` passed: every response relayed here is
    /// cut from its agent (streams then go to the process replacing
    /// this one); the reply is how many were.
    CutStreams {
        /// Where to answer.
        reply: oneshot::Sender<usize>,
    },
    /// Reply with this shard's snapshot.
    Snapshot {
        /// Where to send it.
        reply: oneshot::Sender<ShardSnapshot>,
    },
}
