//! The link stack's stream type and small futures-io adapters: a prefix
//! replay reader and a thread-bound `Send` wrapper (the socket itself is
//! [`super::socket::LinkSocket`]).
//!
//! Key types: [`Prefixed`], [`ThreadBound`], [`BoxIo`].

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::io::{AsyncRead, AsyncWrite};

/// Any byte stream usable by the link stack.
pub trait LinkIo: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> LinkIo for T {}

/// A boxed link stream (plain or behind the private-network cipher).
pub type BoxIo = Box<dyn LinkIo>;

/// Replays bytes already read (e.g. after the preamble) before reading on.
pub struct Prefixed<T> {
    prefix: Vec<u8>,
    pos: usize,
    inner: T,
}

impl<T> Prefixed<T> {
    /// Wrap `inner`, replaying `prefix` first.
    pub fn new(prefix: Vec<u8>, inner: T) -> Self {
        // An empty prefix may still hold a read buffer's room.
        let prefix = if prefix.is_empty() {
            Vec::new()
        } else {
            prefix
        };
        Prefixed {
            prefix,
            pos: 0,
            inner,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Prefixed<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        if self.pos < self.prefix.len() {
            let rest = self.prefix.get(self.pos..).unwrap_or(&[]);
            let n = rest.len().min(buf.len());
            if let (Some(dst), Some(src)) = (buf.get_mut(..n), rest.get(..n)) {
                dst.copy_from_slice(src);
            }
            self.pos += n;
            if self.pos >= self.prefix.len() {
                // Replayed: let the buffer go (it is often a whole read
                // buffer that would otherwise live as long as the link).
                self.prefix = Vec::new();
                self.pos = 0;
            }
            return Poll::Ready(Ok(n));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Prefixed<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_close(cx)
    }
}

/// Makes a thread-bound stream `Send` for libp2p's `Send` bounds. The
/// wrapper panics if touched off its thread; links never leave their shard.
pub struct ThreadBound<T>(pub send_wrapper::SendWrapper<T>);

impl<T> ThreadBound<T> {
    /// Wrap a stream on the current thread.
    pub fn new(inner: T) -> Self {
        ThreadBound(send_wrapper::SendWrapper::new(inner))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ThreadBound<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ThreadBound<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }
    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_close(cx)
    }
}
