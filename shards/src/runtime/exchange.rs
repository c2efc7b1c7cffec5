//! One exchange with an agent: open a `/http/1.1` yamux stream, write the
//! request, read the response head (the latency clock runs from just
//! before the write to the head), then relay the body to the client: SSE
//! chunk by chunk as it arrives, small bodies whole, large ones streamed.
//!
//! Key items: [`exchange_head`], [`relay`], [`Progress`].

use std::cell::Cell;
use std::io;

use futures::AsyncWriteExt;

use super::clock::{self, Instant};
use super::conn::Conn;
use super::link::{LinkHandle, LinkStream, HTTP_PROTOCOL};
use super::respond;
use crate::logic::failure::{Failure, Side, Stage};
use crate::logic::http_parse::{BodyFraming, ChunkedDecoder, ResponseHead};
use crate::logic::http_write::{self, OutFraming};
use crate::logic::usage::{self, SseUsage, Tokens};

/// How far an exchange got, readable after its future was cancelled by
/// the request deadline.
#[derive(Default)]
pub struct Progress {
    /// The stage reached.
    pub stage: Cell<Option<Stage>>,
    /// When the request write began (the latency clock's start).
    pub written_at: Cell<Option<Instant>>,
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
    pub upstream: Conn<LinkStream>,
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
    let mut s = link.open(HTTP_PROTOCOL).await.map_err(|e| {
        (
            Failure::new(
                Side::Agent,
                Stage::Opening,
                format!("cannot open a stream: {e}"),
            ),
            None,
        )
    })?;
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
    let mut upstream = Conn::over(s, Vec::with_capacity(8192));
    let head = upstream.read_response_head().await.map_err(after_send)?;
    Ok(Head {
        upstream,
        head,
        sample_ms: ms_since(t0),
    })
}

/// Non-streaming bodies up to this size are buffered (one write to the
/// client, usage parsed); larger ones stream through.
const BUFFERED_BODY: usize = 4 * 1024 * 1024;

/// How a relay ended.
pub enum RelayEnd {
    /// The whole response reached the client (usage when it had one).
    Done(Option<Tokens>),
    /// The agent's stream broke or stalled mid-body.
    UpstreamFailed(String),
    /// The client went away.
    ClientGone,
}

/// One read from the agent's stream, bounded by an idle timeout so a hung
/// agent cannot hold a client (and a slot) forever.
async fn fill_idle(up: &mut Conn<LinkStream>, idle: std::time::Duration) -> io::Result<usize> {
    match monoio::time::timeout(idle, up.fill()).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("agent stream idle for {idle:?}"),
        )),
    }
}

/// More of a body whose end is known: EOF or a stall is a failure.
async fn more_body(up: &mut Conn<LinkStream>, idle: std::time::Duration) -> Result<(), RelayEnd> {
    match fill_idle(up, idle).await {
        Ok(0) => Err(RelayEnd::UpstreamFailed("agent closed mid-body".into())),
        Ok(_) => Ok(()),
        Err(e) => Err(RelayEnd::UpstreamFailed(e.to_string())),
    }
}

/// Relay the body after `head` to the client.
pub async fn relay(
    client: &mut Conn,
    up: Conn<LinkStream>,
    head: &ResponseHead,
    keep: bool,
    idle: std::time::Duration,
) -> RelayEnd {
    match head.framing {
        BodyFraming::None => {
            let mut out = Vec::with_capacity(512);
            respond::relayed_head(
                &mut out,
                head,
                OutFraming::Length(0),
                keep,
                &client.request_id,
            );
            match client.write_all(out).await {
                Ok(()) => RelayEnd::Done(None),
                Err(_) => RelayEnd::ClientGone,
            }
        }
        BodyFraming::Length(n) => match usize::try_from(n) {
            Ok(n) if n > BUFFERED_BODY => relay_large(client, up, head, n, keep, idle).await,
            Ok(n) => relay_buffered(client, up, head, n, keep, idle).await,
            Err(_) => RelayEnd::UpstreamFailed("response too large".into()),
        },
        BodyFraming::Chunked | BodyFraming::UntilClose => {
            relay_chunks(client, up, head, keep, idle).await
        }
    }
}

/// A body up to [`BUFFERED_BODY`]: read whole, usage parsed, one write.
async fn relay_buffered(
    client: &mut Conn,
    mut up: Conn<LinkStream>,
    head: &ResponseHead,
    n: usize,
    keep: bool,
    idle: std::time::Duration,
) -> RelayEnd {
    while up.buf.len() < n {
        if let Err(end) = more_body(&mut up, idle).await {
            return end;
        }
    }
    let body = up.buf.get(..n).unwrap_or(&[]);
    let tokens = usage::from_body(body);
    let mut out = Vec::with_capacity(512 + n);
    respond::relayed_head(
        &mut out,
        head,
        OutFraming::Length(n),
        keep,
        &client.request_id,
    );
    out.extend_from_slice(body);
    match client.write_all(out).await {
        Ok(()) => RelayEnd::Done(tokens),
        Err(_) => RelayEnd::ClientGone,
    }
}

/// A large body streamed through in pieces (no usage parsing): an agent
/// cannot make the router hold gigabytes.
async fn relay_large(
    client: &mut Conn,
    mut up: Conn<LinkStream>,
    head: &ResponseHead,
    n: usize,
    keep: bool,
    idle: std::time::Duration,
) -> RelayEnd {
    let mut out = Vec::with_capacity(512);
    respond::relayed_head(
        &mut out,
        head,
        OutFraming::Length(n),
        keep,
        &client.request_id,
    );
    let mut left = n;
    loop {
        let mut piece = std::mem::take(&mut up.buf);
        piece.truncate(left);
        left -= piece.len();
        out.extend_from_slice(&piece);
        if !out.is_empty() && client.write_all(std::mem::take(&mut out)).await.is_err() {
            return RelayEnd::ClientGone;
        }
        if left == 0 {
            return RelayEnd::Done(None);
        }
        if let Err(end) = more_body(&mut up, idle).await {
            return end;
        }
    }
}

/// A chunked or until-close body: each piece goes out as it arrives (one
/// chunk per read); SSE usage is metered on the way.
async fn relay_chunks(
    client: &mut Conn,
    mut up: Conn<LinkStream>,
    head: &ResponseHead,
    keep: bool,
    idle: std::time::Duration,
) -> RelayEnd {
    let sse = head.is_event_stream();
    let until_close = head.framing == BodyFraming::UntilClose;
    let mut out = Vec::with_capacity(512);
    respond::relayed_head(
        &mut out,
        head,
        OutFraming::Chunked,
        keep,
        &client.request_id,
    );
    let mut dec = ChunkedDecoder::new();
    let mut meter = SseUsage::default();
    let mut payload = Vec::with_capacity(16 * 1024);
    loop {
        if until_close {
            payload.append(&mut up.buf);
        } else {
            match dec.decode(&up.buf, &mut payload, 0) {
                Ok(used) => up.consume(used),
                Err(e) => {
                    return RelayEnd::UpstreamFailed(format!("bad chunked body from agent: {e}"))
                }
            }
        }
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
            if client.write_all(std::mem::take(&mut out)).await.is_err() {
                return RelayEnd::ClientGone;
            }
            out = Vec::with_capacity(16 * 1024);
        }
        if finished {
            return RelayEnd::Done(meter.seen.then_some(meter.tokens));
        }
        match fill_idle(&mut up, idle).await {
            Ok(0) if until_close => {
                let _ = client.write_all(http_write::LAST_CHUNK.to_vec()).await;
                return RelayEnd::Done(meter.seen.then_some(meter.tokens));
            }
            Ok(0) => {
                return RelayEnd::UpstreamFailed("agent stream ended before the last chunk".into())
            }
            Ok(_) => {}
            Err(e) => return RelayEnd::UpstreamFailed(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
