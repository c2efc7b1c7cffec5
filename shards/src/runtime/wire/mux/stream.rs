//! The streams of a link: [`Opener`] (opens streams without a round trip
//! through the driver), [`Stream`] (futures-io; dropping it resets or
//! closes the stream) and [`Inbound`] (the streams the peer opens).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::io::{AsyncRead, AsyncWrite};

use super::*;

/// Opens streams on a link (cheap to clone; no I/O: the SYN goes out with
/// the stream's first frame).
#[derive(Clone)]
pub struct Opener {
    pub(super) shared: Rcs,
}

impl Opener {
    /// A new outbound stream, or an error when the link is closed.
    pub fn open(&self) -> io::Result<Stream> {
        let mut sh = self.shared.borrow_mut();
        if sh.closed || sh.close_requested {
            return Err(closed_err());
        }
        let id = sh.next_id;
        sh.next_id = id
            .checked_add(2)
            .ok_or_else(|| io::Error::other("stream IDs exhausted"))?;
        sh.streams.insert(id, Slot::new(First::Syn));
        Ok(Stream {
            id,
            inbound: false,
            shared: Some(self.shared.clone()),
        })
    }

    /// Ask the driver to end the session (go-away, then close).
    pub fn close(&self) {
        let mut sh = self.shared.borrow_mut();
        sh.close_requested = true;
        sh.wake_driver();
    }

    /// An opener with no link behind it (every open fails): for unit
    /// tests of the state that holds link handles.
    #[cfg(test)]
    pub(crate) fn detached() -> Self {
        let mut shared = Shared::new(Mode::Server, 0);
        shared.closed = true;
        Opener {
            shared: Rc::new(RefCell::new(shared)),
        }
    }
}

/// One stream of a link (futures-io). Dropping it before this side has
/// closed resets it (or closes it, when the peer already has), and the
/// frame goes out on the driver's next wake; [`Stream::drop_quietly`]
/// lets that frame wait for other traffic.
pub struct Stream {
    pub(super) id: u32,
    pub(super) inbound: bool,
    /// `None` only inside the accept queue (it would hold itself).
    pub(super) shared: Option<Rcs>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream({})", self.id)
    }
}

impl Stream {
    fn with<R>(&self, f: impl FnOnce(&mut Shared, u32) -> R) -> Option<R> {
        let rc = self.shared.as_ref()?;
        let mut sh = rc.borrow_mut();
        Some(f(&mut sh, self.id))
    }

    /// Let go of a finished stream without waking the driver: its closing
    /// frame (if one is owed) leaves with the next frame another stream
    /// sends, not with whatever else wakes the driver (a frame read in,
    /// such as the peer's own late FIN). For a response read to its end,
    /// the peer has nothing more to learn soon; sent at once, the frame
    /// woke the agent for nothing (one system call and one context switch
    /// per request, issue 14).
    pub fn drop_quietly(mut self) {
        self.release(false);
    }

    fn release(&mut self, wake: bool) {
        let Some(rc) = self.shared.take() else {
            return;
        };
        let mut sh = rc.borrow_mut();
        let Some(mut slot) = sh.streams.remove(&self.id) else {
            return;
        };
        super::super::bufpool::give(std::mem::take(&mut slot.recv));
        if self.inbound {
            sh.inbound = sh.inbound.saturating_sub(1);
        }
        if sh.closed || slot.reset || slot.first == First::Syn {
            // Nothing to tell: the session is gone, the stream was reset,
            // or the peer never heard of it.
            return;
        }
        let flags = match (slot.local_fin, slot.remote_fin) {
            // Both sides are done, or ours is and the peer's end is
            // coming (what it still sends is dropped, as yamux does).
            (true, _) => return,
            // The peer is done: close ours.
            (false, true) => FIN,
            // Let go mid-way: the reset is what stops the peer.
            (false, false) => RST,
        };
        let first = match slot.first {
            First::Ack => ACK,
            _ => 0,
        };
        let h = Header::window_update(self.id, flags | first, 0).encode();
        if wake {
            sh.out.extend_from_slice(&h);
            sh.wake_driver();
        } else {
            sh.lazy.extend_from_slice(&h);
            if sh.lazy.len() >= MAX_LAZY {
                // Quiet for long enough: they go with the next wake.
                let lazy = std::mem::take(&mut sh.lazy);
                sh.out.extend_from_slice(&lazy);
                sh.wake_driver();
            }
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.release(true);
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let r = self.with(|sh, id| {
            let closed = sh.closed;
            let Some(slot) = sh.streams.get_mut(&id) else {
                return Poll::Ready(Ok(0));
            };
            let avail = slot.recv.get(slot.rpos..).unwrap_or(&[]);
            if !avail.is_empty() {
                let n = avail.len().min(buf.len());
                if let (Some(dst), Some(src)) = (buf.get_mut(..n), avail.get(..n)) {
                    dst.copy_from_slice(src);
                }
                slot.rpos += n;
                if slot.rpos == slot.recv.len() {
                    slot.recv.clear();
                    slot.rpos = 0;
                }
                if let Some(grant) = slot.window.on_consumed(n as u32) {
                    if !slot.reset && !slot.remote_fin && !closed {
                        let flags = slot.take_first();
                        sh.push(Header::window_update(id, flags, grant), &[]);
                        sh.wake_driver();
                    }
                }
                return Poll::Ready(Ok(n));
            }
            if slot.remote_fin || slot.reset || closed {
                return Poll::Ready(Ok(0));
            }
            match &slot.reader {
                Some(w) if w.will_wake(cx.waker()) => {}
                _ => slot.reader = Some(cx.waker().clone()),
            }
            Poll::Pending
        });
        r.unwrap_or(Poll::Ready(Ok(0)))
    }
}

impl Stream {
    /// Write all of `prefix` and the start of `buf` in one frame; ready
    /// with how much of `buf` went (at least one byte when `buf` is not
    /// empty). For bytes owed before the caller's, without joining them
    /// in a buffer first.
    pub fn poll_write_prefixed(
        &mut self,
        cx: &mut Context<'_>,
        prefix: &[u8],
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = self.with(|sh, id| {
            if sh.closed {
                return Poll::Ready(Err(io::Error::from(io::ErrorKind::WriteZero)));
            }
            if sh.out.len() >= OUT_HIGH_WATER {
                sh.blocked.push(cx.waker().clone());
                sh.wake_driver();
                return Poll::Pending;
            }
            let Some(slot) = sh.streams.get_mut(&id) else {
                return Poll::Ready(Err(io::Error::from(io::ErrorKind::WriteZero)));
            };
            if slot.reset || slot.local_fin {
                return Poll::Ready(Err(io::Error::from(io::ErrorKind::WriteZero)));
            }
            if buf.is_empty() && prefix.is_empty() {
                return Poll::Ready(Ok(0));
            }
            // The prefix goes whole, with at least one byte of `buf`.
            let need = prefix.len() + usize::from(!buf.is_empty());
            if (slot.credit as usize) < need {
                slot.writer = Some(cx.waker().clone());
                return Poll::Pending;
            }
            let room = (slot.credit as usize).min(MAX_SEND_FRAME.max(need)) - prefix.len();
            let k = buf.len().min(room);
            let len = prefix.len() + k;
            slot.credit -= len as u32;
            let flags = slot.take_first();
            sh.push(Header::data(id, flags, len as u32), prefix);
            sh.out.extend_from_slice(buf.get(..k).unwrap_or(&[]));
            sh.wake_driver();
            Poll::Ready(Ok(k))
        });
        r.unwrap_or_else(|| Poll::Ready(Err(closed_err())))
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_prefixed(cx, &[], buf)
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Frames are queued whole; the driver flushes once per wake.
        Poll::Ready(Ok(()))
    }

    fn poll_close(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = self.with(|sh, id| {
            if sh.closed {
                return Poll::Ready(Ok(()));
            }
            let Some(slot) = sh.streams.get_mut(&id) else {
                return Poll::Ready(Ok(()));
            };
            if slot.local_fin || slot.reset {
                return Poll::Ready(Ok(()));
            }
            slot.local_fin = true;
            let flags = slot.take_first() | FIN;
            sh.push(Header::data(id, flags, 0), &[]);
            sh.wake_driver();
            Poll::Ready(Ok(()))
        });
        r.unwrap_or(Poll::Ready(Ok(())))
    }
}

/// The streams the peer opens, in order (a futures `Stream`; ends when
/// the session does). Once it is dropped, the peer's opens are refused
/// (reset), so a side that takes no streams holds none.
pub struct Inbound {
    pub(super) shared: Rcs,
}

impl Drop for Inbound {
    fn drop(&mut self) {
        let queued = {
            let mut sh = self.shared.borrow_mut();
            sh.refusing = true;
            std::mem::take(&mut sh.accepted)
        };
        // Reset what was queued (outside the borrow: each drop takes it).
        for mut s in queued {
            s.shared = Some(self.shared.clone());
            drop(s);
        }
    }
}

impl futures::Stream for Inbound {
    type Item = Stream;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Stream>> {
        let mut sh = self.shared.borrow_mut();
        if let Some(mut s) = sh.accepted.pop_front() {
            // Streams in the queue cannot hold the state that holds them.
            s.shared = Some(self.shared.clone());
            return Poll::Ready(Some(s));
        }
        if sh.closed {
            return Poll::Ready(None);
        }
        sh.acceptor = Some(cx.waker().clone());
        Poll::Pending
    }
}
