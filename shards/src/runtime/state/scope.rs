//! What belongs to one client request, apart from its connection's bytes:
//! its ID and trace context, the headers every response to it carries, the
//! keepalive/committed state of a held request, the facts its audit line
//! names, and how it ended ([`Ending`]).
//!
//! Key types: [`Client`] (a client connection: the [`Conn`] with its
//! stream and buffers, plus the [`RequestScope`] of the request being
//! answered), [`RequestScope`], [`Ending`], [`KeepAlive`].
//! [`crate::runtime::request::ending::finish`] settles a scope once, whatever path the
//! request took.

use crate::runtime::state::model::stats::ActiveRequest;
use std::borrow::Cow;
use std::io;
use std::rc::Rc;

use monoio::net::TcpStream;

use super::model::agent::Agent;
use super::tenancy::{Principal, Ticket};
use crate::logic::http::api::usage::Tokens;
use crate::logic::http::framing::http_parse::RequestHead;
use crate::logic::http::framing::inline_str::InlineStr;
use crate::logic::http::request_id::RequestId;
use crate::logic::http::trace_context::{self, Trace};
use crate::runtime::wire::clock;
use crate::runtime::wire::conn::Conn;

/// The request's ID: the client's `X-Request-ID` when it is a UUID, else a new v4.
pub fn request_id(head: &RequestHead) -> RequestId {
    head.header("x-request-id")
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(str::trim)
        .and_then(RequestId::parse)
        .unwrap_or_else(new_request_id)
}

/// The request's trace: the client's valid `traceparent` (with its
/// `tracestate`), else a trace started here.
pub fn trace(head: &RequestHead) -> Trace {
    trace_context::resolve(
        head.header_values("traceparent"),
        head.header_values("tracestate"),
        rand::random::<[u8; 24]>(),
    )
}

/// A trace started here (a request whose head could not be read).
pub fn new_trace() -> Trace {
    trace_context::resolve(
        std::iter::empty(),
        std::iter::empty(),
        rand::random::<[u8; 24]>(),
    )
}

/// A fresh v4 request ID.
pub fn new_request_id() -> RequestId {
    RequestId::v4(rand::random::<[u8; 16]>())
}

/// Keepalive bytes a held request receives while it waits (hold at
/// zero): the first one commits `head` (200, chunked), every later one is
/// a chunk of `bytes`. Carried across a hand-off so the owner shard goes
/// on without a longer gap.
#[derive(Debug, Clone)]
pub struct KeepAlive {
    /// Period.
    pub every: std::time::Duration,
    /// When the next one is due.
    pub next: clock::Instant,
    /// The committed response head (status 200, chunked), pre-rendered.
    pub head: Vec<u8>,
    /// One keepalive (`: keep-alive\n\n` or a space).
    pub bytes: &'static [u8],
    /// The client asked for a stream (late errors as SSE events).
    pub stream: bool,
    /// `/v1/messages` (late errors in Anthropic's shape).
    pub anthropic: bool,
}

/// How a request ended: the tenant counters, the quota settlement and the
/// audit line read it. Written where it happens (the response writers set
/// status and code), read once by [`crate::runtime::request::ending::finish`].
#[derive(Default)]
pub struct Ending {
    /// Logical status (499: the client went away; 0: nothing answered).
    pub status: u16,
    /// Error code (empty on success).
    pub error_code: &'static str,
    /// Usage the response reported.
    pub tokens: Option<Tokens>,
    /// The agent that answered (or was tried last); its peer ID is copied
    /// only into an audit record.
    pub agent: Option<Rc<Agent>>,
    /// Response bytes from an agent reached the client.
    pub relayed: bool,
    /// Quota taken for the request, settled once at the end.
    pub ticket: Option<Ticket>,
    /// The dispatch driver served it on this (its model's) shard: the
    /// tenant's outcome counters apply.
    pub dispatched: bool,
    /// Agents whose stream broke and was continued on the next one (the
    /// last of them is followed by `agent`), in order.
    pub continued_from: Vec<std::sync::Arc<str>>,
    /// The request's input-token estimate (what a cut stream is charged
    /// for its prompt when no usage came).
    pub input_estimate: u64,
    /// An event stream that broke after reaching the client: the status
    /// the client saw, the output tokens relayed (all its parts), the
    /// input tokens its usage reported (if any).
    pub streamed: Option<(u16, u64, Option<u64>)>,
}

impl Ending {
    /// An event stream with `status` broke after `output` more tokens
    /// reached the client (`input`: its usage's, when one came).
    pub fn stream_broke(&mut self, status: u16, output: u64, input: Option<u64>) {
        let (_, before, seen) = self.streamed.unwrap_or((status, 0, None));
        self.streamed = Some((status, before.saturating_add(output), input.or(seen)));
    }

    /// A stream cut for good after reaching the client (issue 51 #10):
    /// the status it saw and the tokens it got, charged and audited as
    /// such, unless a later part served the answer whole.
    pub fn settle_cut(&mut self) {
        let Some((status, output, input)) = self.streamed else {
            return;
        };
        if self.tokens.is_some() || (self.status > 0 && self.status < 400) || self.status == 499 {
            return;
        }
        self.status = status;
        // The error event the client got names the backend.
        self.error_code = "backend_error";
        self.relayed = true;
        self.tokens = Some(Tokens {
            input: input.unwrap_or(self.input_estimate),
            output,
            ..Tokens::default()
        });
    }

    /// The client closed its connection before the response was done.
    pub fn client_gone(&mut self) {
        self.status = 499;
        self.error_code = "client_closed_request";
    }
}

/// One request's state, from its head to its [`crate::runtime::request::ending::finish`].
pub struct RequestScope {
    /// `X-Request-ID` (the client's when it is a UUID, else generated);
    /// echoed on every response.
    pub request_id: RequestId,
    /// Trace context (its `traceparent` is echoed).
    pub trace: Option<Trace>,
    /// Headers every response to the request carries (`X-RateLimit-*`,
    /// `X-Hivenet-Routed-Model`).
    pub reply_headers: Vec<(&'static str, Vec<u8>)>,
    /// Keepalives of a held request (None: none due).
    pub keepalive: Option<KeepAlive>,
    /// A 200 head already went out (keepalives): later errors go in the
    /// body, and the relay writes no head of its own.
    pub committed: bool,
    /// When its head started arriving.
    pub started: clock::Instant,
    /// Method and path (the audit line's).
    pub method: Cow<'static, str>,
    /// Path without its query.
    pub path: InlineStr,
    /// Who sent it, once authenticated.
    pub principal: Option<Principal>,
    /// The (resolved) model of an inference request, once probed.
    pub model: InlineStr,
    /// Not audited (`/health`, CORS preflight).
    pub quiet: bool,
    /// An admin route: no CORS headers (a browser page of another origin
    /// must not reach it).
    pub no_cors: bool,
    /// Counted in `http_server_active_requests` while the scope lives.
    pub active: Option<crate::runtime::state::model::stats::ActiveRequest>,
    /// How it ended.
    pub ending: Ending,
    /// Its trace, when the OTLP export is on
    /// ([`crate::runtime::request::spans`]).
    pub spans: Option<Box<crate::logic::trace::request::RequestTrace>>,
}

// === impl RequestScope ===

impl RequestScope {
    /// A scope for a request whose head is `head`.
    pub fn of(head: &RequestHead, started: clock::Instant) -> Self {
        RequestScope {
            request_id: request_id(head),
            trace: Some(trace(head)),
            method: head.method.clone(),
            path: InlineStr::from(head.path_only()),
            active: Some(ActiveRequest::begin(&head.method, head.path_only())),
            ..RequestScope::empty(started)
        }
    }

    /// Start the next request on this connection (its head is `head`):
    /// everything of the previous one is reset; the reply-header list
    /// keeps its capacity.
    pub fn begin(&mut self, head: &RequestHead, started: clock::Instant) {
        let mut reply_headers = std::mem::take(&mut self.reply_headers);
        reply_headers.clear();
        *self = RequestScope {
            reply_headers,
            ..RequestScope::of(head, started)
        };
    }

    /// A scope with a fresh ID and trace (no head could be read).
    pub fn fresh(started: clock::Instant) -> Self {
        RequestScope {
            request_id: new_request_id(),
            trace: Some(new_trace()),
            ..RequestScope::empty(started)
        }
    }

    fn empty(started: clock::Instant) -> Self {
        RequestScope {
            request_id: RequestId::default(),
            trace: None,
            reply_headers: Vec::new(),
            keepalive: None,
            committed: false,
            started,
            method: Cow::Borrowed(""),
            path: InlineStr::from(""),
            principal: None,
            model: InlineStr::from(""),
            quiet: false,
            no_cors: false,
            active: None,
            ending: Ending::default(),
            spans: None,
        }
    }
}

/// A client connection: its stream and buffers, and the scope of the
/// request being answered.
pub struct Client {
    /// The stream and its buffers.
    pub conn: Conn<TcpStream>,
    /// The request being answered.
    pub scope: RequestScope,
    /// Its first request was held at zero by the process this one
    /// replaced: its hold goes on here (issue 54).
    pub carried: Option<Box<crate::logic::system::upgrade::CarriedHold>>,
    /// Its first request's stream was relayed by the process this one
    /// replaced until its drain timeout: it is continued here (issue 54).
    pub resumed: Option<Box<crate::logic::system::upgrade::CarriedStream>>,
    /// Its stream goes to the process replacing this one, with these
    /// request bytes (set by the driver; the connection loop sends it).
    pub carry_stream: Option<Box<(Vec<u8>, crate::logic::system::upgrade::CarriedStream)>>,
}

/// Pipelined input kept while a request waits; past it the client socket
/// is no longer watched (its EOF is then found when the response is written).
const WATCH_LIMIT: usize = 64 * 1024;

/// What [`Client::unless_gone`]'s inner wait ended with.
enum Step {
    /// Keepalive bytes the socket did not take at once.
    Write(Vec<u8>),
    /// The watch fired: input or EOF pending (`true`), or the watch failed.
    Ready(bool),
}

/// The bytes of the keepalive due now (the committed head first, once),
/// and the next due time. Empty without a keepalive.
fn next_keepalive(keepalive: &mut Option<KeepAlive>, committed: &mut bool) -> Vec<u8> {
    let Some(k) = keepalive.as_mut() else {
        return Vec::new();
    };
    k.next = clock::now() + k.every;
    let mut out = Vec::with_capacity(k.head.len() + 32);
    if !*committed {
        out.extend_from_slice(&k.head);
        *committed = true;
    }
    crate::logic::http::framing::http_write::write_chunk(&mut out, k.bytes);
    out
}

// === impl Client ===

impl Client {
    /// A client connection before its first request.
    pub fn new(conn: Conn<TcpStream>) -> Self {
        Client {
            conn,
            scope: RequestScope::empty(clock::now()),
            carried: None,
            resumed: None,
            carry_stream: None,
        }
    }

    /// Write all of `data` to the client.
    pub async fn write_all(&mut self, data: Vec<u8>) -> io::Result<()> {
        self.conn.write_all(data).await
    }

    /// Run `fut` while watching the client socket: `None` when the client
    /// closed its connection first (the wait is abandoned at once, so a
    /// departed client never reaches a backend nor keeps a place). Input
    /// that arrives meanwhile is kept for the next request. A held
    /// request's keepalives go out on time meanwhile.
    pub async fn unless_gone<F: std::future::Future>(&mut self, fut: F) -> Option<F::Output> {
        use futures::future::{select, Either};
        futures::pin_mut!(fut);
        let mut watch = self.conn.buf.len() < WATCH_LIMIT;
        loop {
            // Readiness only: nothing is read (or lost) when `fut` ends first.
            self.conn.watched |= watch;
            let step = {
                let stream = &self.conn.stream;
                let scope = &mut self.scope;
                let readable = async move {
                    if watch {
                        stream.readable(false).await.is_ok()
                    } else {
                        futures::future::pending::<bool>().await
                    }
                };
                futures::pin_mut!(readable);
                // The watch lives across keepalives: dropping a pending
                // io_uring poll costs a cancel, which the kernel finds by
                // walking a hash bucket of every pending poll; re-arming
                // it per keepalive stalled a shard holding 18,000
                // requests for 3.6 s (perf/2026-12-01-hold-scale).
                loop {
                    let due = scope.keepalive.as_ref().map(|k| k.next);
                    let beat = async move {
                        match due {
                            Some(t) => {
                                let left = t.saturating_duration_since(clock::now());
                                monoio::time::sleep(left).await
                            }
                            None => futures::future::pending::<()>().await,
                        }
                    };
                    futures::pin_mut!(beat);
                    match select(select(&mut fut, beat), &mut readable).await {
                        Either::Left((Either::Left((out, _)), _)) => return Some(out),
                        // A keepalive is due: sent at once without
                        // blocking; what the socket does not take now is
                        // written after the watch is let go.
                        Either::Left((Either::Right(_), _)) => {
                            let out = next_keepalive(&mut scope.keepalive, &mut scope.committed);
                            match crate::runtime::wire::handoff::send_now(stream, &out) {
                                Ok(n) if n == out.len() => {}
                                Ok(n) => break Step::Write(out[n..].to_vec()),
                                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                                    break Step::Write(out)
                                }
                                Err(_) => return None,
                            }
                        }
                        Either::Right((r, _)) => break Step::Ready(r),
                    }
                }
            };
            match step {
                Step::Write(rest) => {
                    if self.conn.write_all(rest).await.is_err() {
                        return None;
                    }
                }
                Step::Ready(false) => watch = false,
                // Input or EOF is pending: this read completes at once.
                Step::Ready(true) => match self.conn.fill().await {
                    Ok(0) | Err(_) => return None,
                    Ok(_) => watch = self.conn.buf.len() < WATCH_LIMIT,
                },
            }
        }
    }
}
