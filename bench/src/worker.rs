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

use shards::logic::http::framing::http_parse::{BodyFraming, ChunkedDecoder};
use shards::logic::http::framing::http_write::{self, OutFraming};
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
    /// When each event with generated text ended.
    content_events: Vec<Instant>,
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

/// Reads SSE events as they arrive: counts event ends (`\n\n`, a
/// trailing `\n` carried to the next read) and tells whether an ended
/// event carried generated text (an OpenAI delta with a string
/// `"content"`, or an Anthropic `text_delta`): engines send a role-only
/// event first, so the first event is not the first token.
#[derive(Default)]
struct EventScan {
    carry_nl: bool,
    /// The event read so far.
    current: Vec<u8>,
}

impl EventScan {
    /// Event ends in `data`, and how many of them had content.
    fn feed(&mut self, data: &[u8]) -> (usize, usize) {
        let (mut ends, mut content) = (0, 0);
        for b in data {
            self.current.push(*b);
            if *b == b'\n' {
                if self.carry_nl {
                    ends += 1;
                    self.carry_nl = false;
                    content += usize::from(has_content(&self.current));
                    self.current.clear();
                } else {
                    self.carry_nl = true;
                }
            } else if *b != b'\r' {
                self.carry_nl = false;
            }
        }
        (ends, content)
    }
}

fn has_content(event: &[u8]) -> bool {
    let find = |needle: &[u8]| event.windows(needle.len()).any(|w| w == needle);
    find(b"\"content\":\"") || find(b"\"text_delta\"")
}

async fn exchange(conn: &mut Conn, rest: Vec<u8>) -> io::Result<Exchange> {
    if !rest.is_empty() {
        conn.write_all(rest).await?;
    }
    let head = match conn.read_response_head().await {
        Ok(h) => h,
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof && conn.buf.is_empty() => {
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, e))
        }
        Err(e) => return Err(e),
    };
    let headers_at = Instant::now();
    let sse = head.is_event_stream();
    let keep = !head
        .header("connection")
        .map(|v| shards::logic::http::framing::http_parse::contains_ci(v, b"close"))
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
            content_events: Vec::new(),
            code,
            reusable: keep && head.framing != BodyFraming::UntilClose,
        });
    }
    let mut events = Vec::new();
    let mut content_events = Vec::new();
    let mut scan = EventScan::default();
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
        let (ends, content) = scan.feed(&payload);
        events.extend(std::iter::repeat_n(now, ends));
        content_events.extend(std::iter::repeat_n(now, content));
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
        content_events,
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
    /// A connection, and whether it served a request before.
    Ready(Conn, bool),
    /// The connect failed.
    Failed,
    /// At the cap with none idle.
    Full,
}

async fn take_or_open(ctx: &Ctx) -> Slot {
    loop {
        let Some(c) = ctx.pool.borrow_mut().pop() else {
            break;
        };
        // Closed while idle (llama.cpp closes after a stream): a client
        // opens a new one, it does not send into a dead connection.
        if !shards::runtime::wire::handoff::peer_gone(&c.stream) {
            return Slot::Ready(c, true);
        }
        ctx.open.set(ctx.open.get() - 1);
    }
    if ctx.open.get() >= ctx.spec.max_connections {
        return Slot::Full;
    }
    ctx.open.set(ctx.open.get() + 1);
    match monoio::net::TcpStream::connect(ctx.spec.addr).await {
        Ok(s) => {
            ctx.spare_failed.set(false);
            Slot::Ready(Conn::new(s, Vec::new()), false)
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
    let (conn, reused) = loop {
        match take_or_open(&ctx).await {
            Slot::Ready(c, reused) => break (c, reused),
            Slot::Failed => {
                finish(&ctx, intended, intended, None, 0, Some("connect".into()));
                return;
            }
            Slot::Full => monoio::time::sleep(Duration::from_millis(1)).await,
        }
    };
    // A reused connection the server closed before our bytes reached it
    // (its close raced the peek above) is sent again on a new one, as
    // clients do for an idempotent retry; a new one that does this fails.
    let again = reused.then(|| bytes.clone());
    let (sent_at, rest) = send_first(&ctx, &conn, bytes);
    let Err(conn) = complete(&ctx, conn, rest, intended, sent_at).await else {
        return;
    };
    drop(conn);
    ctx.open.set(ctx.open.get() - 1);
    let retried = match (again, take_or_open(&ctx).await) {
        (Some(bytes), Slot::Ready(c, _)) => {
            ctx.progress.sent.fetch_sub(1, Ordering::Relaxed);
            let (sent_at, rest) = send_first(&ctx, &c, bytes);
            complete(&ctx, c, rest, intended, sent_at).await
        }
        (_, Slot::Ready(c, _)) => Err(c),
        _ => {
            finish(&ctx, intended, sent_at, None, 0, Some("connect".into()));
            return;
        }
    };
    if let Err(c) = retried {
        cut(&ctx, c, intended, sent_at);
    }
}

/// A connection closed before any byte of its response: dropped, and the
/// request recorded as cut.
fn cut(ctx: &Ctx, conn: Conn, intended: Instant, sent_at: Instant) {
    drop(conn);
    ctx.open.set(ctx.open.get() - 1);
    finish(ctx, intended, sent_at, None, 0, Some("cut".into()));
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
/// `Err(conn)`: the server closed the connection before any byte of a
/// response (nothing recorded; the caller may send again).
async fn complete(
    ctx: &Ctx,
    mut conn: Conn,
    rest: Vec<u8>,
    intended: Instant,
    sent_at: Instant,
) -> Result<(), Conn> {
    match monoio::time::timeout(ctx.spec.timeout, exchange(&mut conn, rest)).await {
        Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionAborted => return Err(conn),
        Ok(Ok(x)) => {
            finish(ctx, intended, sent_at, Some(&x), x.status, x.code.clone());
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
            finish(ctx, intended, sent_at, None, 0, Some(code.into()));
        }
    }
    Ok(())
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
        s.first_content_us = x.content_events.first().map(|t| us(intended, *t));
        s.content_gaps_us = x
            .content_events
            .windows(2)
            .map(|w| us(w[0], w[1]))
            .collect();
        s.content_gap_seconds = x
            .content_events
            .iter()
            .skip(1)
            .map(|t| t.saturating_duration_since(ctx.start).as_secs() as usize)
            .collect();
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
            if let Slot::Ready(c, _) = take_or_open(&ctx).await {
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
                    if let Err(conn) = complete(&c, conn, rest, intended, sent_at).await {
                        cut(&c, conn, intended, sent_at);
                    }
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

/// Closed loop over several targets on one connection each: one request
/// to each in turn (each turn starting one target further), so a drift of
/// the machine falls on every target alike.
/// One turn (a request to every target) takes one request of the budget.
pub async fn interleaved(
    specs: Vec<WorkerSpec>,
    end: End,
    start: Instant,
    progress: Arc<Progress>,
) -> Vec<Recorder> {
    let mut turns: Vec<(Rc<Ctx>, Rng)> = specs
        .into_iter()
        .map(|spec| {
            let rng = Rng::new(spec.seed);
            (context(spec, start, progress.clone()), rng)
        })
        .collect();
    let n = turns.len();
    let mut turn = 0;
    while Instant::now() < end.until && end.take() {
        // Each turn starts one target further: none always follows the same one.
        for k in 0..n {
            if let Some((ctx, rng)) = turns.get_mut((turn + k) % n) {
                let bytes = request_bytes(&ctx.spec, rng);
                one(ctx.clone(), bytes, Instant::now()).await;
            }
        }
        turn += 1;
    }
    turns
        .into_iter()
        .map(|(ctx, _)| into_recorder(ctx))
        .collect()
}

/// Open loop through the oracle of cache affinity (issue 30): the same
/// requests as [`open_loop`] (same seed and offsets), each placed by a
/// [`crate::prefix_cache::Oracle`] that mirrors every sim's cache and
/// sent straight to that sim; a request that finds every sim at its
/// capacity waits, first come first served (its time counts from its
/// intended send, as through a router). One recorder for all sims.
pub async fn oracle_loop(
    specs: Vec<WorkerSpec>,
    oracle: crate::prefix_cache::Oracle,
    offsets: Vec<Duration>,
    spin: Duration,
    start: Instant,
    progress: Arc<Progress>,
) -> (Recorder, crate::prefix_cache::Oracle) {
    let seed = specs.first().map_or(1, |s| s.seed);
    let mut rng = Rng::new(seed);
    let ctxs: Vec<Rc<Ctx>> = specs
        .into_iter()
        .map(|s| context(s, start, progress.clone()))
        .collect();
    let Some(first) = ctxs.first().cloned() else {
        return (Recorder::default(), oracle);
    };
    // Waiting requests, oldest first; a freed slot is offered to the head.
    let queue: OracleQueue = Rc::default();
    let oracle = Rc::new(RefCell::new(oracle));
    let inflight = Rc::new(Cell::new(0usize));
    let mut precise = crate::timer::PreciseTimer::new();
    for off in offsets {
        let intended = start + off;
        let bytes = request_bytes(&first.spec, &mut rng);
        crate::timer::arrive_at(intended, spin, &mut precise).await;
        queue.borrow_mut().push_back((bytes, intended));
        dispatch_oracle(&ctxs, &oracle, &queue, &inflight);
        crate::timer::yield_turn().await;
    }
    while inflight.get() > 0 || !queue.borrow().is_empty() {
        monoio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut all = Recorder::default();
    for c in ctxs {
        all.merge(&into_recorder(c));
    }
    // Every task has ended: the oracle is ours alone again.
    let oracle = Rc::try_unwrap(oracle)
        .map(RefCell::into_inner)
        .unwrap_or_else(|rc| {
            std::mem::replace(
                &mut *rc.borrow_mut(),
                crate::prefix_cache::Oracle::new(0, 1, 0, 1, 1.0, Default::default()),
            )
        });
    (all, oracle)
}

/// Requests waiting for a free sim: the bytes to send and the intended send time.
type OracleQueue = Rc<RefCell<std::collections::VecDeque<(Vec<u8>, Instant)>>>;

/// Send the waiting requests the oracle finds a free sim for, oldest
/// first; each end offers its slot again.
fn dispatch_oracle(
    ctxs: &[Rc<Ctx>],
    oracle: &Rc<RefCell<crate::prefix_cache::Oracle>>,
    queue: &OracleQueue,
    inflight: &Rc<Cell<usize>>,
) {
    loop {
        let Some((bytes, intended)) = queue.borrow_mut().pop_front() else {
            return;
        };
        let prompt = request_body(&bytes)
            .and_then(crate::sim::prompt_text)
            .unwrap_or_default();
        let placed = oracle.borrow_mut().place(prompt.as_bytes());
        let Some((i, ctx)) = placed.and_then(|i| Some((i, ctxs.get(i)?.clone()))) else {
            queue.borrow_mut().push_front((bytes, intended));
            return;
        };
        inflight.set(inflight.get() + 1);
        let (all, o, q, n) = (
            ctxs.to_vec(),
            oracle.clone(),
            queue.clone(),
            inflight.clone(),
        );
        drop(monoio::spawn(async move {
            one(ctx, bytes, intended).await;
            o.borrow_mut().done(i);
            n.set(n.get() - 1);
            dispatch_oracle(&all, &o, &q, &n);
        }));
    }
}

/// The body of a whole HTTP request as `request_bytes` builds it.
fn request_body(bytes: &[u8]) -> Option<&[u8]> {
    let at = bytes.windows(4).position(|w| w == b"\r\n\r\n")?;
    bytes.get(at + 4..)
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
        let mut scan = EventScan::default();
        assert_eq!(scan.feed(b"data: a\n\ndata: b\n"), (1, 0));
        assert_eq!(scan.feed(b"\ndata: c\r\n\r\n"), (2, 0));
        // A role-only event is not content; a split content event counts
        // when it ends, not before.
        let role = b"data: {\"delta\":{\"role\":\"assistant\",\"content\":null}}\n\n";
        assert_eq!(scan.feed(role), (1, 0));
        assert_eq!(scan.feed(b"data: {\"delta\":{\"content\":\"I"), (0, 0));
        assert_eq!(scan.feed(b"\"}}\n\n"), (1, 1));
        let anthropic = b"event: content_block_delta\ndata: {\"delta\":{\"type\":\"text_delta\",\"text\":\"a\"}}\n\n";
        assert_eq!(scan.feed(anthropic), (1, 1));
    }
}
