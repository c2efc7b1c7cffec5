//! One inference request on its model's shard: [`dispatch`] drives the
//! pure decision machine and calls each feature at fixed hooks: the
//! model's sub-states `affinity` and `fairness` (state, counters and
//! families in [`crate::runtime::state::model`]), [`continuation`] (a
//! broken stream's transcript and tries; its counters in
//! `state::model::continuity`), [`provider`] (the fallback provider); the
//! driver's one capacity wait and its refusal counting are its own
//! (`dispatch/`);
//! [`admission`] is the admission gate,
//! [`forward`] one forward to an agent and its counting, [`exchange`] one
//! exchange with an agent, [`continuation`] a broken stream continued on
//! another agent, [`respond`] every response the
//! router writes itself, [`ending`] the one ending (quota, tenant
//! counters, audit), [`models_api`] the `/v1/models` bodies.

pub mod admission;
pub mod continuation;
pub mod dispatch;
pub mod ending;
pub mod exchange;
pub mod forward;
pub mod models_api;
pub mod provider;
pub mod respond;
