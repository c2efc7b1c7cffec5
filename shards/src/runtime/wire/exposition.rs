//! The Prometheus text format (0.0.4), one way for every family: a
//! [`Family`] writes its `# HELP` and `# TYPE` once, then its series, each
//! with the family's label names (a fixed array: the compiler checks every
//! series names the same labels), label values escaped straight into the
//! output (no allocation per label).
//!
//! Measured against the `prometheus` and `prometheus-client` crates
//! (`scripts/bench/metrics-renderers.sh`, `perf/2026-12-02-metrics-renderers`):
//! prometheus-client's collector renders from snapshots fast enough, but
//! only as OpenMetrics (`# EOF`, counters' `# TYPE` without `_total`), a
//! change of the wire format scrapers read today.

use std::fmt::{self, Display, Write as _};

use serde::Serialize;

/// A family's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up (resets with the process or the lifetime reset).
    Counter,
    /// Any value.
    Gauge,
    /// Cumulative buckets, sum and count.
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// Writes what it is given with label-value escaping (`\`, `"`, newline).
struct Escaped<'o>(&'o mut String);

impl fmt::Write for Escaped<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        // Most values need no escape: copied whole.
        if !s.bytes().any(|b| matches!(b, b'\\' | b'"' | b'\n')) {
            self.0.push_str(s);
            return Ok(());
        }
        for ch in s.chars() {
            match ch {
                '\\' => self.0.push_str("\\\\"),
                '"' => self.0.push_str("\\\""),
                '\n' => self.0.push_str("\\n"),
                c => self.0.push(c),
            }
        }
        Ok(())
    }
}

/// One family being written; `N` label names.
pub struct Family<'o, const N: usize> {
    o: &'o mut String,
    name: &'static str,
    labels: [&'static str; N],
}

// === impl Family ===

impl<'o, const N: usize> Family<'o, N> {
    /// Start the family `name` (its `# HELP` and `# TYPE` lines).
    pub fn new(
        o: &'o mut String,
        name: &'static str,
        kind: Kind,
        help: &str,
        labels: [&'static str; N],
    ) -> Self {
        let _ = writeln!(o, "# HELP {name} {help}");
        let _ = writeln!(o, "# TYPE {name} {}", kind.as_str());
        Family { o, name, labels }
    }

    /// The label braces of a series (none without labels), with `le` last
    /// when given.
    fn labels(&mut self, values: &[&dyn Display; N], le: Option<&dyn Display>) {
        if N == 0 && le.is_none() {
            return;
        }
        self.o.push('{');
        for (i, (name, value)) in self.labels.iter().zip(values).enumerate() {
            if i > 0 {
                self.o.push(',');
            }
            self.o.push_str(name);
            self.o.push_str("=\"");
            let _ = write!(Escaped(self.o), "{value}");
            self.o.push('"');
        }
        if let Some(le) = le {
            if N > 0 {
                self.o.push(',');
            }
            let _ = write!(self.o, "le=\"{le}\"");
        }
        self.o.push('}');
    }

    /// One series of a counter or gauge.
    pub fn series(&mut self, values: [&dyn Display; N], v: impl Display) {
        self.o.push_str(self.name);
        self.labels(&values, None);
        let _ = writeln!(self.o, " {v}");
    }

    /// One histogram series: cumulative `_bucket`s per bound and `+Inf`,
    /// `_sum`, `_count`.
    pub fn histogram(&mut self, values: [&dyn Display; N], bounds: &[f64], h: &Histogram) {
        let mut cum = 0u64;
        for (i, b) in bounds.iter().enumerate() {
            cum += h.buckets.get(i).copied().unwrap_or(0);
            let _ = write!(self.o, "{}_bucket", self.name);
            self.labels(&values, Some(b));
            let _ = writeln!(self.o, " {cum}");
        }
        let _ = write!(self.o, "{}_bucket", self.name);
        self.labels(&values, Some(&"+Inf"));
        let _ = writeln!(self.o, " {}", h.count);
        let _ = write!(self.o, "{}_sum", self.name);
        self.labels(&values, None);
        let _ = writeln!(self.o, " {}", h.sum);
        let _ = write!(self.o, "{}_count", self.name);
        self.labels(&values, None);
        let _ = writeln!(self.o, " {}", h.count);
    }
}

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
