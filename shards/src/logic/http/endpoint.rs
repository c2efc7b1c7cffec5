//! The inference endpoints a client can call, and what each needs.

use crate::logic::link::control::Capability;

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
    pub fn capability(self) -> Capability {
        match self {
            Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::CountTokens => {
                Capability::Llm
            }
            Endpoint::Embeddings => Capability::Embedding,
            Endpoint::Rerank => Capability::Reranker,
        }
    }
}
