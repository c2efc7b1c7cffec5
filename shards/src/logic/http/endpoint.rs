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
    /// `POST /v1/responses` (issue 52).
    Responses,
    /// `POST /v1/responses/input_tokens`.
    ResponsesInputTokens,
}

impl Endpoint {
    /// A generating endpoint (chat, messages, responses): metered for
    /// daily budgets, learned from by the estimator, gated by admission,
    /// held at zero as kind `chat`.
    pub fn generates(self) -> bool {
        matches!(
            self,
            Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::Responses
        )
    }

    /// Endpoint of a path, if it is an inference route.
    pub fn of(path: &str) -> Option<Self> {
        match path {
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            "/v1/messages" => Some(Endpoint::Messages),
            "/v1/messages/count_tokens" => Some(Endpoint::CountTokens),
            "/v1/embeddings" => Some(Endpoint::Embeddings),
            "/v1/rerank" => Some(Endpoint::Rerank),
            "/v1/responses" => Some(Endpoint::Responses),
            "/v1/responses/input_tokens" => Some(Endpoint::ResponsesInputTokens),
            _ => None,
        }
    }

    /// Capability an agent needs to serve it.
    pub fn capability(self) -> Capability {
        match self {
            Endpoint::ChatCompletions
            | Endpoint::Messages
            | Endpoint::CountTokens
            | Endpoint::Responses
            | Endpoint::ResponsesInputTokens => Capability::Llm,
            Endpoint::Embeddings => Capability::Embedding,
            Endpoint::Rerank => Capability::Reranker,
        }
    }
}
