//! One inference request on its model's shard: [`dispatch`] drives the
//! pure decision machine and calls each feature at fixed hooks:
//! [`affinity`], [`fairness`], [`continuation`] (a broken stream's
//! transcript and tries), [`provider`] (the fallback provider); each
//! feature's counters and metric families are the model's
//! (`state::model::{affinity, fairness, continuity}`); the
//! driver's one capacity wait and its refusal counting are its own
//! (`dispatch/`);
//! [`admission`] is the admission gate,
//! [`forward`] one forward to an agent and its counting, [`exchange`] one
//! exchange with an agent, [`continuation`] a broken stream continued on
//! another agent, [`respond`] every response the
//! router writes itself, [`ending`] the one ending (quota, tenant
//! counters, audit), [`models_api`] the `/v1/models` bodies, [`spans`]
//! the request's trace (OTLP).

pub mod admission;
pub mod affinity;
pub mod continuation;
pub mod conversations;
pub mod dispatch;
pub mod ending;
pub mod exchange;
pub mod fairness;
pub mod forward;
pub mod kept;
pub mod models_api;
pub mod provider;
pub mod respond;
pub mod responses;
pub mod spans;
