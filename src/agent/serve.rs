//! One request stream from the router: read the HTTP/1.1 request, proxy it
//! to the backend, write the response back. Streamed (SSE) responses are
//! passed through chunk by chunk as they arrive; a non-streaming response
//! is buffered whole before its headers are sent (the latency estimator's
//! sample boundary relies on this). The link always carries explicit
//! framing (Content-Length or chunked), so a cut stream is never mistaken
//! for a complete one.

use std::io;
use std::rc::Rc;

use futures::AsyncWriteExt;
use shards::logic::http::errors::{self, ApiError, ErrorCode, Source};
use shards::logic::http::framing::http_parse::{self, BodyFraming, ChunkedDecoder};
use shards::logic::http::framing::http_write::{self, OutFraming};
use shards::logic::http::trace_context;
use shards::logic::link::control::AGENT_FULL_HEADER;
use shards::runtime::wire::bufpool::{self, Pooled};
use shards::runtime::wire::conn::{Conn, HeadRead};
use shards::runtime::wire::http_stream::{self, HttpStream};
use shards::runtime::wire::mux;
use tracing::{debug, warn};

use super::backend;
use super::engine::Engine;
use super::spans::AgentTrace;
use super::AgentConfig;

/// Largest request body accepted from the router.
const MAX_BODY: usize = 64 * 1024 * 1024;
/// Most of an engine's error body read for its classification.
const ERROR_BODY_MAX: u64 = 64 * 1024;

/// Read the router's request: head, then a Content-Length body.
async fn read_request(
    conn: &mut Conn<HttpStream>,
) -> io::Result<(http_parse::RequestHead, Vec<u8>)> {
    let head = match conn.read_forwarded_request_head().await {
        Ok(h) => h,
        Err(HeadRead::Closed) => {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "stream closed before a request",
            ))
        }
        Err(HeadRead::Bad(e)) => {
            return Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
        }
    };
    if !matches!(head.framing, BodyFraming::Length(_) | BodyFraming::None) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the router sends Content-Length bodies",
        ));
    }
    let body = conn.read_body(head.framing, MAX_BODY as u64).await?;
    Ok((head, body))
}

async fn write_error(s: &mut HttpStream, err: &ApiError) {
    let mut out = Vec::new();
    http_write::write_error(&mut out, err, true);
    let _ = s.write_all(&out).await;
    let _ = s.flush().await;
    let _ = s.close().await;
}

/// What the router is told when the backend failed before its head
/// (issue 29 #11): a backend that cannot be reached is unavailable (503);
/// one that closed or reset the connection, or answered with a malformed
/// or oversized head, is a backend error (502), each with its own
/// message. Both stay retryable on another agent.
fn before_head_error(e: &io::Error) -> ApiError {
    use io::ErrorKind as K;
    match e.kind() {
        K::UnexpectedEof | K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe => {
            backend_error_502(format!(
                "backend closed the connection before answering: {e}"
            ))
        }
        K::InvalidData => backend_error_502(format!("backend sent a malformed response: {e}")),
        _ => backend_error(503, format!("backend unreachable: {e}")),
    }
}

fn backend_error_502(message: String) -> ApiError {
    ApiError {
        code: ErrorCode::BackendError,
        status: 502,
        message,
        source: Source::Backend,
        retry_after: None,
    }
}

fn backend_error(status: u16, message: String) -> ApiError {
    let code = if status == 504 {
        ErrorCode::RequestTimeout
    } else {
        ErrorCode::BackendUnavailable
    };
    ApiError {
        code,
        status,
        message,
        source: Source::Backend,
        retry_after: None,
    }
}

/// The answer of an agent whose routers together hold its capacity: a 503
/// the router reads as "full, try another agent or wait", not a failure.
/// The router of `link` is being replaced by a new process on the same
/// address (issue 54): link to it now with the twin slot; this link
/// serves what it has until the old process closes it.
fn relink(cfg: &Rc<AgentConfig>, link: &super::Link) {
    let Some(twin) = link.gate.relink(link.index) else {
        return;
    };
    tracing::info!(router = %link.router.addr, "router being replaced: linking to its new process");
    monoio::spawn(super::run_link(
        cfg.clone(),
        link.gate.clone(),
        link.meter.clone(),
        twin,
    ));
}

async fn write_full(s: &mut HttpStream, capacity: u32) {
    let mut out = Vec::new();
    let err = ApiError {
        code: ErrorCode::BackendUnavailable,
        status: 503,
        message: format!("agent at its capacity of {capacity} (its routers together)"),
        source: Source::Backend,
        retry_after: None,
    };
    http_write::write_full_response(
        &mut out,
        err.status,
        "application/json",
        &err.body(),
        true,
        &[(AGENT_FULL_HEADER, b"1")],
    );
    let _ = s.write_all(&out).await;
    let _ = s.flush().await;
    let _ = s.close().await;
}

/// Serve one inbound stream from the router of `link`.
pub async fn serve_stream(cfg: Rc<AgentConfig>, link: super::Link, s: mux::Stream) {
    // The protocol confirmation goes out with the first response bytes.
    let mut conn = match http_stream::accept(s).await {
        Ok(c) => c,
        Err(e) => {
            debug!("stream negotiation failed: {e}");
            return;
        }
    };
    let request = read_request(&mut conn).await;
    let (mut s, buf) = conn.into_parts();
    bufpool::give(buf);
    let (head, body) = match request {
        Ok((head, body)) => (head, Pooled::from(body)),
        Err(e) => {
            write_error(
                &mut s,
                &ApiError::new(
                    ErrorCode::RequestInvalid,
                    format!("bad request from router: {e}"),
                ),
            )
            .await;
            return;
        }
    };
    if head.path_only() == shards::runtime::front::carry::RELINK_PATH {
        relink(&cfg, &link);
        let _ = s
            .write_all(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n")
            .await;
        let _ = s.flush().await;
        let _ = s.close().await;
        return;
    }
    if cfg.engine == Engine::Infinity && head.path_only() == "/v1/chat/completions" {
        let e = ApiError::new(
            ErrorCode::RequestInvalid,
            "the Infinity engine does not support chat completions — use capability embedding or reranker",
        );
        write_error(&mut s, &e).await;
        return;
    }
    let Some(admit) = link.gate.try_enter(link.index, std::time::Instant::now()) else {
        write_full(&mut s, cfg.capacity).await;
        return;
    };
    let mut trace = AgentTrace::begin(cfg.traces.as_ref(), cfg.engine.as_str(), &head);
    let proxied = proxy(&cfg, &link, &mut s, &head, &mut trace, &body, admit).await;
    trace.end(
        match &proxied {
            Ok(()) => None,
            Err(ProxyError::BeforeHead(e) | ProxyError::AfterHead(e)) => Some(e.to_string()),
        }
        .as_deref(),
    );
    match proxied {
        Ok(()) => {}
        Err(ProxyError::BeforeHead(e)) => {
            let err = if e.kind() == io::ErrorKind::TimedOut {
                let (request_id, trace_id) = log_ids(&head);
                warn!(%request_id, %trace_id, timeout = ?cfg.http_timeout, "backend did not answer within --http-timeout");
                backend_error(
                    504,
                    format!(
                        "backend did not answer within {:?} (--http-timeout)",
                        cfg.http_timeout
                    ),
                )
            } else {
                before_head_error(&e)
            };
            write_error(&mut s, &err).await;
        }
        Err(ProxyError::AfterHead(e)) => {
            // Headers already sent: drop the stream without the last chunk
            // so the router sees a cut, not a clean end.
            let (request_id, trace_id) = log_ids(&head);
            warn!(%request_id, %trace_id, "backend failed mid-response: {e}");
        }
    }
}

/// `fut` bounded by `limit` (`None`: unbounded); running out is a
/// `TimedOut` error naming `what`.
pub(super) async fn within<T>(
    limit: Option<std::time::Duration>,
    what: &'static str,
    fut: impl std::future::Future<Output = io::Result<T>>,
) -> io::Result<T> {
    let Some(limit) = limit else {
        return fut.await;
    };
    match monoio::time::timeout(limit, fut).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("{what} for {limit:?}"),
        )),
    }
}

/// A request's IDs for the agent's log lines: `X-Request-ID` (else the
/// trace ID, else `unknown`, spec 03) and the W3C trace ID (else empty).
fn log_ids(head: &http_parse::RequestHead) -> (String, String) {
    // A valid traceparent carries its trace ID, lower-case hex, at 3..35.
    let trace_id = head
        .header("traceparent")
        .filter(|v| trace_context::parse(v).is_some())
        .and_then(|v| v.get(3..35))
        .map(|id| String::from_utf8_lossy(id).into_owned())
        .unwrap_or_default();
    let request_id = head
        .header("x-request-id")
        .map(|v| String::from_utf8_lossy(v).trim().to_string())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| {
            if trace_id.is_empty() {
                "unknown".to_string()
            } else {
                trace_id.clone()
            }
        });
    (request_id, trace_id)
}

enum ProxyError {
    BeforeHead(io::Error),
    AfterHead(io::Error),
}

async fn proxy(
    cfg: &AgentConfig,
    link: &super::Link,
    s: &mut HttpStream,
    head: &http_parse::RequestHead,
    trace: &mut AgentTrace,
    body: &[u8],
    admit: super::gate::Admit,
) -> Result<(), ProxyError> {
    // Issue 56: no whole-exchange bound. The backend has --http-timeout
    // to start its answer; after that a stream may run for any length as
    // long as bytes keep coming (--stream-write-timeout between them and
    // for each write to the router).
    let idle = cfg.stream_write_timeout;
    // Past --http-timeout only while the engine works on it (issue 56).
    let (mut conn, rh) = super::progress::await_head(
        cfg,
        &link.meter,
        link.interim,
        s,
        backend::request(
            &cfg.backend,
            &head.method,
            &head.path,
            trace.headers(head),
            body,
        ),
    )
    .await
    .map_err(ProxyError::BeforeHead)?;
    trace.head(rh.status);
    if !(200..300).contains(&rh.status) && head.path_only() == "/v1/chat/completions" {
        // The native chat path classifies the engine's error into the
        // spec's codes (spec 03 §8): the same answer whatever the engine.
        let answer = within(
            Some(cfg.http_timeout),
            "backend error body",
            conn.read_body(rh.framing, ERROR_BODY_MAX),
        )
        .await
        .map_err(ProxyError::BeforeHead)?;
        backend::release(&cfg.backend, conn, &rh);
        drop(admit);
        let err = errors::classify_backend(rh.status, &answer);
        write_error(s, &err).await;
        return Ok(());
    }
    if rh.is_event_stream() {
        // Stream: headers now, then every piece as it arrives.
        let mut out = Vec::with_capacity(512);
        http_write::write_response_head(
            &mut out,
            rh.status,
            &rh.headers,
            OutFraming::Chunked,
            true,
            &[],
        );
        within(idle, "writing to the router", write_flush(s, &out))
            .await
            .map_err(ProxyError::AfterHead)?;
        let mut dec = ChunkedDecoder::new();
        let mut payload = Vec::with_capacity(16 * 1024);
        let mut remaining = match rh.framing {
            BodyFraming::Length(n) => Some(n),
            _ => None,
        };
        loop {
            match rh.framing {
                BodyFraming::Chunked => {
                    let used = dec.decode(&conn.buf, &mut payload, 0).map_err(|e| {
                        ProxyError::AfterHead(io::Error::new(
                            io::ErrorKind::InvalidData,
                            e.to_string(),
                        ))
                    })?;
                    conn.consume(used);
                }
                _ => {
                    let take = match remaining {
                        Some(r) => (r as usize).min(conn.buf.len()),
                        None => conn.buf.len(),
                    };
                    payload.extend_from_slice(conn.buf.get(..take).unwrap_or(&[]));
                    conn.consume(take);
                    if let Some(r) = remaining.as_mut() {
                        *r -= take as u64;
                    }
                }
            }
            if !payload.is_empty() {
                trace.piece(&payload);
                let mut chunk = Vec::with_capacity(payload.len() + 16);
                http_write::write_chunk(&mut chunk, &payload);
                payload.clear();
                within(idle, "writing to the router", write_flush(s, &chunk))
                    .await
                    .map_err(ProxyError::AfterHead)?;
            }
            let done = match rh.framing {
                BodyFraming::Chunked => dec.is_done(),
                BodyFraming::Length(_) => remaining == Some(0),
                BodyFraming::None => true,
                BodyFraming::UntilClose => false,
            };
            if done {
                break;
            }
            match within(idle, "no byte from the backend", conn.fill()).await {
                Ok(0) if rh.framing == BodyFraming::UntilClose => break,
                Ok(0) => {
                    return Err(ProxyError::AfterHead(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "backend closed mid-stream",
                    )))
                }
                Ok(_) => {}
                Err(e) => return Err(ProxyError::AfterHead(e)),
            }
        }
        backend::release(&cfg.backend, conn, &rh);
        // The backend is done: the place is free before the router hears
        // the end (a router that sends at once is not refused).
        drop(admit);
        within(
            idle,
            "writing to the router",
            write_flush(s, http_write::LAST_CHUNK),
        )
        .await
        .map_err(ProxyError::AfterHead)?;
        let _ = s.close().await;
        return Ok(());
    }
    // Not a stream: buffer the whole body, then headers and body together
    // (its head came, so the body follows: bytes keep coming or it ends).
    let body = within(
        Some(cfg.http_timeout),
        "backend body",
        conn.read_body(rh.framing, MAX_BODY as u64),
    )
    .await
    .map_err(ProxyError::BeforeHead)?;
    let body = Pooled::from(body);
    trace.piece(&body);
    backend::release(&cfg.backend, conn, &rh);
    drop(admit);
    let mut out = Pooled::with_capacity(512 + body.len());
    http_write::write_response_head(
        &mut out,
        rh.status,
        &rh.headers,
        OutFraming::Length(body.len()),
        true,
        &[],
    );
    out.extend_from_slice(&body);
    within(idle, "writing to the router", write_flush(s, &out))
        .await
        .map_err(ProxyError::AfterHead)?;
    let _ = s.close().await;
    Ok(())
}

async fn write_flush(s: &mut HttpStream, bytes: &[u8]) -> io::Result<()> {
    s.write_all(bytes).await?;
    s.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(extra: &str) -> http_parse::RequestHead {
        let raw = format!("POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n{extra}\r\n");
        match http_parse::parse_request_head(raw.as_bytes()) {
            Ok(Some((h, _))) => h,
            other => panic!("test head did not parse: {other:?}"),
        }
    }

    #[test]
    fn log_ids_take_the_trace_id_from_a_valid_traceparent_only() {
        let tp = "traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\n";
        let id = "4bf92f3577b34da6a3ce929d0e0e4736";
        // No X-Request-ID: the trace ID stands in for it (spec 03).
        assert_eq!(log_ids(&head(tp)), (id.to_string(), id.to_string()));
        let both = format!("{tp}X-Request-ID: abc\r\n");
        assert_eq!(log_ids(&head(&both)), ("abc".to_string(), id.to_string()));
        // Upper-case hex is not a valid traceparent: no trace ID.
        let bad = tp
            .to_ascii_uppercase()
            .replace("TRACEPARENT", "traceparent");
        assert_eq!(log_ids(&head(&bad)), ("unknown".to_string(), String::new()));
        assert_eq!(log_ids(&head("")), ("unknown".to_string(), String::new()));
    }
}
