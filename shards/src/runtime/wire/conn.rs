//! A buffered connection over any byte stream: owned-buffer reads appended
//! to a growing buffer, whole-buffer writes, and the one read-and-parse
//! loop for request heads, response heads, bodies and control frames.
//! Used over TCP (client ingress, metrics, the agent's backend client, the
//! simulator, the load generator) and over yamux streams (the router's
//! requests to agents, the agent's side, the control stream) alike.
//!
//! Key types: [`Conn`], [`Transport`], [`BodyError`].

use std::io;

use monoio::buf::IoBufMut;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;

use super::budget::BodyPermit;
use super::link::LinkStream;
use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::http::framing::http_parse::{
    self, BodyFraming, ChunkError, ChunkedDecoder, HeadError, RequestHead, ResponseHead,
};
use crate::logic::link::control::{self, ControlMsg};

/// A byte stream a [`Conn`] can drive. Reads land in a buffer the stream
/// owns for the duration of the call (completion-based I/O needs that).
// The runtime is single-threaded: the futures need not be `Send`.
#[allow(async_fn_in_trait)]
pub trait Transport {
    /// Read once into `buf` (cleared, with spare capacity); returns the
    /// count (0 = EOF) and the buffer, its length set to what was read.
    async fn read_owned(&mut self, buf: Vec<u8>) -> (io::Result<usize>, Vec<u8>);
    /// Write all of `data` (and flush where the stream buffers).
    async fn write_owned(&mut self, data: Vec<u8>) -> io::Result<()>;
    /// Reads need an initialized slice (`futures::AsyncRead`): they go
    /// through [`Transport::poll_read_init`] and a reused zero-filled
    /// scratch buffer instead of zero-filling a fresh reserve on every
    /// read (that memset was ~10 % of the router's instructions per
    /// request).
    const NEEDS_INIT: bool = false;
    /// Poll one read into the whole of `buf` (initialized). Only for
    /// [`Transport::NEEDS_INIT`] streams; the others never get here.
    fn poll_read_init(
        &mut self,
        _cx: &mut std::task::Context<'_>,
        _buf: &mut [u8],
    ) -> std::task::Poll<io::Result<usize>> {
        std::task::Poll::Ready(Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "completion-based stream: use read_owned",
        )))
    }
}

thread_local! {
    /// Zero-filled read buffers of [`READ_RESERVE`] bytes for streams
    /// whose reads need initialized memory, reused across requests on
    /// this thread. Taken and given back within one poll, never held
    /// across an await: an idle link's control stream waits for its next
    /// frame without one (it held 16 KiB per link before).
    static SCRATCH: std::cell::RefCell<Vec<Vec<u8>>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn take_scratch() -> Vec<u8> {
    SCRATCH
        .with(|s| s.borrow_mut().pop())
        .unwrap_or_else(|| vec![0; READ_RESERVE])
}

fn give_scratch(v: Vec<u8>) {
    if v.len() == READ_RESERVE {
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < 64 {
                s.push(v);
            }
        });
    }
}

impl Transport for TcpStream {
    async fn read_owned(&mut self, buf: Vec<u8>) -> (io::Result<usize>, Vec<u8>) {
        let cap = buf.capacity();
        let (res, slice) = self.read(buf.slice_mut(0..cap)).await;
        (res, slice.into_inner())
    }

    async fn write_owned(&mut self, data: Vec<u8>) -> io::Result<()> {
        let (res, buf) = self.write_all(data).await;
        super::bufpool::give(buf);
        res.map(|_| ())
    }
}

/// Streams that speak `futures::io` (link streams): reads need an
/// initialized slice, writes are flushed.
macro_rules! futures_io_transport {
    ($t:ty) => {
        impl $crate::runtime::wire::conn::Transport for $t {
            const NEEDS_INIT: bool = true;

            fn poll_read_init(
                &mut self,
                cx: &mut std::task::Context<'_>,
                buf: &mut [u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                futures::AsyncRead::poll_read(std::pin::Pin::new(self), cx, buf)
            }

            async fn read_owned(&mut self, mut buf: Vec<u8>) -> (std::io::Result<usize>, Vec<u8>) {
                let cap = buf.capacity();
                buf.resize(cap, 0);
                let res = futures::AsyncReadExt::read(self, &mut buf).await;
                buf.truncate(*res.as_ref().unwrap_or(&0));
                (res, buf)
            }

            async fn write_owned(&mut self, data: Vec<u8>) -> std::io::Result<()> {
                let data = $crate::runtime::wire::bufpool::Pooled::from(data);
                futures::AsyncWriteExt::write_all(self, &data).await?;
                futures::AsyncWriteExt::flush(self).await
            }
        }
    };
}

pub(crate) use futures_io_transport;

futures_io_transport!(LinkStream);

/// Why no request head could be read.
#[derive(Debug)]
pub enum HeadRead {
    /// The peer closed (or the socket failed) before a complete head.
    Closed,
    /// The head broke a framing rule.
    Bad(HeadError),
}

/// Why a body could not be read.
#[derive(Debug)]
pub enum BodyError {
    /// Over the limit (declared or received).
    TooLarge,
    /// Broke a framing rule.
    Bad(String),
    /// The peer closed or the read failed before the end.
    Closed(io::Error),
    /// The router-wide body budget cannot take it now.
    OverBudget,
}

impl From<BodyError> for io::Error {
    fn from(e: BodyError) -> Self {
        match e {
            BodyError::TooLarge => io::Error::new(io::ErrorKind::InvalidData, "body too large"),
            BodyError::Bad(why) => io::Error::new(io::ErrorKind::InvalidData, why),
            BodyError::Closed(e) => e,
            BodyError::OverBudget => io::Error::new(io::ErrorKind::OutOfMemory, "body budget"),
        }
    }
}

/// 503 for a body the router-wide budget cannot take now.
pub fn over_budget() -> ApiError {
    ApiError::new(
        ErrorCode::NoCapacity,
        "the router is buffering too many request bodies; retry shortly",
    )
}

/// Read chunk reserved before each read.
const READ_RESERVE: usize = 16 * 1024;

/// A stream plus the bytes read but not yet consumed.
pub struct Conn<S = TcpStream> {
    /// The stream.
    pub stream: S,
    /// Unconsumed input.
    pub buf: Vec<u8>,
    /// Spare read buffer: reads land here first so a read cancelled by a
    /// timeout never loses what `buf` already holds.
    rbuf: Vec<u8>,
    /// The socket was watched for readiness (a poll may still be in
    /// flight): a hand-off must duplicate it rather than unwrap it.
    pub watched: bool,
}

impl Conn<TcpStream> {
    /// Wrap a TCP stream (sets `TCP_NODELAY`).
    pub fn new(stream: TcpStream, buf: Vec<u8>) -> Self {
        let _ = stream.set_nodelay(true);
        Conn::over(stream, buf)
    }
}

impl<S: Transport> Conn<S> {
    /// Wrap any stream, with `buf` already read.
    pub fn over(stream: S, buf: Vec<u8>) -> Self {
        Conn {
            stream,
            buf,
            rbuf: Vec::new(),
            watched: false,
        }
    }

    /// Give back read-buffer capacity a long wait does not need (a held
    /// request: thousands may wait at once; the next read reserves again).
    pub fn trim(&mut self) {
        self.rbuf = Vec::new();
        self.buf.shrink_to_fit();
    }

    /// Take the stream and unconsumed input apart (for a hand-off).
    pub fn into_parts(self) -> (S, Vec<u8>) {
        (self.stream, self.buf)
    }

    /// Read once, appending; returns bytes read (0 = EOF).
    pub async fn fill(&mut self) -> io::Result<usize> {
        if S::NEEDS_INIT {
            let (stream, buf) = (&mut self.stream, &mut self.buf);
            return futures::future::poll_fn(|cx| {
                let mut scratch = take_scratch();
                let res = stream.poll_read_init(cx, &mut scratch);
                if let std::task::Poll::Ready(Ok(n)) = &res {
                    buf.extend_from_slice(scratch.get(..*n).unwrap_or(&[]));
                }
                give_scratch(scratch);
                res
            })
            .await;
        }
        let mut rbuf = std::mem::take(&mut self.rbuf);
        rbuf.clear();
        if rbuf.capacity() < READ_RESERVE {
            rbuf.reserve(READ_RESERVE);
        }
        let (res, rbuf) = self.stream.read_owned(rbuf).await;
        if self.buf.is_empty() && self.buf.capacity() <= rbuf.capacity() {
            // Common case: swap instead of copying (not when `buf` was
            // sized for a whole body: that room stays where it is needed).
            self.rbuf = std::mem::replace(&mut self.buf, rbuf);
        } else {
            self.buf.extend_from_slice(&rbuf);
            self.rbuf = rbuf;
        }
        res
    }

    /// Write all of `data`.
    pub async fn write_all(&mut self, data: Vec<u8>) -> io::Result<()> {
        self.stream.write_owned(data).await
    }

    /// Drop the first `n` buffered bytes.
    pub fn consume(&mut self, n: usize) {
        let n = n.min(self.buf.len());
        self.buf.drain(..n);
    }

    /// Read a request head (server side), consuming its bytes.
    pub async fn read_request_head(&mut self) -> Result<RequestHead, HeadRead> {
        let (h, n) = self.peek_request_head().await?;
        self.consume(n);
        Ok(h)
    }

    /// Read a request head, leaving its `n` bytes in the buffer.
    pub async fn peek_request_head(&mut self) -> Result<(RequestHead, usize), HeadRead> {
        loop {
            match http_parse::parse_request_head(&self.buf) {
                Ok(Some(hn)) => return Ok(hn),
                Ok(None) => {}
                Err(e) => return Err(HeadRead::Bad(e)),
            }
            match self.fill().await {
                Ok(0) | Err(_) => return Err(HeadRead::Closed),
                Ok(_) => {}
            }
        }
    }

    /// Read a request head the router forwarded (the agent's side: the
    /// router's own headers come on top of the client's limit).
    pub async fn read_forwarded_request_head(&mut self) -> Result<RequestHead, HeadRead> {
        self.read_head_with(http_parse::parse_forwarded_request_head)
            .await
    }

    async fn read_head_with(
        &mut self,
        parse: fn(&[u8]) -> http_parse::RequestParse,
    ) -> Result<RequestHead, HeadRead> {
        loop {
            match parse(&self.buf) {
                Ok(Some((h, n))) => {
                    self.consume(n);
                    return Ok(h);
                }
                Ok(None) => {}
                Err(e) => return Err(HeadRead::Bad(e)),
            }
            match self.fill().await {
                Ok(0) | Err(_) => return Err(HeadRead::Closed),
                Ok(_) => {}
            }
        }
    }

    /// Read a response head (client side of an HTTP exchange).
    pub async fn read_response_head(&mut self) -> io::Result<ResponseHead> {
        loop {
            match http_parse::parse_response_head(&self.buf) {
                Ok(Some((h, n))) => {
                    self.consume(n);
                    return Ok(h);
                }
                Ok(None) => {}
                Err(e) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("bad response head: {e}"),
                    ))
                }
            }
            if self.fill().await? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "closed before the response head",
                ));
            }
        }
    }

    /// Read one control-stream frame (`Ok(None)` on a clean EOF).
    pub async fn read_frame(&mut self) -> io::Result<Option<ControlMsg>> {
        loop {
            match control::decode(&self.buf) {
                Ok(Some((m, n))) => {
                    self.consume(n);
                    return Ok(Some(m));
                }
                Ok(None) => {}
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string())),
            }
            if self.fill().await? == 0 {
                return Ok(None);
            }
        }
    }

    /// Read a request body under `limit` and `deadline`. `Err(Some(e))`: answer
    /// `e` and close; `Err(None)`: the client left.
    pub async fn read_request_body(
        &mut self,
        framing: BodyFraming,
        limit: u64,
        deadline: std::time::Duration,
        permit: &mut BodyPermit,
    ) -> Result<Vec<u8>, Option<ApiError>> {
        if framing == BodyFraming::UntilClose {
            let e = ApiError::new(ErrorCode::RequestInvalid, "failed to read request body");
            return Err(Some(e));
        }
        match monoio::time::timeout(
            deadline,
            self.read_body_within(framing, limit, Some(permit)),
        )
        .await
        {
            Ok(Ok(b)) => Ok(b),
            Ok(Err(BodyError::OverBudget)) => Err(Some(over_budget())),
            Ok(Err(BodyError::TooLarge)) => Err(Some(ApiError::body_too_large(limit))),
            Ok(Err(BodyError::Bad(_))) => Err(Some(ApiError::new(
                ErrorCode::RequestInvalid,
                "failed to read request body",
            ))),
            Ok(Err(BodyError::Closed(_))) => Err(None),
            Err(_) => Err(Some(ApiError::new(
                ErrorCode::ClientTimeout,
                "request body deadline exceeded",
            ))),
        }
    }

    /// Read a whole body with the given framing, up to `limit` bytes (0 = no limit).
    pub async fn read_body(&mut self, framing: BodyFraming, limit: u64) -> io::Result<Vec<u8>> {
        self.read_body_checked(framing, limit)
            .await
            .map_err(io::Error::from)
    }

    /// [`Conn::read_body`] with the reason kept apart.
    pub async fn read_body_checked(
        &mut self,
        framing: BodyFraming,
        limit: u64,
    ) -> Result<Vec<u8>, BodyError> {
        self.read_body_within(framing, limit, None).await
    }

    /// Read a body, holding its bytes under `permit` (grown before a
    /// declared length is read, and as a chunked body grows).
    async fn read_body_within(
        &mut self,
        framing: BodyFraming,
        limit: u64,
        mut permit: Option<&mut BodyPermit>,
    ) -> Result<Vec<u8>, BodyError> {
        let closed = |what: &str| {
            BodyError::Closed(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                what.to_string(),
            ))
        };
        match framing {
            BodyFraming::None => Ok(Vec::new()),
            BodyFraming::Length(n) => {
                if limit > 0 && n > limit {
                    return Err(BodyError::TooLarge);
                }
                if let Some(p) = permit.as_deref_mut() {
                    if !p.grow_to(n) {
                        return Err(BodyError::OverBudget);
                    }
                }
                let n = usize::try_from(n).map_err(|_| BodyError::TooLarge)?;
                // Exactly the declared size: no doubling past the budget.
                self.buf.reserve_exact(n.saturating_sub(self.buf.len()));
                while self.buf.len() < n {
                    match self.fill().await {
                        Ok(0) => return Err(closed("body truncated")),
                        Ok(_) => {}
                        Err(e) => return Err(BodyError::Closed(e)),
                    }
                }
                let mut body = super::bufpool::take(n);
                body.extend_from_slice(self.buf.get(..n).unwrap_or(&[]));
                self.consume(n);
                Ok(body)
            }
            BodyFraming::Chunked => {
                let mut dec = ChunkedDecoder::new();
                let mut out = Vec::new();
                loop {
                    match dec.decode(&self.buf, &mut out, limit) {
                        Ok(used) => self.consume(used),
                        Err(ChunkError::TooLarge) => return Err(BodyError::TooLarge),
                        Err(e) => return Err(BodyError::Bad(e.to_string())),
                    }
                    if let Some(p) = permit.as_deref_mut() {
                        // What is buffered, decoded or not, counts.
                        if !p.grow_to((out.len() + self.buf.len()) as u64) {
                            return Err(BodyError::OverBudget);
                        }
                    }
                    if dec.is_done() {
                        return Ok(out);
                    }
                    match self.fill().await {
                        Ok(0) => return Err(closed("chunked body truncated")),
                        Ok(_) => {}
                        Err(e) => return Err(BodyError::Closed(e)),
                    }
                }
            }
            BodyFraming::UntilClose => loop {
                if limit > 0 && self.buf.len() as u64 > limit {
                    return Err(BodyError::TooLarge);
                }
                match self.fill().await {
                    Ok(0) => return Ok(std::mem::take(&mut self.buf)),
                    Ok(_) => {}
                    Err(e) => return Err(BodyError::Closed(e)),
                }
            },
        }
    }
}
