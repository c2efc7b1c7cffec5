//! Client-visible error codes and the router error envelope (spec 01 §8-9).
//!
//! `{"error":{"code":"<code>","message":"<text>","source":"router|backend"}}`

use serde::Serialize;

/// Error codes of the spec's table, each with its fixed HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorCode {
    /// 400, also 413 for body size.
    RequestInvalid,
    /// 401.
    Unauthorized,
    /// 404: no agent ever registered under the model.
    ModelNotFound,
    /// 503: model known, no healthy agent with the capability.
    NoAgentsAvailable,
    /// 503: every eligible agent at capacity.
    NoCapacity,
    /// 503: backend said 429/503 or was unreachable.
    BackendUnavailable,
    /// 502.
    BackendError,
    /// 504.
    RequestTimeout,
    /// 404 for an unknown route (JSON envelope: we do better than gin's text 404).
    NotFound,
    /// 405 for a wrong method on a known route.
    MethodNotAllowed,
    /// 431 header section too large or too many headers.
    HeadersTooLarge,
    /// 408 the client was too slow sending its request.
    ClientTimeout,
    /// 403: the key may not use the model.
    ModelForbidden,
    /// 403: a cross-origin request to an admin route.
    Forbidden,
    /// 429: requests per minute (or no quota declared for the model).
    RateLimitExceeded,
    /// 429: daily token budget.
    TokenLimitExceeded,
    /// 400: B1 request caps (input estimate or image count).
    InputTooLong,
    /// 429: B2 occupancy or B3 pressure shed.
    ConcurrencyLimitExceeded,
    /// 503: a model at zero did not wake in time, or a hold limit.
    ModelWaking,
    /// 400: the backend says the prompt is over its context (agent's
    /// classifier; never retried).
    ContextLengthExceeded,
    /// 400: the backend refused a parameter (agent's classifier; never
    /// retried).
    InvalidParameter,
}

impl ErrorCode {
    /// Wire name of the code.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::RequestInvalid => "request_invalid",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::ModelNotFound => "model_not_found",
            ErrorCode::NoAgentsAvailable => "no_agents_available",
            ErrorCode::NoCapacity => "no_capacity",
            ErrorCode::BackendUnavailable => "backend_unavailable",
            ErrorCode::BackendError => "backend_error",
            ErrorCode::RequestTimeout => "request_timeout",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::HeadersTooLarge => "request_invalid",
            ErrorCode::ClientTimeout => "request_timeout",
            ErrorCode::ModelForbidden => "model_forbidden",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::RateLimitExceeded => "rate_limit_exceeded",
            ErrorCode::TokenLimitExceeded => "token_limit_exceeded",
            ErrorCode::InputTooLong => "input_too_long",
            ErrorCode::ConcurrencyLimitExceeded => "concurrency_limit_exceeded",
            ErrorCode::ModelWaking => "model_waking",
            ErrorCode::ContextLengthExceeded => "context_length_exceeded",
            ErrorCode::InvalidParameter => "invalid_parameter",
        }
    }

    /// HTTP status of the code (spec 01 §9 mapping).
    pub fn status(self) -> u16 {
        match self {
            ErrorCode::RequestInvalid
            | ErrorCode::InputTooLong
            | ErrorCode::ContextLengthExceeded
            | ErrorCode::InvalidParameter => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::ModelForbidden | ErrorCode::Forbidden => 403,
            ErrorCode::RateLimitExceeded
            | ErrorCode::TokenLimitExceeded
            | ErrorCode::ConcurrencyLimitExceeded => 429,
            ErrorCode::ModelNotFound | ErrorCode::NotFound => 404,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::ClientTimeout => 408,
            ErrorCode::HeadersTooLarge => 431,
            ErrorCode::NoAgentsAvailable
            | ErrorCode::ModelWaking
            | ErrorCode::NoCapacity
            | ErrorCode::BackendUnavailable => 503,
            ErrorCode::BackendError => 502,
            ErrorCode::RequestTimeout => 504,
        }
    }
}

/// Who caused an error: drives the `source` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The router decided.
    Router,
    /// The backend (through an agent) decided.
    Backend,
}

/// A client-visible error: code, status override and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// Spec error code.
    pub code: ErrorCode,
    /// HTTP status (usually `code.status()`; 413 for body size).
    pub status: u16,
    /// Human-readable message.
    pub message: String,
    /// Who caused it.
    pub source: Source,
    /// `Retry-After` seconds the response carries (`None`: no header);
    /// `model_waking` repeats it in its body.
    pub retry_after: Option<u64>,
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    code: &'a str,
    message: &'a str,
    source: &'a str,
}

impl ApiError {
    /// A router-side error with the code's own status.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            status: code.status(),
            message: message.into(),
            source: Source::Router,
            retry_after: None,
        }
    }

    /// The same error with `Retry-After: secs`.
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }

    /// 413 body too large (code `request_invalid`).
    pub fn body_too_large(limit: u64) -> Self {
        ApiError {
            code: ErrorCode::RequestInvalid,
            status: 413,
            message: format!("request body too large: limit is {limit} bytes"),
            source: Source::Router,
            retry_after: None,
        }
    }

    /// The envelope on `/v1/messages`: Anthropic's (`type: "error"`,
    /// `error.type`), with the spec's `code` and `source` beside, so both
    /// SDKs read it.
    pub fn body_anthropic(&self) -> Vec<u8> {
        let v = serde_json::json!({
            "type": "error",
            "error": {
                "type": anthropic_type(self.status),
                "message": self.message,
                "code": self.code.as_str(),
                "source": match self.source {
                    Source::Router => "router",
                    Source::Backend => "backend",
                },
            },
        });
        serde_json::to_vec(&v).unwrap_or_else(|_| b"{}".to_vec())
    }

    /// The JSON envelope bytes.
    pub fn body(&self) -> Vec<u8> {
        let env = Envelope {
            error: Inner {
                code: self.code.as_str(),
                message: &self.message,
                source: match self.source {
                    Source::Router => "router",
                    Source::Backend => "backend",
                },
            },
        };
        serde_json::to_vec(&env).unwrap_or_else(|_| b"{}".to_vec())
    }
}

/// Anthropic's error type for a status (spec 01 §8).
pub fn anthropic_type(status: u16) -> &'static str {
    match status {
        400 | 413 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        _ => "api_error",
    }
}

/// A backend's error message: `error.message`, `message`, `error` or
/// `detail` of a JSON body, else the body's text; printable, at most 512
/// characters ("no body" when empty).
pub fn backend_message(body: &[u8]) -> String {
    let json = serde_json::from_slice::<serde_json::Value>(body).ok();
    let from_json = json.as_ref().and_then(|v| {
        let s = |x: &serde_json::Value| x.as_str().map(str::to_string);
        v.pointer("/error/message")
            .and_then(s)
            .or_else(|| v.get("message").and_then(s))
            .or_else(|| v.get("error").and_then(s))
            .or_else(|| v.get("detail").and_then(s))
    });
    let text = from_json.unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    let msg: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(512)
        .collect();
    let msg = msg.trim();
    if msg.is_empty() {
        "no body".into()
    } else {
        msg.to_string()
    }
}

/// The agent's classifier of a backend's non-2xx answer on the native
/// chat path (spec 03 §8; issue 28 #9): the JSON `type` (or `error.type`)
/// names it where the engine says; else a 400/422 whose body speaks of
/// the context and its length, window or tokens is
/// `context_length_exceeded` (vLLM: "maximum context length", SGLang:
/// "longer than the model's context length", llama.cpp: type
/// `exceed_context_size_error`), any other 400/422 `invalid_parameter`,
/// 429/503 `backend_unavailable`, the rest `backend_error`. Source
/// backend; the router never retries the two 400 codes.
pub fn classify_backend(status: u16, body: &[u8]) -> ApiError {
    let json = serde_json::from_slice::<serde_json::Value>(body).ok();
    let kind = json
        .as_ref()
        .and_then(|v| {
            v.get("type")
                .and_then(|t| t.as_str())
                .or_else(|| v.pointer("/error/type").and_then(|t| t.as_str()))
        })
        .unwrap_or("");
    let lower = String::from_utf8_lossy(body).to_ascii_lowercase();
    let speaks_of_context = lower.contains("context")
        && ["length", "window", "token", "size"]
            .iter()
            .any(|w| lower.contains(w));
    let code = match (kind, status) {
        ("context_length_exceeded" | "exceed_context_size_error", _) => {
            ErrorCode::ContextLengthExceeded
        }
        ("invalid_request_error" | "invalid_parameter", 400..=499) => {
            if speaks_of_context {
                ErrorCode::ContextLengthExceeded
            } else {
                ErrorCode::InvalidParameter
            }
        }
        (_, 400 | 422) if speaks_of_context => ErrorCode::ContextLengthExceeded,
        (_, 400 | 422) => ErrorCode::InvalidParameter,
        (_, 429 | 503) => ErrorCode::BackendUnavailable,
        _ => ErrorCode::BackendError,
    };
    ApiError {
        code,
        status: code.status(),
        message: backend_message(body),
        source: Source::Backend,
        retry_after: None,
    }
}

/// The error a client gets when its tries ended on backends answering
/// 502-504 (issue 28 #8): the last backend's status and its own message
/// (`error.message`, `message` or `error` of a JSON body, else the body's
/// text), not a generic "no agents available". Bounded and printable: the
/// body is the backend's, not ours.
pub fn backend_exhausted(status: u16, body: &[u8]) -> ApiError {
    let code = match status {
        502 => ErrorCode::BackendError,
        504 => ErrorCode::RequestTimeout,
        _ => ErrorCode::BackendUnavailable,
    };
    let msg = backend_message(body);
    ApiError {
        code,
        status,
        message: format!("backend answered {status}: {msg}"),
        source: Source::Backend,
        retry_after: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_shape() {
        let e = ApiError::new(
            ErrorCode::ModelNotFound,
            "No agents registered for this model",
        );
        let v: serde_json::Value = serde_json::from_slice(&e.body()).expect("json");
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["source"], "router");
        assert_eq!(e.status, 404);
        assert_eq!(ApiError::body_too_large(10).status, 413);
        assert_eq!(ErrorCode::NoAgentsAvailable.status(), 503);
    }

    #[test]
    fn a_backends_last_answer_reaches_the_client() {
        let e = backend_exhausted(
            503,
            br#"{"error":{"code":"backend_unavailable","message":"backend unreachable: refused"}}"#,
        );
        assert_eq!((e.status, e.code), (503, ErrorCode::BackendUnavailable));
        assert_eq!(e.source, Source::Backend);
        assert_eq!(
            e.message,
            "backend answered 503: backend unreachable: refused"
        );
        let e = backend_exhausted(502, b"<html>Bad\r\nGateway</html>");
        assert_eq!((e.status, e.code), (502, ErrorCode::BackendError));
        assert_eq!(e.message, "backend answered 502: <html>Bad  Gateway</html>");
        let e = backend_exhausted(504, br#"{"detail":"upstream timed out"}"#);
        assert_eq!(e.code, ErrorCode::RequestTimeout);
        assert!(e.message.ends_with("upstream timed out"));
        assert!(backend_exhausted(503, b"").message.ends_with("no body"));
        let long = vec![b'x'; 10_000];
        assert!(backend_exhausted(503, &long).message.len() < 600, "bounded");
    }

    #[test]
    fn backend_errors_are_classified_as_the_spec_says() {
        let llama = br#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":7000,"n_ctx":2048}}"#;
        let e = classify_backend(400, llama);
        assert_eq!((e.code, e.status), (ErrorCode::ContextLengthExceeded, 400));
        assert!(
            e.message.starts_with("the request exceeds"),
            "{}",
            e.message
        );
        let vllm = br#"{"object":"error","message":"This model's maximum context length is 4096 tokens. However, you requested 5000 tokens","type":"BadRequestError","param":null,"code":400}"#;
        assert_eq!(
            classify_backend(400, vllm).code,
            ErrorCode::ContextLengthExceeded
        );
        let sglang = br#"{"object":"error","message":"The input (5000 tokens) is longer than the model's context length (4096 tokens).","type":"BadRequestError","code":400}"#;
        assert_eq!(
            classify_backend(400, sglang).code,
            ErrorCode::ContextLengthExceeded
        );
        let bad =
            br#"{"error":{"message":"temperature must be >= 0","type":"invalid_request_error"}}"#;
        assert_eq!(classify_backend(400, bad).code, ErrorCode::InvalidParameter);
        assert_eq!(
            classify_backend(422, b"bad field").code,
            ErrorCode::InvalidParameter
        );
        assert_eq!(
            classify_backend(429, b"").code,
            ErrorCode::BackendUnavailable
        );
        assert_eq!(classify_backend(503, b"").status, 503);
        let e = classify_backend(500, b"oops");
        assert_eq!(
            (e.code, e.status, e.source),
            (ErrorCode::BackendError, 502, Source::Backend)
        );
        assert_eq!(ErrorCode::InvalidParameter.as_str(), "invalid_parameter");
    }
}
