//! Prometheus text-format helpers shared by [`crate::runtime::metrics`] and
//! [`crate::runtime::metrics::tenants`].

use std::fmt::Write as _;

/// A label value escaped for the text format.
pub fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// One histogram series (`_bucket` cumulative per bound, `+Inf`, `_sum`,
/// `_count`) with `labels` already rendered.
pub fn write_histogram(
    o: &mut String,
    name: &str,
    labels: &str,
    bounds: &[f64],
    h: &crate::runtime::state::model::stats::Histogram,
) {
    let mut cum = 0u64;
    for (i, b) in bounds.iter().enumerate() {
        cum += h.buckets.get(i).copied().unwrap_or(0);
        let _ = writeln!(o, "{name}_bucket{{{labels},le=\"{b}\"}} {cum}");
    }
    let _ = writeln!(o, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(o, "{name}_sum{{{labels}}} {}", h.sum);
    let _ = writeln!(o, "{name}_count{{{labels}}} {}", h.count);
}
