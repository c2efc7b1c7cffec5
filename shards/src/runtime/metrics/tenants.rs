//! Tenant series of `/metrics` (spec 06 §2): per-(tenant, key, model)
//! counters and the request-duration histogram summed over shards, the
//! quota gauges from the key snapshot, today's token usage per bucket,
//! admission rejections, and the audit writer's health. Series exist only
//! for configured keys (a random bearer token is refused before any
//! counter is touched), so cardinality is bounded by the configuration.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::logic::tenancy::quota;
use crate::runtime::services::audit::AuditLog;
use crate::runtime::state::model::stats::{TenantStats, DURATION_BUCKETS};
use crate::runtime::state::tenancy::AuthState;
use crate::runtime::state::views::ShardSnapshot;
use crate::runtime::wire::exposition::Family;
use crate::runtime::wire::exposition::Kind::{Counter, Gauge, Histogram};

type TenantKey = (Arc<str>, Arc<str>, String);

/// Rejection counts by (reason, model).
type Rejections = BTreeMap<(&'static str, String), u64>;

/// What the tenant series sum over shards.
struct Totals<'s> {
    /// Per (tenant, key, model).
    by: BTreeMap<TenantKey, TenantStats>,
    rejections: Rejections,
    /// Healthy agents per model.
    healthy: BTreeMap<&'s str, u64>,
}

impl<'s> Totals<'s> {
    fn of(snaps: &'s [ShardSnapshot]) -> Self {
        let mut t = Totals {
            by: BTreeMap::new(),
            rejections: BTreeMap::new(),
            healthy: BTreeMap::new(),
        };
        for s in snaps {
            for a in &s.agents {
                // A replica as the quota counts it: healthy and has served (51 #9).
                *t.healthy.entry(a.reg.model.as_str()).or_default() +=
                    u64::from(a.healthy && a.success > 0);
            }
            for (m, st) in &s.models {
                for (tenant, keys) in &st.tenants {
                    for (k, ts) in keys {
                        let key = (tenant.clone(), k.clone(), m.clone());
                        t.by.entry(key).or_default().add_shard(ts);
                    }
                }
                for (reason, n) in &st.admission_rejections {
                    *t.rejections.entry((reason, m.clone())).or_default() += n;
                }
            }
        }
        t
    }
}

/// Render the tenant series.
pub fn render(
    o: &mut String,
    snaps: &[ShardSnapshot],
    auth: &AuthState,
    today: u64,
    audit: Option<&AuditLog>,
    refused_before_hold: &crate::runtime::state::hold_book::QuotaRefusals,
) {
    let t = Totals::of(snaps);
    render_usage(o, &t.by);
    render_per_key(o, &t.by, refused_before_hold);
    render_durations(o, &t.by);
    let mut f = Family::new(
        o,
        "hivenet_admission_rejections_total",
        Counter,
        "Requests refused by admission, by reason (b4_rpm: requests per minute).",
        ["reason", "model"],
    );
    for ((reason, m), n) in &t.rejections {
        f.series([reason, m], n);
    }
    render_quotas(o, auth, &t.healthy, today);
    if let Some(a) = audit {
        render_audit(o, a);
    }
}

/// The labels of the per (tenant, key, model) series.
const USAGE_LABELS: [&str; 4] = ["tenant_id", "key_id", "deployment_id", "model"];

/// Per (tenant, key, model): outcomes and tokens.
fn render_usage(o: &mut String, by: &BTreeMap<TenantKey, TenantStats>) {
    type Get = fn(&TenantStats) -> u64;
    let per_model: [(&'static str, &str, Get); 4] = [
        (
            "hivenet_tenant_requests_success_total",
            "Client-visible successes.",
            |t| t.success,
        ),
        (
            "hivenet_tenant_requests_failed_total",
            "Client-visible failures (499 included).",
            |t| t.failed,
        ),
        (
            "hivenet_tenant_input_tokens_total",
            "Input tokens of successful responses.",
            |t| t.input_tokens,
        ),
        (
            "hivenet_tenant_output_tokens_total",
            "Output tokens of successful responses.",
            |t| t.output_tokens,
        ),
    ];
    for (name, help, get) in per_model {
        let mut f = Family::new(o, name, Counter, help, USAGE_LABELS);
        for ((t, k, m), ts) in by {
            f.series([t, k, &"unset", m], get(ts));
        }
    }
    // Fairness per tenant (issue 32): its mean wait is the ratio of the
    // two rates. Only the (tenant, key, model)s that waited.
    let mut f = Family::new(
        o,
        "hivenet_tenant_queue_waits_total",
        Counter,
        "Requests that waited in the capacity queue for a slot.",
        USAGE_LABELS,
    );
    for ((t, k, m), ts) in by {
        if ts.queue_waits > 0 {
            f.series([t, k, &"unset", m], ts.queue_waits);
        }
    }
    let mut f = Family::new(
        o,
        "hivenet_tenant_queue_wait_seconds_total",
        Counter,
        "Their waits in the capacity queue, summed.",
        USAGE_LABELS,
    );
    for ((t, k, m), ts) in by {
        if ts.queue_waits > 0 {
            f.series([t, k, &"unset", m], ts.queue_wait_us as f64 / 1e6);
        }
    }
}

/// The per (tenant, key, model) duration histogram.
fn render_durations(o: &mut String, by: &BTreeMap<TenantKey, TenantStats>) {
    let mut f = Family::new(
        o,
        "hivenet_tenant_request_duration_seconds",
        Histogram,
        "Client-visible duration of successful responses, at their end (streams included).",
        USAGE_LABELS,
    );
    for ((t, k, m), ts) in by {
        if ts.duration.count > 0 {
            f.histogram([t, k, &"unset", m], &DURATION_BUCKETS, &ts.duration);
        }
    }
}

/// Per key, summed over models: refusals (before a hold too) and the
/// last request's time.
fn render_per_key(
    o: &mut String,
    by: &BTreeMap<TenantKey, TenantStats>,
    refused_before_hold: &crate::runtime::state::hold_book::QuotaRefusals,
) {
    // (rate limited, token limited, last request) per key.
    type PerKey = BTreeMap<(Arc<str>, Arc<str>), (u64, u64, u64)>;
    let mut per_key: PerKey = BTreeMap::new();
    for ((t, k, _), ts) in by {
        let e = per_key.entry((t.clone(), k.clone())).or_default();
        e.0 += ts.rate_limited;
        e.1 += ts.token_limited;
        e.2 = e.2.max(ts.last_request);
    }
    for (tk, (r, t)) in refused_before_hold {
        let e = per_key.entry(tk.clone()).or_default();
        e.0 += r;
        e.1 += t;
    }
    let mut f = Family::new(
        o,
        "hivenet_tenant_rate_limited_total",
        Counter,
        "Requests refused by requests per minute.",
        ["tenant_id", "key_id"],
    );
    for ((t, k), (n, _, _)) in &per_key {
        f.series([t, k], n);
    }
    let mut f = Family::new(
        o,
        "hivenet_tenant_token_limited_total",
        Counter,
        "Requests refused by the daily token budget.",
        ["tenant_id", "key_id", "deployment_id", "phase"],
    );
    for ((t, k), (_, n, _)) in &per_key {
        f.series([t, k, &"unset", &"input"], n);
    }
    let mut f = Family::new(
        o,
        "hivenet_tenant_last_request_timestamp",
        Gauge,
        "Unix seconds of the key's last request.",
        ["tenant_id", "key_id", "deployment_id"],
    );
    for ((t, k), (_, _, ts)) in &per_key {
        f.series([t, k, &"unset"], ts);
    }
}

/// The quota gauges from the key snapshot and today's usage per bucket.
fn render_quotas(o: &mut String, auth: &AuthState, healthy: &BTreeMap<&str, u64>, today: u64) {
    let mut f = Family::new(
        o,
        "hivenet_tenant_quota_rpm_limit",
        Gauge,
        "Flat requests-per-minute limit (0: unlimited).",
        ["tenant_id"],
    );
    for (t, l) in &auth.tenant_limits {
        if let Some((rpm, _)) = l.flat {
            f.series([t], rpm);
        }
    }
    let mut f = Family::new(
        o,
        "hivenet_tenant_quota_tpd_limit",
        Gauge,
        "Flat tokens-per-day limit (0: unlimited).",
        ["tenant_id"],
    );
    for (t, l) in &auth.tenant_limits {
        if let Some((_, tpd)) = l.flat {
            f.series([t], tpd);
        }
    }
    let mut f = Family::new(o, "hivenet_tenant_per_model_quota_rpm_limit", Gauge, "Effective per-model requests-per-minute limit (per replica x replicas that are healthy and have served, at least one).", ["tenant_id", "model"]);
    for (t, l) in &auth.tenant_limits {
        for (m, (rpm, _)) in &l.per_model {
            let replicas = healthy.get(m.as_str()).copied().unwrap_or(0).max(1);
            f.series([t, m], rpm.saturating_mul(replicas));
        }
    }
    let mut f = Family::new(
        o,
        "hivenet_tenant_per_model_quota_tpd_limit",
        Gauge,
        "Per-model tokens-per-day limit (0: unlimited).",
        ["tenant_id", "model"],
    );
    for (t, l) in &auth.tenant_limits {
        for (m, (_, tpd)) in &l.per_model {
            f.series([t, m], tpd);
        }
    }
    let mut f = Family::new(
        o,
        "hivenet_tenant_tokens_used_today",
        Gauge,
        "Tokens charged today (UTC) per bucket (model empty: the tenant's flat bucket).",
        ["tenant_id", "model"],
    );
    for ((t, m), b) in &auth.buckets {
        f.series(
            [t, m],
            quota::used_on(b.daily.load(Ordering::Relaxed), today),
        );
    }
}

/// The audit writer's health.
fn render_audit(o: &mut String, a: &AuditLog) {
    for (name, help, n) in [
        (
            "hivenet_audit_records_written_total",
            "Audit lines written.",
            &*a.written,
        ),
        (
            "hivenet_audit_records_dropped_total",
            "Audit records dropped because the writer was behind (serving never waits for it).",
            &a.dropped,
        ),
        (
            "hivenet_audit_write_errors_total",
            "Failed audit writes or flushes.",
            &*a.write_errors,
        ),
        (
            "hivenet_audit_rotations_total",
            "Audit files rotated to <path>.1 at HIVENET_ROUTER_AUDIT_MAX_BYTES.",
            &*a.rotations,
        ),
    ] {
        Family::new(o, name, Counter, help, []).series([], n.load(Ordering::Relaxed));
    }
}
