//! Tenant series of `/metrics` (spec 06 §2): per-(tenant, key, model)
//! counters and the request-duration histogram summed over shards, the
//! quota gauges from the key snapshot, today's token usage per bucket,
//! admission rejections, and the audit writer's health. Series exist only
//! for configured keys (a random bearer token is refused before any
//! counter is touched), so cardinality is bounded by the configuration.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::exposition::{esc, write_histogram};
use crate::logic::tenancy::quota;
use crate::runtime::state::audit::AuditLog;
use crate::runtime::state::model::stats::{TenantStats, DURATION_BUCKETS};
use crate::runtime::state::tenancy::AuthState;
use crate::runtime::state::views::ShardSnapshot;

fn head(o: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(o, "# HELP {name} {help}");
    let _ = writeln!(o, "# TYPE {name} {kind}");
}

type TenantKey = (Arc<str>, Arc<str>, String);

/// Render the tenant series.
pub fn render(
    o: &mut String,
    snaps: &[ShardSnapshot],
    auth: &AuthState,
    today: u64,
    audit: Option<&AuditLog>,
    refused_before_hold: &crate::runtime::state::hold_book::QuotaRefusals,
) {
    let mut by: BTreeMap<TenantKey, TenantStats> = BTreeMap::new();
    let mut rejections: BTreeMap<(&'static str, String), u64> = BTreeMap::new();
    let mut healthy: BTreeMap<&str, u64> = BTreeMap::new();
    for s in snaps {
        for a in &s.agents {
            *healthy.entry(a.reg.model.as_str()).or_default() += u64::from(a.healthy);
        }
        for (m, st) in &s.models {
            for (t, k, ts) in st
                .tenants
                .iter()
                .flat_map(|(t, ks)| ks.iter().map(move |(k, ts)| (t, k, ts)))
            {
                let e = by.entry((t.clone(), k.clone(), m.clone())).or_default();
                e.success += ts.success;
                e.failed += ts.failed;
                e.input_tokens += ts.input_tokens;
                e.output_tokens += ts.output_tokens;
                e.rate_limited += ts.rate_limited;
                e.token_limited += ts.token_limited;
                e.duration.merge(&ts.duration);
                e.last_request = e.last_request.max(ts.last_request);
            }
            for (reason, n) in &st.admission_rejections {
                *rejections.entry((reason, m.clone())).or_default() += n;
            }
        }
    }
    type Get = fn(&TenantStats) -> u64;
    let per_model: [(&str, &str, Get); 4] = [
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
        head(o, name, "counter", help);
        for ((t, k, m), ts) in &by {
            let _ = writeln!(
                o,
                "{name}{{tenant_id=\"{}\",key_id=\"{}\",deployment_id=\"unset\",model=\"{}\"}} {}",
                esc(t),
                esc(k),
                esc(m),
                get(ts)
            );
        }
    }
    // Per key, summed over models.
    // (rate limited, token limited, last request) per key.
    type PerKey = BTreeMap<(Arc<str>, Arc<str>), (u64, u64, u64)>;
    let mut per_key: PerKey = BTreeMap::new();
    for ((t, k, _), ts) in &by {
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
    head(
        o,
        "hivenet_tenant_rate_limited_total",
        "counter",
        "Requests refused by requests per minute.",
    );
    for ((t, k), (n, _, _)) in &per_key {
        let _ = writeln!(
            o,
            "hivenet_tenant_rate_limited_total{{tenant_id=\"{}\",key_id=\"{}\"}} {n}",
            esc(t),
            esc(k)
        );
    }
    head(
        o,
        "hivenet_tenant_token_limited_total",
        "counter",
        "Requests refused by the daily token budget.",
    );
    for ((t, k), (_, n, _)) in &per_key {
        let _ = writeln!(
            o,
            "hivenet_tenant_token_limited_total{{tenant_id=\"{}\",key_id=\"{}\",deployment_id=\"unset\",phase=\"input\"}} {n}",
            esc(t),
            esc(k)
        );
    }
    head(
        o,
        "hivenet_tenant_last_request_timestamp",
        "gauge",
        "Unix seconds of the key's last request.",
    );
    for ((t, k), (_, _, ts)) in &per_key {
        let _ = writeln!(
            o,
            "hivenet_tenant_last_request_timestamp{{tenant_id=\"{}\",key_id=\"{}\",deployment_id=\"unset\"}} {ts}",
            esc(t),
            esc(k)
        );
    }
    head(
        o,
        "hivenet_tenant_request_duration_seconds",
        "histogram",
        "Client-visible duration of successful responses, at their end (streams included).",
    );
    for ((t, k, m), ts) in &by {
        if ts.duration.count == 0 {
            continue;
        }
        let labels = format!(
            "tenant_id=\"{}\",key_id=\"{}\",deployment_id=\"unset\",model=\"{}\"",
            esc(t),
            esc(k),
            esc(m)
        );
        write_histogram(
            o,
            "hivenet_tenant_request_duration_seconds",
            &labels,
            &DURATION_BUCKETS,
            &ts.duration,
        );
    }
    head(
        o,
        "hivenet_admission_rejections_total",
        "counter",
        "Requests refused by admission, by reason (b4_rpm: requests per minute).",
    );
    for ((reason, m), n) in &rejections {
        let _ = writeln!(
            o,
            "hivenet_admission_rejections_total{{reason=\"{reason}\",model=\"{}\"}} {n}",
            esc(m)
        );
    }
    head(
        o,
        "hivenet_tenant_quota_rpm_limit",
        "gauge",
        "Flat requests-per-minute limit (0: unlimited).",
    );
    for (t, l) in &auth.tenant_limits {
        if let Some((rpm, _)) = l.flat {
            let _ = writeln!(
                o,
                "hivenet_tenant_quota_rpm_limit{{tenant_id=\"{}\"}} {rpm}",
                esc(t)
            );
        }
    }
    head(
        o,
        "hivenet_tenant_quota_tpd_limit",
        "gauge",
        "Flat tokens-per-day limit (0: unlimited).",
    );
    for (t, l) in &auth.tenant_limits {
        if let Some((_, tpd)) = l.flat {
            let _ = writeln!(
                o,
                "hivenet_tenant_quota_tpd_limit{{tenant_id=\"{}\"}} {tpd}",
                esc(t)
            );
        }
    }
    head(o, "hivenet_tenant_per_model_quota_rpm_limit", "gauge", "Effective per-model requests-per-minute limit (per replica x healthy replicas, at least one).");
    for (t, l) in &auth.tenant_limits {
        for (m, (rpm, _)) in &l.per_model {
            let replicas = healthy.get(m.as_str()).copied().unwrap_or(0).max(1);
            let _ = writeln!(
                o,
                "hivenet_tenant_per_model_quota_rpm_limit{{tenant_id=\"{}\",model=\"{}\"}} {}",
                esc(t),
                esc(m),
                rpm.saturating_mul(replicas)
            );
        }
    }
    head(
        o,
        "hivenet_tenant_per_model_quota_tpd_limit",
        "gauge",
        "Per-model tokens-per-day limit (0: unlimited).",
    );
    for (t, l) in &auth.tenant_limits {
        for (m, (_, tpd)) in &l.per_model {
            let _ = writeln!(
                o,
                "hivenet_tenant_per_model_quota_tpd_limit{{tenant_id=\"{}\",model=\"{}\"}} {tpd}",
                esc(t),
                esc(m)
            );
        }
    }
    head(
        o,
        "hivenet_tenant_tokens_used_today",
        "gauge",
        "Tokens charged today (UTC) per bucket (model empty: the tenant's flat bucket).",
    );
    for ((t, m), b) in &auth.buckets {
        let used = quota::used_on(b.daily.load(Ordering::Relaxed), today);
        let _ = writeln!(
            o,
            "hivenet_tenant_tokens_used_today{{tenant_id=\"{}\",model=\"{}\"}} {used}",
            esc(t),
            esc(m)
        );
    }
    if let Some(a) = audit {
        head(
            o,
            "hivenet_audit_records_written_total",
            "counter",
            "Audit lines written.",
        );
        let _ = writeln!(
            o,
            "hivenet_audit_records_written_total {}",
            a.written.load(Ordering::Relaxed)
        );
        head(
            o,
            "hivenet_audit_records_dropped_total",
            "counter",
            "Audit records dropped because the writer was behind (serving never waits for it).",
        );
        let _ = writeln!(
            o,
            "hivenet_audit_records_dropped_total {}",
            a.dropped.load(Ordering::Relaxed)
        );
        head(
            o,
            "hivenet_audit_write_errors_total",
            "counter",
            "Failed audit writes or flushes.",
        );
        let _ = writeln!(
            o,
            "hivenet_audit_write_errors_total {}",
            a.write_errors.load(Ordering::Relaxed)
        );
    }
}
