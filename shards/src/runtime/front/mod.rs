//! What a shard listens to: [`event_loop`] (listeners, flush timer, mesh
//! messages), [`ingress`] (client HTTP connections; `placing`: where each request is
//! served), [`hold`] (hold at
//! zero) and [`agent_link`] (the agents' control protocol).

pub mod agent_link;
pub mod carry;
pub mod event_loop;
pub mod hold;
pub mod ingress;
mod placing;
mod reading;
mod stateful;
