//! Load workers: one monoio runtime per thread (optionally pinned), each
//! sending its share of the schedule (open loop) or running its share of
//! the connections back to back (closed loop). Latency is measured from
//! each request's intended send time, so a stalled server shows up in the
//! percentiles instead of silently slowing the sender.

use std::cell::RefCell;
use std::io;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use shards::logic::http_parse::{BodyFraming, ChunkedDecoder};
use shards::logic::http_write::{self, OutFraming};
use shards::runtime::conn::Conn;

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
        .map(|v| shards::logic::http_parse::contains_ci(v, b"close"))
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

/// One request: take or open a connection, send, measure, record.
#[allow(clippy::too_many_arguments)]
async fn one(
    spec: Rc<WorkerSpec>,
    pool: Rc<RefCell<Vec<Conn>>>,
    open: Rc<std::cell::Cell<usize>>,
    bytes: Vec<u8>,
    intended: Instant,
    start: Instant,
    rec: Rc<RefCell<Recorder>>,
    progress: Arc<Progress>,
    sent: Option<futures::channel::oneshot::Sender<()>>,
) {
    // Told once the request is written (or failed before it): the open
    // loop waits for it before doing anything else.
    let mut sent = sent;
    let signal = move |s: &mut Option<futures::channel::oneshot::Sender<()>>| {
        if let Some(tx) = s.take() {
            let _ = tx.send(());
        }
    };
    // Wait for a connection slot when at the cap (the wait counts as latency).
    let conn = loop {
        if let Some(c) = pool.borrow_mut().pop() {
            break Some(c);
        }
        if open.get() < spec.max_connections {
            break None;
        }
        monoio::time::sleep(Duration::from_millis(1)).await;
    };
    let mut conn = match conn {
        Some(c) => c,
        None => {
            open.set(open.get() + 1);
            match monoio::net::TcpStream::connect(spec.addr).await {
                Ok(s) => Conn::new(s, Vec::new()),
                Err(_) => {
                    open.set(open.get() - 1);
                    signal(&mut sent);
                    finish(
                        &rec,
                        &progress,
                        intended,
                        intended,
                        start,
                        None,
                        0,
                        Some("connect".into()),
                    );
                    return;
                }
            }
        }
    };
    let sent_at = Instant::now();
    progress.sent.fetch_add(1, Ordering::Relaxed);
    // One send now: through the ring the request would wait in the
    // submission queue until the runtime's next submit. What the socket
    // does not take at once goes the usual way.
    let rest = match shards::runtime::handoff::send_now(&conn.stream, &bytes) {
        Ok(n) if n == bytes.len() => Vec::new(),
        Ok(n) => bytes.get(n..).unwrap_or(&[]).to_vec(),
        // Would block, or failed: the runtime's write reports it.
        Err(_) => bytes,
    };
    signal(&mut sent);
    match monoio::time::timeout(spec.timeout, exchange(&mut conn, rest)).await {
        Ok(Ok(x)) => {
            let reusable = x.reusable;
            finish(
                &rec,
                &progress,
                intended,
                sent_at,
                start,
                Some(&x),
                x.status,
                x.code.clone(),
            );
            if reusable {
                pool.borrow_mut().push(conn);
            } else {
                open.set(open.get() - 1);
            }
        }
        failed => {
            // The connection is dropped: a transport error, a cut stream or a timeout.
            open.set(open.get() - 1);
            let code = match failed {
                Ok(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => "cut",
                Ok(Err(_)) => "io",
                _ => "timeout",
            };
            finish(
                &rec,
                &progress,
                intended,
                sent_at,
                start,
                None,
                0,
                Some(code.into()),
            );
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn finish(
    rec: &RefCell<Recorder>,
    progress: &Progress,
    intended: Instant,
    sent_at: Instant,
    start: Instant,
    x: Option<&Exchange>,
    status: u16,
    code: Option<String>,
) {
    let end = Instant::now();
    let us = |a: Instant, b: Instant| b.saturating_duration_since(a).as_micros() as u64;
    let mut s = Sample {
        second: intended.saturating_duration_since(start).as_secs() as usize,
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
        progress.ok.fetch_add(1, Ordering::Relaxed);
    } else {
        progress.errors.fetch_add(1, Ordering::Relaxed);
    }
    rec.borrow_mut().record(&s);
}

/// Open loop: send at the intended offsets (spinning the last `spin`
/// before each); wait for every response.
pub async fn open_loop(
    spec: WorkerSpec,
    offsets: Vec<Duration>,
    spin: Duration,
    start: Instant,
    progress: Arc<Progress>,
) -> Recorder {
    let spec = Rc::new(spec);
    let rec = Rc::new(RefCell::new(Recorder::default()));
    let pool = Rc::new(RefCell::new(Vec::new()));
    let open = Rc::new(std::cell::Cell::new(0usize));
    let mut rng = Rng::new(spec.seed);
    // Requests in flight. Their tasks are detached rather than kept as join
    // handles to the end: a finished task's memory goes back to the
    // allocator and the next one reuses warm pages (keeping every handle
    // made each request touch fresh pages: ~11 us of page faults between
    // the spawn and the send).
    let inflight = Rc::new(std::cell::Cell::new(0usize));
    // Each request is built before its time comes, so that at its time
    // only the send is left.
    let mut next = request_bytes(&spec, &mut rng);
    let mut precise = crate::timer::PreciseTimer::new();
    for off in offsets {
        let intended = start + off;
        crate::timer::arrive_at(intended, spin, &mut precise).await;
        let bytes = std::mem::take(&mut next);
        inflight.set(inflight.get() + 1);
        let (sp, po, op, re, pr) = (
            spec.clone(),
            pool.clone(),
            open.clone(),
            rec.clone(),
            progress.clone(),
        );
        let task = move |sent| one(sp, po, op, bytes, intended, start, re, pr, sent);
        let done = inflight.clone();
        let (sent_tx, sent_rx) = futures::channel::oneshot::channel::<()>();
        drop(monoio::spawn(async move {
            task(Some(sent_tx)).await;
            done.set(done.get() - 1);
        }));
        // Let it write before anything else happens here (building the
        // next request took ~11 us that a waiting send paid for): a task
        // that only wakes itself is polled again at once by monoio, so
        // wait for the request's own signal instead.
        let _ = sent_rx.await;
        next = request_bytes(&spec, &mut rng);
    }
    // Every request ends (response, error or its timeout).
    while inflight.get() > 0 {
        monoio::time::sleep(Duration::from_millis(1)).await;
    }
    pool.borrow_mut().clear();
    Rc::try_unwrap(rec)
        .map(RefCell::into_inner)
        .unwrap_or_default()
}

/// Closed loop: `connections` connections, each sending back to back until `until`.
pub async fn closed_loop(
    spec: WorkerSpec,
    connections: usize,
    until: Instant,
    start: Instant,
    progress: Arc<Progress>,
) -> Recorder {
    let spec = Rc::new(spec);
    let rec = Rc::new(RefCell::new(Recorder::default()));
    let mut tasks = Vec::new();
    for c in 0..connections {
        let spec = spec.clone();
        let rec = rec.clone();
        let progress = progress.clone();
        tasks.push(monoio::spawn(async move {
            let pool = Rc::new(RefCell::new(Vec::new()));
            let open = Rc::new(std::cell::Cell::new(0usize));
            let mut rng = Rng::new(spec.seed ^ (c as u64).wrapping_mul(0x9E37_79B9));
            let single = Rc::new(WorkerSpec {
                max_connections: 1,
                ..(*spec).clone()
            });
            while Instant::now() < until {
                let bytes = request_bytes(&single, &mut rng);
                let before = progress.errors.load(Ordering::Relaxed);
                one(
                    single.clone(),
                    pool.clone(),
                    open.clone(),
                    bytes,
                    Instant::now(),
                    start,
                    rec.clone(),
                    progress.clone(),
                    None,
                )
                .await;
                // A refused connection fails at once: pause briefly rather than spin.
                if open.get() == 0 && progress.errors.load(Ordering::Relaxed) > before {
                    monoio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }));
    }
    for t in tasks {
        t.await;
    }
    Rc::try_unwrap(rec)
        .map(RefCell::into_inner)
        .unwrap_or_default()
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
