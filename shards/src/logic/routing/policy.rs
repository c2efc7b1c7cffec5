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
use crate::logic::routing::affinity::{Holders, Outcome};

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
    pub fallback_provider: Option<crate::logic::http::provider::FallbackProvider>,
    /// `min_share`: the share of a model's capacity reserved for each
    /// priority class (interactive, standard, batch; 0: none), so that a
    /// class finds a free slot while others saturate the model.
    #[serde(skip)]
    pub min_share: [f64; 3],
    /// `tenant_headroom`: slots of a contended model that a flooding
    /// tenant leaves free for calm ones ([`super::tenant_slots`]; 0:
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
            tenant_headroom: super::tenant_slots::DEFAULT_HEADROOM,
        }
    }
}

mod parse;
pub use parse::{parse, PolicyError};

// === evaluation ===

/// What the pipeline reads of one agent.
#[derive(Debug, Clone, Copy)]
pub struct AgentFacts<'a> {
    /// Shard-local id (for "failed earlier in this step").
    pub id: u64,
    /// Routable.
    pub healthy: bool,
    /// Declared capability.
    pub capability: Capability,
    /// Engine.
    pub engine: &'a str,
    /// Region.
    pub region: &'a str,
    /// Organization.
    pub organization: &'a str,
    /// Machine.
    pub machine: &'a str,
    /// Tags.
    pub tags: &'a [String],
    /// In flight.
    pub active: u32,
    /// Capacity.
    pub capacity: u32,
    /// Live SRTT (None: UNKNOWN).
    pub srtt: Option<f64>,
    /// Lifetime success rate (None: no history).
    pub success_rate: Option<f64>,
    /// Failures since the last success (None: no history).
    pub consecutive_failures: Option<u64>,
    /// Engine signals the agent reported (absent fields pass).
    pub signals: crate::logic::link::engine_metrics::EngineSignals,
    /// Host signals the agent reported (absent fields pass).
    pub hardware: crate::logic::link::hardware::HardwareSignals,
    /// GPU model the agent declared or read (empty: none known).
    pub gpu_model: &'a str,
}

impl AgentFacts<'_> {
    fn signal(&self, f: Field) -> Option<f64> {
        match f {
            Field::Srtt => self.srtt.filter(|v| *v > 0.0),
            Field::SuccessRate => self.success_rate,
            Field::ConsecutiveFailures => self.consecutive_failures.map(|v| v as f64),
            Field::CapacityUtilization => {
                (self.capacity > 0).then(|| f64::from(self.active) / f64::from(self.capacity))
            }
            Field::KvCacheUtilization => self.signals.kv_cache_utilization,
            Field::RunningRequests => self.signals.running_requests,
            Field::WaitingRequests => self.signals.waiting_requests,
            Field::AvgTtftSeconds => self.signals.avg_ttft_seconds,
            Field::P90TtftSeconds => self.signals.p90_ttft_seconds,
            Field::AvgItlSeconds => self.signals.avg_itl_seconds,
            Field::P90ItlSeconds => self.signals.p90_itl_seconds,
            Field::MemoryUsedPercent => self.hardware.memory_used_percent,
            Field::CpuUsagePercent => self.hardware.cpu_usage_percent,
            // Absent (no GPU reported) passes, as every missing signal.
            Field::GpuTemperatureC => self.hardware.gpu_temperature_c,
            Field::GpuUtilPercent => self.hardware.gpu_util_percent,
            Field::GpuVramUsedPercent => self.hardware.gpu_vram_used_percent,
        }
    }

    fn matches(&self, m: &Match) -> bool {
        (m.region.is_empty() || m.region == self.region)
            && (m.engine.is_empty() || m.engine == self.engine)
            && (m.organization.is_empty() || m.organization == self.organization)
            && (m.machine.is_empty() || m.machine == self.machine)
            && (m.capability.is_empty() || m.capability == self.capability.as_str())
            && (m.gpu_model.is_empty() || m.gpu_model == self.gpu_model)
            && m.tags.iter().all(|t| self.tags.contains(t))
    }
}

/// How many agents each gate removed in one step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct GateCounts {
    /// Agents of the model.
    pub pool: usize,
    /// Removed by health.
    pub unhealthy: usize,
    /// Removed by capability.
    pub capability: usize,
    /// Removed by match.
    pub unmatched: usize,
    /// Removed because they failed this request in this step.
    pub prev_failed: usize,
    /// Removed because full.
    pub at_capacity: usize,
    /// Removed by exclude_if.
    pub excluded: usize,
}

/// Result of one step's pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepPick {
    /// Use the agent at this index.
    Agent(usize),
    /// Candidates exist but all are full (queue-eligible).
    Full(GateCounts),
    /// No candidate.
    Empty(GateCounts),
}

/// Run one step over `n` agents read through `get`, skipping `failed` ids.
/// One pass, no sort, no copy.
pub fn select<'a>(
    step: &Step,
    cap: Capability,
    n: usize,
    get: impl Fn(usize) -> Option<AgentFacts<'a>>,
    failed: &[u64],
    rotation: usize,
) -> StepPick {
    select_with(step, cap, n, get, failed, rotation, &Holders::default()).0
}

/// [`select`], and for a `prefix-aware` step the cache holders of the
/// request: the least loaded eligible holder is chosen when it carries at
/// most `load_band` of its capacity more than the least-loaded eligible
/// agent (never a full, excluded or failed one: the gates run first);
/// otherwise least-loaded, as [`Outcome::Overloaded`] when a holder was
/// there and [`Outcome::Miss`] when none. `None` for least-loaded steps.
pub fn select_with<'a>(
    step: &Step,
    cap: Capability,
    n: usize,
    get: impl Fn(usize) -> Option<AgentFacts<'a>>,
    failed: &[u64],
    rotation: usize,
    holders: &Holders,
) -> (StepPick, Option<Outcome>) {
    let cfg = step.affinity.as_ref();
    let mut c = GateCounts {
        pool: n,
        ..GateCounts::default()
    };
    // (index, active, capacity, failing): at equal load, an agent whose
    // last request failed (a timeout on a hung backend among them) is
    // not preferred over one that answered (issue 29 #10).
    let mut best: Option<(usize, u64, u64, bool)> = None;
    let start = if n == 0 { 0 } else { rotation % n };
    for k in 0..n {
        let i = (start + k) % n;
        let Some(a) = get(i) else { continue };
        if !a.healthy {
            c.unhealthy += 1;
            continue;
        }
        if a.capability != cap {
            c.capability += 1;
            continue;
        }
        if !a.matches(&step.matcher) {
            c.unmatched += 1;
            continue;
        }
        if failed.contains(&a.id) {
            c.prev_failed += 1;
            continue;
        }
        if a.capacity == 0 || a.active >= a.capacity {
            c.at_capacity += 1;
            continue;
        }
        if step
            .exclude_if
            .iter()
            .any(|r| a.signal(r.field).map(|v| r.violated(v)).unwrap_or(false))
        {
            c.excluded += 1;
            continue;
        }
        let (act, capy) = (u64::from(a.active), u64::from(a.capacity));
        let failing = a.consecutive_failures.unwrap_or(0) > 0;
        let better = match best {
            None => true,
            Some((_, ba, bc, bf)) => {
                act * bc < ba * capy || (act * bc == ba * capy && bf && !failing)
            }
        };
        if better {
            best = Some((i, act, capy, failing));
        }
    }
    match best {
        Some((i, ba, bc, _)) => {
            let Some(cfg) = cfg else {
                return (StepPick::Agent(i), None);
            };
            if holders.is_empty() {
                return (StepPick::Agent(i), Some(Outcome::Miss));
            }
            // The holders (at most four) are looked up after the pass, not
            // tested at every agent of it: a hit at 1,000 agents cost 1.6-
            // 2.6 us more than least-loaded that way, this costs a few
            // binary searches.
            match least_loaded_holder(step, cap, n, &get, failed, holders) {
                // util(holder) <= util(best) + band, in integers where it
                // can be: ha/hc <= ba/bc + band.
                Some((h, ha, hc))
                    if (ha as f64) / (hc as f64) <= (ba as f64) / (bc as f64) + cfg.load_band =>
                {
                    (StepPick::Agent(h), Some(Outcome::hit(holders.kind)))
                }
                _ => (StepPick::Agent(i), Some(Outcome::Overloaded)),
            }
        }
        None if c.at_capacity > 0 && c.excluded == 0 && c.unmatched == 0 && c.capability == 0 => {
            // A wait, not a decision: the outcome is counted when it is sent.
            (StepPick::Full(c), None)
        }
        None => (StepPick::Empty(c), None),
    }
}

/// The least-loaded holder of the request's prefix that passes every gate
/// of `step`, whatever the load band (a request that waited for its
/// holders takes the slot it waited for).
pub fn free_holder<'a>(
    step: &Step,
    cap: Capability,
    n: usize,
    get: impl Fn(usize) -> Option<AgentFacts<'a>>,
    failed: &[u64],
    holders: &Holders,
) -> Option<usize> {
    least_loaded_holder(step, cap, n, &get, failed, holders).map(|(i, _, _)| i)
}

/// The holders (at most four) found in the pool: index and facts.
fn holders_in_pool<'a, 'g>(
    n: usize,
    get: &'g impl Fn(usize) -> Option<AgentFacts<'a>>,
    holders: &'g Holders,
) -> impl Iterator<Item = (usize, AgentFacts<'a>)> + 'g {
    holders.iter().filter_map(move |h| {
        let i = index_of(n, get, u64::from(h.agent))?;
        get(i).map(|a| (i, a))
    })
}

/// The eligible holder with the smallest share of its capacity in flight:
/// (index, in flight, capacity).
fn least_loaded_holder<'a>(
    step: &Step,
    cap: Capability,
    n: usize,
    get: &impl Fn(usize) -> Option<AgentFacts<'a>>,
    failed: &[u64],
    holders: &Holders,
) -> Option<(usize, u64, u64)> {
    let mut best: Option<(usize, u64, u64)> = None;
    for (i, a) in holders_in_pool(n, get, holders) {
        if !eligible(step, cap, &a, failed) {
            continue;
        }
        let (act, capy) = (u64::from(a.active), u64::from(a.capacity));
        if best.is_none_or(|(_, ba, bc)| act * bc < ba * capy) {
            best = Some((i, act, capy));
        }
    }
    best
}

/// Whether a holder of the request's prefix passes every gate of `step`
/// but capacity: it is full, and a slot will free on it (the wait of
/// `holder_wait_ms`). Asked only after an [`Outcome::Overloaded`].
pub fn holder_full<'a>(
    step: &Step,
    cap: Capability,
    n: usize,
    get: impl Fn(usize) -> Option<AgentFacts<'a>>,
    failed: &[u64],
    holders: &Holders,
) -> bool {
    holders_in_pool(n, &get, holders).any(|(_, a)| {
        a.capacity > 0
            && a.active >= a.capacity
            && eligible(step, cap, &AgentFacts { active: 0, ..a }, failed)
    })
}

/// Whether `a` passes every gate of `step` (the pass of [`select_with`],
/// without its counts).
fn eligible(step: &Step, cap: Capability, a: &AgentFacts<'_>, failed: &[u64]) -> bool {
    a.healthy
        && a.capability == cap
        && a.matches(&step.matcher)
        && !failed.contains(&a.id)
        && a.capacity > 0
        && a.active < a.capacity
        && !step
            .exclude_if
            .iter()
            .any(|r| a.signal(r.field).map(|v| r.violated(v)).unwrap_or(false))
}

/// Pool index of the agent whose id truncates to `id` (the index keeps 32
/// bits). Agents join a pool in the order of their ids, so a binary search
/// finds it; a scan covers a pool in any other order.
fn index_of<'a>(
    n: usize,
    get: &impl Fn(usize) -> Option<AgentFacts<'a>>,
    id: u64,
) -> Option<usize> {
    let key = |i: usize| get(i).map(|f| f.id & 0xffff_ffff);
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match key(mid) {
            Some(k) if k < id => lo = mid + 1,
            Some(k) if k > id => hi = mid,
            Some(_) => return Some(mid),
            None => break,
        }
    }
    (0..n).find(|&i| key(i) == Some(id))
}

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
