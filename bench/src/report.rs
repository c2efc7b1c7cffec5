//! Recording and reporting: HDR histograms per metric, errors by status
//! and error code, a per-second timeline, the JSON report, a readable
//! table and an SVG plot (latency distribution and latency over time).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use hdrhistogram::Histogram;
use serde::Serialize;

fn hist() -> Histogram<u64> {
    // Microseconds, 3 significant digits, auto-resizing; a constant
    // configuration that cannot fail.
    let mut h = Histogram::<u64>::new(3).expect("3 significant digits is a valid histogram");
    h.auto(true);
    h
}

/// What one worker observed.
pub struct Recorder {
    /// From the intended send time to the end of the response.
    pub total: Histogram<u64>,
    /// From the actual send to the end of the response.
    pub service: Histogram<u64>,
    /// From the intended send time to the response headers.
    pub headers: Histogram<u64>,
    /// From the intended send time to the first SSE event.
    pub first_event: Histogram<u64>,
    /// From the intended send time to the first event with generated text.
    pub first_content: Histogram<u64>,
    /// Gaps between SSE events.
    pub gap: Histogram<u64>,
    /// Gaps between events with generated text (the inter-token gap).
    pub content_gap: Histogram<u64>,
    /// How late requests were sent against their schedule.
    pub send_lag: Histogram<u64>,
    /// Requests sent.
    pub sent: u64,
    /// Successful responses.
    pub ok: u64,
    /// Failures by HTTP status (`0` = transport).
    pub by_status: BTreeMap<u16, u64>,
    /// Failures by error code (envelope `error.code`, else `error.type`, else the transport reason).
    pub by_code: BTreeMap<String, u64>,
    /// Per-second histograms of `total`, by intended send second.
    pub timeline: Vec<Histogram<u64>>,
    /// Per-second histograms of `content_gap`, by the second each gap
    /// ended in (what a router upgrade at second t adds shows there).
    pub gap_timeline: Vec<Histogram<u64>>,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder {
            total: hist(),
            service: hist(),
            headers: hist(),
            first_event: hist(),
            first_content: hist(),
            gap: hist(),
            content_gap: hist(),
            send_lag: hist(),
            sent: 0,
            ok: 0,
            by_status: BTreeMap::new(),
            by_code: BTreeMap::new(),
            timeline: Vec::new(),
            gap_timeline: Vec::new(),
        }
    }
}

/// Record `v` in the histogram of second `t` of `line`.
fn at_second(line: &mut Vec<Histogram<u64>>, t: usize, v: u64) {
    while line.len() <= t {
        line.push(hist());
    }
    if let Some(h) = line.get_mut(t) {
        let _ = h.record(v.max(1));
    }
}

/// One request's outcome.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// Intended send second (timeline bucket).
    pub second: usize,
    /// Microseconds from intended send to the end.
    pub total_us: u64,
    /// Microseconds from actual send to the end.
    pub service_us: u64,
    /// Microseconds from intended send to the headers (if any arrived).
    pub headers_us: Option<u64>,
    /// Microseconds from intended send to the first event (streams).
    pub first_event_us: Option<u64>,
    /// Microseconds from intended send to the first event with text.
    pub first_content_us: Option<u64>,
    /// Gaps between events, microseconds.
    pub gaps_us: Vec<u64>,
    /// Gaps between events with text, microseconds.
    pub content_gaps_us: Vec<u64>,
    /// The second (since the start) each of `content_gaps_us` ended in.
    pub content_gap_seconds: Vec<usize>,
    /// Microseconds the send was late.
    pub lag_us: u64,
    /// HTTP status (0: transport failure).
    pub status: u16,
    /// Error code for failures.
    pub code: Option<String>,
}

impl Recorder {
    /// Record one outcome.
    pub fn record(&mut self, s: &Sample) {
        self.sent += 1;
        let _ = self.send_lag.record(s.lag_us.max(1));
        if (200..300).contains(&s.status) {
            self.ok += 1;
            let _ = self.total.record(s.total_us.max(1));
            let _ = self.service.record(s.service_us.max(1));
            if let Some(h) = s.headers_us {
                let _ = self.headers.record(h.max(1));
            }
            if let Some(f) = s.first_event_us {
                let _ = self.first_event.record(f.max(1));
            }
            if let Some(f) = s.first_content_us {
                let _ = self.first_content.record(f.max(1));
            }
            for g in &s.gaps_us {
                let _ = self.gap.record((*g).max(1));
            }
            for g in &s.content_gaps_us {
                let _ = self.content_gap.record((*g).max(1));
            }
            for (g, t) in s.content_gaps_us.iter().zip(&s.content_gap_seconds) {
                at_second(&mut self.gap_timeline, *t, *g);
            }
            while self.timeline.len() <= s.second {
                self.timeline.push(hist());
            }
            if let Some(h) = self.timeline.get_mut(s.second) {
                let _ = h.record(s.total_us.max(1));
            }
        } else {
            *self.by_status.entry(s.status).or_default() += 1;
            *self
                .by_code
                .entry(s.code.clone().unwrap_or_else(|| "unknown".into()))
                .or_default() += 1;
        }
    }

    /// Merge another worker's observations.
    pub fn merge(&mut self, o: &Recorder) {
        let _ = self.total.add(&o.total);
        let _ = self.service.add(&o.service);
        let _ = self.headers.add(&o.headers);
        let _ = self.first_event.add(&o.first_event);
        let _ = self.first_content.add(&o.first_content);
        let _ = self.gap.add(&o.gap);
        let _ = self.content_gap.add(&o.content_gap);
        let _ = self.send_lag.add(&o.send_lag);
        self.sent += o.sent;
        self.ok += o.ok;
        for (k, v) in &o.by_status {
            *self.by_status.entry(*k).or_default() += v;
        }
        for (k, v) in &o.by_code {
            *self.by_code.entry(k.clone()).or_default() += v;
        }
        for (i, h) in o.gap_timeline.iter().enumerate() {
            while self.gap_timeline.len() <= i {
                self.gap_timeline.push(hist());
            }
            if let Some(t) = self.gap_timeline.get_mut(i) {
                let _ = t.add(h);
            }
        }
        for (i, h) in o.timeline.iter().enumerate() {
            while self.timeline.len() <= i {
                self.timeline.push(hist());
            }
            if let Some(t) = self.timeline.get_mut(i) {
                let _ = t.add(h);
            }
        }
    }
}

/// Percentiles of one metric, milliseconds.
#[derive(Debug, Clone, Serialize, serde::Deserialize, Default)]
pub struct Summary {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 95th percentile.
    #[serde(default)]
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Maximum.
    pub max: f64,
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// Summarise a histogram.
pub fn summary(h: &Histogram<u64>) -> Summary {
    if h.is_empty() {
        return Summary::default();
    }
    Summary {
        count: h.len(),
        mean: h.mean() / 1000.0,
        p50: ms(h.value_at_quantile(0.5)),
        p90: ms(h.value_at_quantile(0.9)),
        p95: ms(h.value_at_quantile(0.95)),
        p99: ms(h.value_at_quantile(0.99)),
        p999: ms(h.value_at_quantile(0.999)),
        max: ms(h.max()),
    }
}

/// One second of the timeline.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Second {
    /// Seconds since start (intended send time).
    pub t: usize,
    /// Successful requests sent in that second.
    pub count: u64,
    /// Median latency, ms.
    pub p50: f64,
    /// 99th percentile, ms.
    pub p99: f64,
    /// Maximum, ms.
    pub max: f64,
}

/// The JSON report.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Report {
    /// `open` or `closed`.
    pub mode: String,
    /// Target base URL.
    pub target: String,
    /// Requested rate (open loop), req/s.
    pub rate: f64,
    /// Connections (closed loop).
    pub connections: usize,
    /// Seconds the schedule lasted (with `requests`, the cap on the run).
    pub duration_s: f64,
    /// Requests asked for (closed loop with `--requests`): the run ends
    /// when they are sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests: Option<u64>,
    /// Seconds until the last response.
    pub elapsed_s: f64,
    /// Requests sent.
    pub sent: u64,
    /// 2xx responses.
    pub ok: u64,
    /// Everything else.
    pub errors: u64,
    /// Successful responses per second of elapsed time.
    pub achieved_rps: f64,
    /// Failures by status (`0`: transport).
    pub errors_by_status: BTreeMap<String, u64>,
    /// Failures by error code.
    pub errors_by_code: BTreeMap<String, u64>,
    /// Latency from the intended send time (coordinated-omission corrected).
    pub total: Summary,
    /// Latency from the actual send.
    pub service: Summary,
    /// Time to response headers.
    pub headers: Summary,
    /// Time to the first SSE event.
    pub first_event: Summary,
    /// Time to the first SSE event with generated text.
    pub first_content: Summary,
    /// Gaps between SSE events.
    pub event_gap: Summary,
    /// Gaps between SSE events with generated text.
    pub content_gap: Summary,
    /// How late sends were against the schedule.
    pub send_lag: Summary,
    /// Per second of the schedule.
    pub timeline: Vec<Second>,
    /// Gaps between events with text, by the second they ended in.
    #[serde(default)]
    pub content_gap_by_second: Vec<Second>,
    /// Latency distribution (percentile, ms) for plotting.
    pub distribution: Vec<(f64, f64)>,
}

/// Build the report.
pub fn build(
    rec: &Recorder,
    mode: &str,
    target: &str,
    rate: f64,
    connections: usize,
    duration_s: f64,
    elapsed_s: f64,
) -> Report {
    let errors = rec.sent - rec.ok;
    let seconds = |line: &Vec<Histogram<u64>>| -> Vec<Second> {
        line.iter()
            .enumerate()
            .map(|(t, h)| Second {
                t,
                count: h.len(),
                p50: if h.is_empty() {
                    0.0
                } else {
                    ms(h.value_at_quantile(0.5))
                },
                p99: if h.is_empty() {
                    0.0
                } else {
                    ms(h.value_at_quantile(0.99))
                },
                max: if h.is_empty() { 0.0 } else { ms(h.max()) },
            })
            .collect()
    };
    let content_gap_by_second = seconds(&rec.gap_timeline);
    let timeline = seconds(&rec.timeline);
    let mut distribution = Vec::new();
    if !rec.total.is_empty() {
        for q in [
            0.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99, 100.0,
        ] {
            distribution.push((q, ms(rec.total.value_at_percentile(q))));
        }
    }
    Report {
        mode: mode.into(),
        target: target.into(),
        rate,
        connections,
        duration_s,
        requests: None,
        elapsed_s,
        sent: rec.sent,
        ok: rec.ok,
        errors,
        achieved_rps: if elapsed_s > 0.0 {
            rec.ok as f64 / elapsed_s
        } else {
            0.0
        },
        errors_by_status: rec
            .by_status
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect(),
        errors_by_code: rec.by_code.clone(),
        total: summary(&rec.total),
        service: summary(&rec.service),
        headers: summary(&rec.headers),
        first_event: summary(&rec.first_event),
        first_content: summary(&rec.first_content),
        event_gap: summary(&rec.gap),
        content_gap: summary(&rec.content_gap),
        send_lag: summary(&rec.send_lag),
        timeline,
        content_gap_by_second,
        distribution,
    }
}

/// A readable table.
pub fn table(r: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "target {}  mode {}  sent {}  ok {}  errors {}  achieved {:.1} req/s over {:.1}s",
        r.target, r.mode, r.sent, r.ok, r.errors, r.achieved_rps, r.elapsed_s
    );
    let _ = writeln!(
        o,
        "{:<22}{:>9}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}",
        "metric (ms)", "count", "mean", "p50", "p90", "p99", "p99.9", "max"
    );
    for (name, s) in [
        ("total (from intended)", &r.total),
        ("service (from send)", &r.service),
        ("headers", &r.headers),
        ("first event", &r.first_event),
        ("first content", &r.first_content),
        ("event gap", &r.event_gap),
        ("content gap", &r.content_gap),
        ("send lag", &r.send_lag),
    ] {
        if s.count == 0 {
            continue;
        }
        let _ = writeln!(
            o,
            "{:<22}{:>9}{:>10.3}{:>10.3}{:>10.3}{:>10.3}{:>10.3}{:>10.3}",
            name, s.count, s.mean, s.p50, s.p90, s.p99, s.p999, s.max
        );
    }
    for (k, v) in &r.errors_by_code {
        let _ = writeln!(o, "error {k}: {v}");
    }
    o
}

/// Two panels: latency by percentile, and p50/p99/max per second.
pub fn svg(r: &Report) -> String {
    let (w, h, pad) = (760.0f64, 300.0f64, 50.0f64);
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{}" font-family="sans-serif" font-size="11">"#,
        h * 2.0 + 20.0
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    // Panel 1: distribution, x = -log10(1 - q) (0 .. 4 = 99.99%).
    let maxy = r.distribution.iter().map(|p| p.1).fold(0.001, f64::max);
    let px = |q: f64| {
        let f = (1.0 - q / 100.0).max(1e-4);
        pad + (-f.log10() / 4.0) * (w - 2.0 * pad)
    };
    let py = |v: f64, top: f64| top + h - pad - (v / maxy) * (h - 2.0 * pad);
    let _ = writeln!(
        o,
        r#"<text x="{pad}" y="18" font-size="13">Latency by percentile (from intended send), {} — max {:.2} ms</text>"#,
        r.target, maxy
    );
    let pts: Vec<String> = r
        .distribution
        .iter()
        .map(|(q, v)| format!("{:.1},{:.1}", px(*q), py(*v, 0.0)))
        .collect();
    let _ = writeln!(
        o,
        r#"<polyline fill="none" stroke="steelblue" stroke-width="2" points="{}"/>"#,
        pts.join(" ")
    );
    for (q, label) in [
        (0.0, "0%"),
        (90.0, "90%"),
        (99.0, "99%"),
        (99.9, "99.9%"),
        (99.99, "99.99%"),
    ] {
        let _ = writeln!(
            o,
            r##"<text x="{:.1}" y="{:.1}">{label}</text><line x1="{:.1}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#ccc"/>"##,
            px(q),
            h - pad + 15.0,
            px(q),
            px(q),
            pad,
            h - pad
        );
    }
    let _ = writeln!(
        o,
        r#"<text x="5" y="{:.1}">{:.2} ms</text><text x="5" y="{:.1}">0</text>"#,
        pad,
        maxy,
        h - pad
    );
    // Panel 2: timeline.
    let top = h + 20.0;
    let n = r.timeline.len().max(1) as f64;
    let maxt = r.timeline.iter().map(|s| s.max).fold(0.001, f64::max);
    let tx = |i: usize| pad + (i as f64 / n) * (w - 2.0 * pad);
    let ty = |v: f64| top + h - pad - (v / maxt) * (h - 2.0 * pad);
    let _ = writeln!(
        o,
        r#"<text x="{pad}" y="{:.1}" font-size="13">Latency over time (per second): p50 (green), p99 (orange), max (red); max {:.2} ms</text>"#,
        top + 18.0,
        maxt
    );
    for (color, f) in [("green", 0usize), ("orange", 1), ("red", 2)] {
        let pts: Vec<String> = r
            .timeline
            .iter()
            .map(|s| {
                let v = match f {
                    0 => s.p50,
                    1 => s.p99,
                    _ => s.max,
                };
                format!("{:.1},{:.1}", tx(s.t), ty(v))
            })
            .collect();
        let _ = writeln!(
            o,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#,
            pts.join(" ")
        );
    }
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}">0 s</text><text x="{:.1}" y="{:.1}">{} s</text>"#,
        pad,
        top + h - pad + 15.0,
        w - pad - 20.0,
        top + h - pad + 15.0,
        r.timeline.len()
    );
    let _ = writeln!(
        o,
        r#"<text x="5" y="{:.1}">{:.2} ms</text><text x="5" y="{:.1}">0</text>"#,
        top + pad,
        maxt,
        top + h - pad
    );
    let _ = writeln!(o, "</svg>");
    o
}
