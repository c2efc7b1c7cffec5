//! A buffered monoio TCP connection: owned-buffer reads appended to a
//! growing buffer, whole-buffer writes. Used by the client ingress, the
//! metrics listener, the agent's backend client and the simulator.

use std::io;

use monoio::buf::IoBufMut;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;

use crate::logic::http_parse::{
    self, BodyFraming, ChunkedDecoder, HeadError, RequestHead, ResponseHead,
};

/// Why no request head could be read.
#[derive(Debug)]
pub enum HeadRead {
    /// The peer closed (or the socket failed) before a complete head.
    Closed,
    /// The head broke a framing rule.
    Bad(HeadError),
}

/// Read chunk reserved before each read.
const READ_RESERVE: usize = 16 * 1024;

/// A TCP stream plus the bytes read but not yet consumed.
pub struct Conn {
    /// The socket.
    pub stream: TcpStream,
    /// Unconsumed input.
    pub buf: Vec<u8>,
    /// Spare read buffer: reads land here first so a read cancelled by a
    /// timeout never loses what `buf` already holds.
    rbuf: Vec<u8>,
    /// `X-Request-ID` of the request being answered (echoed on the response).
    pub request_id: String,
}

impl Conn {
    /// Wrap a stream (sets `TCP_NODELAY`).
    pub fn new(stream: TcpStream, buf: Vec<u8>) -> Self {
        let _ = stream.set_nodelay(true);
        Conn {
            stream,
            buf,
            rbuf: Vec::new(),
            request_id: String::new(),
        }
    }

    /// Take the socket and unconsumed input apart (for a hand-off).
    pub fn into_parts(self) -> (TcpStream, Vec<u8>) {
        (self.stream, self.buf)
    }

    /// Read once, appending; returns bytes read (0 = EOF).
    pub async fn fill(&mut self) -> io::Result<usize> {
        let mut rbuf = std::mem::take(&mut self.rbuf);
        rbuf.clear();
        if rbuf.capacity() < READ_RESERVE {
            rbuf.reserve(READ_RESERVE);
        }
        let cap = rbuf.capacity();
        let (res, slice) = self.stream.read(rbuf.slice_mut(0..cap)).await;
        let rbuf = slice.into_inner();
        if self.buf.is_empty() {
            // Common case: swap instead of copying.
            self.rbuf = std::mem::replace(&mut self.buf, rbuf);
        } else {
            self.buf.extend_from_slice(&rbuf);
            self.rbuf = rbuf;
        }
        res
    }

    /// Write all of `data`.
    pub async fn write_all(&mut self, data: Vec<u8>) -> io::Result<()> {
        let (res, _) = self.stream.write_all(data).await;
        res.map(|_| ())
    }

    /// Drop the first `n` buffered bytes.
    pub fn consume(&mut self, n: usize) {
        let n = n.min(self.buf.len());
        self.buf.drain(..n);
    }

    /// Read a request head (server side), consuming its bytes.
    pub async fn read_request_head(&mut self) -> Result<RequestHead, HeadRead> {
        loop {
            match http_parse::parse_request_head(&self.buf) {
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
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{e:?}"))),
            }
            if self.fill().await? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "closed before response head",
                ));
            }
        }
    }

    /// Read a whole body with the given framing, up to `limit` bytes (0 = no limit).
    pub async fn read_body(&mut self, framing: BodyFraming, limit: u64) -> io::Result<Vec<u8>> {
        match framing {
            BodyFraming::None => Ok(Vec::new()),
            BodyFraming::Length(n) => {
                if limit > 0 && n > limit {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "body too large"));
                }
                let n = usize::try_from(n)
                    .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "length"))?;
                while self.buf.len() < n {
                    if self.fill().await? == 0 {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "body truncated",
                        ));
                    }
                }
                let body = self.buf.get(..n).unwrap_or(&[]).to_vec();
                self.consume(n);
                Ok(body)
            }
            BodyFraming::Chunked => {
                let mut dec = ChunkedDecoder::new();
                let mut out = Vec::new();
                loop {
                    let used = dec.decode(&self.buf, &mut out, limit).map_err(|e| {
                        io::Error::new(io::ErrorKind::InvalidData, format!("chunked: {e:?}"))
                    })?;
                    self.consume(used);
                    if dec.is_done() {
                        return Ok(out);
                    }
                    if self.fill().await? == 0 {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "chunked body truncated",
                        ));
                    }
                }
            }
            BodyFraming::UntilClose => loop {
                if limit > 0 && self.buf.len() as u64 > limit {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "body too large"));
                }
                if self.fill().await? == 0 {
                    return Ok(std::mem::take(&mut self.buf));
                }
            },
        }
    }
}
