//! Control-stream messages between agent and router: length-prefixed JSON
//! (big-endian u32 length, then a JSON object), bounded by
//! [`MAX_CONTROL_FRAME`].
//!
//! Agent -> router: [`ControlMsg::Register`], [`ControlMsg::Heartbeat`].
//! Router -> agent: [`ControlMsg::Registered`], [`ControlMsg::Rejected`].

use serde::{Deserialize, Serialize};

/// Largest accepted control frame body.
pub const MAX_CONTROL_FRAME: usize = 64 * 1024;

/// Capability an agent serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Capability {
    /// Chat / messages.
    #[default]
    Llm,
    /// `/v1/embeddings`.
    Embedding,
    /// `/v1/rerank`.
    Reranker,
}

impl Capability {
    /// Wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Capability::Llm => "llm",
            Capability::Embedding => "embedding",
            Capability::Reranker => "reranker",
        }
    }

    /// Parse a flag value.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "llm" => Some(Capability::Llm),
            "embedding" => Some(Capability::Embedding),
            "reranker" => Some(Capability::Reranker),
            _ => None,
        }
    }
}

/// What an agent declares at registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Registration {
    /// The agent's libp2p PeerId (checked against the noise identity).
    pub peer_id: String,
    /// Model served (must equal the preamble's).
    pub model: String,
    /// Engine name (`vllm`, `ollama`...).
    pub engine: String,
    /// Capability.
    #[serde(default)]
    pub capability: Capability,
    /// Concurrent requests the agent accepts.
    pub capacity: u32,
    /// Agent version string.
    #[serde(default)]
    pub version: String,
    /// Region label.
    #[serde(default)]
    pub region: String,
    /// Organization label.
    #[serde(default)]
    pub organization: String,
    /// Machine label.
    #[serde(default)]
    pub machine: String,
    /// Free-form tags.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Deployment ID.
    #[serde(default)]
    pub deployment_id: String,
    /// Replica ID.
    #[serde(default)]
    pub replica_id: String,
    /// GPU model (`--gpu-model`, else the first GPU `nvidia-smi` names;
    /// empty: none known), matched by a policy's `match.gpu_model`.
    #[serde(default)]
    pub gpu_model: String,
    /// `--hide-llm`: the model is marked hidden in `/v1/models` (spec 01:
    /// still listed, `hide_llm: true`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hide_llm: bool,
    /// `--llm-pretty-name` (at most [`MAX_LLM_PRETTY_NAME`] bytes kept).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub llm_pretty_name: String,
    /// `--llm-info` (at most [`MAX_LLM_INFO`] bytes kept).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub llm_info: String,
}

/// Most bytes of a registered `llm_pretty_name` the router keeps.
pub const MAX_LLM_PRETTY_NAME: usize = 256;
/// Most bytes of a registered `llm_info` the router keeps.
pub const MAX_LLM_INFO: usize = 4096;

/// `s` cut to at most `max` bytes on a character boundary.
pub fn truncate_label(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}

/// One control-stream message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[allow(clippy::large_enum_variant)] // one registration per link: size does not matter
pub enum ControlMsg {
    /// Agent asks to join routing.
    Register(Registration),
    /// Router accepted the registration.
    Registered {
        /// Heartbeat period the router expects, milliseconds.
        heartbeat_interval_ms: u64,
        /// The router reads interim `102 Processing` heads and restarts
        /// its head deadline at each: the agent sends one at most this
        /// often (milliseconds) while its engine shows progress on an
        /// answer not yet started (issue 56). 0 (an older router): none.
        #[serde(default)]
        progress_interval_ms: u64,
    },
    /// Router refused; the link is closed after this.
    Rejected {
        /// Why.
        reason: String,
    },
    /// Periodic liveness plus backend health.
    Heartbeat {
        /// The agent's own check of its backend.
        backend_healthy: bool,
        /// The agent is stopping (SIGTERM): send it nothing new; what it
        /// still serves finishes, or is continued elsewhere when it leaves.
        /// Sent at once, not at the next period.
        #[serde(default)]
        draining: bool,
    },
    /// Engine signals scraped from the backend's `/metrics`.
    RoutingSignals {
        /// The latest engine values.
        engine: super::engine_metrics::EngineSignals,
        /// The latest host values.
        #[serde(default)]
        hardware: super::hardware::HardwareSignals,
    },
    /// An agent that serves several routers: its requests in flight over
    /// every link (`active`) and over this one (`own`), sent when they
    /// change. The others' share counts against its capacity here.
    Load {
        /// In flight at the agent, every router's.
        active: u32,
        /// Of those, this link's.
        own: u32,
    },
}

/// The response header of an agent that serves several routers and is at
/// its capacity (a 503): full, not failing; try another agent or wait.
pub const AGENT_FULL_HEADER: &str = "x-hivenet-agent-full";

/// Why a frame could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// Declared length over the bound.
    TooLarge(usize),
    /// Body is not a valid message.
    Invalid(String),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::TooLarge(n) => {
                write!(f, "control frame of {n} bytes exceeds {MAX_CONTROL_FRAME}")
            }
            FrameError::Invalid(e) => write!(f, "invalid control frame: {e}"),
        }
    }
}

/// Encode one frame.
pub fn encode(msg: &ControlMsg) -> Vec<u8> {
    let body = serde_json::to_vec(msg).unwrap_or_default();
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// Decode one frame from the start of `buf`: `Ok(None)` while incomplete.
pub fn decode(buf: &[u8]) -> Result<Option<(ControlMsg, usize)>, FrameError> {
    let Some(len_bytes) = buf.get(..4) else {
        return Ok(None);
    };
    let mut lb = [0u8; 4];
    lb.copy_from_slice(len_bytes);
    let len = u32::from_be_bytes(lb) as usize;
    if len > MAX_CONTROL_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    let Some(body) = buf.get(4..4 + len) else {
        return Ok(None);
    };
    let msg = serde_json::from_slice(body).map_err(|e| FrameError::Invalid(e.to_string()))?;
    Ok(Some((msg, 4 + len)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn register_round_trip() {
        let r = ControlMsg::Register(Registration {
            peer_id: "12D3KooWx".into(),
            model: "m".into(),
            engine: "vllm".into(),
            capability: Capability::Embedding,
            capacity: 4,
            tags: vec!["a".into()],
            ..Default::default()
        });
        let enc = encode(&r);
        let (d, n) = decode(&enc).expect("ok").expect("complete");
        assert_eq!(d, r);
        assert_eq!(n, enc.len());
        assert_eq!(decode(&enc[..enc.len() - 1]), Ok(None));
    }

    #[test]
    fn rejects_oversize_and_garbage() {
        assert_eq!(decode(&[0, 1, 0, 1]), Err(FrameError::TooLarge(65537)));
        assert!(matches!(
            decode(b"\0\0\0\x02{}"),
            Err(FrameError::Invalid(_))
        ));
    }

    proptest! {
        #[test]
        fn heartbeat_round_trip(b in any::<bool>(), extra in proptest::collection::vec(any::<u8>(), 0..10)) {
            let m = ControlMsg::Heartbeat { backend_healthy: b, draining: !b };
            let mut enc = encode(&m);
            let n0 = enc.len();
            enc.extend_from_slice(&extra);
            let (d, n) = decode(&enc).expect("ok").expect("c");
            prop_assert_eq!(d, m);
            prop_assert_eq!(n, n0);
        }

        #[test]
        fn never_panics(b in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = decode(&b);
        }
    }
}
