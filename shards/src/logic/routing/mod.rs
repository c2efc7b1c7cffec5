//! Where a request goes and in what order: [`decision`] (the request's
//! machine: quota, admission, daily budget, policy steps, queue, retries,
//! errors), [`policy`] and [`policy_set`] (YAML, gate pipeline),
//! [`admission`] (B1-B4), [`srtt`] (the latency estimator), [`failure`]
//! (who failed, retry or not), [`wait_queue`] (the capacity queue and
//! its tenants' slots),
//! [`directory`] (model to shard), [`history`] (an agent's persisted
//! record), [`affinity`] (the cache-holder index and what a miss costs),
//! [`refusal`] (the one refusal type).

pub mod admission;
pub mod affinity;
pub mod decision;
pub mod directory;
pub mod failure;
pub mod history;
pub mod policy;
pub mod policy_set;
pub mod refusal;
pub mod srtt;
pub mod wait_queue;
