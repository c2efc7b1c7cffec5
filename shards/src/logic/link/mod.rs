//! The agent link's codecs: [`control`] (registration, heartbeats and
//! signals as length-prefixed JSON), [`preamble`] (shard steering before
//! the handshake), [`multistream`] (the listener's side of
//! multistream-select), [`mux_frame`] (yamux frames); and what agents
//! report: [`engine_metrics`], [`hardware`].

pub mod control;
pub mod engine_metrics;
pub mod hardware;
pub mod multistream;
pub mod mux_frame;
pub mod preamble;
