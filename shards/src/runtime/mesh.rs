//! Cross-core messages. One unbounded channel per shard; a connection
//! crosses cores at most once per model change, never per chunk.

use futures::channel::oneshot;

use super::clock::Instant;
use super::shard::ShardSnapshot;
use crate::logic::http_parse::RequestHead;
use crate::logic::probe::RequestMeta;

/// An inference endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    ChatCompletions,
    /// `POST /v1/messages`.
    Messages,
    /// `POST /v1/messages/count_tokens`.
    CountTokens,
    /// `POST /v1/embeddings`.
    Embeddings,
    /// `POST /v1/rerank`.
    Rerank,
}

impl Endpoint {
    /// Endpoint of a path, if it is an inference route.
    pub fn of(path: &str) -> Option<Self> {
        match path {
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            "/v1/messages" => Some(Endpoint::Messages),
            "/v1/messages/count_tokens" => Some(Endpoint::CountTokens),
            "/v1/embeddings" => Some(Endpoint::Embeddings),
            "/v1/rerank" => Some(Endpoint::Rerank),
            _ => None,
        }
    }

    /// Capability an agent needs to serve it.
    pub fn capability(self) -> crate::logic::control::Capability {
        use crate::logic::control::Capability;
        match self {
            Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::CountTokens => {
                Capability::Llm
            }
            Endpoint::Embeddings => Capability::Embedding,
            Endpoint::Rerank => Capability::Reranker,
        }
    }
}

/// A request read and probed on one shard, to be served on another.
#[derive(Debug)]
pub struct PendingRequest {
    /// Parsed head.
    pub head: RequestHead,
    /// Whole body as received (de-chunked).
    pub body: Vec<u8>,
    /// Probed fields.
    pub meta: RequestMeta,
    /// Which endpoint.
    pub endpoint: Endpoint,
    /// When the head started arriving.
    pub received_at: Instant,
    /// `X-Request-ID` (the client's when it is a UUID, else generated).
    pub request_id: String,
}

/// The messages shards exchange.
pub enum ShardMsg {
    /// Adopt a client connection and serve `pending` first.
    AdoptHttp {
        /// The socket, out of its former runtime.
        stream: std::net::TcpStream,
        /// Bytes read past the pending request (pipelined input).
        buf: Vec<u8>,
        /// The request to serve.
        pending: Box<PendingRequest>,
    },
    /// Adopt an agent link after its preamble.
    AdoptLink {
        /// The socket.
        stream: std::net::TcpStream,
        /// Bytes read past the preamble.
        prefix: Vec<u8>,
        /// The model the preamble named.
        model: String,
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
    /// Reply with this shard's snapshot.
    Snapshot {
        /// Where to send it.
        reply: oneshot::Sender<ShardSnapshot>,
    },
}
