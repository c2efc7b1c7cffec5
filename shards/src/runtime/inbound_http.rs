//! An inbound `/http/1.1` request stream on the agent's side of a link:
//! the dialer's multistream-select prelude is read and checked here
//! ([`crate::logic::multistream`]), and the confirmation the listener owes
//! goes out in the same yamux frame as the first response bytes instead
//! of a frame of its own (the router then wakes once per response, not
//! twice).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::{AsyncRead, AsyncWrite};

use super::conn::Conn;
use super::link::HTTP_PROTOCOL;
use crate::logic::multistream::{self, Prelude};

/// The listener's confirmation of [`HTTP_PROTOCOL`] (checked against
/// [`multistream::confirmation`] in the tests).
pub const HTTP_CONFIRMATION: &[u8] = b"\x13/multistream/1.0.0\n\x0a/http/1.1\n";

/// Largest first write merged with the confirmation on the stack (yamux
/// frames carry at most 16 KiB anyway; more goes in the next frame).
const MERGE: usize = 4096;

/// A request stream whose confirmation is still owed.
pub struct InboundHttp {
    stream: yamux::Stream,
    /// What of the confirmation is not written yet.
    owed: &'static [u8],
}

/// Read the dialer's prelude on `s`. Returns the stream with the bytes
/// read past the prelude (the start of the request), or why not.
pub async fn accept(s: yamux::Stream) -> io::Result<Conn<InboundHttp>> {
    let mut conn = Conn::over(
        InboundHttp {
            stream: s,
            owed: HTTP_CONFIRMATION,
        },
        Vec::with_capacity(8192),
    );
    loop {
        match multistream::parse_prelude(&conn.buf, HTTP_PROTOCOL) {
            Prelude::Selected { consumed } => {
                conn.consume(consumed);
                return Ok(conn);
            }
            Prelude::Incomplete => {
                if conn.fill().await? == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "stream closed during protocol negotiation",
                    ));
                }
            }
            // The router dials only this protocol: anything else is not
            // ours to answer (a dropped stream resets it).
            Prelude::Refused => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "stream asks for another protocol",
                ))
            }
            Prelude::Invalid(why) => return Err(io::Error::new(io::ErrorKind::InvalidData, why)),
        }
    }
}

impl InboundHttp {
    /// Write what is owed of the confirmation on its own (before a flush
    /// or close with no response bytes to carry it).
    fn poll_owed(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.owed.is_empty() {
            match Pin::new(&mut self.stream).poll_write(cx, self.owed) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => self.owed = self.owed.get(n..).unwrap_or(&[]),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for InboundHttp {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for InboundHttp {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        while !this.owed.is_empty() {
            // The owed bytes and the start of `buf` in one write.
            let mut joined = [0u8; MERGE];
            let owed = this.owed.len();
            let take = buf.len().min(MERGE.saturating_sub(owed));
            let (head, tail) = joined.split_at_mut(owed);
            head.copy_from_slice(this.owed);
            let data = buf.get(..take).unwrap_or(&[]);
            if let Some(t) = tail.get_mut(..take) {
                t.copy_from_slice(data);
            }
            let all = joined.get(..owed + take).unwrap_or(&[]);
            match Pin::new(&mut this.stream).poll_write(cx, all) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) if n >= owed => {
                    this.owed = &[];
                    if n > owed {
                        return Poll::Ready(Ok(n - owed));
                    }
                }
                Poll::Ready(Ok(n)) => this.owed = this.owed.get(n..).unwrap_or(&[]),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_constant_confirmation_matches_the_encoder() {
        assert_eq!(
            HTTP_CONFIRMATION,
            multistream::confirmation(HTTP_PROTOCOL).as_slice()
        );
    }
}
