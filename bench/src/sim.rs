//! `hivenet-sim`: a simulated OpenAI/Anthropic-compatible backend with
//! honest timing (timer sleeps, no busy loops): time to first token,
//! inter-token gap, output length, error rate, cold start, and a
//! vLLM-style `/metrics`.
//!
//! Streaming responses send their headers together with the first token
//! (after the time to first token), as an engine whose first body write
//! carries the first token does.

use std::cell::Cell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{json, Value};
use shards::logic::http::framing::http_parse::BodyFraming;
use shards::logic::http::framing::http_write::{self, OutFraming};
use shards::runtime::wire::conn::Conn;

mod responses;

/// Simulator settings.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Model name served.
    pub model: String,
    /// Delay before the first token.
    pub ttft: Duration,
    /// Delay between tokens.
    pub itl: Duration,
    /// Output tokens per completion (capped by the request's max_tokens).
    pub output_tokens: u32,
    /// Fraction of inference requests answered with `error_status`.
    pub error_rate: f64,
    /// The status of those answers (500 by default; 429 or 503 stand
    /// for a busy engine).
    pub error_status: u16,
    /// `/health` answers 503 until this long after start.
    pub startup_delay: Duration,
    /// Stall the whole server once, when this many inference requests have
    /// arrived (0: never), for `stall_for` (a GC pause, a host hiccup).
    pub stall_after: u64,
    /// Length of the one stall.
    pub stall_for: Duration,
    /// KV-cache use reported in `/metrics` (0-1).
    pub kv_cache_usage: f64,
    /// Report this many prompt tokens in chat usage whatever was sent
    /// (0: the true count): a lying backend.
    pub claim_prompt_tokens: u64,
    /// Remember each inference request's trace headers (off by default:
    /// the simulator is also the benchmarks' minimal backend).
    pub record_traces: bool,
    /// Export one span per request to this OTLP/HTTP traces URL, under
    /// the request's `traceparent` (as vLLM's `--otlp-traces-endpoint`).
    pub otlp_traces_endpoint: Option<String>,
    /// Prefix cache capacity in tokens (0: no cache).
    pub prefix_cache_tokens: u64,
    /// Time to first token added per uncached prompt token.
    pub prefill_per_token: Duration,
    /// Tokens per prefix-cache block (16 as vLLM; 1 as llama.cpp).
    pub cache_block_tokens: u64,
    /// Which of a prompt's blocks the prefix cache evicts first.
    pub cache_eviction: crate::prefix_cache::Eviction,
    /// Request bytes per prompt token (the stand-in for a tokenizer).
    pub bytes_per_token: f64,
    /// Fraction of answers cut mid-way (the connection closed without
    /// their end, as an engine that dies): a stream at a random token, a
    /// whole answer after half its body. The continuation tests' fault.
    pub abort_rate: f64,
    /// Requests served at once per simulator thread (0: no limit, the
    /// default); past it a request waits in line, first come first
    /// served, before its prefill, as vLLM's `--max-num-seqs`.
    pub max_running: u32,
}

/// The engine's slots (`--max-running`): requests past them wait in
/// arrival order; the prefix cache is read when a request gets its slot.
#[derive(Default)]
struct Slots {
    free: Cell<u32>,
    line: std::cell::RefCell<std::collections::VecDeque<futures::channel::oneshot::Sender<()>>>,
}

/// A slot held until the answer is written.
struct SlotGuard<'a>(Option<&'a Slots>);

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        let Some(s) = self.0 else {
            return;
        };
        // The slot passes to the next in line (one that left is skipped).
        let mut line = s.line.borrow_mut();
        while let Some(next) = line.pop_front() {
            if next.send(()).is_ok() {
                return;
            }
        }
        s.free.set(s.free.get() + 1);
    }
}

impl Sim {
    /// A slot, waiting in line when all are taken (`--max-running`).
    async fn slot(&self) -> SlotGuard<'_> {
        if self.cfg.max_running == 0 {
            return SlotGuard(None);
        }
        let s = &self.slots;
        if s.free.get() > 0 && s.line.borrow().is_empty() {
            s.free.set(s.free.get() - 1);
            return SlotGuard(Some(s));
        }
        let (tx, rx) = futures::channel::oneshot::channel();
        s.line.borrow_mut().push_back(tx);
        let _ = rx.await;
        SlotGuard(Some(s))
    }
}

/// Counters shared by the simulator's threads.
#[derive(Default)]
pub struct SimStats {
    /// Requests answered successfully.
    pub success: AtomicU64,
    /// Requests answered with an injected error.
    pub errors: AtomicU64,
    /// Requests in flight.
    pub running: AtomicU64,
    /// Tokens generated.
    pub generated: AtomicU64,
    /// Inference requests arrived.
    pub arrived: AtomicU64,
    /// End of the stall, once it started.
    pub stall_until: std::sync::Mutex<Option<Instant>>,
    /// KV-cache use reported now (f64 bits): `--kv-cache-usage` at start,
    /// changed at run time by `PUT /sim/kv_cache_usage` (a test drives
    /// engine pressure up and down).
    pub kv_bits: AtomicU64,
    /// Trace headers of the last [`TRACE_LOG`] inference requests, newest
    /// last (`GET /sim/trace_headers`: tests check what reached the
    /// backend).
    pub traces: std::sync::Mutex<std::collections::VecDeque<TraceSeen>>,
    /// The prefix cache (shared by the threads, as an engine's is).
    pub prefix: std::sync::Mutex<crate::prefix_cache::PrefixCache>,
    /// Prompt tokens looked up in the prefix cache (vLLM's
    /// `prefix_cache_queries`).
    pub prefix_queries: AtomicU64,
    /// Of those, tokens found (`prefix_cache_hits`).
    pub prefix_hits: AtomicU64,
    /// Most requests in flight at once (a capacity shared by several
    /// routers is checked here, at the engine).
    pub peak_running: AtomicU64,
    /// The integral of requests in flight over time: (last change, slot
    /// seconds). Its rate over a window is the mean occupancy.
    pub busy: std::sync::Mutex<(Option<Instant>, f64)>,
}

impl SimStats {
    /// Requests in flight change by `delta` (+1 or -1).
    fn running_changed(&self, delta: i64) {
        let now = Instant::now();
        if let Ok(mut b) = self.busy.lock() {
            let before = self.running.load(Ordering::Relaxed);
            if let Some(last) = b.0 {
                b.1 += before as f64 * now.saturating_duration_since(last).as_secs_f64();
            }
            b.0 = Some(now);
            let after = if delta >= 0 {
                self.running.fetch_add(1, Ordering::Relaxed) + 1
            } else {
                self.running
                    .fetch_sub(1, Ordering::Relaxed)
                    .saturating_sub(1)
            };
            self.peak_running.fetch_max(after, Ordering::Relaxed);
        }
    }

    /// Slot seconds busy up to now.
    fn busy_seconds(&self) -> f64 {
        let now = Instant::now();
        self.busy.lock().map_or(0.0, |b| {
            let open = b.0.map_or(0.0, |last| {
                self.running.load(Ordering::Relaxed) as f64
                    * now.saturating_duration_since(last).as_secs_f64()
            });
            b.1 + open
        })
    }
}

/// How many requests' trace headers the simulator remembers.
pub const TRACE_LOG: usize = 256;

/// The trace headers one request arrived with (empty when absent).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct TraceSeen {
    /// Request path.
    pub path: String,
    /// `X-Request-ID`.
    pub x_request_id: String,
    /// `traceparent` values, in order.
    pub traceparent: Vec<String>,
    /// `tracestate` values, in order.
    pub tracestate: Vec<String>,
    /// `baggage` values, in order.
    pub baggage: Vec<String>,
}

/// Words the simulator "generates", in order.
const WORDS: [&str; 16] = [
    "The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".", " Hivenet",
    " routes", " every", " token", " home", ".",
];

/// The text of `n` generated tokens (what a client must receive).
pub fn generated_text(n: u32) -> String {
    (0..n as usize).map(|i| WORDS[i % WORDS.len()]).collect()
}

fn token(i: u32) -> &'static str {
    WORDS[i as usize % WORDS.len()]
}

/// The text of `n` generated tokens from token `from` on.
fn text_from(from: u32, n: u32) -> String {
    (from..from.saturating_add(n)).map(token).collect()
}

#[derive(Deserialize, Default)]
struct ChatReq {
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Per-thread state.
struct Sim {
    cfg: SimConfig,
    stats: Arc<SimStats>,
    started: Instant,
    rng: Cell<u64>,
    traces: Option<Arc<shards::runtime::services::otlp::TraceExport>>,
    slots: Slots,
}

impl Sim {
    fn roll_error(&self) -> bool {
        if self.cfg.error_rate <= 0.0 {
            return false;
        }
        self.uniform() < self.cfg.error_rate
    }

    /// A uniform draw in [0, 1).
    fn uniform(&self) -> f64 {
        // xorshift64*: deterministic per thread, cheap.
        let mut x = self.rng.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng.set(x);
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// After how many of `n` streamed tokens this answer is cut (`None`:
    /// it is not): uniform over 1..n, at `--abort-rate`.
    fn roll_abort(&self, n: u32) -> Option<u32> {
        if self.cfg.abort_rate <= 0.0 || n < 2 || self.uniform() >= self.cfg.abort_rate {
            return None;
        }
        let at = 1 + (self.uniform() * f64::from(n - 1)) as u32;
        Some(at.min(n - 1))
    }
}

/// Tokens of the generated text that an assistant message last in the
/// request already holds: a continuation (vLLM's
/// `continue_final_message`, llama.cpp's prefill) goes on from there, so
/// the two parts make the uninterrupted text exactly. 0 when the last
/// message is not the assistant's or is not such a prefix. It may be
/// longer than this simulator's own `--output-tokens` (the first part came
/// from another engine): then nothing is left to generate.
fn continued_tokens(body: &[u8]) -> u32 {
    let Ok(p) = serde_json::from_slice::<PromptParts>(body) else {
        return 0;
    };
    let Some(last) = p
        .messages
        .as_ref()
        .and_then(Value::as_array)
        .and_then(|m| m.last())
    else {
        return 0;
    };
    if last.get("role").and_then(Value::as_str) != Some("assistant") {
        return 0;
    }
    let Some(text) = last.get("content").and_then(Value::as_str) else {
        return 0;
    };
    let mut acc = String::new();
    for i in 0..=u32::try_from(text.len()).unwrap_or(u32::MAX) {
        if acc == text {
            return i;
        }
        if acc.len() >= text.len() {
            break;
        }
        acc.push_str(token(i));
    }
    0
}

async fn sleep(d: Duration) {
    crate::timer::sleep(d).await;
}

/// Run the simulator on `threads` threads sharing `addr` (SO_REUSEPORT).
pub fn run(addr: SocketAddr, threads: usize, cfg: SimConfig) -> std::io::Result<()> {
    let listeners = shards::runtime::wire::executor::bind_reuseport(addr, threads)?;
    if let Some(l) = listeners.first() {
        tracing::info!(addr = %l.local_addr()?, model = %cfg.model, ttft = ?cfg.ttft, itl = ?cfg.itl, tokens = cfg.output_tokens, "hivenet-sim listening");
    }
    let stats = Arc::new(SimStats {
        prefix: std::sync::Mutex::new(
            crate::prefix_cache::PrefixCache::shaped(
                cfg.prefix_cache_tokens,
                cfg.cache_block_tokens,
                cfg.bytes_per_token,
            )
            .evicting(cfg.cache_eviction),
        ),
        ..SimStats::default()
    });
    stats
        .kv_bits
        .store(cfg.kv_cache_usage.to_bits(), Ordering::Relaxed);
    let started = Instant::now();
    let traces = match &cfg.otlp_traces_endpoint {
        Some(url) => Some(engine_spans(url)?),
        None => None,
    };
    let mut handles = Vec::new();
    for (i, l) in listeners.into_iter().enumerate() {
        let cfg = cfg.clone();
        let stats = stats.clone();
        let traces = traces.clone();
        let h = shards::runtime::wire::executor::spawn_runtime(
            format!("sim-{i}"),
            None,
            shards::runtime::wire::executor::DriverChoice::Auto,
            move || async move {
                let sim = Rc::new(Sim {
                    slots: Slots {
                        free: Cell::new(cfg.max_running),
                        line: Default::default(),
                    },
                    cfg,
                    stats,
                    started,
                    rng: Cell::new(0x9E37_79B9_7F4A_7C15 ^ (i as u64 + 1)),
                    traces,
                });
                let listener = match monoio::net::TcpListener::from_std(l) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!("sim listener: {e}");
                        return;
                    }
                };
                loop {
                    match listener.accept().await {
                        Ok((s, _)) => {
                            monoio::spawn(serve(sim.clone(), Conn::new(s, Vec::new())));
                        }
                        Err(e) => {
                            tracing::warn!("accept: {e}");
                            monoio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
            },
        )?;
        handles.push(h);
    }
    for h in handles {
        let _ = h.join();
    }
    Ok(())
}

async fn serve(sim: Rc<Sim>, mut conn: Conn) {
    loop {
        // Requests come through the router and the agent, which may add a
        // few headers to the client's (real backends do not count them).
        let head = match conn.read_forwarded_request_head().await {
            Ok(h) => h,
            Err(shards::runtime::wire::conn::HeadRead::Closed) => return,
            Err(shards::runtime::wire::conn::HeadRead::Bad(_)) => {
                let _ = conn.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec()).await;
                return;
            }
        };
        let body = match conn.read_body(head.framing, 64 * 1024 * 1024).await {
            Ok(b) => b,
            Err(_) => return,
        };
        let keep = head.keep_alive;
        if sim.cfg.record_traces && head.method == "POST" {
            record_trace(&sim.stats, &head);
        }
        let span = sim.traces.as_ref().and_then(|_| engine_span(&sim, &head));
        // Inference waits for a slot (`--max-running`); the rest does not.
        let _slot = if head.method == "POST" {
            Some(sim.slot().await)
        } else {
            None
        };
        let ok = handle(&sim, &mut conn, &head.method, head.path_only(), &body, keep).await;
        if let (Some(mut s), Some(t)) = (span, sim.traces.as_ref()) {
            s.end(unix_ns());
            t.send(vec![s]);
        }
        if !ok || !keep {
            return;
        }
    }
}

/// The engine's spans, as vLLM exports them (`--otlp-traces-endpoint`):
/// every one, batched every 100 ms.
fn engine_spans(url: &str) -> std::io::Result<Arc<shards::runtime::services::otlp::TraceExport>> {
    use shards::logic::trace::otlp::Resource;
    use shards::runtime::services::otlp::{target_of, ExportCfg, Target, TraceExport};
    let (authority, path) = target_of(url, false)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    TraceExport::start(ExportCfg {
        target: Target {
            authority,
            path,
            headers: Vec::new(),
            timeout: Duration::from_secs(2),
        },
        resource: Resource {
            attrs: vec![("service.name", "hivenet-sim".into())],
            scope: "vllm.llm_engine",
            version: "sim",
        },
        sampler: shards::logic::trace::sampler::Sampler::parse(
            Some("parentbased_always_on"),
            None,
            None,
        )
        .unwrap_or_default(),
        delay: Duration::from_millis(100),
        queue: 4096,
        batch: 512,
    })
}

use shards::runtime::wire::clock::unix_ns;

/// vLLM's `llm_request` span for an inference request that names a
/// sampled parent.
fn engine_span(
    sim: &Sim,
    head: &shards::logic::http::framing::http_parse::RequestHead,
) -> Option<shards::logic::trace::span::Span> {
    use shards::logic::trace::span::{Kind, Span};
    if head.method != "POST" {
        return None;
    }
    let tp = head
        .header("traceparent")
        .and_then(shards::logic::http::trace_context::parse)?;
    if tp.flags & shards::logic::http::trace_context::SAMPLED == 0 {
        return None;
    }
    let mut id = sim.uniform().to_bits().to_le_bytes();
    id[0] |= 1;
    let mut s = Span::new(
        tp.trace_id,
        id,
        Some(tp.parent_id),
        "llm_request",
        Kind::Server,
        unix_ns(),
    );
    s.set("gen_ai.request.model", sim.cfg.model.as_str());
    s.set("gen_ai.system", "vllm");
    s.set("url.path", head.path_only());
    Some(s)
}

fn record_trace(stats: &SimStats, head: &shards::logic::http::framing::http_parse::RequestHead) {
    let values = |name: &str| -> Vec<String> {
        head.header_values(name)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .collect()
    };
    let seen = TraceSeen {
        path: head.path_only().to_string(),
        x_request_id: head
            .header("x-request-id")
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default(),
        traceparent: values("traceparent"),
        tracestate: values("tracestate"),
        baggage: values("baggage"),
    };
    if let Ok(mut log) = stats.traces.lock() {
        if log.len() >= TRACE_LOG {
            log.pop_front();
        }
        log.push_back(seen);
    }
}

async fn reply(conn: &mut Conn, status: u16, ctype: &str, body: &[u8], keep: bool) -> bool {
    let mut out = Vec::with_capacity(body.len() + 200);
    http_write::write_full_response(&mut out, status, ctype, body, keep, &[]);
    conn.write_all(out).await.is_ok()
}

async fn reply_json(conn: &mut Conn, status: u16, v: &Value, keep: bool) -> bool {
    let body = serde_json::to_vec(v).unwrap_or_default();
    reply(conn, status, "application/json", &body, keep).await
}

/// A whole non-streamed answer, or at `--abort-rate` its head and half
/// its body, then the connection closed (an engine dying mid-answer).
async fn answer_or_abort(sim: &Sim, conn: &mut Conn, v: &Value, keep: bool) -> bool {
    if sim.roll_abort(2).is_none() {
        return reply_json(conn, 200, v, keep).await;
    }
    let body = serde_json::to_vec(v).unwrap_or_default();
    let mut out = Vec::with_capacity(256 + body.len());
    let headers: [(&str, &[u8]); 1] = [("Content-Type", b"application/json")];
    http_write::write_response_head(
        &mut out,
        200,
        headers,
        OutFraming::Length(body.len()),
        keep,
        &[],
    );
    out.extend_from_slice(body.get(..body.len() / 2).unwrap_or(&[]));
    let _ = conn.write_all(out).await;
    false
}

fn input_tokens(sim: &Sim, body: &[u8]) -> u64 {
    crate::prefix_cache::tokens_of(body.len(), sim.cfg.bytes_per_token)
}

#[derive(Deserialize)]
struct PromptParts {
    #[serde(default)]
    system: Option<Value>,
    #[serde(default)]
    messages: Option<Value>,
}

/// The prompt as an engine's chat template renders it, for the prefix
/// cache: role and content of the system prompt and each message in
/// order, the same for both API shapes (the body's other fields change
/// between turns and are not part of it). `None`: not a chat body.
/// Shared with the bench's oracle (`worker::oracle_loop`), which mirrors
/// each sim's cache.
pub fn prompt_text(body: &[u8]) -> Option<String> {
    let p = serde_json::from_slice::<PromptParts>(body).ok()?;
    let mut text = String::new();
    let mut turn = |role: &str, content: &Value| {
        text.push_str(role);
        text.push('\n');
        match content.as_str() {
            Some(c) => text.push_str(c),
            None => text.push_str(&content.to_string()),
        }
        text.push('\n');
    };
    if let Some(sys) = &p.system {
        turn("system", sys);
    }
    for m in p
        .messages
        .as_ref()
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        turn(role, m.get("content").unwrap_or(&Value::Null));
    }
    Some(text)
}

/// Prompt tokens read from the prefix cache (0 without one), counted in
/// the vLLM-style metrics; and the time to first token for the rest.
fn prefill(sim: &Sim, body: &[u8], prompt: u64) -> (u64, Duration) {
    prefill_text(sim, prompt_text(body), prompt)
}

/// [`prefill`] of a prompt already rendered (`None`: no cache lookup).
fn prefill_text(sim: &Sim, text: Option<String>, prompt: u64) -> (u64, Duration) {
    let mut cached = 0;
    if sim.cfg.prefix_cache_tokens > 0 {
        if let Some(text) = text {
            if let Ok(mut c) = sim.stats.prefix.lock() {
                cached = c.lookup_and_keep(text.as_bytes()).min(prompt);
            }
        }
        sim.stats
            .prefix_queries
            .fetch_add(prompt, Ordering::Relaxed);
        sim.stats.prefix_hits.fetch_add(cached, Ordering::Relaxed);
    }
    let uncached = u32::try_from(prompt - cached).unwrap_or(u32::MAX);
    (cached, sim.cfg.ttft + sim.cfg.prefill_per_token * uncached)
}

async fn handle(
    sim: &Sim,
    conn: &mut Conn,
    method: &str,
    path: &str,
    body: &[u8],
    keep: bool,
) -> bool {
    let cold = sim.started.elapsed() < sim.cfg.startup_delay;
    match (method, path) {
        ("GET", "/health") => {
            if cold {
                reply_json(conn, 503, &json!({"status": "loading"}), keep).await
            } else {
                reply_json(conn, 200, &json!({"status": "ok"}), keep).await
            }
        }
        ("PUT", "/sim/kv_cache_usage") => {
            let v = std::str::from_utf8(body)
                .ok()
                .and_then(|t| t.trim().parse::<f64>().ok())
                .filter(|v| (0.0..=1.0).contains(v));
            match v {
                Some(v) => {
                    sim.stats.kv_bits.store(v.to_bits(), Ordering::Relaxed);
                    reply_json(conn, 200, &json!({"kv_cache_usage": v}), keep).await
                }
                None => {
                    let e = json!({"error": "body must be a number in [0, 1]"});
                    reply_json(conn, 400, &e, keep).await
                }
            }
        }
        ("GET", "/sim/trace_headers") => {
            let seen: Vec<TraceSeen> = match sim.stats.traces.lock() {
                Ok(log) => log.iter().cloned().collect(),
                Err(_) => Vec::new(),
            };
            reply_json(conn, 200, &json!(seen), keep).await
        }
        ("GET", "/v1/models") => {
            let v = json!({"object": "list", "data": [{"id": sim.cfg.model, "object": "model", "owned_by": "hivenet-sim"}]});
            reply_json(conn, 200, &v, keep).await
        }
        ("GET", "/api/tags") => {
            // Ollama's model list (names carry a ":latest" tag).
            let v = json!({"models": [{"name": format!("{}:latest", sim.cfg.model)}]});
            reply_json(conn, 200, &v, keep).await
        }
        ("GET", "/metrics") => {
            let s = &sim.stats;
            let text = format!(
                "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"{m}\"}} {}\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"{m}\"}} 0\n# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{model_name=\"{m}\"}} {kv}\n# TYPE vllm:request_success_total counter\nvllm:request_success_total{{finished_reason=\"stop\",model_name=\"{m}\"}} {}\n# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{{model_name=\"{m}\"}} {}\n# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{{model_name=\"{m}\"}} {}\n# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{{model_name=\"{m}\"}} {}\n# TYPE hivenet_sim_peak_running gauge\nhivenet_sim_peak_running {}\n# TYPE hivenet_sim_busy_slot_seconds_total counter\nhivenet_sim_busy_slot_seconds_total {:.6}\n",
                s.running.load(Ordering::Relaxed),
                s.success.load(Ordering::Relaxed),
                s.generated.load(Ordering::Relaxed),
                s.prefix_queries.load(Ordering::Relaxed),
                s.prefix_hits.load(Ordering::Relaxed),
                s.peak_running.load(Ordering::Relaxed),
                s.busy_seconds(),
                m = sim.cfg.model,
                kv = f64::from_bits(s.kv_bits.load(Ordering::Relaxed))
            );
            reply(
                conn,
                200,
                "text/plain; version=0.0.4",
                text.as_bytes(),
                keep,
            )
            .await
        }
        (
            "POST",
            "/v1/chat/completions"
            | "/v1/messages"
            | "/v1/messages/count_tokens"
            | "/v1/embeddings"
            | "/v1/rerank"
            | "/v1/responses"
            | "/v1/responses/input_tokens",
        ) => {
            if cold {
                return reply_json(conn, 503, &json!({"error": {"message": "model is loading", "type": "service_unavailable"}}), keep).await;
            }
            stall(sim).await;
            if path != "/v1/messages/count_tokens" && sim.roll_error() {
                sim.stats.errors.fetch_add(1, Ordering::Relaxed);
                return reply_json(conn, sim.cfg.error_status, &json!({"error": {"message": "simulated backend error", "type": "server_error"}}), keep).await;
            }
            sim.stats.running_changed(1);
            let r = match path {
                "/v1/chat/completions" => chat(sim, conn, body, keep).await,
                "/v1/messages" => messages(sim, conn, body, keep).await,
                "/v1/messages/count_tokens" => {
                    reply_json(
                        conn,
                        200,
                        &json!({"input_tokens": input_tokens(sim, body)}),
                        keep,
                    )
                    .await
                }
                "/v1/embeddings" => embeddings(sim, conn, body, keep).await,
                "/v1/responses" => responses::responses(sim, conn, body, keep).await,
                "/v1/responses/input_tokens" => {
                    responses::input_tokens_of(sim, conn, body, keep).await
                }
                _ => rerank(sim, conn, body, keep).await,
            };
            sim.stats.running_changed(-1);
            if r {
                sim.stats.success.fetch_add(1, Ordering::Relaxed);
            }
            r
        }
        _ => {
            reply_json(
                conn,
                404,
                &json!({"error": {"message": "not found", "type": "not_found"}}),
                keep,
            )
            .await
        }
    }
}

/// The one server-wide stall: every request that arrives during it waits
/// for its end.
async fn stall(sim: &Sim) {
    let n = sim.stats.arrived.fetch_add(1, Ordering::Relaxed) + 1;
    let until = match sim.stats.stall_until.lock() {
        Ok(mut g) => {
            if sim.cfg.stall_after > 0 && n == sim.cfg.stall_after && g.is_none() {
                *g = Some(Instant::now() + sim.cfg.stall_for);
            }
            *g
        }
        Err(_) => None,
    };
    if let Some(u) = until {
        crate::timer::sleep_until(u).await;
    }
}

/// The `n` tokens of a non-streamed answer, the first after `ttft`:
/// `generation_tokens_total` moves as they are made, as vLLM's does at
/// each scheduler step (issue 56: the agent waits on it), in steps of at
/// most 50 ms rather than a timer per token. The same time in all as one
/// sleep of `ttft + itl * (n - 1)`.
async fn generate_whole(sim: &Sim, ttft: Duration, n: u32) {
    sleep(ttft).await;
    if n == 0 {
        return;
    }
    sim.stats.generated.fetch_add(1, Ordering::Relaxed);
    let itl = sim.cfg.itl.as_nanos().max(1);
    let per_step = u32::try_from(Duration::from_millis(50).as_nanos() / itl)
        .unwrap_or(u32::MAX)
        .max(1);
    let mut left = n - 1;
    while left > 0 {
        let k = left.min(per_step);
        sleep(sim.cfg.itl * k).await;
        sim.stats
            .generated
            .fetch_add(u64::from(k), Ordering::Relaxed);
        left -= k;
    }
}

fn bad_request(msg: String) -> Value {
    json!({"error": {"message": msg, "type": "invalid_request_error"}})
}

async fn chat(sim: &Sim, conn: &mut Conn, body: &[u8], keep: bool) -> bool {
    let req: ChatReq = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return reply_json(conn, 400, &bad_request(e.to_string()), keep).await,
    };
    let from = continued_tokens(body);
    let left = sim.cfg.output_tokens.saturating_sub(from);
    let n = req
        .max_completion_tokens
        .or(req.max_tokens)
        .map(|m| m.min(left))
        .unwrap_or(left);
    let prompt = input_tokens(sim, body);
    let (cached, ttft) = prefill(sim, body, prompt);
    let id = "chatcmpl-sim";
    let model = &sim.cfg.model;
    // A lying backend (tests of the router's usage bound).
    let prompt = if sim.cfg.claim_prompt_tokens > 0 {
        sim.cfg.claim_prompt_tokens
    } else {
        prompt
    };
    let mut usage = json!({"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt.saturating_add(u64::from(n))});
    if sim.cfg.prefix_cache_tokens > 0 {
        usage["prompt_tokens_details"] = json!({"cached_tokens": cached});
    }
    if !req.stream {
        generate_whole(sim, ttft, n).await;
        let v = json!({
            "id": id, "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text_from(from, n)}, "finish_reason": "stop"}],
            "usage": usage
        });
        return answer_or_abort(sim, conn, &v, keep).await;
    }
    sleep(ttft).await;
    let mut out = Vec::with_capacity(1024);
    let headers: [(&str, &[u8]); 2] = [
        ("Content-Type", b"text/event-stream"),
        ("Cache-Control", b"no-cache"),
    ];
    http_write::write_response_head(&mut out, 200, headers, OutFraming::Chunked, keep, &[]);
    let abort = sim.roll_abort(n);
    for i in 0..n {
        if abort == Some(i) {
            return false;
        }
        if i > 0 {
            sleep(sim.cfg.itl).await;
        }
        let delta = if i == 0 {
            json!({"role": "assistant", "content": token(from + i)})
        } else {
            json!({"content": token(from + i)})
        };
        let ev = json!({"id": id, "object": "chat.completion.chunk", "created": 0, "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": null}]});
        http_write::write_chunk(&mut out, format!("data: {ev}\n\n").as_bytes());
        sim.stats.generated.fetch_add(1, Ordering::Relaxed);
        if conn.write_all(std::mem::take(&mut out)).await.is_err() {
            return false;
        }
    }
    let fin = json!({"id": id, "object": "chat.completion.chunk", "created": 0, "model": model, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
    http_write::write_chunk(&mut out, format!("data: {fin}\n\n").as_bytes());
    if req.stream_options.map(|o| o.include_usage).unwrap_or(false) {
        let u = json!({"id": id, "object": "chat.completion.chunk", "created": 0, "model": model, "choices": [],
            "usage": usage});
        http_write::write_chunk(&mut out, format!("data: {u}\n\n").as_bytes());
    }
    http_write::write_chunk(&mut out, b"data: [DONE]\n\n");
    out.extend_from_slice(http_write::LAST_CHUNK);
    conn.write_all(out).await.is_ok()
}

async fn messages(sim: &Sim, conn: &mut Conn, body: &[u8], keep: bool) -> bool {
    let req: ChatReq = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return reply_json(conn, 400, &json!({"type": "error", "error": {"type": "invalid_request_error", "message": e.to_string()}}), keep).await,
    };
    let from = continued_tokens(body);
    let left = sim.cfg.output_tokens.saturating_sub(from);
    let n = req.max_tokens.map(|m| m.min(left)).unwrap_or(left);
    let all = input_tokens(sim, body);
    let (cached, ttft) = prefill(sim, body, all);
    // Anthropic counts cache reads apart from input_tokens.
    let prompt = all - cached;
    let model = &sim.cfg.model;
    if !req.stream {
        generate_whole(sim, ttft, n).await;
        let mut usage = json!({"input_tokens": prompt, "output_tokens": n});
        if sim.cfg.prefix_cache_tokens > 0 {
            usage["cache_read_input_tokens"] = json!(cached);
        }
        let v = json!({"id": "msg_sim", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text_from(from, n)}], "stop_reason": "end_turn", "stop_sequence": null,
            "usage": usage});
        return answer_or_abort(sim, conn, &v, keep).await;
    }
    sleep(ttft).await;
    let mut out = Vec::with_capacity(2048);
    let headers: [(&str, &[u8]); 1] = [("Content-Type", b"text/event-stream")];
    http_write::write_response_head(&mut out, 200, headers, OutFraming::Chunked, keep, &[]);
    let ev = |name: &str, v: Value| format!("event: {name}\ndata: {v}\n\n");
    let start = ev(
        "message_start",
        json!({"type": "message_start", "message": {"id": "msg_sim", "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": prompt, "output_tokens": 1, "cache_read_input_tokens": cached}}}),
    );
    http_write::write_chunk(&mut out, start.as_bytes());
    http_write::write_chunk(&mut out, ev("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})).as_bytes());
    http_write::write_chunk(&mut out, ev("ping", json!({"type": "ping"})).as_bytes());
    let abort = sim.roll_abort(n);
    for i in 0..n {
        if abort == Some(i) {
            return false;
        }
        if i > 0 {
            sleep(sim.cfg.itl).await;
        }
        let d = ev(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": token(from + i)}}),
        );
        http_write::write_chunk(&mut out, d.as_bytes());
        sim.stats.generated.fetch_add(1, Ordering::Relaxed);
        if conn.write_all(std::mem::take(&mut out)).await.is_err() {
            return false;
        }
    }
    http_write::write_chunk(
        &mut out,
        ev(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        )
        .as_bytes(),
    );
    http_write::write_chunk(&mut out, ev("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": n}})).as_bytes());
    http_write::write_chunk(
        &mut out,
        ev("message_stop", json!({"type": "message_stop"})).as_bytes(),
    );
    out.extend_from_slice(http_write::LAST_CHUNK);
    conn.write_all(out).await.is_ok()
}

async fn embeddings(sim: &Sim, conn: &mut Conn, body: &[u8], keep: bool) -> bool {
    let v: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return reply_json(conn, 400, &bad_request(e.to_string()), keep).await,
    };
    let inputs: Vec<String> = match v.get("input") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().unwrap_or("").to_string())
            .collect(),
        _ => return reply_json(conn, 400, &bad_request("input is required".into()), keep).await,
    };
    sleep(sim.cfg.ttft).await;
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let seed = s
                .bytes()
                .fold(7u32, |a, b| a.wrapping_mul(31).wrapping_add(u32::from(b)));
            let emb: Vec<f64> = (0..8)
                .map(|k| f64::from((seed.rotate_left(k * 4) % 1000) as u16) / 1000.0)
                .collect();
            json!({"object": "embedding", "index": i, "embedding": emb})
        })
        .collect();
    let toks = input_tokens(sim, body);
    reply_json(conn, 200, &json!({"object": "list", "model": sim.cfg.model, "data": data, "usage": {"prompt_tokens": toks, "total_tokens": toks}}), keep).await
}

async fn rerank(sim: &Sim, conn: &mut Conn, body: &[u8], keep: bool) -> bool {
    let v: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return reply_json(conn, 400, &bad_request(e.to_string()), keep).await,
    };
    let query = v
        .get("query")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_lowercase();
    let docs: Vec<String> = v
        .get("documents")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|d| d.as_str().unwrap_or("").to_lowercase())
                .collect()
        })
        .unwrap_or_default();
    sleep(sim.cfg.ttft).await;
    let mut results: Vec<(usize, f64)> = docs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let words = query.split_whitespace().count().max(1) as f64;
            let hits = query.split_whitespace().filter(|w| d.contains(w)).count() as f64;
            (i, hits / words)
        })
        .collect();
    results.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal));
    let res: Vec<Value> = results
        .iter()
        .map(|(i, s)| json!({"index": i, "relevance_score": s}))
        .collect();
    reply_json(
        conn,
        200,
        &json!({"model": sim.cfg.model, "results": res}),
        keep,
    )
    .await
}

/// Used by tests: body framing of a sim response is always explicit.
pub fn is_explicit(f: BodyFraming) -> bool {
    !matches!(f, BodyFraming::UntilClose)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_deterministic() {
        assert_eq!(generated_text(3), "The quick brown");
        assert_eq!(generated_text(0), "");
        assert_eq!(generated_text(17).len(), generated_text(16).len() + 3);
    }

    #[test]
    fn a_prefill_of_the_text_is_continued_from_where_it_stops() {
        let body = |last: serde_json::Value| {
            serde_json::to_vec(&json!({"messages": [{"role": "user", "content": "hi"}, last]}))
                .unwrap_or_default()
        };
        let assistant = |t: &str| json!({"role": "assistant", "content": t});
        assert_eq!(continued_tokens(&body(assistant(&generated_text(5)))), 5);
        // Longer than any --output-tokens here (the first part came from
        // an engine that generates more): still found.
        assert_eq!(continued_tokens(&body(assistant(&generated_text(70)))), 70);
        assert_eq!(
            continued_tokens(&body(assistant("The quick br"))),
            0,
            "not whole tokens"
        );
        assert_eq!(continued_tokens(&body(assistant("Something else"))), 0);
        assert_eq!(
            continued_tokens(&body(json!({"role": "user", "content": "The"}))),
            0,
            "a user message last is a new turn"
        );
        assert_eq!(text_from(3, 2), " fox jumps");
    }
}
