//! Traces the router and the agent export (issue 53): the spans of one
//! request ([`span`]), their OTLP/protobuf encoding ([`otlp`]) and which
//! traces are kept ([`sampler`]). Pure: times and IDs come in as
//! arguments; the export thread is [`crate::runtime::services::otlp`].

pub mod otlp;
pub mod request;
pub mod sampler;
pub mod span;
