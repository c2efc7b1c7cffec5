//! `bench`: the simulated backend (`hivenet-sim`) and the load generator
//! (`hivenet-bench`). The generator is a library with a thin `main`, so
//! tests call [`run`] with [`Opts`].
#![forbid(unsafe_code)]

pub mod hold_client;
pub mod prefix_cache;
pub mod report;
pub mod schedule;
pub mod sim;
pub mod template;
pub mod timer;
pub mod worker;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use argh::FromArgs;
use shards::runtime::wire::executor::{spawn_runtime, DriverChoice};

use prefix_cache::Eviction;
use report::{Recorder, Report};
use schedule::Arrivals;
use template::{Dist, Endpoint, Template};
use worker::{Progress, WorkerSpec};

/// Open-loop (or closed-loop) HTTP load generator for LLM inference APIs.
#[derive(FromArgs, Debug, Clone)]
pub struct Opts {
    /// base URL, e.g. http://127.0.0.1:8080
    #[argh(option)]
    pub url: String,
    /// open loop: requests per second
    #[argh(option)]
    pub rate: Option<f64>,
    /// closed loop: connections sending back to back (used when --rate is absent)
    #[argh(option)]
    pub connections: Option<usize>,
    /// run length, e.g. 10s (default 10s; with --requests, a cap, default
    /// 10m)
    #[argh(option)]
    pub duration: Option<String>,
    /// closed loop: stop after this many requests in all, so a count per
    /// request divides by a fixed number (a run ends at this count or at
    /// the duration, whichever comes first)
    #[argh(option)]
    pub requests: Option<u64>,
    /// arrivals: constant or poisson (default poisson)
    #[argh(option, default = "String::from(\"poisson\")")]
    pub arrivals: String,
    /// endpoint: chat, messages, embeddings or rerank (default chat)
    #[argh(option, default = "String::from(\"chat\")")]
    pub endpoint: String,
    /// comma-separated models, picked uniformly (default sim-model)
    #[argh(option, default = "String::from(\"sim-model\")")]
    pub model: String,
    /// ask for streamed responses (chat and messages)
    #[argh(switch)]
    pub stream: bool,
    /// send the same prompt every time (an engine's prefix cache then
    /// holds it, as in a conversation); the default draws a new one
    #[argh(switch)]
    pub same_prompt: bool,
    /// multi-turn conversations: this many open at once, each request the
    /// next turn of one drawn at random (system prompt, earlier turns,
    /// a new user text of --prompt-tokens); default 0: independent prompts
    #[argh(option, default = "0")]
    pub conversations: u32,
    /// conversations: applications, each with its own system prompt
    /// shared by its conversations (default 4)
    #[argh(option, default = "4")]
    pub apps: u32,
    /// conversations: system prompt length in tokens (default 512)
    #[argh(option, default = "512")]
    pub system_tokens: u64,
    /// conversations: turns before a conversation starts over (default 8)
    #[argh(option, default = "8")]
    pub turns: u32,
    /// sampling temperature sent in the body (default: none sent)
    #[argh(option)]
    pub temperature: Option<f64>,
    /// prompt length in tokens: N or A-B (default 16)
    #[argh(option, default = "String::from(\"16\")")]
    pub prompt_tokens: String,
    /// max_tokens: N or A-B (default 16)
    #[argh(option, default = "String::from(\"16\")")]
    pub max_tokens: String,
    /// API key sent as Authorization: Bearer
    #[argh(option)]
    pub api_key: Option<String>,
    /// worker threads (default 1)
    #[argh(option, default = "1")]
    pub threads: usize,
    /// open loop: busy-wait this long before each send instead of
    /// sleeping, to absorb timer wake-up slack (default 100us; 0 sleeps only)
    #[argh(option, default = "String::from(\"100us\")")]
    pub spin: String,
    /// CPUs to pin worker threads to, e.g. 0 or 0-1
    #[argh(option)]
    pub cpus: Option<String>,
    /// per-request timeout (default 60s)
    #[argh(option, default = "String::from(\"60s\")")]
    pub timeout: String,
    /// most connections per worker in open loop (default 4096)
    #[argh(option, default = "4096")]
    pub max_connections: usize,
    /// seed for arrivals and bodies (default 1)
    #[argh(option, default = "1")]
    pub seed: u64,
    /// JSON report path; the SVG plot goes beside it (default bench-report.json)
    #[argh(option, default = "String::from(\"bench-report.json\")")]
    pub out: String,
    /// no progress line each second
    #[argh(switch)]
    pub quiet: bool,
    /// closed loop on one connection: also these comma-separated URLs,
    /// one request to each in turn after --url's (so the targets share
    /// every moment of the machine); with --requests, that many turns.
    /// Target k's report goes beside --out as <stem>-<k>.json (k = 1..)
    #[argh(option)]
    pub interleave: Option<String>,
    /// open loop through an oracle of cache affinity instead of --url:
    /// these comma-separated hivenet-sim URLs, each request sent to the
    /// sim with a free slot whose cache (mirrored exactly) holds the
    /// longest prefix of it (issue 30's "oracle that knows every
    /// engine's cache")
    #[argh(option)]
    pub oracle_of: Option<String>,
    /// the sims' cache and slots for --oracle-of:
    /// CACHE_TOKENS:BLOCK_TOKENS:BYTES_PER_TOKEN:CAPACITY[:EVICTION]
    /// (default 4096:1:2.0:4, the calibrated sim of
    /// scripts/bench/affinity-ramp.sh behind agents of --capacity 4;
    /// EVICTION is the sims' --cache-eviction, prompt-order by default)
    #[argh(option, default = "String::from(\"4096:1:2.0:4\")")]
    pub oracle_shape: String,
    /// with --oracle-of: read the mirrors from this file if it exists (the same
    /// sims served an earlier run) and write them back at the end
    #[argh(option)]
    pub oracle_state: Option<String>,
}

/// `--oracle-shape`: cache tokens, block tokens, bytes per token,
/// capacity, and the sims' `--cache-eviction` (optional, `prompt-order`).
fn parse_oracle_shape(s: &str) -> Result<(u64, u64, f64, usize, Eviction), String> {
    let bad = || {
        format!("--oracle-shape {s:?}: want CACHE_TOKENS:BLOCK_TOKENS:BYTES_PER_TOKEN:CAPACITY[:EVICTION], e.g. 4096:1:2.0:4 or 4096:16:2.0:32:tail-first")
    };
    let f: Vec<&str> = s.split(':').collect();
    let (c, b, t, k, e) = match f.as_slice() {
        [c, b, t, k] => (c, b, t, k, Eviction::PromptOrder),
        [c, b, t, k, e] => (c, b, t, k, Eviction::parse(e.trim()).ok_or_else(bad)?),
        _ => return Err(bad()),
    };
    let cache = c.trim().parse::<u64>().map_err(|_| bad())?;
    let block = b
        .trim()
        .parse::<u64>()
        .ok()
        .filter(|&b| b > 0)
        .ok_or_else(bad)?;
    let bpt = t
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|t| t.is_finite() && *t > 0.0)
        .ok_or_else(bad)?;
    let cap = k
        .trim()
        .parse::<usize>()
        .ok()
        .filter(|&k| k > 0)
        .ok_or_else(bad)?;
    Ok((cache, block, bpt, cap, e))
}

fn parse_target(url: &str) -> Result<(SocketAddr, String), String> {
    let rest = url
        .trim()
        .strip_prefix("http://")
        .ok_or_else(|| format!("--url {url:?}: only http:// is supported"))?;
    let auth = rest.split('/').next().unwrap_or("");
    let addr = auth
        .to_socket_addrs()
        .map_err(|e| format!("--url {url:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("--url {url:?}: cannot resolve"))?;
    Ok((addr, auth.to_string()))
}

/// Run a benchmark and return its report (also written as JSON and SVG).
pub fn run(opts: &Opts) -> Result<Report, String> {
    let (addr, host) = parse_target(&opts.url)?;
    let duration = match (&opts.duration, opts.requests) {
        (Some(d), _) => humantime::parse_duration(d).map_err(|e| format!("--duration: {e}"))?,
        (None, Some(_)) => Duration::from_secs(600),
        (None, None) => Duration::from_secs(10),
    };
    let timeout =
        humantime::parse_duration(&opts.timeout).map_err(|e| format!("--timeout: {e}"))?;
    let spin = humantime::parse_duration(&opts.spin).map_err(|e| format!("--spin: {e}"))?;
    if spin > Duration::from_millis(10) {
        return Err("--spin must be at most 10ms".into());
    }
    let arrivals =
        Arrivals::parse(&opts.arrivals).ok_or("--arrivals must be constant or poisson")?;
    let endpoint = Endpoint::parse(&opts.endpoint)
        .ok_or("--endpoint must be chat, messages, embeddings or rerank")?;
    let template = Template {
        endpoint,
        models: opts
            .model
            .split(',')
            .map(str::trim)
            .filter(|m| !m.is_empty())
            .map(String::from)
            .collect(),
        prompt_tokens: Dist::parse(&opts.prompt_tokens)
            .map_err(|e| format!("--prompt-tokens: {e}"))?,
        max_tokens: Dist::parse(&opts.max_tokens).map_err(|e| format!("--max-tokens: {e}"))?,
        stream: opts.stream,
        same_prompt: opts.same_prompt,
        temperature: match opts.temperature {
            Some(t) if !(0.0..=2.0).contains(&t) => {
                return Err("--temperature must be between 0 and 2".into())
            }
            t => t,
        },
        conversations: match opts.conversations {
            0 => None,
            n if opts.same_prompt => {
                return Err(format!(
                    "--conversations {n} and --same-prompt: choose one workload"
                ))
            }
            n => Some(template::Conversations::new(
                n,
                opts.apps,
                opts.system_tokens,
                opts.turns,
            )),
        },
    };
    let threads = opts.threads.max(1);
    let cpus: Vec<usize> = match &opts.cpus {
        Some(s) => shards::logic::system::core_plan::parse_cpu_list(s)
            .map_err(|e| format!("--cpus: {e}"))?,
        None => Vec::new(),
    };
    let (mode, rate, connections) = match (opts.rate, opts.connections) {
        (Some(r), _) if r > 0.0 && r.is_finite() => ("open", r, 0),
        (Some(_), _) => return Err("--rate must be a positive number".into()),
        (None, Some(c)) if c > 0 => ("closed", 0.0, c),
        _ => return Err("give --rate (open loop) or --connections (closed loop)".into()),
    };
    let budget = match opts.requests {
        None => None,
        Some(_) if mode == "open" => {
            return Err("--requests is for the closed loop (--connections); the open loop sends --rate for --duration".into())
        }
        Some(0) => return Err("--requests must be at least 1".into()),
        Some(n) => Some(Arc::new(AtomicU64::new(n))),
    };
    let offsets = if mode == "open" {
        schedule::schedule(arrivals, rate, duration, opts.seed)
    } else {
        Vec::new()
    };
    let progress = Arc::new(Progress::default());
    // Workers start together a little in the future.
    let start = Instant::now() + Duration::from_millis(50);
    let others: Vec<&str> = opts
        .interleave
        .as_deref()
        .map(|u| {
            u.split(',')
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .collect()
        })
        .unwrap_or_default();
    if let Some(urls) = opts.oracle_of.as_deref() {
        if mode != "open" || threads != 1 {
            return Err("--oracle-of takes --rate (open loop) and one thread".into());
        }
        let (cache, block, bpt, cap, eviction) = parse_oracle_shape(&opts.oracle_shape)?;
        let mut specs = Vec::new();
        for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
            let (addr, host) = parse_target(url)?;
            specs.push(WorkerSpec {
                addr,
                host,
                template: template.clone(),
                api_key: opts.api_key.clone(),
                timeout,
                max_connections: opts.max_connections.max(1),
                seed: opts.seed,
            });
        }
        if specs.is_empty() {
            return Err("--oracle-of: no URL".into());
        }
        let mut oracle = prefix_cache::Oracle::new(specs.len(), cap, cache, block, bpt, eviction);
        if let Some(path) = opts.oracle_state.as_deref() {
            if let Ok(text) = std::fs::read(path) {
                oracle = serde_json::from_slice(&text)
                    .map_err(|e| format!("--oracle-state {path}: {e}"))?;
                oracle.predicted = 0;
            }
        }
        let state_path = opts.oracle_state.clone();
        let (tx, rx) = std::sync::mpsc::channel::<(Recorder, prefix_cache::Oracle)>();
        let h = spawn_runtime(
            "bench-0".into(),
            cpus.first().copied(),
            DriverChoice::Auto,
            move || async move {
                let (rec, oracle) =
                    worker::oracle_loop(specs, oracle, offsets, spin, start, progress).await;
                let _ = tx.send((rec, oracle));
            },
        )
        .map_err(|e| format!("cannot start worker: {e}"))?;
        let (rec, oracle) = rx.recv().map_err(|_| "the worker stopped".to_string())?;
        let _ = h.join();
        eprintln!("oracle: cached tokens predicted {}", oracle.predicted);
        if let Some(path) = state_path.as_deref() {
            let text = serde_json::to_vec(&oracle).map_err(|e| format!("--oracle-state: {e}"))?;
            std::fs::write(path, text).map_err(|e| format!("--oracle-state {path}: {e}"))?;
        }
        let elapsed = start.elapsed().as_secs_f64();
        let report = report::build(&rec, mode, urls, rate, 1, duration.as_secs_f64(), elapsed);
        write_report(&report, &opts.out)?;
        return Ok(report);
    }
    if !others.is_empty() {
        if mode != "closed" || connections != 1 || threads != 1 {
            return Err("--interleave takes --connections 1 and one thread".into());
        }
        let mut specs = Vec::new();
        for url in std::iter::once(opts.url.as_str()).chain(others.iter().copied()) {
            let (addr, host) = parse_target(url)?;
            specs.push(WorkerSpec {
                addr,
                host,
                template: template.clone(),
                api_key: opts.api_key.clone(),
                timeout,
                max_connections: 1,
                seed: opts.seed,
            });
        }
        let end = worker::End {
            until: start + duration,
            budget,
        };
        let (tx, rx) = std::sync::mpsc::channel::<Vec<Recorder>>();
        let h = spawn_runtime(
            "bench-0".into(),
            cpus.first().copied(),
            DriverChoice::Auto,
            move || async move {
                let _ = tx.send(worker::interleaved(specs, end, start, progress).await);
            },
        )
        .map_err(|e| format!("cannot start worker: {e}"))?;
        let recs = rx.recv().map_err(|_| "the worker stopped".to_string())?;
        let _ = h.join();
        let elapsed = start.elapsed().as_secs_f64();
        let stem = opts.out.strip_suffix(".json").unwrap_or(&opts.out);
        let mut first = None;
        for (k, (rec, url)) in recs
            .iter()
            .zip(std::iter::once(opts.url.as_str()).chain(others.iter().copied()))
            .enumerate()
        {
            let mut report =
                report::build(rec, mode, url, rate, 1, duration.as_secs_f64(), elapsed);
            report.requests = opts.requests;
            let path = if k == 0 {
                opts.out.clone()
            } else {
                format!("{stem}-{k}.json")
            };
            write_report(&report, &path)?;
            if k > 0 {
                print!("{}", report::table(&report));
                println!("report: {path}");
            }
            first.get_or_insert(report);
        }
        return first.ok_or_else(|| "no target".to_string());
    }
    let (tx, rx) = std::sync::mpsc::channel::<Recorder>();
    let mut handles = Vec::new();
    for w in 0..threads {
        let spec = WorkerSpec {
            addr,
            host: host.clone(),
            template: template.clone(),
            api_key: opts.api_key.clone(),
            timeout,
            max_connections: opts.max_connections.max(1),
            seed: opts.seed.wrapping_add(w as u64 * 7919),
        };
        let mine: Vec<Duration> = offsets.iter().skip(w).step_by(threads).copied().collect();
        let conns = connections / threads + usize::from(w < connections % threads);
        let progress = progress.clone();
        let tx = tx.clone();
        let cpu = if cpus.is_empty() {
            None
        } else {
            cpus.get(w % cpus.len()).copied()
        };
        let is_open = mode == "open";
        let budget = budget.clone();
        let h = spawn_runtime(
            format!("bench-{w}"),
            cpu,
            DriverChoice::Auto,
            move || async move {
                let rec = if is_open {
                    worker::open_loop(spec, mine, spin, start, progress).await
                } else {
                    let end = worker::End {
                        until: start + duration,
                        budget,
                    };
                    worker::closed_loop(spec, conns, end, start, progress).await
                };
                let _ = tx.send(rec);
            },
        )
        .map_err(|e| format!("cannot start worker: {e}"))?;
        handles.push(h);
    }
    drop(tx);
    // Progress line each second until every worker reported.
    let mut merged = Recorder::default();
    let mut done = 0;
    let mut last_ok = 0;
    let mut tick = 0u64;
    while done < threads {
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(r) => {
                merged.merge(&r);
                done += 1;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                tick += 1;
                if !opts.quiet {
                    let ok = progress.ok.load(Ordering::Relaxed);
                    eprintln!(
                        "t={tick}s sent={} ok={ok} errors={} last_s={} req/s",
                        progress.sent.load(Ordering::Relaxed),
                        progress.errors.load(Ordering::Relaxed),
                        ok - last_ok
                    );
                    last_ok = ok;
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    for h in handles {
        let _ = h.join();
    }
    let elapsed = start.elapsed().as_secs_f64();
    let mut report = report::build(
        &merged,
        mode,
        &opts.url,
        rate,
        connections,
        duration.as_secs_f64(),
        elapsed,
    );
    report.requests = opts.requests;
    write_report(&report, &opts.out)?;
    Ok(report)
}

/// The JSON report at `path`, its SVG plot beside it.
fn write_report(report: &Report, path: &str) -> Result<(), String> {
    let json = serde_json::to_string_pretty(report).map_err(|e| e.to_string())?;
    std::fs::write(path, json).map_err(|e| format!("cannot write {path}: {e}"))?;
    let svg_path = match path.strip_suffix(".json") {
        Some(stem) => format!("{stem}.svg"),
        None => format!("{path}.svg"),
    };
    std::fs::write(&svg_path, report::svg(report))
        .map_err(|e| format!("cannot write {svg_path}: {e}"))
}
