//! Forwarding one request to an agent over a fresh `/http/1.1` yamux
//! stream and relaying the response to the client: SSE chunk by chunk,
//! flushed as they arrive; a capacity slot is held until the response
//! ends (streams included); a transport failure before the response head
//! retries once on another agent.

use std::io;
use std::rc::Rc;

use futures::{AsyncReadExt, AsyncWriteExt};
use tracing::{debug, warn};

use super::clock;
use super::conn::Conn;
use super::ingress::{extra_headers, refs};
use super::link::{LinkStream, HTTP_PROTOCOL};
use super::mesh::PendingRequest;
use super::shard::{wake_head, Agent, Shard, Slot, StepOutcome};
use crate::logic::errors::{ApiError, ErrorCode};
use crate::logic::http_parse::{self, BodyFraming, ChunkedDecoder, ResponseHead};
use crate::logic::http_write::{self, OutFraming};
use crate::logic::policy::GateCounts;
use crate::logic::policy::Session;
use crate::logic::usage::{self, SseUsage, Tokens};

/// What the connection does after the exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Keep reading requests.
    KeepAlive,
    /// Close it.
    Close,
}

/// Client headers never forwarded to agents (credentials stay at the router).
fn forwardable(name: &str) -> bool {
    !(name.eq_ignore_ascii_case("authorization")
        || name.eq_ignore_ascii_case("cookie")
        || name.eq_ignore_ascii_case("x-api-key"))
}

fn build_request(p: &PendingRequest) -> Vec<u8> {
    let headers: Vec<(String, Vec<u8>)> = p
        .head
        .headers
        .iter()
        .filter(|(n, _)| forwardable(n) && !n.eq_ignore_ascii_case("x-request-id"))
        .cloned()
        .chain(std::iter::once((
            "X-Request-ID".to_string(),
            p.request_id.as_bytes().to_vec(),
        )))
        .collect();
    let mut out = Vec::with_capacity(512 + p.body.len());
    http_write::write_request_head(
        &mut out,
        &p.head.method,
        &p.head.path,
        "agent",
        &headers,
        OutFraming::Length(p.body.len()),
    );
    out.extend_from_slice(&p.body);
    out
}

/// Why an exchange failed, and whether a latency sample exists.
enum ExchangeError {
    /// The stream could not be opened: nothing reached the agent.
    Open(io::Error),
    /// Failed after the request was written (elapsed ms since the write began).
    AfterSend(io::Error, f64),
}

/// Open a stream, write the request, read the response head. The latency
/// clock starts immediately before the request is written to the stream
/// and stops when the response head has arrived.
async fn exchange_head(
    agent: &Agent,
    request: &[u8],
) -> Result<(LinkStream, ResponseHead, Vec<u8>, f64), ExchangeError> {
    let s = agent
        .link
        .open(HTTP_PROTOCOL)
        .await
        .map_err(ExchangeError::Open)?;
    let t0 = clock::now();
    let ms = |t0: clock::Instant| t0.elapsed().as_secs_f64() * 1e3;
    match send_and_read_head(s, request).await {
        Ok((s, h, rest)) => Ok((s, h, rest, ms(t0))),
        Err(e) => Err(ExchangeError::AfterSend(e, ms(t0))),
    }
}

async fn send_and_read_head(
    mut s: LinkStream,
    request: &[u8],
) -> io::Result<(LinkStream, ResponseHead, Vec<u8>)> {
    s.write_all(request).await?;
    s.flush().await?;
    let mut buf = Vec::with_capacity(8192);
    let mut tmp = vec![0u8; 16 * 1024];
    loop {
        match http_parse::parse_response_head(&buf) {
            Ok(Some((h, n))) => {
                buf.drain(..n);
                return Ok((s, h, buf));
            }
            Ok(None) => {}
            Err(e) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("bad response head from agent: {e:?}"),
                ))
            }
        }
        let n = s.read(&mut tmp).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "agent closed the stream before the response head",
            ));
        }
        buf.extend_from_slice(tmp.get(..n).unwrap_or(&[]));
    }
}

/// Non-streaming bodies up to this size are buffered (one write to the
/// client, usage parsed); larger ones stream through.
const BUFFERED_BODY: usize = 4 * 1024 * 1024;

/// One read from the agent's stream, bounded by an idle timeout so a hung
/// agent cannot hold a client (and a slot) forever.
async fn read_idle(
    s: &mut LinkStream,
    buf: &mut [u8],
    idle: std::time::Duration,
) -> io::Result<usize> {
    match monoio::time::timeout(idle, s.read(buf)).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("agent stream idle for {idle:?}"),
        )),
    }
}

enum Relay {
    Done(Option<Tokens>),
    UpstreamFailed(String),
    ClientGone,
}

async fn relay(
    conn: &mut Conn,
    mut s: LinkStream,
    head: &ResponseHead,
    mut buf: Vec<u8>,
    keep: bool,
    idle: std::time::Duration,
) -> Relay {
    let mut tmp = vec![0u8; 16 * 1024];
    match head.framing {
        BodyFraming::None => {
            let mut out = Vec::with_capacity(512);
            http_write::write_response_head(
                &mut out,
                head.status,
                &head.headers,
                OutFraming::Length(0),
                keep,
                &refs(&extra_headers(&conn.request_id)),
            );
            if conn.write_all(out).await.is_err() {
                return Relay::ClientGone;
            }
            Relay::Done(None)
        }
        BodyFraming::Length(n) => {
            let Ok(n) = usize::try_from(n) else {
                return Relay::UpstreamFailed("response too large".into());
            };
            if n > BUFFERED_BODY {
                // Large bodies stream through in pieces (no usage parsing):
                // an agent cannot make the router hold gigabytes.
                let mut out = Vec::with_capacity(512);
                http_write::write_response_head(
                    &mut out,
                    head.status,
                    &head.headers,
                    OutFraming::Length(n),
                    keep,
                    &refs(&extra_headers(&conn.request_id)),
                );
                buf.truncate(n);
                let mut left = n - buf.len();
                out.extend_from_slice(&buf);
                if conn.write_all(out).await.is_err() {
                    return Relay::ClientGone;
                }
                while left > 0 {
                    match read_idle(&mut s, &mut tmp, idle).await {
                        Ok(0) => return Relay::UpstreamFailed("agent closed mid-body".into()),
                        Ok(k) => {
                            let k = k.min(left);
                            left -= k;
                            if conn
                                .write_all(tmp.get(..k).unwrap_or(&[]).to_vec())
                                .await
                                .is_err()
                            {
                                return Relay::ClientGone;
                            }
                        }
                        Err(e) => return Relay::UpstreamFailed(e.to_string()),
                    }
                }
                return Relay::Done(None);
            }
            while buf.len() < n {
                match read_idle(&mut s, &mut tmp, idle).await {
                    Ok(0) => return Relay::UpstreamFailed("agent closed mid-body".into()),
                    Ok(k) => buf.extend_from_slice(tmp.get(..k).unwrap_or(&[])),
                    Err(e) => return Relay::UpstreamFailed(e.to_string()),
                }
            }
            buf.truncate(n);
            let tokens = usage::from_body(&buf);
            let mut out = Vec::with_capacity(512 + n);
            http_write::write_response_head(
                &mut out,
                head.status,
                &head.headers,
                OutFraming::Length(n),
                keep,
                &refs(&extra_headers(&conn.request_id)),
            );
            out.extend_from_slice(&buf);
            if conn.write_all(out).await.is_err() {
                return Relay::ClientGone;
            }
            Relay::Done(tokens)
        }
        BodyFraming::Chunked | BodyFraming::UntilClose => {
            let sse = head.is_event_stream();
            let mut out = Vec::with_capacity(512);
            let mut ex = extra_headers(&conn.request_id);
            if sse {
                ex.push(("X-Accel-Buffering", b"no".to_vec()));
            }
            let extra = refs(&ex);
            http_write::write_response_head(
                &mut out,
                head.status,
                &head.headers,
                OutFraming::Chunked,
                keep,
                &extra,
            );
            let until_close = head.framing == BodyFraming::UntilClose;
            let mut dec = ChunkedDecoder::new();
            let mut meter = SseUsage::default();
            let mut payload = Vec::with_capacity(16 * 1024);
            loop {
                if until_close {
                    payload.append(&mut buf);
                } else {
                    match dec.decode(&buf, &mut payload, 0) {
                        Ok(used) => {
                            buf.drain(..used);
                        }
                        Err(e) => {
                            return Relay::UpstreamFailed(format!(
                                "bad chunked body from agent: {e:?}"
                            ))
                        }
                    }
                }
                // Each piece goes out as it arrives: one chunk per read.
                if sse {
                    meter.feed(&payload);
                }
                http_write::write_chunk(&mut out, &payload);
                payload.clear();
                let finished = !until_close && dec.is_done();
                if finished {
                    out.extend_from_slice(http_write::LAST_CHUNK);
                }
                if !out.is_empty() {
                    if conn.write_all(std::mem::take(&mut out)).await.is_err() {
                        return Relay::ClientGone;
                    }
                    out = Vec::with_capacity(16 * 1024);
                }
                if finished {
                    return Relay::Done(meter.seen.then_some(meter.tokens));
                }
                match read_idle(&mut s, &mut tmp, idle).await {
                    Ok(0) if until_close => {
                        let _ = conn.write_all(http_write::LAST_CHUNK.to_vec()).await;
                        return Relay::Done(meter.seen.then_some(meter.tokens));
                    }
                    Ok(0) => {
                        return Relay::UpstreamFailed(
                            "agent stream ended before the last chunk".into(),
                        )
                    }
                    Ok(k) => buf.extend_from_slice(tmp.get(..k).unwrap_or(&[])),
                    Err(e) => return Relay::UpstreamFailed(e.to_string()),
                }
            }
        }
    }
}

async fn send_error(conn: &mut Conn, err: &ApiError, keep: bool) -> Outcome {
    let mut out = Vec::with_capacity(256);
    let body = err.body();
    let ex = extra_headers(&conn.request_id);
    http_write::write_full_response(
        &mut out,
        err.status,
        "application/json",
        &body,
        keep,
        &refs(&ex),
    );
    if conn.write_all(out).await.is_ok() && keep {
        Outcome::KeepAlive
    } else {
        Outcome::Close
    }
}

fn labels(agent: &Agent) -> (String, String) {
    (agent.reg.region.clone(), agent.reg.engine.clone())
}

/// How a forward attempt ended, for the session.
enum Attempt {
    /// The response went out (or the client left): done.
    Done(Outcome),
    /// A retryable failure on this agent.
    Retry,
}

async fn attempt(
    shard: &Rc<Shard>,
    conn: &mut Conn,
    p: &PendingRequest,
    agent: Rc<Agent>,
    request: &[u8],
    deadline: clock::Instant,
    step: usize,
) -> Attempt {
    let keep = p.head.keep_alive;
    let model = &p.meta.model;
    let slot = Slot::take(agent.clone());
    let remaining = deadline.saturating_duration_since(clock::now());
    match monoio::time::timeout(remaining, exchange_head(&agent, request)).await {
        Ok(Ok((stream, head, rest, sample_ms))) => {
            // The sample is applied on this (the model's) shard before the
            // next routing decision, success or error status alike.
            agent.observe(sample_ms);
            debug!(peer_id = %agent.reg.peer_id, status = head.status, sample_ms, "agent response head");
            // Backend overloaded or unreachable behind this agent: retryable.
            if matches!(head.status, 502..=504) {
                agent.fail();
                shard.with_stats(model, |s| *s.failed.entry(labels(&agent)).or_default() += 1);
                drop(slot);
                return Attempt::Retry;
            }
            let result = relay(
                conn,
                stream,
                &head,
                rest,
                keep,
                shard.shared.cfg.request_timeout,
            )
            .await;
            drop(slot);
            match result {
                Relay::Done(tokens) => {
                    // Client-visible duration, measured at the real end of the
                    // response (streams included) with its real status.
                    let secs = p.received_at.elapsed().as_secs_f64();
                    shard.with_stats(model, |s| s.observe_duration(&agent, head.status, secs));
                    if head.status < 400 {
                        agent.succeed();
                        shard.with_stats(model, |s| {
                            *s.routed.entry(labels(&agent)).or_default() += 1;
                            if step == 0 {
                                s.primary_routed += 1;
                            } else {
                                s.fallback_routed += 1;
                            }
                        });
                    } else {
                        agent.fail();
                        shard.with_stats(model, |s| {
                            *s.failed.entry(labels(&agent)).or_default() += 1
                        });
                    }
                    if let Some(t) = tokens {
                        agent.add_tokens(t);
                    }
                    Attempt::Done(if keep {
                        Outcome::KeepAlive
                    } else {
                        Outcome::Close
                    })
                }
                Relay::UpstreamFailed(why) => {
                    agent.fail();
                    shard.with_stats(model, |s| *s.failed.entry(labels(&agent)).or_default() += 1);
                    warn!(peer_id = %agent.reg.peer_id, "response from agent failed mid-body: {why}; closing the client connection");
                    Attempt::Done(Outcome::Close)
                }
                Relay::ClientGone => Attempt::Done(Outcome::Close),
            }
        }
        Ok(Err(ExchangeError::Open(e))) => {
            // Nothing reached the agent: a failure, but no sample.
            agent.fail();
            shard.with_stats(model, |s| *s.failed.entry(labels(&agent)).or_default() += 1);
            warn!(peer_id = %agent.reg.peer_id, "cannot open a stream to the agent: {e}");
            Attempt::Retry
        }
        Ok(Err(ExchangeError::AfterSend(e, elapsed_ms))) => {
            agent.observe(elapsed_ms);
            agent.fail();
            shard.with_stats(model, |s| *s.failed.entry(labels(&agent)).or_default() += 1);
            warn!(peer_id = %agent.reg.peer_id, "forward to agent failed: {e}");
            Attempt::Retry
        }
        Err(_) => {
            agent.observe(remaining.as_secs_f64() * 1e3);
            agent.fail();
            shard.with_stats(model, |s| *s.failed.entry(labels(&agent)).or_default() += 1);
            drop(slot);
            let e = ApiError::new(
                ErrorCode::RequestTimeout,
                "Request deadline exceeded while contacting agent",
            );
            Attempt::Done(send_error(conn, &e, keep).await)
        }
    }
}

/// Forward `p` following its model's policy snapshot: per step, the gate
/// pipeline picks an agent; a retryable failure excludes it for the step
/// and tries another (`max_tries`); a full step waits in the model's
/// capacity queue (FIFO, `--queue-depth`) until a slot frees or the
/// request deadline passes; an exhausted step moves to the next one.
pub async fn forward(shard: &Rc<Shard>, conn: &mut Conn, p: &PendingRequest) -> Outcome {
    let keep = p.head.keep_alive;
    let cap = p.endpoint.capability();
    let model = p.meta.model.as_str();
    let request = build_request(p);
    let cfg = &shard.shared.cfg;
    let deadline = p.received_at + cfg.request_timeout;
    let policy = shard.policy_for(model);
    let mut session = Session::new(&policy, cfg.max_tries_per_step);
    let mut last_full = false;
    // The queue place this request holds (kept when it loses a race), and
    // when it first queued (one wait observation per request that waited).
    let mut place: Option<u64> = None;
    let mut queued_at: Option<clock::Instant> = None;
    while let Some(step) = policy.steps.get(session.step) {
        let mut outcome = shard.select_step(model, step, cap, &session.failed);
        if matches!(outcome, StepOutcome::Agent(_)) && place.is_none() && cfg.queue_depth > 0 {
            // Requests already waiting came first: a newcomer joins the line
            // and the free slot goes to the head (strict FIFO).
            let queue = shard
                .models
                .borrow()
                .get(model)
                .map(|pool| pool.queue.clone());
            if let Some(q) = queue {
                if !q.borrow().is_empty() {
                    wake_head(&q);
                    outcome = StepOutcome::Full(GateCounts::default());
                }
            }
        }
        match outcome {
            StepOutcome::Agent(agent) => {
                last_full = false;
                place = None;
                if let Some(t) = queued_at.take() {
                    let secs = t.elapsed().as_secs_f64();
                    shard.with_stats(model, |s| s.observe_wait(secs));
                }
                match attempt(
                    shard,
                    conn,
                    p,
                    agent.clone(),
                    &request,
                    deadline,
                    session.step,
                )
                .await
                {
                    Attempt::Done(o) => return o,
                    Attempt::Retry => session.record_failure(&policy, agent.id),
                }
            }
            StepOutcome::Full(counts) => {
                last_full = true;
                let queue = shard
                    .models
                    .borrow()
                    .get(model)
                    .map(|pool| pool.queue.clone());
                let Some(queue) = queue else {
                    session.trail.push((session.step, counts));
                    session.advance();
                    continue;
                };
                let (tx, rx) = futures::channel::oneshot::channel();
                let seq = match place {
                    Some(seq) => {
                        queue.borrow_mut().requeue(seq, tx);
                        Ok(seq)
                    }
                    None => queue.borrow_mut().push(tx, cfg.queue_depth).map_err(|_| ()),
                };
                let Ok(seq) = seq else {
                    // Queue full or disabled: next step now.
                    session.trail.push((session.step, counts));
                    session.advance();
                    continue;
                };
                place = Some(seq);
                let waited = clock::now();
                queued_at.get_or_insert(waited);
                let remaining = deadline.saturating_duration_since(waited);
                match monoio::time::timeout(remaining, rx).await {
                    Ok(Ok(())) => {
                        // Retry the same step; keep the place if we lose.
                    }
                    _ => {
                        queue.borrow_mut().remove(seq);
                        place = None;
                        session.trail.push((session.step, counts));
                        session.advance();
                        if session.exhausted() || clock::now() >= deadline {
                            shard.with_stats(model, |s| s.exhausted += 1);
                            warn!(model, steps = ?session.trail, "capacity queue wait timed out");
                            let e = ApiError::new(
                                ErrorCode::RequestTimeout,
                                "Request timed out waiting for an available agent",
                            );
                            return send_error(conn, &e, keep).await;
                        }
                    }
                }
            }
            StepOutcome::Empty(counts) => {
                last_full = false;
                session.trail.push((session.step, counts));
                session.advance();
            }
        }
    }
    shard.with_stats(model, |s| {
        s.exhausted += 1;
        *s.failed.entry((String::new(), String::new())).or_default() += 1;
    });
    let trail: Vec<String> = session
        .trail
        .iter()
        .map(|(i, c)| {
            let name = policy.steps.get(*i).map(|s| s.name.as_str()).unwrap_or("?");
            format!(
                "{name}: pool={} unhealthy={} capability_mismatch={} unmatched={} prev_failed={} at_capacity={} exclude_if={}",
                c.pool, c.unhealthy, c.capability, c.unmatched, c.prev_failed, c.at_capacity, c.excluded
            )
        })
        .collect();
    warn!(
        model,
        capability = cap.as_str(),
        steps = policy.steps.len(),
        "policy_exhausted: {}",
        trail.join(" | ")
    );
    let e = if shard.all_unhealthy(model) {
        ApiError::new(
            ErrorCode::NoAgentsAvailable,
            "All agents for this model are currently offline or unhealthy",
        )
    } else if last_full {
        ApiError::new(
            ErrorCode::NoCapacity,
            "All agents for this model are at maximum capacity",
        )
    } else {
        ApiError::new(
            ErrorCode::NoAgentsAvailable,
            "all policy steps exhausted: no eligible agents",
        )
    };
    send_error(conn, &e, keep).await
}
