//! `hivenet-sim`: simulated OpenAI/Anthropic-compatible backend.
#![forbid(unsafe_code)]

use argh::FromArgs;
use bench::sim::{self, SimConfig};

/// Simulated inference backend with honest timing.
#[derive(FromArgs)]
struct Flags {
    /// listen port (default 8888)
    #[argh(option, default = "8888")]
    port: u16,
    /// listen IP (default 127.0.0.1)
    #[argh(option, default = "String::from(\"127.0.0.1\")")]
    host: String,
    /// model name served (default sim-model)
    #[argh(option, default = "String::from(\"sim-model\")")]
    model: String,
    /// time to first token, e.g. 20ms (default 0ms)
    #[argh(option, default = "String::from(\"0ms\")")]
    ttft: String,
    /// inter-token gap, e.g. 5ms (default 0ms)
    #[argh(option, default = "String::from(\"0ms\")")]
    itl: String,
    /// output tokens per completion (default 16)
    #[argh(option, default = "16")]
    output_tokens: u32,
    /// fraction of inference requests answered with 500 (default 0)
    #[argh(option, default = "0.0")]
    error_rate: f64,
    /// status of those answers (default 500; 429 or 503: a busy engine)
    #[argh(option, default = "500")]
    error_status: u16,
    /// cold start: /health answers 503 for this long (default 0s)
    #[argh(option, default = "String::from(\"0s\")")]
    startup_delay: String,
    /// stall the whole server once after this many inference requests (default 0: never)
    #[argh(option, default = "0")]
    stall_after: u64,
    /// length of that stall (default 1s)
    #[argh(option, default = "String::from(\"1s\")")]
    stall_for: String,
    /// KV-cache use reported in /metrics, 0-1 (default 0)
    #[argh(option, default = "0.0")]
    kv_cache_usage: f64,
    /// claim this many prompt tokens in chat usage (default 0: the true count)
    #[argh(option, default = "0")]
    claim_prompt_tokens: u64,
    /// remember the trace headers (traceparent, tracestate, baggage) of the
    /// last 256 inference requests, served at GET /sim/trace_headers
    #[argh(switch)]
    record_traces: bool,
    /// export one span per inference request to this OTLP/HTTP traces URL
    /// (as vLLM's --otlp-traces-endpoint), under its traceparent
    #[argh(option)]
    otlp_traces_endpoint: Option<String>,
    /// worker threads (default 1)
    #[argh(option, default = "1")]
    threads: usize,
    /// a prefix cache of this many tokens (0: none, the default): shared
    /// prompt prefixes are reported as cached_tokens and cost no prefill
    #[argh(option, default = "0")]
    prefix_cache_tokens: u64,
    /// added to the time to first token per uncached prompt token, e.g.
    /// 8ms (llama-server, SmolLM2-135M, one thread here:
    /// perf/2026-12-02-sim-calibration); default 0
    #[argh(option, default = "String::from(\"0ms\")")]
    prefill_per_token: String,
    /// tokens per prefix-cache block (default 16, vLLM's; 1 reuses every
    /// cached token, as llama.cpp does)
    #[argh(option, default = "16")]
    cache_block_tokens: u64,
    /// which of a prompt's cached blocks go first when the cache is full:
    /// prompt-order (the default: its head first, what the llama-server
    /// calibration fits) or tail-first (vLLM's and SGLang's: its tail
    /// first, a shared system prompt last)
    #[argh(option, default = "String::from(\"prompt-order\")")]
    cache_eviction: String,
    /// request bytes per prompt token, the simulator's stand-in for a
    /// tokenizer (default 4; SmolLM2 on the calibration prompts: see
    /// perf/2026-12-02-sim-calibration)
    #[argh(option, default = "4.0")]
    bytes_per_token: f64,
    /// fraction of answers cut mid-way, the connection closed without
    /// their end as an engine that dies: a stream at a random token, a
    /// whole answer after half its body (default 0)
    #[argh(option, default = "0.0")]
    abort_rate: f64,
    /// requests served at once per thread (0: no limit, the default);
    /// past it a request waits in line before its prefill, as vLLM's
    /// --max-num-seqs
    #[argh(option, default = "0")]
    max_running: u32,
}

fn dur(name: &str, s: &str) -> std::time::Duration {
    match humantime::parse_duration(s) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("hivenet-sim: --{name}: invalid duration {s:?}: {e}");
            std::process::exit(2);
        }
    }
}

fn main() {
    use std::io::IsTerminal;
    let args: Vec<String> = std::env::args().collect();
    shards::exit_on_version_flag("hivenet-sim", &args);
    let _ = tracing_subscriber::fmt()
        .with_ansi(std::io::stdout().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_target(false)
        .try_init();
    let f: Flags = argh::from_env();
    if !(0.0..=1.0).contains(&f.error_rate) {
        eprintln!("hivenet-sim: --error-rate must be within [0, 1]");
        std::process::exit(2);
    }
    if !(0.0..=1.0).contains(&f.abort_rate) {
        eprintln!("hivenet-sim: --abort-rate must be within [0, 1]");
        std::process::exit(2);
    }
    if f.cache_block_tokens == 0 {
        eprintln!("hivenet-sim: --cache-block-tokens must be at least 1");
        std::process::exit(2);
    }
    let Some(cache_eviction) = bench::prefix_cache::Eviction::parse(&f.cache_eviction) else {
        eprintln!("hivenet-sim: --cache-eviction must be prompt-order or tail-first");
        std::process::exit(2);
    };
    if !(f.bytes_per_token.is_finite() && (0.5..=64.0).contains(&f.bytes_per_token)) {
        eprintln!("hivenet-sim: --bytes-per-token must be within [0.5, 64]");
        std::process::exit(2);
    }
    let ip: std::net::IpAddr = match f.host.parse() {
        Ok(ip) => ip,
        Err(_) => {
            eprintln!("hivenet-sim: --host: invalid IP {:?}", f.host);
            std::process::exit(2);
        }
    };
    let cfg = SimConfig {
        model: f.model,
        ttft: dur("ttft", &f.ttft),
        itl: dur("itl", &f.itl),
        output_tokens: f.output_tokens,
        error_rate: f.error_rate,
        error_status: f.error_status,
        startup_delay: dur("startup-delay", &f.startup_delay),
        stall_after: f.stall_after,
        stall_for: dur("stall-for", &f.stall_for),
        kv_cache_usage: f.kv_cache_usage,
        claim_prompt_tokens: f.claim_prompt_tokens,
        record_traces: f.record_traces,
        otlp_traces_endpoint: f.otlp_traces_endpoint,
        prefix_cache_tokens: f.prefix_cache_tokens,
        prefill_per_token: dur("prefill-per-token", &f.prefill_per_token),
        cache_block_tokens: f.cache_block_tokens,
        cache_eviction,
        bytes_per_token: f.bytes_per_token,
        abort_rate: f.abort_rate,
        max_running: f.max_running,
    };
    if let Err(e) = sim::run(std::net::SocketAddr::new(ip, f.port), f.threads.max(1), cfg) {
        eprintln!("hivenet-sim: {e}");
        std::process::exit(1);
    }
}
