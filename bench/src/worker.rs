//! Load workers: one monoio runtime per thread (optionally pinned), each
//! sending its share of the schedule (open loop) or running its share of
//! the connections back to back (closed loop). Latency is measured from
//! each request's intended send time, so a stalled server shows up in the
//! percentiles instead of silently slowing the sender.

use std::cell::{Cell, RefCell};
use std::io;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use shards::logic::http::http_parse::{BodyFraming, ChunkedDecoder};
use shards::logic::http::http_write::{self, OutFraming};
use shards::runtime::wire::conn::Conn;

use crate::report::{Recorder, Sample};
use crate::schedule::Rng;
use crate::template::Template;

/// Live counters for the progress line.
#[derive(Default)]
pub struct Progress {
    /// Requests sent.
    pub sent: AtomicU64,
    /// Successes.
    pub ok: AtomicU64,
    /// Failures.
    pub errors: AtomicU64,
}

/// When a closed loop stops: at a time, or when the requests shared by
/// every connection of every worker are spent.
#[derive(Clone)]
pub struct End {
    /// No request starts after this.
    pub until: Instant,
    /// Requests left to send, when the run is a fixed number of them.
    pub budget: Option<Arc<AtomicU64>>,
}

impl End {
    /// Claim one request of the budget; false when none is left.
    fn take(&self) -> bool {
        match &self.budget {
            None => true,
            Some(b) => b
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok(),
        }
    }
}

/// What a worker needs.
#[derive(Clone)]
pub struct WorkerSpec {
    /// Target address.
    pub addr: SocketAddr,
    /// Host header.
    pub host: String,
    /// Request template.
    pub template: Template,
    /// `Authorization: Bearer` value.
    pub api_key: Option<String>,
    /// Per-request timeout.
    pub timeout: Duration,
    /// Most connections this worker opens.
    pub max_connections: usize,
    /// Seed for request bodies.
    pub seed: u64,
}

fn request_bytes(spec: &WorkerSpec, rng: &mut Rng) -> Vec<u8> {
    let req = spec.template.build(rng);
    let mut headers = vec![("Content-Type".to_string(), b"application/json".to_vec())];
    if let Some(k) = &spec.api_key {
        headers.push((
            "Authorization".to_string(),
            format!("Bearer {k}").into_bytes(),
        ));
    }
    let mut out = Vec::with_capacity(req.body.len() + 256);
    http_write::write_request_head(
        &mut out,
        "POST",
        req.path,
        &spec.host,
        &headers,
        OutFraming::Length(req.body.len()),
    );
    out.extend_from_slice(&req.body);
    out
}

struct Exchange {
    status: u16,
    headers_at: Instant,
    events: Vec<Instant>,
    code: Option<String>,
    reusable: bool,
}

fn error_code(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let e = v.get("error")?;
    e.get("code")
        .and_then(|c| c.as_str())
        .or_else(|| e.get("type").and_then(|c| c.as_str()))
        .map(str::to_string)
}

/// Count SSE event ends (`\n\n`) in `data`, carrying a trailing `\n`.
fn count_events(data: &[u8], carry_nl: &mut bool) -> usize {
    let mut n = 0;
    for b in data {
        if *b == b'\n' {
            if *carry_nl {
                n += 1;
                *carry_nl = false;
            } else {
                *carry_nl = true;
            }
        } else if *b != b'\r' {
            *carry_nl = false;
        }
    }
    n
}

async fn exchange(conn: &mut Conn, rest: Vec<u8>) -> io::Result<Exchange> {
    if !rest.is_empty() {
        conn.write_all(rest).await?;
    }
    let head = conn.read_response_head().await?;
    let headers_at = Instant::now();
    let sse = head.is_event_stream();
    let keep = !head
        .header("connection")
        .map(|v| shards::logic::http::http_parse::contains_ci(v, b"close"))
        .unwrap_or(false);
    if !(200..300).contains(&head.status) || !sse {
        let body = conn.read_body(head.framing, 256 * 1024 * 1024).await?;
        let code = if (200..300).contains(&head.status) {
            None
        } else {
            error_code(&body)
        };
        return Ok(Exchange {
            status: head.status,
            headers_at,
            events: Vec::new(),
            code,
            reusable: keep && head.framing != BodyFraming::UntilClose,
        });
    }
    let mut events = Vec::new();
    let mut carry = false;
    let mut dec = ChunkedDecoder::new();
    let mut remaining = match head.framing {
        BodyFraming::Length(n) => n,
        _ => u64::MAX,
    };
    let mut payload = Vec::new();
    loop {
        match head.framing {
            BodyFraming::Chunked => {
                let used = dec
                    .decode(&conn.buf, &mut payload, 0)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                conn.consume(used);
            }
            _ => {
                let take = (conn.buf.len() as u64).min(remaining) as usize;
                payload.extend_from_slice(conn.buf.get(..take).unwrap_or(&[]));
                conn.consume(take);
                remaining = remaining.saturating_sub(take as u64);
            }
        }
        let now = Instant::now();
        for _ in 0..count_events(&payload, &mut carry) {
            events.push(now);
        }
        payload.clear();
        let done = match head.framing {
            BodyFraming::Chunked => dec.is_done(),
            BodyFraming::Length(_) => remaining == 0,
            BodyFraming::None => true,
            BodyFraming::UntilClose => false,
        };
        if done {
            break;
        }
        if conn.fill().await? == 0 {
            if head.framing == BodyFraming::UntilClose {
                break;
            }
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "stream cut"));
        }
    }
    Ok(Exchange {
        status: head.status,
        headers_at,
        events,
        code: None,
        reusable: keep && head.framing != BodyFraming::UntilClose,
    })
}

/// What every request of one worker shares.
struct Ctx {
    spec: WorkerSpec,
    /// Idle keep-alive connections.
    pool: RefCell<Vec<Conn>>,
    /// Connections open (idle or busy).
    open: Cell<usize>,
    rec: RefCell<Recorder>,
    progress: Arc<Progress>,
    start: Instant,
    /// Connects in flight for the spare pool ([`top_up`]).
    connecting: Cell<usize>,
    /// The last spare connect failed: no more until a request's own
    /// connect succeeds (a down target must not get a connect per wake).
    spare_failed: Cell<bool>,
}

/// Idle connections the open loop keeps ready, so that a connect (which
/// costs more than the gap between requests at 10,000/s) is rarely on a
/// request's send path. It did not remove the 20-70 ms episodes of late
/// sends seen at 10,000/s: those come from the host running slowly
/// (perf/2026-12-01-send-lag-turns).
const SPARE_CONNECTIONS: usize = 4;

/// Open connections in the background until [`SPARE_CONNECTIONS`] are
/// idle or on their way (within the cap).
fn top_up(ctx: &Rc<Ctx>) {
    while !ctx.spare_failed.get()
        && ctx.pool.borrow().len() + ctx.connecting.get() < SPARE_CONNECTIONS
        && ctx.open.get() < ctx.spec.max_connections
    {
        ctx.open.set(ctx.open.get() + 1);
        ctx.connecting.set(ctx.connecting.get() + 1);
        let c = ctx.clone();
        drop(monoio::spawn(async move {
            match monoio::net::TcpStream::connect(c.spec.addr).await {
                Ok(s) => c.pool.borrow_mut().push(Conn::new(s, Vec::new())),
                Err(_) => {
                    c.open.set(c.open.get() - 1);
                    c.spare_failed.set(true);
                }
            }
            c.connecting.set(c.connecting.get() - 1);
        }));
    }
}

/// A connection for a request, as far as one is available now.
// Only ever a return value, moved once: boxing the connection would cost
// an allocation per request for nothing.
#[allow(clippy::large_enum_variant)]
enum Slot {
    Ready(Conn),
    /// The connect failed.
    Failed,
    /// At the cap with none idle.
    Full,
}

async fn take_or_open(ctx: &Ctx) -> Slot {
    if let Some(c) = ctx.pool.borrow_mut().pop() {
        return Slot::Ready(c);
    }
    if ctx.open.get() >= ctx.spec.max_connections {
        return Slot::Full;
    }
    ctx.open.set(ctx.open.get() + 1);
    match monoio::net::TcpStream::connect(ctx.spec.addr).await {
        Ok(s) => {
            ctx.spare_failed.set(false);
            Slot::Ready(Conn::new(s, Vec::new()))
        }
        Err(_) => {
            ctx.open.set(ctx.open.get() - 1);
            Slot::Failed
        }
    }
}

/// One request: take or open a connection (waiting for a slot at the
/// cap; the wait counts as send lag), send, measure, record.
async fn one(ctx: Rc<Ctx>, bytes: Vec<u8>, intended: Instant) {
    let conn = loop {
        match take_or_open(&ctx).await {
            Slot::Ready(c) => break c,
            Slot::Failed => {
                finish(&ctx, intended, intended, None, 0, Some("connect".into()));
                return;
            }
            Slot::Full => monoio::time::sleep(Duration::from_millis(1)).await,
        }
    };
    let (sent_at, rest) = send_first(&ctx, &conn, bytes);
    complete(ctx, conn, rest, intended, sent_at).await;
}

/// Send what the socket takes now, with one system call: through the
/// ring the request would wait in the submission queue until the
/// runtime's next submit. Returns the send time and what is left for the
/// runtime's write.
fn send_first(ctx: &Ctx, conn: &Conn, bytes: Vec<u8>) -> (Instant, Vec<u8>) {
    let sent_at = Instant::now();
    ctx.progress.sent.fetch_add(1, Ordering::Relaxed);
    let rest = match shards::runtime::wire::handoff::send_now(&conn.stream, &bytes) {
        Ok(n) if n == bytes.len() => Vec::new(),
        Ok(n) => bytes.get(n..).unwrap_or(&[]).to_vec(),
        // Would block, or failed: the runtime's write reports it.
        Err(_) => bytes,
    };
    (sent_at, rest)
}

/// The rest of a sent request: its response, measured and recorded.
async fn complete(
    ctx: Rc<Ctx>,
    mut conn: Conn,
    rest: Vec<u8>,
    intended: Instant,
    sent_at: Instant,
) {
    match monoio::time::timeout(ctx.spec.timeout, exchange(&mut conn, rest)).await {
        Ok(Ok(x)) => {
            finish(&ctx, intended, sent_at, Some(&x), x.status, x.code.clone());
            if x.reusable {
                ctx.pool.borrow_mut().push(conn);
            } else {
                ctx.open.set(ctx.open.get() - 1);
            }
        }
        failed => {
            // The connection is dropped: a transport error, a cut stream or a timeout.
            ctx.open.set(ctx.open.get() - 1);
            let code = match failed {
                Ok(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => "cut",
                Ok(Err(_)) => "io",
                _ => "timeout",
            };
            finish(&ctx, intended, sent_at, None, 0, Some(code.into()));
        }
    }
}

fn finish(
    ctx: &Ctx,
    intended: Instant,
    sent_at: Instant,
    x: Option<&Exchange>,
    status: u16,
    code: Option<String>,
) {
    let end = Instant::now();
    let us = |a: Instant, b: Instant| b.saturating_duration_since(a).as_micros() as u64;
    let mut s = Sample {
        second: intended.saturating_duration_since(ctx.start).as_secs() as usize,
        total_us: us(intended, end),
        service_us: us(sent_at, end),
        lag_us: us(intended, sent_at),
        status,
        code,
        ..Default::default()
    };
    if let Some(x) = x {
        s.headers_us = Some(us(intended, x.headers_at));
        if let Some(first) = x.events.first() {
            s.first_event_us = Some(us(intended, *first));
        }
        s.gaps_us = x.events.windows(2).map(|w| us(w[0], w[1])).collect();
    }
    if (200..300).contains(&status) {
        ctx.progress.ok.fetch_add(1, Ordering::Relaxed);
    } else {
        ctx.progress.errors.fetch_add(1, Ordering::Relaxed);
    }
    ctx.rec.borrow_mut().record(&s);
}

fn context(spec: WorkerSpec, start: Instant, progress: Arc<Progress>) -> Rc<Ctx> {
    Rc::new(Ctx {
        spec,
        pool: RefCell::new(Vec::new()),
        open: Cell::new(0),
        rec: RefCell::new(Recorder::default()),
        progress,
        start,
        connecting: Cell::new(0),
        spare_failed: Cell::new(false),
    })
}

fn into_recorder(ctx: Rc<Ctx>) -> Recorder {
    ctx.pool.borrow_mut().clear();
    std::mem::take(&mut *ctx.rec.borrow_mut())
}

/// Open loop: send at the intended offsets (spinning the last `spin`
/// before each); wait for every response.
///
/// The send itself happens here, in the loop's own poll right after the
/// wait: the request and its connection are ready before its time, so
/// at its time only the send system call is left. Sending from a task of
/// its own put the send behind every response the runtime had ready
/// (those pile up during the busy wait): p99 26-32 us with Poisson
/// arrivals (perf/2026-12-01-send-lag).
pub async fn open_loop(
    spec: WorkerSpec,
    offsets: Vec<Duration>,
    spin: Duration,
    start: Instant,
    progress: Arc<Progress>,
) -> Recorder {
    let mut rng = Rng::new(spec.seed);
    let ctx = context(spec, start, progress);
    // Requests in flight. Their tasks are detached rather than kept as join
    // handles to the end: a finished task's memory goes back to the
    // allocator and the next one reuses warm pages (keeping every handle
    // made each request touch fresh pages: ~11 us of page faults between
    // the spawn and the send).
    let inflight = Rc::new(Cell::new(0usize));
    let mut precise = crate::timer::PreciseTimer::new();
    let mut ready: Option<Conn> = None;
    for off in offsets {
        let intended = start + off;
        let bytes = request_bytes(&ctx.spec, &mut rng);
        top_up(&ctx);
        if ready.is_none() {
            // A failed connect or a full pool is left to the request's
            // own task at its time (it records the failure or waits).
            if let Slot::Ready(c) = take_or_open(&ctx).await {
                ready = Some(c);
            }
        }
        crate::timer::arrive_at(intended, spin, &mut precise).await;
        inflight.set(inflight.get() + 1);
        let done = inflight.clone();
        let c = ctx.clone();
        match ready.take() {
            Some(conn) => {
                let (sent_at, rest) = send_first(&ctx, &conn, bytes);
                drop(monoio::spawn(async move {
                    complete(c, conn, rest, intended, sent_at).await;
                    done.set(done.get() - 1);
                }));
            }
            None => drop(monoio::spawn(async move {
                one(c, bytes, intended).await;
                done.set(done.get() - 1);
            })),
        }
        // One turn for the other tasks (responses, spare connects) before
        // the next request, also when it is already due: a loop that is
        // behind and never yields reads no response, so every request
        // found its connections busy and opened another (up to 149).
        crate::timer::yield_turn().await;
    }
    if let Some(c) = ready {
        ctx.pool.borrow_mut().push(c);
    }
    // Every request ends (response, error or its timeout), and every
    // spare connect.
    while inflight.get() > 0 || ctx.connecting.get() > 0 {
        monoio::time::sleep(Duration::from_millis(1)).await;
    }
    into_recorder(ctx)
}

/// Closed loop: `connections` connections, each sending back to back until `until`.
pub async fn closed_loop(
    spec: WorkerSpec,
    connections: usize,
    end: End,
    start: Instant,
    progress: Arc<Progress>,
) -> Recorder {
    let mut tasks = Vec::new();
    for c in 0..connections {
        let mut rng = Rng::new(spec.seed ^ (c as u64).wrapping_mul(0x9E37_79B9));
        // Each connection has a context of its own (a pool of one); the
        // recorders are merged at the end.
        let single = WorkerSpec {
            max_connections: 1,
            ..spec.clone()
        };
        let ctx = context(single, start, progress.clone());
        let end = end.clone();
        tasks.push(monoio::spawn(async move {
            while Instant::now() < end.until && end.take() {
                let bytes = request_bytes(&ctx.spec, &mut rng);
                let before = ctx.progress.errors.load(Ordering::Relaxed);
                one(ctx.clone(), bytes, Instant::now()).await;
                // A refused connection fails at once: pause briefly rather than spin.
                if ctx.open.get() == 0 && ctx.progress.errors.load(Ordering::Relaxed) > before {
                    monoio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            into_recorder(ctx)
        }));
    }
    let mut all = Recorder::default();
    for t in tasks {
        all.merge(&t.await);
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_across_reads() {
        let mut carry = false;
        assert_eq!(count_events(b"data: a\n\ndata: b\n", &mut carry), 1);
        assert_eq!(count_events(b"\ndata: c\r\n\r\n", &mut carry), 2);
    }
}
