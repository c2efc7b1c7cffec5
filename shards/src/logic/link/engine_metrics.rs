//! Engine signals scraped from a backend's Prometheus `/metrics` (spec 03
//! §9): KV-cache use, running and waiting requests, mean and p90 time to
//! first token and inter-token latency. Pure: the agent passes the text.
//! NaN and infinities are dropped; the first sample of a name wins.

use serde::{Deserialize, Serialize};

/// What an agent reports about its engine (each absent when not exposed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineSignals {
    /// KV cache use, 0-1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_utilization: Option<f64>,
    /// Requests being generated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_requests: Option<f64>,
    /// Requests queued in the engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_requests: Option<f64>,
    /// Mean time to first token, s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub avg_ttft_seconds: Option<f64>,
    /// p90 time to first token, s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p90_ttft_seconds: Option<f64>,
    /// Mean inter-token latency, s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub avg_itl_seconds: Option<f64>,
    /// p90 inter-token latency, s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p90_itl_seconds: Option<f64>,
}

/// Keep `v` when finite and within `lo..=hi`, else drop it (counted).
fn in_range(v: &mut Option<f64>, lo: f64, hi: f64, dropped: &mut u32) {
    if let Some(x) = *v {
        if !(x.is_finite() && (lo..=hi).contains(&x)) {
            *v = None;
            *dropped += 1;
        }
    }
}

impl EngineSignals {
    /// Drop every signal out of its range (an agent is a peer, not trusted
    /// code: `kv_cache_utilization` 1e308 or negative running requests
    /// are absent, not believed); returns how many were dropped.
    pub fn sanitize(&mut self) -> u32 {
        let mut n = 0;
        in_range(&mut self.kv_cache_utilization, 0.0, 1.0, &mut n);
        in_range(&mut self.running_requests, 0.0, 1e6, &mut n);
        in_range(&mut self.waiting_requests, 0.0, 1e6, &mut n);
        for t in [
            &mut self.avg_ttft_seconds,
            &mut self.p90_ttft_seconds,
            &mut self.avg_itl_seconds,
            &mut self.p90_itl_seconds,
        ] {
            in_range(t, 0.0, 3600.0, &mut n);
        }
        n
    }
}

/// Keep a host signal in range (see [`EngineSignals::sanitize`]).
pub fn keep_in_range(v: &mut Option<f64>, lo: f64, hi: f64, dropped: &mut u32) {
    in_range(v, lo, hi, dropped);
}

/// Metric names per engine (`""`: the engine does not export it; the
/// signal stays absent, never 0).
struct Names {
    kv: &'static str,
    running: &'static str,
    waiting: &'static str,
    ttft: &'static str,
    itl: &'static str,
}

fn names(engine: &str) -> Option<Names> {
    match engine {
        "vllm" => Some(Names {
            kv: "vllm:kv_cache_usage_perc",
            running: "vllm:num_requests_running",
            waiting: "vllm:num_requests_waiting",
            ttft: "vllm:time_to_first_token_seconds",
            itl: "vllm:inter_token_latency_seconds",
        }),
        "sglang" => Some(Names {
            kv: "sglang:token_usage",
            running: "sglang:num_running_reqs",
            waiting: "sglang:num_queue_reqs",
            ttft: "sglang:time_to_first_token_seconds",
            itl: "sglang:inter_token_latency_seconds",
        }),
        // What llama-server exports (tools/server/server-task.cpp, build
        // 11434): no KV gauge (see `kv_from_slots`) and no latency
        // histograms, only lifetime counters.
        "llamacpp" => Some(Names {
            kv: "",
            running: "llamacpp:requests_processing",
            waiting: "llamacpp:requests_deferred",
            ttft: "",
            itl: "",
        }),
        _ => None,
    }
}

/// Whether the engine exposes metrics the agent scrapes.
pub fn scraped(engine: &str) -> bool {
    names(engine).is_some()
}

/// One sample line: name, `le` label if any, value.
fn sample(line: &str) -> Option<(&str, Option<f64>, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name_labels, value) = line.rsplit_once(' ')?;
    let value: f64 = value.trim().parse().ok()?;
    let (name, labels) = match name_labels.find('{') {
        Some(i) => (name_labels.get(..i)?, name_labels.get(i..)),
        None => (name_labels, None),
    };
    let le = labels.and_then(|l| {
        let i = l.find("le=\"")?;
        let rest = l.get(i + 4..)?;
        let end = rest.find('"')?;
        let v = rest.get(..end)?;
        if v == "+Inf" {
            Some(f64::INFINITY)
        } else {
            v.parse().ok()
        }
    });
    Some((name.trim(), le, value))
}

/// Mean and p90 of a histogram from its cumulative buckets, sum and count
/// (p90 by linear interpolation inside the bucket).
fn hist(
    buckets: &[(f64, f64)],
    sum: Option<f64>,
    count: Option<f64>,
) -> (Option<f64>, Option<f64>) {
    let Some(count) = count.filter(|c| *c > 0.0) else {
        return (None, None);
    };
    let mean = sum.map(|s| s / count);
    let target = 0.9 * count;
    let mut prev_le = 0.0f64;
    let mut prev_c = 0.0f64;
    let mut p90 = None;
    for (le, c) in buckets {
        if *c >= target {
            if le.is_infinite() {
                p90 = Some(prev_le);
            } else {
                let span = c - prev_c;
                let frac = if span > 0.0 {
                    (target - prev_c) / span
                } else {
                    1.0
                };
                p90 = Some(prev_le + (le - prev_le) * frac);
            }
            break;
        }
        prev_le = *le;
        prev_c = *c;
    }
    (mean, p90)
}

/// The counters that move while an engine works (issue 56: a
/// non-streamed answer gives no byte before it is whole, so the agent
/// waits past `--http-timeout` only while these move). vLLM and SGLang
/// count tokens per scheduler step, llama-server its `llama_decode()`
/// calls (prompt batches included); other engines export none.
fn work_counters(engine: &str) -> &'static [&'static str] {
    match engine {
        "vllm" => &["vllm:generation_tokens_total", "vllm:prompt_tokens_total"],
        "sglang" => &[
            "sglang:generation_tokens_total",
            "sglang:prompt_tokens_total",
        ],
        "llamacpp" => &["llamacpp:n_decode_total"],
        _ => &[],
    }
}

/// Whether `engine` exports a counter of its work.
pub fn tracks_work(engine: &str) -> bool {
    !work_counters(engine).is_empty()
}

/// The engine's work so far: the sum of its work counters over every
/// series (`None` when the text has none of them).
pub fn work_done(engine: &str, text: &str) -> Option<f64> {
    let names = work_counters(engine);
    let mut total: Option<f64> = None;
    for (name, _, v) in text.lines().filter_map(sample) {
        if names.contains(&name) && v.is_finite() && v >= 0.0 {
            *total.get_or_insert(0.0) += v;
        }
    }
    total
}

/// Parse a backend's metrics text for `engine`.
pub fn parse(engine: &str, text: &str) -> EngineSignals {
    let Some(n) = names(engine) else {
        return EngineSignals::default();
    };
    let mut out = EngineSignals::default();
    let mut ttft_b: Vec<(f64, f64)> = Vec::new();
    let mut itl_b: Vec<(f64, f64)> = Vec::new();
    let (mut ttft_sum, mut ttft_count, mut itl_sum, mut itl_count) = (None, None, None, None);
    for line in text.lines() {
        let Some((name, le, v)) = sample(line) else {
            continue;
        };
        if !v.is_finite() {
            continue;
        }
        let first = |slot: &mut Option<f64>| {
            if slot.is_none() {
                *slot = Some(v);
            }
        };
        if name.is_empty() {
            continue;
        }
        if name == n.kv {
            first(&mut out.kv_cache_utilization);
        } else if name == n.running {
            first(&mut out.running_requests);
        } else if name == n.waiting {
            first(&mut out.waiting_requests);
        } else if let Some(base) = name.strip_suffix("_bucket").filter(|b| !b.is_empty()) {
            if let Some(le) = le {
                if base == n.ttft {
                    ttft_b.push((le, v));
                } else if base == n.itl {
                    itl_b.push((le, v));
                }
            }
        } else if let Some(base) = name.strip_suffix("_sum").filter(|b| !b.is_empty()) {
            if base == n.ttft {
                first(&mut ttft_sum);
            } else if base == n.itl {
                first(&mut itl_sum);
            }
        } else if let Some(base) = name.strip_suffix("_count").filter(|b| !b.is_empty()) {
            if base == n.ttft {
                first(&mut ttft_count);
            } else if base == n.itl {
                first(&mut itl_count);
            }
        }
    }
    ttft_b.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
    itl_b.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
    (out.avg_ttft_seconds, out.p90_ttft_seconds) = hist(&ttft_b, ttft_sum, ttft_count);
    (out.avg_itl_seconds, out.p90_itl_seconds) = hist(&itl_b, itl_sum, itl_count);
    out
}

/// KV-cache use of a llama-server from its `GET /slots` body (it exports
/// no KV gauge): the tokens each slot's cache holds (its prompt plus what
/// it decoded) over the slots' context sizes. `None` when the body is not
/// a non-empty slot list with context sizes.
pub fn kv_from_slots(body: &[u8]) -> Option<f64> {
    #[derive(Deserialize)]
    struct Next {
        #[serde(default)]
        n_decoded: u64,
    }
    #[derive(Deserialize)]
    struct Slot {
        n_ctx: u64,
        #[serde(default)]
        n_prompt_tokens: u64,
        #[serde(default)]
        next_token: Vec<Next>,
    }
    let slots: Vec<Slot> = serde_json::from_slice(body).ok()?;
    let ctx: u64 = slots.iter().map(|s| s.n_ctx).sum();
    if ctx == 0 {
        return None;
    }
    let used: u64 = slots
        .iter()
        .map(|s| {
            let decoded: u64 = s.next_token.iter().map(|n| n.n_decoded).sum();
            s.n_prompt_tokens.saturating_add(decoded).min(s.n_ctx)
        })
        .sum();
    Some(used as f64 / ctx as f64)
}

/// Whether the engine's KV use is read from `GET /slots`.
pub fn kv_from_slots_endpoint(engine: &str) -> bool {
    engine == "llamacpp"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_out_of_range_are_absent() {
        let mut s = EngineSignals {
            kv_cache_utilization: Some(1e308),
            running_requests: Some(-3.0),
            waiting_requests: Some(f64::NAN),
            avg_ttft_seconds: Some(0.2),
            ..Default::default()
        };
        assert_eq!(s.sanitize(), 3);
        assert_eq!(s.kv_cache_utilization, None);
        assert_eq!(s.running_requests, None);
        assert_eq!(s.waiting_requests, None);
        assert_eq!(s.avg_ttft_seconds, Some(0.2));
        assert_eq!(s.sanitize(), 0);
    }
    use proptest::prelude::*;

    /// What llama-server build 11434 exports on `/metrics` (abridged from
    /// a real scrape: counters and the two gauges).
    const LLAMACPP: &str = "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens\n# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 120\nllamacpp:prompt_tokens_cached_total 80\nllamacpp:prompt_seconds_total 1.5\nllamacpp:tokens_predicted_total 40\nllamacpp:tokens_predicted_seconds_total 2\nllamacpp:n_decode_total 44\n# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 1\nllamacpp:requests_deferred 2\nllamacpp:n_busy_slots_per_decode 1\n";

    #[test]
    fn llamacpp_signals_are_the_ones_it_has() {
        let s = parse("llamacpp", LLAMACPP);
        assert_eq!(s.running_requests, Some(1.0));
        assert_eq!(s.waiting_requests, Some(2.0));
        // Not exported: absent, never 0.
        assert_eq!(s.kv_cache_utilization, None);
        assert_eq!(s.avg_ttft_seconds, None);
        assert_eq!(s.p90_itl_seconds, None);
        // The names an older agent looked for do not exist any more.
        assert!(!LLAMACPP.contains("kv_cache_usage_ratio"));
    }

    #[test]
    fn work_is_what_moves_while_an_engine_generates() {
        assert_eq!(work_done("llamacpp", LLAMACPP), Some(44.0));
        let vllm = "vllm:generation_tokens_total{model_name=\"m\"} 10\nvllm:prompt_tokens_total{model_name=\"m\"} 5\nvllm:generation_tokens_total{model_name=\"n\"} 1\n";
        assert_eq!(work_done("vllm", vllm), Some(16.0));
        // No counter, a bad value or an engine that exports none: unknown.
        assert_eq!(work_done("vllm", "vllm:num_requests_running 3\n"), None);
        assert_eq!(
            work_done("vllm", "vllm:generation_tokens_total NaN\n"),
            None
        );
        assert_eq!(work_done("ollama", vllm), None);
        assert!(tracks_work("sglang") && !tracks_work("custom"));
    }

    #[test]
    fn llamacpp_kv_use_from_its_slots() {
        // Two slots of 2048: one holds a 300-token prompt and 100 decoded,
        // the other is empty.
        let body = br#"[{"id":0,"n_ctx":2048,"is_processing":true,"id_task":7,"n_prompt_tokens":300,"n_prompt_tokens_cache":250,"next_token":[{"has_next_token":true,"n_remain":-1,"n_decoded":100}]},{"id":1,"n_ctx":2048,"is_processing":false}]"#;
        assert_eq!(kv_from_slots(body), Some(400.0 / 4096.0));
        // A slot never holds more than its context.
        let over = br#"[{"n_ctx":10,"n_prompt_tokens":30}]"#;
        assert_eq!(kv_from_slots(over), Some(1.0));
        assert_eq!(kv_from_slots(b"[]"), None);
        assert_eq!(kv_from_slots(br#"{"error":"slots disabled"}"#), None);
        assert_eq!(kv_from_slots(b"garbage"), None);
        assert!(kv_from_slots_endpoint("llamacpp") && !kv_from_slots_endpoint("vllm"));
    }

    const VLLM: &str = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 3\nvllm:num_requests_waiting{model_name=\"m\"} 1\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.42\nvllm:kv_cache_usage_perc{model_name=\"other\"} 0.99\nvllm:time_to_first_token_seconds_bucket{le=\"0.1\"} 5\nvllm:time_to_first_token_seconds_bucket{le=\"0.5\"} 9\nvllm:time_to_first_token_seconds_bucket{le=\"1.0\"} 10\nvllm:time_to_first_token_seconds_bucket{le=\"+Inf\"} 10\nvllm:time_to_first_token_seconds_sum 2.5\nvllm:time_to_first_token_seconds_count 10\nvllm:num_requests_swapped NaN\n";

    #[test]
    fn vllm_text() {
        let s = parse("vllm", VLLM);
        assert_eq!(s.running_requests, Some(3.0));
        assert_eq!(s.waiting_requests, Some(1.0));
        assert_eq!(s.kv_cache_utilization, Some(0.42), "first sample wins");
        assert_eq!(s.avg_ttft_seconds, Some(0.25));
        // 90% of 10 = 9: reached exactly at le=0.5.
        assert_eq!(s.p90_ttft_seconds, Some(0.5));
        assert_eq!(s.avg_itl_seconds, None);
        assert_eq!(parse("ollama", VLLM), EngineSignals::default());
    }

    proptest! {
        #[test]
        fn never_panics(t in ".{0,400}") {
            let _ = parse("vllm", &t);
            let _ = parse("sglang", &t);
        }
    }
}
