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

/// The route label of a request path: its endpoint's pattern, or
/// `unmatched` (a bounded set, whatever clients send).
pub fn route_of(path: &str) -> &'static str {
    const FIXED: [&str; 14] = [
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/embeddings",
        "/v1/rerank",
        "/v1/models",
        "/health",
        "/admin/routing-table",
        "/admin/health",
        "/admin/policy",
        "/admin/metrics/reset",
        "/admin/sibling-map",
        "/admin/api-keys",
        "/admin/registrations/stream",
    ];
    if let Some(r) = FIXED.iter().find(|r| **r == path) {
        return r;
    }
    const PREFIXED: [(&str, &str); 4] = [
        ("/v1/models/", "/v1/models/:model"),
        ("/admin/models/", "/admin/models/:model"),
        ("/admin/policy/models", "/admin/policy/models/:model"),
        ("/admin/api-keys/", "/admin/api-keys/:id"),
    ];
    PREFIXED
        .iter()
        .find(|(p, _)| path.starts_with(p))
        .map_or("unmatched", |(_, r)| r)
}

/// The method label: a known method, else `OTHER`.
pub fn method_of(m: &str) -> &'static str {
    ["GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH"]
        .into_iter()
        .find(|k| *k == m)
        .unwrap_or("OTHER")
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

/// `hivenet_queue_wait_seconds` buckets: 0.01 x 2^k, k = 0..12.
pub const QUEUE_BUCKETS: [f64; 13] = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96,
];

/// A histogram over fixed bucket bounds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Histogram {
    /// Counts per bucket, `+Inf` last (not cumulative).
    pub buckets: Vec<u64>,
    /// Sum of the observations.
    pub sum: f64,
    /// Observations.
    pub count: u64,
}

impl Histogram {
    /// Add one observation against `bounds`.
    pub fn observe(&mut self, bounds: &[f64], v: f64) {
        if self.buckets.len() != bounds.len() + 1 {
            self.buckets = vec![0; bounds.len() + 1];
        }
        let i = bounds.iter().position(|b| v <= *b).unwrap_or(bounds.len());
        if let Some(c) = self.buckets.get_mut(i) {
            *c += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Add another histogram over the same bounds.
    pub fn merge(&mut self, other: &Histogram) {
        if self.buckets.len() < other.buckets.len() {
            self.buckets.resize(other.buckets.len(), 0);
        }
        for (x, c) in self.buckets.iter_mut().zip(&other.buckets) {
            *x += c;
        }
        self.sum += other.sum;
        self.count += other.count;
    }
}

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
    /// Waits in the capacity queue that ended with a slot.
    pub wait: Histogram,
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
}

impl ModelStats {
    /// Add one shard's statistics of the model (the per-model totals of
    /// `/metrics`): counters summed, the wait histogram merged; a model
    /// lives on one shard, so its admission gauges are taken as they are.
    pub fn add_shard(&mut self, st: &ModelStats) {
        self.primary_routed += st.primary_routed;
        self.fallback_routed += st.fallback_routed;
        self.exhausted += st.exhausted;
        self.queue_depth += st.queue_depth;
        self.wait.merge(&st.wait);
        for (reason, n) in &st.connection_resets {
            *self.connection_resets.entry(reason).or_default() += n;
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

    /// Record one wait that ended with a slot.
    pub fn observe_wait(&mut self, secs: f64) {
        self.wait.observe(&QUEUE_BUCKETS, secs);
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
