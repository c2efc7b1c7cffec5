//! Why a request is refused, whichever step of its order refused it: one
//! type ([`Refusal`]) with its reason label and its client-visible error.
//! The decision machine ([`super::decision`]) ends a request with one,
//! the runtime's driver counts it in one place and writes it once.

use std::time::Duration;

use super::admission::Reason;
use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::link::control::Capability;

/// Which quota refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaLimit {
    /// Requests per minute (or no quota declared for the model).
    Requests,
    /// Tokens per day.
    Tokens,
}

/// A quota's refusal: the 429 and its `X-RateLimit-*` headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaRefusal {
    /// Which limit.
    pub limit: QuotaLimit,
    /// The 429 (with its `Retry-After` when the limit says when).
    pub error: ApiError,
    /// `X-RateLimit-*` (and `retry-after-ms`).
    pub headers: Vec<(&'static str, Vec<u8>)>,
}

/// Why the routing steps refused a request (the decision machine's own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rejection {
    /// No agent of the model is registered here.
    ModelNotFound,
    /// Every agent is offline or unhealthy.
    NoAgentsAvailable,
    /// Every eligible agent is full and the queue could not take it.
    NoCapacity,
    /// Every policy step ran out of eligible agents.
    Exhausted,
    /// Agents serve the model here, none with the endpoint's capability
    /// (a chat model asked on `/v1/embeddings`): the capability it needs.
    CapabilityMismatch(Capability),
    /// The deadline passed in the capacity queue.
    QueueTimeout,
    /// The deadline passed while contacting an agent.
    AgentTimeout,
    /// The client went away while the request waited: nothing is written.
    ClientGone,
    /// The steps ran out past the deadline, so the fallback provider was
    /// not tried.
    ProviderTimeout,
}

impl Rejection {
    /// The client-visible error.
    pub fn error(self) -> ApiError {
        match self {
            Rejection::ModelNotFound => ApiError::new(
                ErrorCode::ModelNotFound,
                "No agents registered for this model",
            ),
            Rejection::NoAgentsAvailable => ApiError::new(
                ErrorCode::NoAgentsAvailable,
                "All agents for this model are currently offline or unhealthy",
            ),
            Rejection::NoCapacity => ApiError::new(
                ErrorCode::NoCapacity,
                "All agents for this model are at maximum capacity",
            ),
            Rejection::Exhausted => ApiError::new(
                ErrorCode::NoAgentsAvailable,
                "all policy steps exhausted: no eligible agents",
            ),
            Rejection::CapabilityMismatch(cap) => ApiError::new(
                ErrorCode::ModelNotFound,
                format!(
                    "No agents registered for this model with capability {}: its agents serve another endpoint",
                    cap.as_str()
                ),
            ),
            Rejection::QueueTimeout => ApiError::new(
                ErrorCode::RequestTimeout,
                "Request timed out waiting for an available agent",
            ),
            Rejection::AgentTimeout => ApiError::new(
                ErrorCode::RequestTimeout,
                "Request deadline exceeded while contacting agent",
            ),
            Rejection::ProviderTimeout => ApiError::new(
                ErrorCode::RequestTimeout,
                "Request timed out before provider fallback could be attempted",
            ),
            // Never sent (nobody is there to read it); for logs.
            Rejection::ClientGone => ApiError::new(
                ErrorCode::ClientTimeout,
                "client closed the connection while its request waited",
            ),
        }
    }

    /// The reason label.
    pub fn label(self) -> &'static str {
        match self {
            Rejection::ModelNotFound => "model_not_found",
            Rejection::NoAgentsAvailable => "no_agents_available",
            Rejection::NoCapacity => "no_capacity",
            Rejection::Exhausted => "policy_exhausted",
            Rejection::CapabilityMismatch(_) => "capability_mismatch",
            Rejection::QueueTimeout => "queue_timeout",
            Rejection::AgentTimeout => "agent_timeout",
            Rejection::ClientGone => "client_gone",
            Rejection::ProviderTimeout => "request_timeout",
        }
    }

    /// Whether the policy ran out of steps (counted as `exhausted`).
    pub fn exhausted_policy(self) -> bool {
        matches!(
            self,
            Rejection::NoAgentsAvailable
                | Rejection::NoCapacity
                | Rejection::Exhausted
                | Rejection::QueueTimeout
        )
    }
}

/// Why a request is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Over a quota (requests per minute, tokens per day).
    Quota(QuotaRefusal),
    /// An admission gate (B1-B4); the error names B1's numbers.
    Admission {
        /// Which gate.
        reason: Reason,
        /// The client-visible error.
        error: ApiError,
    },
    /// Released from a hold, but admission found no room before the hold
    /// budget ended: `503 model_waking`.
    HoldNoRoom {
        /// The hold budget.
        budget: Duration,
        /// `Retry-After` seconds.
        retry_after: u64,
    },
    /// The routing steps: not found, no agent, no capacity, a deadline,
    /// or the client gone.
    Routing(Rejection),
}

impl From<Rejection> for Refusal {
    fn from(r: Rejection) -> Self {
        Refusal::Routing(r)
    }
}

impl Refusal {
    /// The reason label (logs and the per-reason counters).
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::Quota(q) => match q.limit {
                QuotaLimit::Requests => "b4_rpm",
                QuotaLimit::Tokens => "tokens_per_day",
            },
            Refusal::Admission { reason, .. } => reason.as_str(),
            Refusal::HoldNoRoom { .. } => "hold_no_room",
            Refusal::Routing(r) => r.label(),
        }
    }

    /// The client-visible error for a request for `model`.
    pub fn error(&self, model: &str) -> ApiError {
        match self {
            Refusal::Quota(q) => q.error.clone(),
            Refusal::Admission { error, .. } => error.clone(),
            Refusal::HoldNoRoom {
                budget,
                retry_after,
            } => crate::logic::sites::hold::waking(
                model,
                crate::logic::sites::hold::Waking::NoRoom,
                *budget,
            )
            .retry_after(*retry_after),
            Refusal::Routing(r) => r.error(),
        }
    }

    /// The client left: nothing is written.
    pub fn client_gone(&self) -> bool {
        *self == Refusal::Routing(Rejection::ClientGone)
    }
}
