#!/usr/bin/env bash
# Issue 26 item 5: can the `prometheus` crate or `prometheus-client`
# render our families from shard snapshots within 2x of the hand-written
# renderer at 10,000 series? A scratch crate outside the repository (no
# new dependency in the workspace) renders the same snapshots three ways
# (hand-written as runtime::metrics does it: writeln! with escaped
# labels; prometheus-client: a registry of label-typed families built
# from the snapshots at each scrape, and a collector encoding the
# snapshots at scrape time; prometheus: GaugeVecs and the text encoder), interleaved, and prints the median time per scrape and the
# ratios. Usage: scripts/bench/metrics-renderers.sh [SERIES] [ROUNDS]
set -euo pipefail
SERIES="${1:-10000}"
ROUNDS="${2:-40}"
DIR="${METRICS_BENCH_DIR:-/tmp/hivenet-metrics-renderers}"
mkdir -p "$DIR/src"
cat > "$DIR/Cargo.toml" <<'TOML'
[package]
name = "metrics-renderers"
version = "0.1.0"
edition = "2021"

[dependencies]
prometheus-client = "0.23"
prometheus = { version = "0.14", default-features = false }

[profile.release]
debug = 1
TOML
cat > "$DIR/src/main.rs" <<'RS'
use std::fmt::Write as _;
use std::time::Instant;

/// What a shard snapshot holds of one agent (the label set of our agent
/// families, and ten values).
struct AgentSnap {
    model: String,
    peer_id: String,
    engine: &'static str,
    values: [f64; 10],
}

const NAMES: [&str; 10] = [
    "hivenet_agent_srtt_ms",
    "hivenet_agent_rttvar_ms",
    "hivenet_agent_active_requests",
    "hivenet_agent_capacity",
    "hivenet_agent_healthy",
    "hivenet_agent_success_total",
    "hivenet_agent_failure_total",
    "hivenet_agent_tokens_in_total",
    "hivenet_agent_tokens_out_total",
    "hivenet_agent_kv_cache_usage_ratio",
];

fn esc(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn hand(snaps: &[AgentSnap]) -> String {
    let mut o = String::with_capacity(4096);
    for (i, name) in NAMES.iter().enumerate() {
        let _ = writeln!(o, "# HELP {name} help text.");
        let _ = writeln!(o, "# TYPE {name} gauge");
        for a in snaps {
            let _ = writeln!(
                o,
                "{name}{{model=\"{}\",peer_id=\"{}\",engine=\"{}\"}} {}",
                esc(&a.model),
                esc(&a.peer_id),
                a.engine,
                a.values[i]
            );
        }
    }
    o
}

/// As runtime::metrics::exposition::Family writes since issue 26:
/// label values escaped straight into the output.
struct Escaped<'o>(&'o mut String);

impl std::fmt::Write for Escaped<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
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

fn family(snaps: &[AgentSnap]) -> String {
    let mut o = String::with_capacity(4096);
    for (i, name) in NAMES.iter().enumerate() {
        let _ = writeln!(o, "# HELP {name} help text.");
        let _ = writeln!(o, "# TYPE {name} gauge");
        for a in snaps {
            o.push_str(name);
            for (j, (l, v)) in [("model", a.model.as_str()), ("peer_id", a.peer_id.as_str()), ("engine", a.engine)].iter().enumerate() {
                o.push_str(if j == 0 { "{" } else { "," });
                o.push_str(l);
                o.push_str("=\"");
                let _ = write!(Escaped(&mut o), "{v}");
                o.push('"');
            }
            let _ = writeln!(o, "}} {}", a.values[i]);
        }
    }
    o
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct AgentLabels {
    model: String,
    peer_id: String,
    engine: &'static str,
}

fn client(snaps: &[AgentSnap]) -> String {
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    use std::sync::atomic::AtomicU64;
    let mut reg = prometheus_client::registry::Registry::default();
    for (i, name) in NAMES.iter().enumerate() {
        let fam = Family::<AgentLabels, Gauge<f64, AtomicU64>>::default();
        for a in snaps {
            fam.get_or_create(&AgentLabels {
                model: a.model.clone(),
                peer_id: a.peer_id.clone(),
                engine: a.engine,
            })
            .set(a.values[i]);
        }
        reg.register(name.trim_start_matches("hivenet_"), "help text", fam);
    }
    let mut o = String::new();
    let _ = prometheus_client::encoding::text::encode(&mut o, &reg);
    o
}

/// prometheus-client's way to render from snapshots: a collector
/// encodes the snapshot's values at scrape time, no per-series state.
#[derive(Debug)]
struct Snapshots(std::sync::Arc<Vec<AgentSnapS>>);

#[derive(Debug)]
struct AgentSnapS {
    model: String,
    peer_id: String,
    engine: &'static str,
    values: [f64; 10],
}

impl prometheus_client::collector::Collector for Snapshots {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::metrics::MetricType;
        for (i, name) in NAMES.iter().enumerate() {
            let mut fam = encoder.encode_descriptor(
                name.trim_start_matches("hivenet_"),
                "help text",
                None,
                MetricType::Gauge,
            )?;
            for a in self.0.iter() {
                let labels = [
                    ("model", a.model.as_str()),
                    ("peer_id", a.peer_id.as_str()),
                    ("engine", a.engine),
                ];
                ConstGauge::new(a.values[i]).encode(fam.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

fn collector(snaps: &std::sync::Arc<Vec<AgentSnapS>>) -> String {
    let mut reg = prometheus_client::registry::Registry::with_prefix("hivenet");
    reg.register_collector(Box::new(Snapshots(snaps.clone())));
    let mut o = String::new();
    let _ = prometheus_client::encoding::text::encode(&mut o, &reg);
    o
}

fn prom(snaps: &[AgentSnap]) -> String {
    use prometheus::{Encoder, GaugeVec, Opts, Registry, TextEncoder};
    let reg = Registry::new();
    for (i, name) in NAMES.iter().enumerate() {
        let g = GaugeVec::new(Opts::new(*name, "help text"), &["model", "peer_id", "engine"])
            .expect("family");
        for a in snaps {
            g.with_label_values(&[a.model.as_str(), a.peer_id.as_str(), a.engine])
                .set(a.values[i]);
        }
        reg.register(Box::new(g)).expect("register");
    }
    let mut buf = Vec::new();
    let _ = TextEncoder::new().encode(&reg.gather(), &mut buf);
    String::from_utf8(buf).unwrap_or_default()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let series: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let rounds: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(40);
    let agents = series / NAMES.len();
    let snaps: Vec<AgentSnap> = (0..agents)
        .map(|i| AgentSnap {
            model: format!("model-{}", i % 50),
            peer_id: format!("12D3KooW{:044}", i),
            engine: "vllm",
            values: std::array::from_fn(|k| (i * 10 + k) as f64 * 0.5),
        })
        .collect();
    let shared = std::sync::Arc::new(
        snaps
            .iter()
            .map(|a| AgentSnapS {
                model: a.model.clone(),
                peer_id: a.peer_id.clone(),
                engine: a.engine,
                values: a.values,
            })
            .collect::<Vec<_>>(),
    );
    let (mut th, mut tc, mut tp, mut tk, mut tf) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut sizes = (0, 0, 0, 0, 0);
    for _ in 0..rounds {
        let t = Instant::now();
        sizes.0 = std::hint::black_box(hand(&snaps)).len();
        th.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        sizes.1 = std::hint::black_box(client(&snaps)).len();
        tc.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        sizes.2 = std::hint::black_box(prom(&snaps)).len();
        tp.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        sizes.3 = std::hint::black_box(collector(&shared)).len();
        tk.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        sizes.4 = std::hint::black_box(family(&snaps)).len();
        tf.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let f = median(&mut tf);
    let (h, c, p, k) = (median(&mut th), median(&mut tc), median(&mut tp), median(&mut tk));
    println!("series {}  rounds {rounds}", agents * NAMES.len());
    println!("hand-written                 {h:8.3} ms per scrape  {:>9} bytes  1.00x", sizes.0);
    println!("prometheus-client families   {c:8.3} ms per scrape  {:>9} bytes  {:.2}x", sizes.1, c / h);
    println!("prometheus                   {p:8.3} ms per scrape  {:>9} bytes  {:.2}x", sizes.2, p / h);
    println!("family helper (escape in place) {f:8.3} ms per scrape  {:>9} bytes  {:.2}x", sizes.4, f / h);
    println!("prometheus-client collector {k:8.3} ms per scrape  {:>9} bytes  {:.2}x", sizes.3, k / h);
}
RS
cd "$DIR"
cargo build --release -q
"$DIR/target/release/metrics-renderers" "$SERIES" "$ROUNDS"
