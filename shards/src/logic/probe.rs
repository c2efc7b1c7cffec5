//! Request body probe: extracts the top-level `model` and `stream` from a
//! JSON body with borrowed serde fields; everything else is skipped, never
//! built into a DOM, and the body bytes are forwarded unchanged.

use std::borrow::Cow;

use serde::Deserialize;

use super::errors::{ApiError, ErrorCode};

/// Longest accepted model name (spec 01 §3).
pub const MAX_MODEL_BYTES: usize = 256;

#[derive(Deserialize)]
struct Probe<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
}

/// What routing needs from a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestMeta {
    /// Routing key.
    pub model: String,
    /// The client asked for a stream (informational: the response's
    /// content type decides how it is relayed).
    pub stream: bool,
}

/// Probe a JSON body. Errors carry the spec's messages.
pub fn probe(body: &[u8]) -> Result<RequestMeta, ApiError> {
    let p: Probe<'_> = serde_json::from_slice(body)
        .map_err(|e| ApiError::new(ErrorCode::RequestInvalid, format!("Invalid request: {e}")))?;
    let model = match p.model {
        Some(m) if !m.is_empty() => m,
        _ => {
            return Err(ApiError::new(
                ErrorCode::RequestInvalid,
                "model field is required",
            ))
        }
    };
    if model.len() > MAX_MODEL_BYTES {
        return Err(ApiError::new(
            ErrorCode::RequestInvalid,
            "model name exceeds maximum length of 256 characters",
        ));
    }
    Ok(RequestMeta {
        model: model.into_owned(),
        stream: p.stream.unwrap_or(false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn extracts_model_and_stream() {
        let m = probe(br#"{"messages":[{"role":"user","content":"hi"}],"model":"m1","stream":true,"x":{"y":[1,2]}}"#)
            .expect("ok");
        assert_eq!(m.model, "m1");
        assert!(m.stream);
    }

    #[test]
    fn escaped_model_is_unescaped() {
        assert_eq!(probe(br#"{"model":"a\/b"}"#).expect("ok").model, "a/b");
    }

    #[test]
    fn errors() {
        assert_eq!(probe(b"not json").expect_err("bad").status, 400);
        assert_eq!(
            probe(br#"{"model":""}"#).expect_err("e").message,
            "model field is required"
        );
        assert_eq!(
            probe(br#"{}"#).expect_err("e").message,
            "model field is required"
        );
        assert_eq!(
            probe(br#"{"model":"m","stream":"yes"}"#)
                .expect_err("e")
                .status,
            400
        );
        assert_eq!(probe(br#"[1]"#).expect_err("e").status, 400);
        let long = format!(r#"{{"model":"{}"}}"#, "a".repeat(257));
        assert!(probe(long.as_bytes())
            .expect_err("e")
            .message
            .contains("256"));
    }

    proptest! {
        #[test]
        fn never_panics(b in proptest::collection::vec(any::<u8>(), 0..500)) {
            let _ = probe(&b);
        }

        #[test]
        fn model_round_trips(m in "[a-zA-Z0-9/._:-]{1,100}") {
            let body = serde_json::json!({"model": m, "messages": []}).to_string();
            prop_assert_eq!(probe(body.as_bytes()).expect("ok").model, m);
        }
    }
}
