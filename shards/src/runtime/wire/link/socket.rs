//! The link's TCP socket under the pnet, noise and yamux layers.
//!
//! Reads and writes are the runtime's own operations (completions on
//! io_uring, readiness on epoll), not monoio's poll-io readiness shim,
//! which cost a `recvfrom` returning EAGAIN per read and an `epoll_wait`
//! per wake (issue 14: 13.6 system calls per proxied request).
//!
//! Writes are gathered: every frame yamux and noise write goes into one
//! buffer, and once the link's driver has done everything a wake brought
//! it, the buffer goes out in one send ([`Flusher`]). Before the driver
//! runs (the handshakes), a flush sends at once.
//!
//! Key types: [`LinkSocket`] (the futures-io stream), [`Flusher`] (the
//! driver's end).

use std::cell::RefCell;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use futures::io::{AsyncRead, AsyncWrite};
use monoio::io::{
    AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt, OwnedReadHalf, OwnedWriteHalf, Splitable,
};
use monoio::net::TcpStream;

/// A link's first reads ask for this much: an idle link (heartbeats,
/// signals) keeps only this buffer, so a thousand links cost 4 MiB here
/// instead of 64 (measured: 250 -> 129 KiB per registered link with the
/// mux's buffer, `perf/2026-12-03-registered-links`).
const READ_MIN: usize = 4 * 1024;
/// A read that fills its buffer doubles the next one, up to this (a yamux
/// data frame is at most 256 KiB; most reads are one response or a few
/// frames): a busy link reads in as few calls as before.
const READ_CAP: usize = 64 * 1024;
/// Past this many unsent bytes a write waits for the send in flight.
const HIGH_WATER: usize = 1024 * 1024;

type ReadDone = (io::Result<usize>, Vec<u8>, OwnedReadHalf<TcpStream>);
type WriteDone = (io::Result<()>, Vec<u8>, OwnedWriteHalf<TcpStream>);
type CloseOp = Pin<Box<dyn Future<Output = io::Result<()>>>>;

pin_project_lite::pin_project! {
    /// One kind of socket operation at a time, in a box allocated once per
    /// link and reused for every operation: boxing each read and send
    /// cost two heap allocations per proxied request on each side. The
    /// operation's future type cannot be named (monoio's `read`/`write_all`
    /// are `async`), so the slot keeps the function that makes it and is
    /// used through [`Reusable`].
    struct OpSlot<I, F> {
        make: fn(I, Vec<u8>) -> F,
        #[pin]
        op: Option<F>,
    }
}

/// An [`OpSlot`] with its future type erased.
trait Reusable<I, T> {
    /// Start the operation on `io` and `buf` (the slot must be idle).
    fn start(self: Pin<&mut Self>, io: I, buf: Vec<u8>);
    /// Poll the operation in flight; `None` when the slot is idle.
    fn poll_op(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>>;
    /// An operation is in flight.
    fn busy(&self) -> bool;
}

impl<I, T, F: Future<Output = T>> Reusable<I, T> for OpSlot<I, F> {
    fn start(self: Pin<&mut Self>, io: I, buf: Vec<u8>) {
        let mut this = self.project();
        let op = (this.make)(io, buf);
        this.op.set(Some(op));
    }

    fn poll_op(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut this = self.project();
        let Some(op) = this.op.as_mut().as_pin_mut() else {
            return Poll::Ready(None);
        };
        match op.poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(done) => {
                this.op.set(None);
                Poll::Ready(Some(done))
            }
        }
    }

    fn busy(&self) -> bool {
        self.op.is_some()
    }
}

type ReadSlot = Pin<Box<dyn Reusable<OwnedReadHalf<TcpStream>, ReadDone>>>;
type WriteSlot = Pin<Box<dyn Reusable<OwnedWriteHalf<TcpStream>, WriteDone>>>;

fn read_slot() -> ReadSlot {
    async fn read(mut half: OwnedReadHalf<TcpStream>, buf: Vec<u8>) -> ReadDone {
        let (res, buf) = half.read(buf).await;
        (res, buf, half)
    }
    Box::pin(OpSlot {
        make: read,
        op: None,
    })
}

fn write_slot() -> WriteSlot {
    async fn write(mut half: OwnedWriteHalf<TcpStream>, buf: Vec<u8>) -> WriteDone {
        let (res, buf) = half.write_all(buf).await;
        (res.map(|_| ()), buf, half)
    }
    Box::pin(OpSlot {
        make: write,
        op: None,
    })
}

enum Reading {
    Idle(OwnedReadHalf<TcpStream>),
    /// The read half is inside the slot's operation.
    Busy,
    Gone,
}

struct Writing {
    half: Option<OwnedWriteHalf<TcpStream>>,
    /// The send; busy while the write half is inside it.
    op: WriteSlot,
    close: Option<CloseOp>,
    /// Bytes written by the layers above, not yet handed to a send.
    pending: Vec<u8>,
    /// The buffer of the last finished send, reused.
    spare: Vec<u8>,
    /// The driver sends at the end of its wake; a flush only marks.
    deferred: bool,
}

impl Writing {
    /// Finish the send in flight and start one for what has gathered
    /// since; ready when everything written so far is sent.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            if self.op.busy() {
                let (res, mut buf, half) = match self.op.as_mut().poll_op(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Some(done)) => done,
                    Poll::Ready(None) => return Poll::Ready(Err(closed())),
                };
                self.half = Some(half);
                buf.clear();
                if buf.capacity() <= HIGH_WATER {
                    self.spare = buf;
                }
                res?;
            }
            if self.pending.is_empty() {
                return Poll::Ready(Ok(()));
            }
            let Some(half) = self.half.take() else {
                return Poll::Ready(Err(closed()));
            };
            let buf = std::mem::replace(&mut self.pending, std::mem::take(&mut self.spare));
            self.op.as_mut().start(half, buf);
        }
    }
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "link socket closed")
}

/// The link's socket as a futures-io stream (see the module doc).
pub struct LinkSocket {
    reading: Reading,
    read_op: ReadSlot,
    /// Read bytes not yet handed out, from `pos`.
    rbuf: Vec<u8>,
    /// The next read's size: [`READ_MIN`], doubled by full reads up to [`READ_CAP`].
    read_size: usize,
    pos: usize,
    eof: bool,
    writing: Rc<RefCell<Writing>>,
    fd: std::os::fd::RawFd,
}

impl Drop for LinkSocket {
    fn drop(&mut self) {
        // A read in flight keeps the descriptor open inside the runtime
        // until it completes (and forever when the runtime is going away
        // with it): end the connection now so the peer sees it.
        if matches!(self.reading, Reading::Busy) {
            // Open: the read half inside the operation still owns it.
            crate::runtime::wire::handoff::shut_down(self.fd);
        }
    }
}

/// The link driver's end of a [`LinkSocket`]: sends what the wake
/// gathered, once.
#[derive(Clone)]
pub struct Flusher(Rc<RefCell<Writing>>);

impl Flusher {
    /// From now on a flush only marks; [`Flusher::poll_send`] sends.
    pub fn defer(&self) {
        self.0.borrow_mut().deferred = true;
    }

    /// Send what was written (ready when all of it is out; pending wakes
    /// the caller when the send in flight ends).
    pub fn poll_send(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.0.borrow_mut().poll_send(cx)
    }
}

impl LinkSocket {
    /// Take over `stream`; also returns the driver's [`Flusher`].
    pub fn new(stream: TcpStream) -> (Self, Flusher) {
        use std::os::fd::AsRawFd;
        let fd = stream.as_raw_fd();
        let (r, w) = stream.into_split();
        let writing = Rc::new(RefCell::new(Writing {
            half: Some(w),
            op: write_slot(),
            close: None,
            pending: Vec::new(),
            spare: Vec::new(),
            deferred: false,
        }));
        let s = LinkSocket {
            reading: Reading::Idle(r),
            read_op: read_slot(),
            rbuf: Vec::new(),
            read_size: READ_MIN,
            pos: 0,
            eof: false,
            writing: writing.clone(),
            fd,
        };
        (s, Flusher(writing))
    }
}

impl AsyncRead for LinkSocket {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        loop {
            if this.pos < this.rbuf.len() {
                let have = this.rbuf.get(this.pos..).unwrap_or(&[]);
                let n = have.len().min(out.len());
                if let (Some(dst), Some(src)) = (out.get_mut(..n), have.get(..n)) {
                    dst.copy_from_slice(src);
                }
                this.pos += n;
                return Poll::Ready(Ok(n));
            }
            if this.eof || out.is_empty() {
                return Poll::Ready(Ok(0));
            }
            match std::mem::replace(&mut this.reading, Reading::Gone) {
                Reading::Idle(half) => {
                    let mut buf = std::mem::take(&mut this.rbuf);
                    buf.clear();
                    if buf.capacity() < this.read_size {
                        buf.reserve_exact(this.read_size);
                    }
                    this.read_op.as_mut().start(half, buf);
                    this.reading = Reading::Busy;
                }
                Reading::Busy => match this.read_op.as_mut().poll_op(cx) {
                    Poll::Pending => {
                        this.reading = Reading::Busy;
                        return Poll::Pending;
                    }
                    Poll::Ready(None) => return Poll::Ready(Err(closed())),
                    Poll::Ready(Some((res, buf, half))) => {
                        this.reading = Reading::Idle(half);
                        if buf.len() >= buf.capacity() && this.read_size < READ_CAP {
                            this.read_size = (buf.capacity() * 2).min(READ_CAP);
                        }
                        this.rbuf = buf;
                        this.pos = 0;
                        match res {
                            Ok(0) => this.eof = true,
                            Ok(_) => {}
                            Err(e) => return Poll::Ready(Err(e)),
                        }
                    }
                },
                Reading::Gone => return Poll::Ready(Err(closed())),
            }
        }
    }
}

impl AsyncWrite for LinkSocket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut w = self.writing.borrow_mut();
        if w.pending.len() >= HIGH_WATER {
            match w.poll_send(cx) {
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                _ if w.pending.len() >= HIGH_WATER => return Poll::Pending,
                _ => {}
            }
        }
        w.pending.extend_from_slice(data);
        Poll::Ready(Ok(data.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut w = self.writing.borrow_mut();
        if w.deferred {
            // Sent by the driver at the end of this wake.
            return Poll::Ready(Ok(()));
        }
        w.poll_send(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut w = self.writing.borrow_mut();
        if w.close.is_none() {
            match w.poll_send(cx) {
                Poll::Ready(Ok(())) => {}
                other => return other,
            }
            let Some(mut half) = w.half.take() else {
                return Poll::Ready(Ok(()));
            };
            w.close = Some(Box::pin(async move { half.shutdown().await }));
        }
        match w.close.as_mut() {
            Some(op) => op.as_mut().poll(cx),
            None => Poll::Ready(Ok(())),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::time::Duration;

    use futures::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::runtime::wire::executor::{run_on_runtime, DriverChoice};

    /// A connected pair: our end in the runtime, the peer a blocking std
    /// socket.
    async fn pair() -> (TcpStream, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let ours = TcpStream::connect(addr).await.expect("connect");
        let (peer, _) = l.accept().expect("accept");
        peer.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        (ours, peer)
    }

    fn both(f: fn() -> std::pin::Pin<Box<dyn Future<Output = ()>>>) {
        for d in [DriverChoice::Auto, DriverChoice::Epoll] {
            run_on_runtime(d, |_| f());
        }
    }

    #[test]
    fn deferred_writes_leave_in_one_send_when_the_driver_says() {
        both(|| {
            Box::pin(async {
                let (ours, mut peer) = pair().await;
                let (mut s, flusher) = LinkSocket::new(ours);
                flusher.defer();
                for part in [&b"frame-1;"[..], b"frame-2;", b"frame-3;"] {
                    s.write_all(part).await.expect("write");
                    s.flush().await.expect("flush");
                }
                // Nothing has left: the flushes only marked.
                peer.set_nonblocking(true).expect("nb");
                let mut buf = [0u8; 64];
                let early = peer.read(&mut buf);
                assert!(
                    matches!(&early, Err(e) if e.kind() == io::ErrorKind::WouldBlock),
                    "sent before the driver flushed: {early:?}"
                );
                peer.set_nonblocking(false).expect("blocking");
                futures::future::poll_fn(|cx| flusher.poll_send(cx))
                    .await
                    .expect("send");
                let mut got = Vec::new();
                while got.len() < 24 {
                    let n = peer.read(&mut buf).expect("read");
                    assert!(n > 0);
                    got.extend_from_slice(&buf[..n]);
                }
                assert_eq!(&got, b"frame-1;frame-2;frame-3;");
            })
        });
    }

    #[test]
    fn a_flush_before_the_driver_sends_at_once_and_reads_cross_buffers() {
        both(|| {
            Box::pin(async {
                let (ours, mut peer) = pair().await;
                let (mut s, _flusher) = LinkSocket::new(ours);
                s.write_all(b"hello").await.expect("write");
                s.flush().await.expect("flush");
                let mut buf = [0u8; 5];
                peer.read_exact(&mut buf).expect("read");
                assert_eq!(&buf, b"hello");
                // More than one read buffer, then the end.
                let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
                let sent = data.clone();
                let w = std::thread::spawn(move || {
                    peer.write_all(&sent).expect("peer write");
                    drop(peer);
                });
                let mut got = vec![0u8; data.len()];
                s.read_exact(&mut got).await.expect("read_exact");
                assert_eq!(got, data);
                let mut rest = [0u8; 8];
                assert_eq!(s.read(&mut rest).await.expect("eof"), 0);
                w.join().expect("writer");
            })
        });
    }

    #[test]
    fn dropping_a_socket_with_a_read_in_flight_ends_the_connection() {
        both(|| {
            Box::pin(async {
                let (ours, mut peer) = pair().await;
                let (mut s, _flusher) = LinkSocket::new(ours);
                let mut buf = [0u8; 8];
                {
                    let read = s.read(&mut buf);
                    futures::pin_mut!(read);
                    let waited = futures::future::select(
                        read,
                        Box::pin(monoio::time::sleep(Duration::from_millis(20))),
                    )
                    .await;
                    assert!(matches!(waited, futures::future::Either::Right(_)));
                }
                drop(s);
                let mut end = [0u8; 8];
                assert_eq!(
                    peer.read(&mut end).expect("peer read"),
                    0,
                    "peer sees the end"
                );
            })
        });
    }
}
