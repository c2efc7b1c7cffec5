//! Routing policies (spec 04 §3-5, §11): parsing and validation of the
//! YAML documents, and the per-step candidate pipeline. Pure: agents are
//! read through a closure, time and the rotation are passed in.
//!
//! Gate order per step: model, health, capability, match, this request's
//! earlier failures (in this step), capacity, `exclude_if`; then
//! least-loaded among the survivors with a rotating tie-break. An agent
//! with no value for an `exclude_if` field passes that rule.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::logic::link::control::Capability;
pub use crate::logic::routing::affinity::AffinityCfg;

/// A comparison in an `exclude_if` rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// `>`.
    Gt,
    /// `>=`.
    Gte,
    /// `<`.
    Lt,
    /// `<=`.
    Lte,
}

/// A signal an `exclude_if` rule can read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Field {
    /// Live SRTT, ms.
    Srtt,
    /// Lifetime success / all.
    SuccessRate,
    /// Failures since the last success.
    ConsecutiveFailures,
    /// active / capacity.
    CapacityUtilization,
    /// Engine KV cache use 0-1 (vllm, sglang, llamacpp agents report it).
    KvCacheUtilization,
    /// Engine running requests (absent until reported).
    RunningRequests,
    /// Engine waiting requests (absent until reported).
    WaitingRequests,
    /// Engine mean TTFT, s (absent until reported).
    AvgTtftSeconds,
    /// Engine p90 TTFT, s (absent until reported).
    P90TtftSeconds,
    /// Engine mean ITL, s (absent until reported).
    AvgItlSeconds,
    /// Engine p90 ITL, s (absent until reported).
    P90ItlSeconds,
    /// Max GPU temperature (absent until reported).
    GpuTemperatureC,
    /// Max GPU utilisation 0-1 (absent until reported).
    GpuUtilPercent,
    /// Max GPU VRAM use 0-1 (absent until reported).
    GpuVramUsedPercent,
    /// Host memory use 0-1 (absent until reported).
    MemoryUsedPercent,
    /// Host CPU use 0-1 (absent until reported).
    CpuUsagePercent,
}

const FIELDS: [(&str, Field); 16] = [
    ("srtt", Field::Srtt),
    ("success_rate", Field::SuccessRate),
    ("consecutive_failures", Field::ConsecutiveFailures),
    ("capacity_utilization", Field::CapacityUtilization),
    ("kv_cache_utilization", Field::KvCacheUtilization),
    ("running_requests", Field::RunningRequests),
    ("waiting_requests", Field::WaitingRequests),
    ("avg_ttft_seconds", Field::AvgTtftSeconds),
    ("p90_ttft_seconds", Field::P90TtftSeconds),
    ("avg_itl_seconds", Field::AvgItlSeconds),
    ("p90_itl_seconds", Field::P90ItlSeconds),
    ("gpu_temperature_c", Field::GpuTemperatureC),
    ("gpu_util_percent", Field::GpuUtilPercent),
    ("gpu_vram_used_percent", Field::GpuVramUsedPercent),
    ("memory_used_percent", Field::MemoryUsedPercent),
    ("cpu_usage_percent", Field::CpuUsagePercent),
];

impl Field {
    /// YAML name.
    pub fn name(self) -> &'static str {
        FIELDS
            .iter()
            .find(|(_, f)| *f == self)
            .map(|(n, _)| *n)
            .unwrap_or("?")
    }
}

/// One `exclude_if` rule: exclude the agent when `value op threshold`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Rule {
    /// Signal.
    pub field: Field,
    /// Comparison.
    pub op: Op,
    /// Threshold.
    pub value: f64,
}

impl Rule {
    /// Whether `v` violates the rule (so the agent is excluded).
    pub fn violated(&self, v: f64) -> bool {
        match self.op {
            Op::Gt => v > self.value,
            Op::Gte => v >= self.value,
            Op::Lt => v < self.value,
            Op::Lte => v <= self.value,
        }
    }
}

/// Metadata an agent must match (empty fields match anything).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Match {
    /// Region label.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub region: String,
    /// Engine name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub engine: String,
    /// Organization label.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub organization: String,
    /// Machine label.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub machine: String,
    /// Capability (`llm|embedding|reranker`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub capability: String,
    /// GPU model label (agents do not report it yet: only empty matches).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub gpu_model: String,
    /// Every tag must be present.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
}

/// One step of a policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Step {
    /// `routing_policy` or the fallback's name.
    pub name: String,
    /// Metadata filter.
    #[serde(rename = "match")]
    pub matcher: Match,
    /// Exclusion rules.
    pub exclude_if: Vec<Rule>,
    /// Tries in this step (0: the router's `--max-tries-per-step`).
    pub max_tries: u32,
    /// `strategy: prefix-aware` and its settings (None: least-loaded).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity: Option<AffinityCfg>,
}

impl Step {
    /// Whether the step reads a GPU signal or the GPU model.
    pub fn reads_gpu(&self) -> bool {
        !self.matcher.gpu_model.is_empty()
            || self.exclude_if.iter().any(|r| {
                matches!(
                    r.field,
                    Field::GpuTemperatureC | Field::GpuUtilPercent | Field::GpuVramUsedPercent
                )
            })
    }
}

/// A validated policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Policy {
    /// Models a per-model document claims.
    pub models: Vec<String>,
    /// The primary step followed by the fallback steps.
    pub steps: Vec<Step>,
    /// Static aliases `alias -> model` (global document only), resolved
    /// right after authentication.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub aliases: BTreeMap<String, String>,
    /// Admission fields (spec 04 §10-§11), enforced by
    /// [`super::admission`] before the first step.
    #[serde(flatten)]
    pub admission: AdmissionPolicy,
    /// Used when every local step is exhausted (spec 04 §7).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fallback_provider: Option<crate::logic::http::api::provider::FallbackProvider>,
    /// `min_share`: the share of a model's capacity reserved for each
    /// priority class (interactive, standard, batch; 0: none), so that a
    /// class finds a free slot while others saturate the model.
    #[serde(skip)]
    pub min_share: [f64; 3],
    /// `tenant_headroom`: slots of a contended model that a flooding
    /// tenant leaves free for calm ones ([`super::wait_queue::tenant_slots`]; 0:
    /// none).
    #[serde(skip)]
    pub tenant_headroom: u32,
}

/// Whether a request of class `class` must leave the model's free slots
/// to other classes: taking one would leave fewer free slots than the
/// other classes' unmet reservations (`floor(share x capacity)` minus
/// what they run). `running`: requests in flight per class.
pub fn reserved_for_others(
    min_share: &[f64; 3],
    class: usize,
    capacity: u64,
    in_flight: u64,
    running: &[u32; 3],
) -> bool {
    let free = capacity.saturating_sub(in_flight);
    let mut unmet = 0u64;
    for (c, (share, run)) in min_share.iter().zip(running).enumerate() {
        if c == class || *share <= 0.0 {
            continue;
        }
        let reserved = (share * capacity as f64).floor() as u64;
        unmet += reserved.saturating_sub(u64::from(*run));
    }
    unmet > 0 && free <= unmet
}

/// How a policy's admission treats keys (spec 04 §10).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Capacity reserved for the operator's tenants: no per-key B4 gates.
    #[default]
    Reserved,
    /// Shared capacity: per-key occupancy share, ITPM and OTPM apply.
    Serverless,
}

/// The admission fields of a policy (`0` = unset).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct AdmissionPolicy {
    /// `reserved` or `serverless`.
    pub mode: Mode,
    /// B1: largest input-token estimate accepted.
    #[serde(skip_serializing_if = "is_zero")]
    pub max_input_tokens: u64,
    /// B1: most image parts accepted.
    #[serde(skip_serializing_if = "is_zero")]
    pub images_max: u64,
    /// B2: tokens in flight per healthy replica (before the admit fraction).
    #[serde(skip_serializing_if = "is_zero")]
    pub admit_budget_tokens: u64,
    /// B2: requests in flight per healthy replica.
    #[serde(skip_serializing_if = "is_zero")]
    pub max_inflight: u64,
    /// B3: shed when the mean engine signal over healthy agents violates
    /// a rule (only `kv_cache_utilization` and `waiting_requests`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shed_if: Vec<Rule>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl AdmissionPolicy {
    /// Whether the B2 occupancy gate applies.
    pub fn occupancy(&self) -> bool {
        self.admit_budget_tokens > 0 || self.max_inflight > 0
    }

    /// Whether any gate applies at all (the hot path skips the rest).
    pub fn any(&self) -> bool {
        self.mode == Mode::Serverless
            || self.max_input_tokens > 0
            || self.images_max > 0
            || self.occupancy()
            || !self.shed_if.is_empty()
    }
}

impl Default for Policy {
    /// The built-in default: least-loaded over every agent, no fallback.
    fn default() -> Self {
        Policy {
            models: Vec::new(),
            steps: vec![Step {
                name: "routing_policy".into(),
                matcher: Match::default(),
                exclude_if: Vec::new(),
                max_tries: 0,
                affinity: None,
            }],
            aliases: BTreeMap::new(),
            admission: AdmissionPolicy::default(),
            fallback_provider: None,
            min_share: [0.0; 3],
            tenant_headroom: super::wait_queue::tenant_slots::DEFAULT_HEADROOM,
        }
    }
}

mod parse;
pub use parse::{parse, PolicyError};

mod select;
pub use select::*;

/// A request's cursor over the steps of its policy snapshot.
#[derive(Debug, Clone)]
pub struct Session {
    /// Current step index.
    pub step: usize,
    /// Tries used in this step.
    pub tries: u32,
    /// Agents that failed in this step.
    pub failed: Vec<u64>,
    /// Gate counts per step visited (for the exhaustion log).
    pub trail: Vec<(usize, GateCounts)>,
    steps: usize,
    default_tries: u32,
}

impl Session {
    /// Start at the primary step.
    pub fn new(policy: &Policy, default_tries: u32) -> Self {
        Session {
            step: 0,
            tries: 0,
            failed: Vec::new(),
            trail: Vec::new(),
            steps: policy.steps.len(),
            default_tries: default_tries.max(1),
        }
    }

    /// Whether every step is used up.
    pub fn exhausted(&self) -> bool {
        self.step >= self.steps
    }

    /// Move to the next step.
    pub fn advance(&mut self) {
        self.step += 1;
        self.tries = 0;
        self.failed.clear();
    }

    /// A retryable failure on `agent`: exclude it in this step; advance
    /// when the step's tries are used up.
    pub fn record_failure(&mut self, policy: &Policy, agent: u64) {
        self.failed.push(agent);
        self.tries += 1;
        let max = policy
            .steps
            .get(self.step)
            .map(|s| s.max_tries)
            .filter(|m| *m > 0)
            .unwrap_or(self.default_tries);
        if self.tries >= max {
            self.advance();
        }
    }
}

#[cfg(test)]
mod tests;
