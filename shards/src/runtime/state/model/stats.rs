//! Per-model statistics: plain counters and histograms on the model's
//! shard, summed over shards at scrape.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;

/// `hivenet_request_duration_seconds` buckets (spec 06).
pub const DURATION_BUCKETS: [f64; 9] = [0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0];

/// `http_server_request_duration_seconds` buckets (spec 06: 0.005 to 60 s,
/// 13 of them).
pub const HTTP_BUCKETS: [f64; 13] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Every route label: the endpoints' patterns, then `unmatched` (a
/// bounded set, whatever clients send).
pub const ROUTES: [&str; 20] = [
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/models",
    "/health",
    "/ready",
    "/admin/routing-table",
    "/admin/health",
    "/admin/policy",
    "/admin/metrics/reset",
    "/admin/sibling-map",
    "/admin/api-keys",
    "/admin/registrations/stream",
    "/v1/models/:model",
    "/admin/models/:model",
    "/admin/policy/models/:model",
    "/admin/api-keys/:id",
    "unmatched",
];

/// Where [`ROUTES`]' patterns with a parameter begin.
const PREFIXED_FROM: usize = 15;

/// The index in [`ROUTES`] of a request path's route.
pub fn route_index(path: &str) -> usize {
    if let Some(i) = ROUTES[..PREFIXED_FROM].iter().position(|r| *r == path) {
        return i;
    }
    const PREFIXES: [&str; 4] = [
        "/v1/models/",
        "/admin/models/",
        "/admin/policy/models",
        "/admin/api-keys/",
    ];
    PREFIXES
        .iter()
        .position(|p| path.starts_with(p))
        .map_or(ROUTES.len() - 1, |i| PREFIXED_FROM + i)
}

/// The route label of a request path: its endpoint's pattern, or
/// `unmatched`.
pub fn route_of(path: &str) -> &'static str {
    ROUTES[route_index(path)]
}

/// Every method label: the known methods, then `OTHER`.
pub const METHODS: [&str; 8] = [
    "GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH", "OTHER",
];

/// The index in [`METHODS`] of a method.
pub fn method_index(m: &str) -> usize {
    METHODS[..7].iter().position(|k| *k == m).unwrap_or(7)
}

/// The method label: a known method, else `OTHER`.
pub fn method_of(m: &str) -> &'static str {
    METHODS[method_index(m)]
}

/// `http_server_active_requests` by (method, route), process-wide: a
/// request may begin on one shard and end on another (a hand-over), so
/// the count is not a shard's. One relaxed add at a request's head and
/// one at its scope's end.
static ACTIVE: [std::sync::atomic::AtomicI64; 8 * 19] =
    [const { std::sync::atomic::AtomicI64::new(0) }; 8 * 19];

/// One request in flight, counted in `http_server_active_requests` until
/// dropped (with its scope, wherever that ends).
#[derive(Debug)]
pub struct ActiveRequest(usize);

impl ActiveRequest {
    /// Count a request of `method` on `path` as active.
    pub fn begin(method: &str, path: &str) -> Self {
        let i = method_index(method) * ROUTES.len() + route_index(path);
        if let Some(a) = ACTIVE.get(i) {
            a.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        ActiveRequest(i)
    }
}

impl Drop for ActiveRequest {
    fn drop(&mut self) {
        if let Some(a) = ACTIVE.get(self.0) {
            a.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// The (method, route) pairs with requests in flight, and how many.
pub fn active_requests() -> Vec<(&'static str, &'static str, i64)> {
    let mut out = Vec::new();
    for (i, a) in ACTIVE.iter().enumerate() {
        let n = a.load(std::sync::atomic::Ordering::Relaxed);
        if n != 0 {
            out.push((METHODS[i / ROUTES.len()], ROUTES[i % ROUTES.len()], n));
        }
    }
    out
}

/// Every request's duration by (method, route, status) on one shard: a
/// short list, scanned (no allocation once a key has been seen).
pub type HttpDurations = Vec<((&'static str, &'static str, u16), Histogram)>;

/// Add one request to `d`.
pub fn observe_http(d: &mut HttpDurations, key: (&'static str, &'static str, u16), secs: f64) {
    match d.iter_mut().find(|(k, _)| *k == key) {
        Some((_, h)) => h.observe(&HTTP_BUCKETS, secs),
        None => {
            let mut h = Histogram::default();
            h.observe(&HTTP_BUCKETS, secs);
            d.push((key, h));
        }
    }
}

pub use super::fairness::QUEUE_BUCKETS;

pub use crate::runtime::wire::exposition::Histogram;

/// One agent's duration series for one status.
#[derive(Debug, Clone, Serialize)]
pub struct DurationSeries {
    /// The agent's peer ID (label).
    pub peer_id: String,
    /// The observations.
    pub hist: Histogram,
}

/// Region and engine of an agent, and the tenant (the routing counters' labels).
pub type RegionEngine = (Arc<str>, Arc<str>, Arc<str>);

/// A tenant's counters on one model (labels `tenant_id`, `key_id`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct TenantStats {
    /// Client-visible successes.
    pub success: u64,
    /// Client-visible failures (every error answer, 499 included).
    pub failed: u64,
    /// Input tokens of successful responses.
    pub input_tokens: u64,
    /// Output tokens of successful responses.
    pub output_tokens: u64,
    /// Refused by requests per minute.
    pub rate_limited: u64,
    /// Refused by the daily token budget.
    pub token_limited: u64,
    /// Requests that waited in the capacity queue for a slot, and their
    /// waits summed (microseconds).
    pub queue_waits: u64,
    pub queue_wait_us: u64,
    /// Client-visible duration of successful responses, at their end.
    pub duration: Histogram,
    /// Unix seconds of the last request.
    pub last_request: u64,
}

impl TenantStats {
    /// Add one shard's statistics of the same (tenant, key, model).
    pub fn add_shard(&mut self, ts: &TenantStats) {
        self.success += ts.success;
        self.failed += ts.failed;
        self.input_tokens += ts.input_tokens;
        self.output_tokens += ts.output_tokens;
        self.rate_limited += ts.rate_limited;
        self.token_limited += ts.token_limited;
        self.queue_waits += ts.queue_waits;
        self.queue_wait_us += ts.queue_wait_us;
        self.duration.merge(&ts.duration);
        self.last_request = self.last_request.max(ts.last_request);
    }
}

/// Per-model routing counters.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ModelStats {
    /// Successful forwards by (region, engine).
    pub routed: BTreeMap<RegionEngine, u64>,
    /// Failed forward attempts and exhaustions by (region, engine).
    pub failed: BTreeMap<RegionEngine, u64>,
    /// Served by the primary step.
    pub primary_routed: u64,
    /// Served by a fallback step.
    pub fallback_routed: u64,
    /// Every step exhausted.
    pub exhausted: u64,
    /// Fairness: waits, admitted and refused by priority class (the
    /// feature's own counters and families: [`super::fairness`]).
    pub classes: super::fairness::ClassStats,
    /// Waiters now (filled at snapshot).
    pub queue_depth: usize,
    /// Client-visible duration of completed responses (first request byte
    /// to last response byte, streams included), by (agent id, status).
    pub durations: BTreeMap<(u64, u16, Arc<str>), DurationSeries>,
    /// Per tenant, then key ID.
    pub tenants: BTreeMap<Arc<str>, BTreeMap<Arc<str>, TenantStats>>,
    /// `hivenet_admission_rejections_total{reason}` on this model.
    pub admission_rejections: BTreeMap<&'static str, u64>,
    /// `hivenet_admission_*` gauges (filled at snapshot).
    pub admission: super::admission::Gauges,
    /// `hivenet_agent_connection_resets_total{reason}`: exchanges with an
    /// agent cut by the transport or a deadline (`forward_failure` before
    /// the head, `stream_cut` while relaying, `deadline`).
    pub connection_resets: BTreeMap<&'static str, u64>,
    /// Stream continuity: how broken streams ended ([`super::continuity`]).
    pub continuity: super::continuity::ContinuityStats,
    /// Responses API requests by kind ([`super::conversations`]).
    pub responses: super::conversations::ResponsesStats,
    /// Requests sent to the policy's fallback provider (spec 04 §7).
    pub provider_fallback: u64,
    /// Responses whose usage was clamped to the request's bound.
    pub usage_clamped: u64,
    /// Cache affinity: decisions, stale hits, holder waits, the learned
    /// miss cost ([`super::affinity`]).
    pub affinity: super::affinity::AffinityStats,
    /// Backend failures reported by agents, by status (502 closed or
    /// malformed, 503 unreachable or busy, 504 timed out).
    pub backend_errors: BTreeMap<u16, u64>,
    /// `http_client_request_duration_seconds{provider,status_code}`:
    /// provider calls, status 0 on a transport error.
    pub provider_calls: BTreeMap<(&'static str, u16), Histogram>,
}

/// `http_client_request_duration_seconds` buckets (spec 06: 0.05 to 120 s,
/// 11 of them).
pub const CLIENT_BUCKETS: [f64; 11] =
    [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

impl ModelStats {
    /// Add one shard's statistics of the model (the per-model totals of
    /// `/metrics`): counters summed, the wait histogram merged; a model
    /// lives on one shard, so its admission gauges are taken as they are.
    pub fn add_shard(&mut self, st: &ModelStats) {
        self.primary_routed += st.primary_routed;
        self.fallback_routed += st.fallback_routed;
        self.exhausted += st.exhausted;
        self.queue_depth += st.queue_depth;
        self.classes.add(&st.classes);
        for (reason, n) in &st.connection_resets {
            *self.connection_resets.entry(reason).or_default() += n;
        }
        self.continuity.add(&st.continuity);
        self.responses.add(&st.responses);
        self.provider_fallback += st.provider_fallback;
        self.usage_clamped += st.usage_clamped;
        self.affinity.add(&st.affinity);
        for (k, n) in &st.backend_errors {
            *self.backend_errors.entry(*k).or_default() += n;
        }
        for (k, h) in &st.provider_calls {
            self.provider_calls.entry(*k).or_default().merge(h);
        }
        if st.admission.active {
            self.admission = st.admission;
        }
    }

    /// Record one completed response of agent `id`.
    pub fn observe_duration(
        &mut self,
        id: u64,
        peer_id: &str,
        status: u16,
        tenant: Arc<str>,
        secs: f64,
    ) {
        self.durations
            .entry((id, status, tenant))
            .or_insert_with(|| DurationSeries {
                peer_id: peer_id.to_string(),
                hist: Histogram::default(),
            })
            .hist
            .observe(&DURATION_BUCKETS, secs);
    }

    /// The counters of (tenant, key); the names are cloned only the first
    /// time (no shared reference count touched per request after that).
    pub fn tenant(&mut self, tenant: &Arc<str>, key: &Arc<str>) -> Option<&mut TenantStats> {
        if !self.tenants.contains_key(&**tenant) {
            self.tenants.insert(tenant.clone(), BTreeMap::new());
        }
        let keys = self.tenants.get_mut(&**tenant)?;
        if !keys.contains_key(&**key) {
            keys.insert(key.clone(), TenantStats::default());
        }
        keys.get_mut(&**key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_sum_and_merge() {
        let mut h = Histogram::default();
        h.observe(&QUEUE_BUCKETS, 0.005);
        h.observe(&QUEUE_BUCKETS, 0.03);
        h.observe(&QUEUE_BUCKETS, 100.0);
        assert_eq!(h.buckets.len(), QUEUE_BUCKETS.len() + 1);
        assert_eq!(h.buckets[0], 1);
        assert_eq!(h.buckets[2], 1);
        assert_eq!(h.buckets[QUEUE_BUCKETS.len()], 1, "+Inf");
        assert_eq!(h.count, 3);
        let mut m = Histogram::default();
        m.merge(&h);
        m.merge(&h);
        assert_eq!(m.count, 6);
        assert_eq!(m.buckets[0], 2);
        assert!((m.sum - 2.0 * h.sum).abs() < 1e-9);
    }
}

/// The provider calls of models no agent registered on this shard: their
/// counters, for at most [`ProviderOnly::MAX`] model names (client
/// input); the rest share [`ProviderOnly::OTHER`].
#[derive(Default)]
pub struct ProviderOnly {
    models: std::collections::BTreeMap<String, ModelStats>,
}

impl ProviderOnly {
    /// Most model names kept apart.
    pub const MAX: usize = 256;
    /// The label of the others.
    pub const OTHER: &'static str = "_other_models";

    /// Count with `f` on `model`'s counters.
    pub fn count(&mut self, model: &str, f: impl FnOnce(&mut ModelStats)) {
        let key = if self.models.contains_key(model) || self.models.len() < Self::MAX {
            model
        } else {
            Self::OTHER
        };
        f(self.models.entry(key.to_string()).or_default());
    }

    /// Each model's counters.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &ModelStats)> {
        self.models.iter()
    }
}
