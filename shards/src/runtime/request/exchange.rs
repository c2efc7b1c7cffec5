//! One exchange with an agent: open a `/http/1.1` yamux stream, write the
//! request, read the response head (the latency clock runs from just
//! before the write to the head), then relay the body to the client: SSE
//! chunk by chunk as it arrives, small bodies whole, large ones streamed.
//!
//! Key items: [`exchange_head`], [`relay`], [`Progress`].

use std::cell::Cell;
use std::io;

use futures::AsyncWriteExt;

use super::respond;
use crate::logic::http::api::usage::{self, SseUsage, Tokens};
use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::http::framing::http_parse::{BodyFraming, ChunkedDecoder, ResponseHead};
use crate::logic::http::framing::http_write::{self, OutFraming};
use crate::logic::routing::failure::{Failure, Side, Stage};
use crate::runtime::state::model::admission::Reservation;
use crate::runtime::state::scope::Client;
use crate::runtime::wire::clock::{self, Instant};
use crate::runtime::wire::conn::Conn;
use crate::runtime::wire::http_stream::{self, HttpStream};
use crate::runtime::wire::link::LinkHandle;

/// How far an exchange got, readable after its future was cancelled by
/// the request deadline.
#[derive(Default)]
pub struct Progress {
    /// The stage reached.
    pub stage: Cell<Option<Stage>>,
    /// When the request write began (the latency clock's start).
    pub written_at: Cell<Option<Instant>>,
    /// When the agent last sent an interim `102` head: its engine is
    /// working on an answer not yet started (issue 56).
    pub interim_at: Cell<Option<Instant>>,
}

impl Progress {
    /// The failure of an exchange cut by the deadline, and its latency
    /// sample when the request had reached the agent.
    pub fn deadline(&self) -> (Failure, Option<f64>) {
        let stage = self.stage.get().unwrap_or(Stage::Opening);
        let f = Failure::new(Side::Router, stage, "request deadline passed");
        let sample = self
            .written_at
            .get()
            .filter(|_| f.reached_agent())
            .map(ms_since);
        (f, sample)
    }
}

fn ms_since(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1e3
}

/// A response head from an agent.
pub struct Head {
    /// The stream, with what was read past the head.
    pub upstream: Conn<HttpStream>,
    /// The head.
    pub head: ResponseHead,
    /// Request write to response head, ms.
    pub sample_ms: f64,
}

/// Open a stream, write the request, read the response head. On failure,
/// the latency sample is there only when the request was written.
pub async fn exchange_head(
    link: &LinkHandle,
    request: &[u8],
    progress: &Progress,
) -> Result<Head, (Failure, Option<f64>)> {
    progress.stage.set(Some(Stage::Opening));
    // The multistream-select lines go out with the request (V1Lazy).
    let s = link.open_raw().await.map_err(|e| {
        (
            Failure::new(
                Side::Agent,
                Stage::Opening,
                format!("cannot open a stream: {e}"),
            ),
            None,
        )
    })?;
    let mut s = HttpStream::new(s);
    let t0 = clock::now();
    progress.stage.set(Some(Stage::AwaitingHead));
    progress.written_at.set(Some(t0));
    let after_send = |e: io::Error| {
        (
            Failure::new(Side::Agent, Stage::AwaitingHead, e.to_string()),
            Some(ms_since(t0)),
        )
    };
    s.write_all(request).await.map_err(after_send)?;
    s.flush().await.map_err(after_send)?;
    let mut upstream = Conn::over(s, crate::runtime::wire::bufpool::take(8192));
    http_stream::read_lines(&mut upstream)
        .await
        .map_err(after_send)?;
    let head = loop {
        let head = upstream.read_response_head().await.map_err(after_send)?;
        // Interim heads (the agent's progress reports) restart the head
        // deadline; 101 is never one here (no upgrade is asked for).
        if (100..200).contains(&head.status) && head.status != 101 {
            progress.interim_at.set(Some(clock::now()));
            continue;
        }
        break head;
    };
    Ok(Head {
        upstream,
        head,
        sample_ms: ms_since(t0),
    })
}

/// `fut` (an exchange up to its head) bounded by `deadline`, or by
/// `restart` after the agent's last interim head when that is later: an
/// answer its engine is still working on is not cut (issue 56). `None`:
/// the deadline passed.
pub async fn until_head<T>(
    deadline: Instant,
    restart: std::time::Duration,
    progress: &Progress,
    fut: impl std::future::Future<Output = T>,
) -> Option<T> {
    futures::pin_mut!(fut);
    loop {
        let until = head_deadline(deadline, progress.interim_at.get(), restart);
        let left = until.saturating_duration_since(clock::now());
        if left.is_zero() {
            return None;
        }
        if let Ok(v) = monoio::time::timeout(left, &mut fut).await {
            return Some(v);
        }
    }
}

/// The head deadline: the request's, or `restart` after the agent's last
/// progress report when that is later.
pub fn head_deadline(
    deadline: Instant,
    interim_at: Option<Instant>,
    restart: std::time::Duration,
) -> Instant {
    interim_at.map_or(deadline, |t| deadline.max(t + restart))
}

/// Non-streaming bodies up to this size are buffered (one write to the
/// client, usage parsed); larger ones stream through.
const BUFFERED_BODY: usize = 4 * 1024 * 1024;
/// A Responses answer is buffered up to this size: its ID is rewritten
/// and the turn kept (a larger one passes through as the engine gave it,
/// unkept).
const BUFFERED_TURN: usize = 16 * 1024 * 1024;

/// How a relay ended.
pub enum RelayEnd {
    /// The whole response reached the client (usage when it had one).
    Done(Option<Tokens>),
    /// The agent's stream broke or stalled mid-body.
    UpstreamFailed(String),
    /// The agent's stream broke before any of its body reached the client
    /// (a buffered answer): the request may be sent again elsewhere.
    FailedUnsent(String),
    /// The agent's event stream broke after its head and the client was
    /// told nothing yet: a continuation may follow ([`cut_stream`] if
    /// none does).
    Broken(String),
    /// The client went away.
    ClientGone,
}

/// The agent's side of a relay: the stream, the idle bound between its
/// bytes (`--stream-idle-timeout`) and the signal that cuts it when the
/// agent is declared dead.
pub struct Upstream<'a> {
    /// The stream, with what was read past the head.
    pub conn: Conn<HttpStream>,
    /// Longest silence allowed between bytes.
    pub idle: std::time::Duration,
    /// Fires when the agent's responses must be cut.
    pub cut: crate::runtime::state::model::agent::CutWatch<'a>,
    /// The request's admission reservation: an SSE stream trues it up to
    /// the exact input tokens and grows it with content as it streams.
    pub held: Option<&'a Reservation>,
    /// The link the stream is on (a finished stream is retired to it).
    pub link: &'a LinkHandle,
    /// The relayed event stream, kept for a continuation when the agent
    /// dies mid-stream (`--stream-migrations`); `None`: not kept.
    pub kept: Option<&'a mut Vec<u8>>,
    /// A continuation's stream is spliced into the client's (opening
    /// events dropped, ID and usage the first part's).
    pub splice: Option<&'a mut crate::logic::http::api::continuation::Splice>,
    /// A Responses turn: the router's ID given to the client, the
    /// engine's end kept before it reaches the client (issue 52).
    pub turn: Option<&'a mut super::responses::Conversation>,
}

/// Most of a stream kept for its continuation: a longer one is cut as
/// before (a whole answer is far less; this bounds a runaway agent).
pub const KEPT_MAX: usize = 4 * 1024 * 1024;

impl Upstream<'_> {
    /// Largest body read whole before it is relayed.
    fn buffered_max(&self) -> usize {
        if self.turn.is_some() {
            BUFFERED_TURN
        } else {
            BUFFERED_BODY
        }
    }

    /// One read, bounded by the idle timeout and the cut signal, so a hung
    /// or frozen agent cannot hold a client (and a slot) for long.
    pub(super) async fn fill(&mut self) -> Result<usize, String> {
        use futures::future::{select, Either};
        let idle = self.idle;
        let read = monoio::time::timeout(idle, self.conn.fill());
        futures::pin_mut!(read);
        match select(read, &mut self.cut).await {
            Either::Left((Ok(Ok(n)), _)) => Ok(n),
            Either::Left((Ok(Err(e)), _)) => Err(e.to_string()),
            Either::Left((Err(_), _)) => Err(format!(
                "no byte from the agent for {idle:?} (--stream-idle-timeout)"
            )),
            Either::Right(_) => Err(
                "the router cut the agent's responses (declared dead, or its drain ended)".into(),
            ),
        }
    }

    /// Hand the finished stream to its link: its closing frame leaves with
    /// the next request on the link instead of in a send (and an agent
    /// wake-up) of its own. Only for a stream read to its end: a failed
    /// or abandoned one is dropped at once, its reset is what stops the
    /// agent.
    pub(super) fn retire(self) {
        let Upstream { conn, link, .. } = self;
        let (stream, buf) = conn.into_parts();
        crate::runtime::wire::bufpool::give(buf);
        link.retire(stream.into_inner());
    }

    /// More of a body whose end is known: EOF, a stall or a cut fails it.
    async fn more_body(&mut self) -> Result<(), RelayEnd> {
        match self.fill().await {
            Ok(0) => Err(RelayEnd::UpstreamFailed("agent closed mid-body".into())),
            Ok(_) => Ok(()),
            Err(e) => Err(RelayEnd::UpstreamFailed(e)),
        }
    }
}

/// Relay the body after `head` to the client.
pub async fn relay(
    client: &mut Client,
    up: Upstream<'_>,
    head: &ResponseHead,
    keep: bool,
) -> RelayEnd {
    if client.scope.committed {
        // Keepalives already sent a 200 head: no head of our own, the body
        // goes out as chunks, keepalives stop.
        client.scope.keepalive = None;
        return relay_committed(client, up, head).await;
    }
    match head.framing {
        BodyFraming::None => {
            let mut out = Vec::with_capacity(512);
            respond::relayed_head(&mut out, head, OutFraming::Length(0), keep, &client.scope);
            match client.write_all(out).await {
                Ok(()) => RelayEnd::Done(None),
                Err(_) => RelayEnd::ClientGone,
            }
        }
        BodyFraming::Length(n) => match usize::try_from(n) {
            Ok(n) if n > up.buffered_max() => relay_large(client, up, head, n, keep).await,
            Ok(n) => relay_buffered(client, up, head, n, keep).await,
            Err(_) => RelayEnd::UpstreamFailed("response too large".into()),
        },
        BodyFraming::Chunked | BodyFraming::UntilClose => {
            relay_chunks(client, up, head, keep, false).await
        }
    }
}

/// The body after a committed head, as chunks (usage parsed when the body
/// is small enough to buffer).
async fn relay_committed(
    client: &mut Client,
    mut up: Upstream<'_>,
    head: &ResponseHead,
) -> RelayEnd {
    let n = match head.framing {
        BodyFraming::None => 0,
        BodyFraming::Length(n) => usize::try_from(n).unwrap_or(usize::MAX),
        BodyFraming::Chunked | BodyFraming::UntilClose => {
            return relay_chunks(client, up, head, false, true).await
        }
    };
    let mut out = Vec::new();
    let mut tokens = None;
    if n <= up.buffered_max() {
        while up.conn.buf.len() < n {
            if let Err(end) = up.more_body().await {
                return unsent(end);
            }
        }
        let body = up.conn.buf.get(..n).unwrap_or(&[]);
        tokens = usage::from_body(body);
        let tapped = up.turn.as_deref_mut().and_then(|t| t.tap.body(body));
        let body = tapped.as_deref().unwrap_or(body);
        if !body.is_empty() {
            http_write::write_chunk(&mut out, body);
        }
        if let Some(turn) = up.turn.as_deref_mut() {
            turn.keep().await;
        }
    } else {
        let mut left = n;
        loop {
            let mut piece = std::mem::take(&mut up.conn.buf);
            piece.truncate(left);
            left -= piece.len();
            if !piece.is_empty() {
                let mut c = Vec::with_capacity(piece.len() + 16);
                http_write::write_chunk(&mut c, &piece);
                if client.write_all(c).await.is_err() {
                    return RelayEnd::ClientGone;
                }
            }
            if left == 0 {
                break;
            }
            if let Err(end) = up.more_body().await {
                return end;
            }
        }
    }
    out.extend_from_slice(http_write::LAST_CHUNK);
    match client.write_all(out).await {
        Ok(()) => RelayEnd::Done(tokens),
        Err(_) => RelayEnd::ClientGone,
    }
}

/// A body up to [`BUFFERED_BODY`]: read whole, usage parsed, one write.
async fn relay_buffered(
    client: &mut Client,
    mut up: Upstream<'_>,
    head: &ResponseHead,
    n: usize,
    keep: bool,
) -> RelayEnd {
    while up.conn.buf.len() < n {
        if let Err(end) = up.more_body().await {
            return unsent(end);
        }
    }
    let body = up.conn.buf.get(..n).unwrap_or(&[]);
    let tokens = usage::from_body(body);
    let tapped = up.turn.as_deref_mut().and_then(|t| t.tap.body(body));
    let body = tapped.as_deref().unwrap_or(body);
    let n = body.len();
    let mut out = crate::runtime::wire::bufpool::take(512 + n);
    respond::relayed_head(&mut out, head, OutFraming::Length(n), keep, &client.scope);
    out.extend_from_slice(body);
    let turn = up.turn.take();
    // The stream is done with: retired before the client write.
    up.retire();
    if let Some(turn) = turn {
        turn.keep().await;
    }
    match client.write_all(out).await {
        Ok(()) => RelayEnd::Done(tokens),
        Err(_) => RelayEnd::ClientGone,
    }
}

/// A break while a body was buffered: nothing of it reached the client.
fn unsent(end: RelayEnd) -> RelayEnd {
    match end {
        RelayEnd::UpstreamFailed(why) => RelayEnd::FailedUnsent(why),
        other => other,
    }
}

/// A large body streamed through in pieces (no usage parsing): an agent
/// cannot make the router hold gigabytes.
async fn relay_large(
    client: &mut Client,
    mut up: Upstream<'_>,
    head: &ResponseHead,
    n: usize,
    keep: bool,
) -> RelayEnd {
    let mut out = Vec::with_capacity(512);
    respond::relayed_head(&mut out, head, OutFraming::Length(n), keep, &client.scope);
    let mut left = n;
    loop {
        let mut piece = std::mem::take(&mut up.conn.buf);
        piece.truncate(left);
        left -= piece.len();
        out.extend_from_slice(&piece);
        if !out.is_empty() && client.write_all(std::mem::take(&mut out)).await.is_err() {
            return RelayEnd::ClientGone;
        }
        if left == 0 {
            return RelayEnd::Done(None);
        }
        if let Err(end) = up.more_body().await {
            return end;
        }
    }
}

/// Relayed SSE events: kept for a continuation (up to [`KEPT_MAX`]),
/// metered for usage, and the admission reservation trued up as the
/// answer grows.
#[inline]
fn events_seen(up: &mut Upstream<'_>, meter: &mut SseUsage, payload: &[u8]) {
    if let Some(k) = up.kept.as_deref_mut() {
        if k.len() + payload.len() <= KEPT_MAX {
            k.extend_from_slice(payload);
        } else {
            up.kept = None;
        }
    }
    meter.feed(payload);
    if let Some(h) = up.held {
        h.streamed(meter.content_bytes);
        if meter.seen {
            h.exact_input(meter.tokens.input);
        }
    }
}

/// A chunked or until-close body: each piece goes out as it arrives (one
/// chunk per read); SSE usage is metered on the way.
async fn relay_chunks(
    client: &mut Client,
    mut up: Upstream<'_>,
    head: &ResponseHead,
    keep: bool,
    committed: bool,
) -> RelayEnd {
    let sse = head.is_event_stream();
    let until_close = head.framing == BodyFraming::UntilClose;
    let mut out = Vec::with_capacity(512);
    if !committed {
        respond::relayed_head(&mut out, head, OutFraming::Chunked, keep, &client.scope);
    }
    let mut dec = ChunkedDecoder::new();
    let mut meter = SseUsage::counting(up.held.is_some_and(|h| h.grows()));
    let mut payload = Vec::with_capacity(16 * 1024);
    loop {
        if until_close {
            payload.append(&mut up.conn.buf);
        } else {
            match dec.decode(&up.conn.buf, &mut payload, 0) {
                Ok(used) => up.conn.consume(used),
                Err(e) => {
                    return RelayEnd::UpstreamFailed(format!("bad chunked body from agent: {e}"))
                }
            }
        }
        if let Some(sp) = up.splice.as_deref_mut() {
            let spliced = sp.feed(&payload);
            payload.clear();
            payload.extend_from_slice(&spliced);
        }
        if let Some(turn) = up.turn.as_deref_mut() {
            let mut lines = Vec::with_capacity(payload.len() + 64);
            turn.tap.feed(&payload, &mut lines);
            if !until_close && dec.is_done() {
                turn.tap.finish(&mut lines);
            }
            payload = lines;
            // The terminal event waits until the turn is kept.
            turn.keep().await;
        }
        if sse {
            events_seen(&mut up, &mut meter, &payload);
        }
        http_write::write_chunk(&mut out, &payload);
        payload.clear();
        if !until_close && dec.is_done() {
            // Whole: the stream is retired before the last write, as in
            // relay_buffered (its closing frame rides with the next
            // request instead of waking the agent once more).
            out.extend_from_slice(http_write::LAST_CHUNK);
            up.retire();
            return match client.write_all(out).await {
                Ok(()) => RelayEnd::Done(meter.seen.then_some(meter.tokens)),
                Err(_) => RelayEnd::ClientGone,
            };
        }
        if !out.is_empty() {
            if client.write_all(std::mem::take(&mut out)).await.is_err() {
                return RelayEnd::ClientGone;
            }
            out = Vec::with_capacity(16 * 1024);
        }
        let fail = match up.fill().await {
            Ok(0) if until_close => {
                up.retire();
                let _ = client.write_all(http_write::LAST_CHUNK.to_vec()).await;
                return RelayEnd::Done(meter.seen.then_some(meter.tokens));
            }
            Ok(0) => "agent stream ended before the last chunk".to_string(),
            Ok(_) => continue,
            Err(e) => e,
        };
        if sse {
            // What reached the client is charged and audited if nothing
            // serves the rest (issue 51 #10).
            let out = if meter.seen {
                meter.tokens.output.max(meter.content_events)
            } else {
                meter.content_events
            };
            let input = meter.seen.then_some(meter.tokens.input);
            client.scope.ending.stream_broke(head.status, out, input);
        }
        if sse && up.kept.is_some() {
            return RelayEnd::Broken(fail);
        }
        if sse {
            cut_stream(client, &fail).await;
        }
        return RelayEnd::UpstreamFailed(fail);
    }
}

/// Tell the client why its event stream ends before cutting it (never a
/// clean end: no last chunk).
pub async fn cut_stream(client: &mut Client, why: &str) {
    let err = ApiError::new(ErrorCode::BackendError, format!("stream cut: {why}"));
    let mut event = b"event: error\ndata: ".to_vec();
    event.extend_from_slice(&err.body());
    event.extend_from_slice(b"\n\n");
    let mut chunk = Vec::with_capacity(event.len() + 16);
    http_write::write_chunk(&mut chunk, &event);
    let _ = client.write_all(chunk).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interim_head_restarts_the_deadline_never_shortens_it() {
        let t0 = Instant::now();
        let d = t0 + std::time::Duration::from_secs(1);
        let r = std::time::Duration::from_secs(1);
        assert_eq!(head_deadline(d, None, r), d);
        // A report before the deadline moves it a whole period on.
        let late = t0 + std::time::Duration::from_millis(900);
        assert_eq!(head_deadline(d, Some(late), r), late + r);
        // One long before it shortens nothing.
        assert_eq!(head_deadline(d + r * 5, Some(t0), r), d + r * 5);
    }

    #[test]
    fn a_deadline_before_the_write_is_no_sample() {
        let p = Progress::default();
        let (f, sample) = p.deadline();
        assert_eq!((f.side, f.stage), (Side::Router, Stage::Opening));
        assert_eq!(sample, None, "nothing reached the agent");
        p.stage.set(Some(Stage::Opening));
        assert_eq!(p.deadline().1, None, "still opening the stream");
        p.stage.set(Some(Stage::AwaitingHead));
        p.written_at.set(Some(clock::now()));
        let (f, sample) = p.deadline();
        assert_eq!(f.stage, Stage::AwaitingHead);
        assert!(!f.retryable(), "the router's deadline is not retried");
        assert!(sample.is_some_and(|ms| ms >= 0.0), "written: a sample");
    }
}
