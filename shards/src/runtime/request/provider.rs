//! Provider fallback, the I/O shell (spec 04 §7): when every local step
//! of a chat or messages request is exhausted and its policy names a
//! `fallback_provider`, the request goes to OpenAI or Anthropic (or a
//! compatible server at a base URL override) over HTTPS or HTTP, and the
//! answer comes back whole or streamed as it arrives, in the client's
//! own API, stamped `processed_by`. The pure parts (shapes, translation)
//! are in [`crate::logic::http::api::provider`].
//!
//! Key items: [`fallback`]; the accounts are
//! [`crate::runtime::services::providers::Providers`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use monoio::buf::IoBufMut;
use monoio::io::{AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt};
use monoio::net::TcpStream;
use tracing::warn;

use super::respond;
use crate::logic::http::api::provider::{self as shape, Api, Engine, FallbackProvider};
use crate::logic::http::api::usage::{self, SseUsage, Tokens};
use crate::logic::http::endpoint::Endpoint;
use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::http::framing::http_parse::BodyFraming;
use crate::logic::http::framing::http_parse::ChunkedDecoder;
use crate::logic::http::framing::http_write;
use crate::runtime::services::providers::Account;
use crate::runtime::state::model::stats::ModelStats;
use crate::runtime::state::scope::Client;
use crate::runtime::state::shard::Shard;
use crate::runtime::wire::clock;
use crate::runtime::wire::conn::{Conn, Transport};

/// The provider client's own timeout (spec 04 §7), also bounded by the
/// request deadline.
pub const PROVIDER_TIMEOUT: Duration = Duration::from_secs(120);
/// Largest whole answer read from a provider.
const MAX_ANSWER: u64 = 16 * 1024 * 1024;
/// Most of a provider's error body shown to the client.
const ERROR_SHOWN: usize = 4 * 1024;

/// A connection to a provider: plain TCP or TLS over it.
enum ProviderStream {
    Plain(TcpStream),
    Tls(Box<monoio_rustls::ClientTlsStream<TcpStream>>),
}

impl Transport for ProviderStream {
    async fn read_owned(&mut self, buf: Vec<u8>) -> (std::io::Result<usize>, Vec<u8>) {
        match self {
            ProviderStream::Plain(s) => s.read_owned(buf).await,
            ProviderStream::Tls(s) => {
                let cap = buf.capacity();
                let (res, slice) = s.read(buf.slice_mut(0..cap)).await;
                (res, slice.into_inner())
            }
        }
    }

    async fn write_owned(&mut self, data: Vec<u8>) -> std::io::Result<()> {
        match self {
            ProviderStream::Plain(s) => s.write_owned(data).await,
            ProviderStream::Tls(s) => {
                let (res, _) = s.write_all(data).await;
                res?;
                s.flush().await
            }
        }
    }
}

/// The address of `host`: a literal at once, a name resolved on a
/// thread of its own (the shard never blocks on DNS).
async fn resolve(host: &str, port: u16) -> Result<SocketAddr, String> {
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    let (tx, rx) = futures::channel::oneshot::channel();
    let name = host.to_string();
    std::thread::Builder::new()
        .name("provider-dns".into())
        .spawn(move || {
            use std::net::ToSocketAddrs;
            let r = (name.as_str(), port)
                .to_socket_addrs()
                .map_err(|e| e.to_string())
                .and_then(|mut a| a.next().ok_or_else(|| "no address".to_string()));
            let _ = tx.send(r);
        })
        .map_err(|e| format!("resolve {host}: {e}"))?;
    rx.await
        .map_err(|_| format!("resolve {host}: lookup ended"))?
        .map_err(|e| format!("resolve {host}: {e}"))
}

async fn connect(
    a: &Account,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<ProviderStream, String> {
    let addr = resolve(&a.base.host, a.base.port).await?;
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    if !a.base.tls {
        return Ok(ProviderStream::Plain(tcp));
    }
    let cfg = tls.ok_or("no TLS settings")?;
    let name = rustls::pki_types::ServerName::try_from(a.base.host.clone())
        .map_err(|e| format!("server name {:?}: {e}", a.base.host))?;
    let s = monoio_rustls::TlsConnector::from(cfg.clone())
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS with {}: {e}", a.base.host))?;
    Ok(ProviderStream::Tls(Box::new(s)))
}

/// How a fallback ended, for the caller's counters.
pub enum Fallback {
    /// Answered (the status the client got) with the usage seen.
    Served { status: u16, tokens: Option<Tokens> },
    /// Failed before anything reached the client: answer with this.
    Failed(ApiError),
    /// The answer broke after its head.
    Cut,
    /// The client left while the provider worked.
    ClientGone,
}

/// The client API of an endpoint that may fall back (`None`: not an LLM
/// request, never sent to a provider).
pub fn api_of(e: Endpoint) -> Option<Api> {
    match e {
        Endpoint::ChatCompletions => Some(Api::Chat),
        Endpoint::Messages => Some(Api::Messages),
        _ => None,
    }
}

/// Send the client's request (`request`: the agent request bytes, head
/// and body) to `fp` and answer the client. The caller counts.
pub async fn fallback(
    shard: &Shard,
    c: &mut Client,
    fp: &FallbackProvider,
    api: Api,
    request: &[u8],
    deadline: clock::Instant,
    keep: bool,
) -> (Fallback, Option<u16>) {
    let providers = &shard.router.cfg.providers;
    let fail = |m: String| {
        Fallback::Failed(ApiError::new(
            ErrorCode::BackendError,
            format!("provider {}: {m}", fp.engine.name()),
        ))
    };
    let Some(account) = providers.account(fp.engine) else {
        return (fail("no key configured".into()), None);
    };
    let body = request
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .and_then(|i| request.get(i + 4..))
        .unwrap_or(&[]);
    let req =
        match shape::build_request(fp.engine, &fp.model, &account.base, &account.key, api, body) {
            Ok(r) => r,
            Err(e) => return (fail(e.0), None),
        };
    let left = deadline
        .saturating_duration_since(clock::now())
        .min(PROVIDER_TIMEOUT);
    // A released request's keepalives go on, and a client that leaves
    // drops the call (issue 56), as for an agent.
    let head = monoio::time::timeout(left, ask(account, providers.tls.as_ref(), &req.bytes));
    let Some(head) = c.unless_gone(head).await else {
        return (Fallback::ClientGone, None);
    };
    let (mut conn, head) = match head {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => return (fail(e), Some(0)),
        Err(_) => return (fail(format!("no answer within {left:?}")), Some(0)),
    };
    let status = head.status;
    if !(200..300).contains(&status) {
        let text = error_text(&mut conn, &head, deadline).await;
        return (
            fail(format!("HTTP {status}: {}", text.trim())),
            Some(status),
        );
    }
    if req.stream && head.is_event_stream() {
        let idle = shard.router.cfg.stream_idle_timeout;
        let end = relay_stream(c, conn, head.framing, fp.engine, req.translated, idle, keep).await;
        return (end, Some(status));
    }
    // Whole answer: bounded by the deadline and the provider timeout.
    let left = deadline
        .saturating_duration_since(clock::now())
        .min(PROVIDER_TIMEOUT);
    let whole = monoio::time::timeout(left, conn.read_body(head.framing, MAX_ANSWER));
    let Some(whole) = c.unless_gone(whole).await else {
        return (Fallback::ClientGone, Some(status));
    };
    let answer = match whole {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return (fail(format!("answer body: {e}")), Some(0)),
        Err(_) => return (fail(format!("answer body not within {left:?}")), Some(0)),
    };
    let out = match shape::response_body(fp.engine, api, &answer) {
        Ok(b) => b,
        Err(e) => return (fail(e.0), Some(status)),
    };
    let tokens = usage::from_body(&out);
    if !send_whole(c, &out, keep).await {
        return (Fallback::Cut, Some(status));
    }
    (
        Fallback::Served {
            status: 200,
            tokens,
        },
        Some(status),
    )
}

/// Connect to the provider, send the request, read its answer's head.
async fn ask(
    account: &Account,
    tls: Option<&Arc<rustls::ClientConfig>>,
    bytes: &[u8],
) -> Result<
    (
        Conn<ProviderStream>,
        crate::logic::http::framing::http_parse::ResponseHead,
    ),
    String,
> {
    let stream = connect(account, tls).await?;
    let mut conn = Conn::over(stream, Vec::with_capacity(16 * 1024));
    conn.write_all(bytes.to_vec())
        .await
        .map_err(|e| format!("send: {e}"))?;
    let head = conn
        .read_response_head()
        .await
        .map_err(|e| format!("answer: {e}"))?;
    Ok((conn, head))
}

/// The start of a provider's error answer (bounded, briefly).
async fn error_text(
    conn: &mut Conn<ProviderStream>,
    head: &crate::logic::http::framing::http_parse::ResponseHead,
    deadline: clock::Instant,
) -> String {
    let body = monoio::time::timeout(
        Duration::from_secs(2).min(deadline.saturating_duration_since(clock::now())),
        conn.read_body(head.framing, 64 * 1024),
    )
    .await;
    match body {
        Ok(Ok(b)) => String::from_utf8_lossy(&b[..b.len().min(ERROR_SHOWN)]).into_owned(),
        _ => String::new(),
    }
}

/// Send a whole answer: as the body's end of a held request whose head
/// is out (keepalives), else as one JSON response. Whether it was sent.
async fn send_whole(c: &mut Client, out: &[u8], keep: bool) -> bool {
    if c.scope.committed {
        c.scope.keepalive = None;
        c.scope.ending.status = 200;
        let mut chunk = Vec::with_capacity(out.len() + 16);
        http_write::write_chunk(&mut chunk, out);
        chunk.extend_from_slice(http_write::LAST_CHUNK);
        c.conn.write_all(chunk).await.is_ok()
    } else {
        respond::send_json(c, 200, out, keep).await || !keep
    }
}

/// Move what `conn` holds of the body into `payload`, by its framing.
/// Whether the body is complete.
fn take_body(
    conn: &mut Conn<ProviderStream>,
    framing: BodyFraming,
    dec: &mut ChunkedDecoder,
    left: &mut Option<u64>,
    payload: &mut Vec<u8>,
) -> Result<bool, String> {
    if framing == BodyFraming::Chunked {
        let used = dec
            .decode(&conn.buf, payload, 0)
            .map_err(|e| format!("bad chunked answer: {e}"))?;
        conn.consume(used);
        return Ok(dec.is_done());
    }
    let n = left.map_or(conn.buf.len(), |l| conn.buf.len().min(l as usize));
    payload.extend_from_slice(conn.buf.get(..n).unwrap_or(&[]));
    conn.consume(n);
    if let Some(l) = left.as_mut() {
        *l -= n as u64;
    }
    Ok(*left == Some(0) || framing == BodyFraming::None)
}

/// Relay a provider's event stream to the client as it arrives (in the
/// client's API), metering its usage.
async fn relay_stream(
    c: &mut Client,
    mut conn: Conn<ProviderStream>,
    framing: BodyFraming,
    engine: Engine,
    translated: bool,
    idle: Duration,
    keep: bool,
) -> Fallback {
    let mut out = Vec::with_capacity(16 * 1024);
    if c.scope.committed {
        c.scope.keepalive = None;
    } else {
        respond::event_stream_head(&mut out, &c.scope);
    }
    c.scope.ending.status = 200;
    c.scope.ending.relayed = true;
    let _ = keep;
    let mut dec = ChunkedDecoder::new();
    let mut left = match framing {
        BodyFraming::Length(n) => Some(n),
        _ => None,
    };
    let mut translator = translated.then(|| shape::StreamTranslator::new(engine));
    let mut meter = SseUsage::default();
    let mut payload = Vec::with_capacity(16 * 1024);
    let mut events = Vec::with_capacity(16 * 1024);
    loop {
        let done = match take_body(&mut conn, framing, &mut dec, &mut left, &mut payload) {
            Ok(done) => done,
            Err(e) => return cut(c, e).await,
        };
        let piece: &[u8] = match translator.as_mut() {
            Some(t) => {
                if let Err(e) = t.feed(&payload, &mut events) {
                    return cut(c, e.0).await;
                }
                &events
            }
            None => &payload,
        };
        meter.feed(piece);
        if !piece.is_empty() {
            http_write::write_chunk(&mut out, piece);
        }
        payload.clear();
        events.clear();
        if done {
            out.extend_from_slice(http_write::LAST_CHUNK);
            return match c.conn.write_all(out).await {
                Ok(()) => Fallback::Served {
                    status: 200,
                    tokens: meter.seen.then_some(meter.tokens),
                },
                Err(_) => Fallback::Cut,
            };
        }
        if !out.is_empty() {
            if c.conn.write_all(std::mem::take(&mut out)).await.is_err() {
                c.scope.ending.client_gone();
                return Fallback::Cut;
            }
            out = Vec::with_capacity(16 * 1024);
        }
        match monoio::time::timeout(idle, conn.fill()).await {
            Ok(Ok(0)) if framing == BodyFraming::UntilClose => {
                let _ = c.conn.write_all(http_write::LAST_CHUNK.to_vec()).await;
                return Fallback::Served {
                    status: 200,
                    tokens: meter.seen.then_some(meter.tokens),
                };
            }
            Ok(Ok(0)) => return cut(c, "the provider closed mid-stream".into()).await,
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return cut(c, format!("read: {e}")).await,
            Err(_) => return cut(c, format!("no byte for {idle:?} (--stream-idle-timeout)")).await,
        }
    }
}

/// End a stream that broke after its head: an error event, then the end.
async fn cut(c: &mut Client, why: String) -> Fallback {
    warn!("provider stream cut: {why}");
    let err = ApiError::new(ErrorCode::BackendError, format!("stream cut: {why}"));
    c.scope.ending.status = err.status;
    c.scope.ending.error_code = err.code.as_str();
    let mut event = b"event: error\ndata: ".to_vec();
    event.extend_from_slice(&err.body());
    event.extend_from_slice(b"\n\n");
    let mut chunk = Vec::with_capacity(event.len() + 16);
    http_write::write_chunk(&mut chunk, &event);
    let _ = c.conn.write_all(chunk).await;
    Fallback::Cut
}

/// A request the machine sent to its policy's fallback provider.
pub struct Call<'a> {
    /// Its model (the call is counted there).
    pub model: &'a str,
    /// Its endpoint.
    pub endpoint: Endpoint,
    /// The policy's fallback provider.
    pub provider: Option<&'a FallbackProvider>,
    /// The request bytes as an agent would receive them.
    pub request: &'a [u8],
    /// Its deadline.
    pub deadline: clock::Instant,
    /// Its tenant (the routed/failed label).
    pub tenant: Arc<str>,
    /// The client's connection may stay open.
    pub keep: bool,
}

/// The machine's [`Action::Provider`]: send the request to the policy's
/// fallback provider, answer the client and count the call on the model.
/// Returns whether the client connection stays open.
///
/// [`Action::Provider`]: crate::logic::routing::decision::Action::Provider
pub async fn serve(shard: &Shard, c: &mut Client, call: Call<'_>) -> bool {
    let Call {
        model,
        endpoint,
        provider,
        request,
        deadline,
        tenant,
        keep,
    } = call;
    let (Some(fp), Some(api)) = (provider, api_of(endpoint)) else {
        // The machine names a provider only where one applies.
        let e = ApiError::new(ErrorCode::NoAgentsAvailable, "no fallback provider applies");
        return respond::send_error(c, &e, keep).await;
    };
    let started = clock::now();
    let (end, status) = fallback(shard, c, fp, api, request, deadline, keep).await;
    let engine = fp.engine.name();
    super::spans::provider(c, engine, started, status.unwrap_or(0));
    let labels = (Arc::<str>::from("cloud"), Arc::<str>::from(engine), tenant);
    let secs = started.elapsed().as_secs_f64();
    let ok = matches!(end, Fallback::Served { .. });
    let count = |s: &mut ModelStats| {
        s.provider_fallback += 1;
        if let Some(st) = status {
            s.provider_calls
                .entry((engine, st))
                .or_default()
                .observe(&crate::runtime::state::model::stats::CLIENT_BUCKETS, secs);
        }
        if ok {
            *s.routed.entry(labels).or_default() += 1;
        } else {
            *s.failed.entry(labels).or_default() += 1;
            s.exhausted += 1;
        }
    };
    match shard.model(model) {
        Some(m) => count(&mut m.borrow_mut().stats),
        // A model no agent ever registered here (issue 56): counted in
        // the shard's bounded book of such models.
        None => shard.provider_only.borrow_mut().count(model, count),
    }
    match end {
        Fallback::Served { status, tokens } => {
            c.scope.ending.status = status;
            c.scope.ending.relayed = true;
            c.scope.ending.tokens = tokens;
            keep && !c.scope.committed
        }
        Fallback::Failed(e) => {
            warn!(
                model,
                provider = engine,
                "provider fallback failed: {}",
                e.message
            );
            respond::send_error(c, &e, keep).await
        }
        Fallback::Cut => false,
        Fallback::ClientGone => {
            c.scope.ending.client_gone();
            false
        }
    }
}
