//! A `/http/1.1` request stream on a link, on either side: the
//! multistream-select lines ([`crate::logic::link::multistream`]) are read and
//! checked here, and the lines this side owes go out in the same yamux
//! frame as its first bytes instead of a frame of their own. The dialer
//! (the router) owes the header and protocol lines before its request;
//! the listener (the agent) owes the same two lines as its confirmation
//! before its response. The bytes on the wire are those of
//! `multistream-select` `V1Lazy`.
//!
//! Why not the crate on this path: its listener flushed the confirmation
//! as a frame of its own, so the router woke twice per response. Its
//! dialer and listener also cost about 7 and 15 heap allocations per
//! stream (issue 14).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::{AsyncRead, AsyncWrite};

use super::conn::{futures_io_transport, Conn};
use super::link::HTTP_PROTOCOL;
use super::mux;
use crate::logic::link::multistream::{self, Prelude};

/// The multistream-select lines for [`HTTP_PROTOCOL`]: what the dialer
/// sends first, and what the listener confirms with. They are the same
/// bytes, checked against [`multistream::confirmation`] in the tests.
pub const HTTP_LINES: &[u8] = b"\x13/multistream/1.0.0\n\x0a/http/1.1\n";

/// A request stream whose multistream-select lines are still owed.
pub struct HttpStream {
    stream: mux::Stream,
    /// What of [`HTTP_LINES`] is not written yet.
    owed: &'static [u8],
}

impl HttpStream {
    /// A stream that owes its lines (either side).
    pub fn new(stream: mux::Stream) -> Self {
        HttpStream {
            stream,
            owed: HTTP_LINES,
        }
    }

    /// The yamux stream (what is still owed is dropped with the wrapper).
    pub fn into_inner(self) -> mux::Stream {
        self.stream
    }
}

/// The agent's side: read the dialer's lines on `s`. Returns the stream
/// with the bytes read past them (the start of the request), or why not.
pub async fn accept(s: mux::Stream) -> io::Result<Conn<HttpStream>> {
    let mut conn = Conn::over(HttpStream::new(s), super::bufpool::take(8192));
    read_lines(&mut conn).await?;
    Ok(conn)
}

/// Read and drop the peer's multistream-select lines at the start of
/// `conn` (the dialer's request, or the listener's confirmation).
pub async fn read_lines(conn: &mut Conn<HttpStream>) -> io::Result<()> {
    loop {
        match multistream::parse_prelude(&conn.buf, HTTP_PROTOCOL) {
            Prelude::Selected { consumed } => {
                conn.consume(consumed);
                return Ok(());
            }
            Prelude::Incomplete => {
                if conn.fill().await? == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "stream closed during protocol negotiation",
                    ));
                }
            }
            // Only this protocol is spoken on request streams: a peer
            // that names another (or answers `na`) is not ours.
            Prelude::Refused => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "the peer did not select /http/1.1",
                ))
            }
            Prelude::Invalid(why) => return Err(io::Error::new(io::ErrorKind::InvalidData, why)),
        }
    }
}

impl HttpStream {
    /// Write what is owed of the lines on its own (before a flush or close
    /// with no bytes of ours to carry them).
    fn poll_owed(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.owed.is_empty() {
            // Whole, in one frame of its own.
            std::task::ready!(self.stream.poll_write_prefixed(cx, self.owed, &[]))?;
            self.owed = &[];
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for HttpStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for HttpStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if !this.owed.is_empty() {
            // The owed lines and the start of `buf` in one frame.
            return match this.stream.poll_write_prefixed(cx, this.owed, buf) {
                Poll::Ready(Ok(n)) => {
                    this.owed = &[];
                    Poll::Ready(Ok(n))
                }
                other => other,
            };
        }
        Pin::new(&mut this.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.poll_owed(cx))?;
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.poll_owed(cx))?;
        Pin::new(&mut self.stream).poll_close(cx)
    }
}

futures_io_transport!(HttpStream);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_constant_lines_match_the_encoder() {
        assert_eq!(
            HTTP_LINES,
            multistream::confirmation(HTTP_PROTOCOL).as_slice()
        );
    }
}
