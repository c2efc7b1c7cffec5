//! The per-step candidate pipeline (spec 04 §3-5): what it reads of an
//! agent ([`AgentFacts`]), its gates in order, and the choice
//! ([`select`], [`select_with`] for `prefix-aware` steps, the holder
//! helpers). Pure: agents are read through a closure, the rotation is
//! passed in.

use serde::Serialize;

use super::{Field, Match, Step};
use crate::logic::link::control::Capability;
use crate::logic::routing::affinity::{Holders, Outcome};

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
    /// The agent has failed and its probe is due (issue 51 #12): the
    /// failure gates (`consecutive_failures`, `success_rate`) and the
    /// tie-break against a failing agent let one request through, so a
    /// recovered agent gets traffic again even when requests come one at
    /// a time. Set by the state from [`probe_backoff`].
    pub probe_due: bool,
    /// Engine signals the agent reported (absent fields pass).
    pub signals: crate::logic::link::engine_metrics::EngineSignals,
    /// Host signals the agent reported (absent fields pass).
    pub hardware: crate::logic::link::hardware::HardwareSignals,
    /// GPU model the agent declared or read (empty: none known).
    pub gpu_model: &'a str,
}

/// How long a failing agent waits for its next probe: 1 s after its
/// last try, doubling with each consecutive failure up to 30 s.
pub fn probe_backoff(consecutive_failures: u64) -> std::time::Duration {
    let doublings = consecutive_failures.saturating_sub(1).min(5) as u32;
    std::time::Duration::from_secs(1 << doublings).min(std::time::Duration::from_secs(30))
}

impl AgentFacts<'_> {
    pub(crate) fn signal(&self, f: Field) -> Option<f64> {
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

/// The step's gates in order (health, capability, match, this request's
/// earlier failures, capacity, `exclude_if`): whether `a` passes them;
/// the gate that removes it is counted in `c`.
#[inline]
fn passes(
    step: &Step,
    cap: Capability,
    a: &AgentFacts<'_>,
    failed: &[u64],
    c: &mut GateCounts,
) -> bool {
    let count = if !a.healthy {
        &mut c.unhealthy
    } else if a.capability != cap {
        &mut c.capability
    } else if !a.matches(&step.matcher) {
        &mut c.unmatched
    } else if failed.contains(&a.id) {
        &mut c.prev_failed
    } else if a.capacity == 0 || a.active >= a.capacity {
        &mut c.at_capacity
    } else if step.exclude_if.iter().any(|r| {
        // A due probe passes the failure gates (one request per backoff).
        let probed =
            a.probe_due && matches!(r.field, Field::ConsecutiveFailures | Field::SuccessRate);
        !probed && a.signal(r.field).map(|v| r.violated(v)).unwrap_or(false)
    }) {
        &mut c.excluded
    } else {
        return true;
    };
    *count += 1;
    false
}

/// The gate of `step` that removes `a` for this request, or `eligible`
/// (a traced request's verdict per agent; the gates of [`passes`]).
pub fn verdict(step: &Step, cap: Capability, a: &AgentFacts<'_>, failed: &[u64]) -> &'static str {
    let mut c = GateCounts::default();
    if passes(step, cap, a, failed, &mut c) {
        "eligible"
    } else if c.unhealthy > 0 {
        "unhealthy"
    } else if c.capability > 0 {
        "capability_mismatch"
    } else if c.unmatched > 0 {
        "unmatched"
    } else if c.prev_failed > 0 {
        "prev_failed"
    } else if c.at_capacity > 0 {
        "at_capacity"
    } else {
        "exclude_if"
    }
}

/// [`select`], and for a `prefix-aware` step the cache holders of the
/// request: the most recent eligible holder that carries at most
/// `load_band` of its capacity more than the least-loaded eligible agent
/// is chosen (never a full, excluded or failed one: the gates run first);
/// otherwise least-loaded, as [`Outcome::Overloaded`] when a holder was
/// there and [`Outcome::Miss`] when none. `None` for least-loaded steps.
///
/// The most recent, not the least loaded: an engine's cache evicts the
/// least recently used, so the holder that served the prefix last is the
/// one most likely to hold it still, and sending a prefix's requests
/// there until it is full keeps each engine's cache on few prefixes.
/// Spreading them over every holder made each engine hold several
/// applications' prompts in turn, which its cache could not keep: 65 %
/// of the predicted cached tokens came back on the GPU-shaped fleet
/// (perf/2026-12-06-affinity-lead).
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
        if !passes(step, cap, &a, failed, &mut c) {
            continue;
        }
        let (act, capy) = (u64::from(a.active), u64::from(a.capacity));
        let failing = a.consecutive_failures.unwrap_or(0) > 0 && !a.probe_due;
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
            // util(holder) <= util(best) + band: ha/hc <= ba/bc + band.
            let floor = (ba as f64) / (bc as f64) + cfg.load_band;
            let within =
                |a: &AgentFacts<'_>| f64::from(a.active) / f64::from(a.capacity.max(1)) <= floor;
            match freshest_holder(step, cap, n, &get, failed, holders, within) {
                Some(h) => (StepPick::Agent(h), Some(Outcome::hit(holders.kind))),
                None => (StepPick::Agent(i), Some(Outcome::Overloaded)),
            }
        }
        None if c.at_capacity > 0 && c.excluded == 0 && c.unmatched == 0 && c.capability == 0 => {
            // A wait, not a decision: the outcome is counted when it is sent.
            (StepPick::Full(c), None)
        }
        None => (StepPick::Empty(c), None),
    }
}

/// The most recent holder of the request's prefix that passes every gate
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
    freshest_holder(step, cap, n, &get, failed, holders, |_| true)
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

/// The first eligible holder, most recent first, that `ok` accepts.
fn freshest_holder<'a>(
    step: &Step,
    cap: Capability,
    n: usize,
    get: &impl Fn(usize) -> Option<AgentFacts<'a>>,
    failed: &[u64],
    holders: &Holders,
    ok: impl Fn(&AgentFacts<'a>) -> bool,
) -> Option<usize> {
    holders_in_pool(n, get, holders)
        .find(|(_, a)| eligible(step, cap, a, failed) && ok(a))
        .map(|(i, _)| i)
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
