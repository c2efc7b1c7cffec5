//! The link's stream multiplexer: yamux on the wire
//! ([`crate::logic::link::mux_frame`]), built for one thread.
//!
//! Why not the `yamux` crate: it is built for multi-threaded runtimes.
//! Every write became a heap frame sent over a channel to the connection
//! task, every stream had its own channel and `Arc<Mutex>`, the
//! connection polled its streams through a `FuturesUnordered`, and its
//! round-trip pinger read the clock about ten times per request. In the
//! profiles of issue 14 that was 6-8 % of router and agent CPU and about
//! eleven heap allocations per proxied request on each side. Here a
//! stream's write appends its frame to one buffer the link's driver
//! writes out once per wake, and a read copies straight out of the
//! stream's receive buffer. Both sides of a link are ours, and a test
//! runs this implementation against the `yamux` crate to keep the wire
//! the same.
//!
//! Key items: [`Connection`] (owned by the link's driver task:
//! [`Connection::poll_drive`] moves bytes), [`Inbound`] (the streams the
//! peer opens),
//! [`Opener`] (opens streams without a round trip through the driver),
//! [`Stream`] (futures-io; dropping it resets or closes the stream).

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use futures::io::{AsyncRead, AsyncWrite};

use crate::logic::link::mux_frame::{
    self, FrameError, Header, Kind, RecvWindow, ACK, FIN, GO_AWAY_NORMAL, GO_AWAY_PROTOCOL,
    HEADER_LEN, INITIAL_WINDOW, MAX_SEND_FRAME, RST, SYN,
};

use super::link::adapter::BoxIo;

mod stream;
pub use stream::{Inbound, Opener, Stream};

/// Closing frames (12 bytes each) held for other traffic at most.
const MAX_LAZY: usize = 64 * 12;
/// Past this many queued bytes a stream's write waits for the driver.
const OUT_HIGH_WATER: usize = 1024 * 1024;
/// One read from the secured socket asks for up to this much: one
/// largest send frame. Reads from noise copy out of its decrypted frame
/// (no system call), so a smaller chunk costs copies, not calls; every
/// link holds this buffer, idle or not (64 KiB made a thousand idle
/// links cost 64 MiB).
const READ_CHUNK: usize = 16 * 1024;

/// Stream IDs are handed out in order; hashing them is wasted work.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }
    fn write_u32(&mut self, n: u32) {
        // Spread into the high bits too: the table's control bytes are
        // taken from them.
        self.0 = u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type Slots = HashMap<u32, Slot, BuildHasherDefault<IdHasher>>;

/// What the first frame of a stream from this side must carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum First {
    /// Outbound, nothing sent yet: the peer learns of it from our SYN.
    Syn,
    /// Inbound, nothing sent yet: our first frame acknowledges it.
    Ack,
    /// Something was sent.
    Sent,
}

/// One stream's state, kept while its [`Stream`] handle lives.
struct Slot {
    recv: Vec<u8>,
    rpos: usize,
    window: RecvWindow,
    /// Bytes we may still send.
    credit: u32,
    reader: Option<Waker>,
    writer: Option<Waker>,
    first: First,
    local_fin: bool,
    remote_fin: bool,
    reset: bool,
}

impl Slot {
    fn new(first: First) -> Self {
        Slot {
            recv: Vec::new(),
            rpos: 0,
            window: RecvWindow::default(),
            credit: INITIAL_WINDOW,
            reader: None,
            writer: None,
            first,
            local_fin: false,
            remote_fin: false,
            reset: false,
        }
    }

    /// The flag the next frame must carry, and it is spent.
    fn take_first(&mut self) -> u16 {
        let f = match self.first {
            First::Syn => SYN,
            First::Ack => ACK,
            First::Sent => 0,
        };
        self.first = First::Sent;
        f
    }

    fn wake_all(&mut self) {
        if let Some(w) = self.reader.take() {
            w.wake();
        }
        if let Some(w) = self.writer.take() {
            w.wake();
        }
    }
}

/// State shared by the driver, the openers and the streams of one link.
struct Shared {
    client: bool,
    next_id: u32,
    streams: Slots,
    /// Frames waiting for the driver.
    out: Vec<u8>,
    /// Closing frames of quietly dropped streams: sent with the next
    /// frames in `out`, never on their own (see [`Stream::drop_quietly`]).
    lazy: Vec<u8>,
    driver: Option<Waker>,
    /// Streams waiting for `out` to drain below the high-water mark.
    blocked: Vec<Waker>,
    /// Inbound streams not yet taken through [`Inbound`].
    accepted: VecDeque<Stream>,
    acceptor: Option<Waker>,
    /// The [`Inbound`] is gone: streams the peer opens are refused.
    refusing: bool,
    max_inbound: usize,
    inbound: usize,
    /// No new frames: the session ended (or is ending).
    closed: bool,
    /// An [`Opener`] asked for the link to close.
    close_requested: bool,
}

impl Shared {
    fn new(mode: Mode, max_inbound: usize) -> Self {
        let client = mode == Mode::Client;
        Shared {
            client,
            next_id: if client { 1 } else { 2 },
            streams: Slots::default(),
            out: Vec::new(),
            lazy: Vec::new(),
            driver: None,
            blocked: Vec::new(),
            accepted: VecDeque::new(),
            acceptor: None,
            refusing: false,
            max_inbound,
            inbound: 0,
            closed: false,
            close_requested: false,
        }
    }

    fn push(&mut self, h: Header, body: &[u8]) {
        self.out.extend_from_slice(&h.encode());
        self.out.extend_from_slice(body);
    }

    fn wake_driver(&self) {
        if let Some(w) = &self.driver {
            w.wake_by_ref();
        }
    }

    fn end(&mut self) {
        self.closed = true;
        if let Some(w) = self.acceptor.take() {
            w.wake();
        }
        for s in self.streams.values_mut() {
            s.wake_all();
        }
        for w in self.blocked.drain(..) {
            w.wake();
        }
    }
}

type Rcs = Rc<RefCell<Shared>>;

/// The driver's end of a link: reads and writes the secured socket.
pub struct Connection {
    io: BoxIo,
    shared: Rcs,
    rbuf: Vec<u8>,
    rstart: usize,
    rend: usize,
    /// The data frame whose body is being read.
    body: Option<Body>,
    /// Frames being written to `io`, from `wpos`.
    wbuf: Vec<u8>,
    wpos: usize,
    /// `io` has bytes written since its last flush.
    unflushed: bool,
    goaway_sent: bool,
    /// The peer broke the protocol: said in a go-away, then returned.
    failed: Option<FrameError>,
}

/// A data frame body in the making.
#[derive(Debug, Clone, Copy)]
struct Body {
    stream: u32,
    remaining: u32,
    /// Delivered to the stream (false: dropped).
    kept: bool,
    /// The frame carries FIN, applied once its last byte is in.
    fin: bool,
}

impl Body {
    fn dropped(stream: u32, len: u32) -> Self {
        Body {
            stream,
            remaining: len,
            kept: false,
            fin: false,
        }
    }
}

/// Which end of the link this is (yamux: the dialer is the client).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The agent (opens odd streams).
    Client,
    /// The router (opens even streams).
    Server,
}

fn closed_err() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "link closed")
}

impl Connection {
    /// Multiplex `io`. At most `max_inbound` peer-opened streams live at
    /// once; more are reset (the session stays up).
    pub fn new(io: BoxIo, mode: Mode, max_inbound: usize) -> Self {
        let shared = Shared::new(mode, max_inbound);
        Connection {
            io,
            shared: Rc::new(RefCell::new(shared)),
            rbuf: vec![0; READ_CHUNK],
            rstart: 0,
            rend: 0,
            body: None,
            wbuf: Vec::new(),
            wpos: 0,
            unflushed: false,
            goaway_sent: false,
            failed: None,
        }
    }

    /// The streams the peer opens.
    pub fn inbound(&self) -> Inbound {
        Inbound {
            shared: self.shared.clone(),
        }
    }

    /// A handle that opens streams on this link.
    pub fn opener(&self) -> Opener {
        Opener {
            shared: self.shared.clone(),
        }
    }

    /// Move bytes both ways. Ready when the session ended: `Ok` when
    /// either side closed it, the error otherwise. Pending when there is
    /// nothing to do until the socket or a stream wakes the driver.
    pub fn poll_drive(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        {
            let mut sh = self.shared.borrow_mut();
            match &sh.driver {
                Some(w) if w.will_wake(cx.waker()) => {}
                _ => sh.driver = Some(cx.waker().clone()),
            }
        }
        loop {
            let close = {
                let sh = self.shared.borrow();
                sh.close_requested && !self.goaway_sent
            };
            if close {
                self.goaway(GO_AWAY_NORMAL);
            }
            if let Poll::Ready(Err(e)) = self.poll_write_out(cx) {
                self.shared.borrow_mut().end();
                return Poll::Ready(Err(e));
            }
            if self.goaway_sent {
                // Everything queued, the go-away included, goes out before
                // the socket closes.
                if !self.wbuf.is_empty() || !self.shared.borrow().out.is_empty() {
                    return Poll::Pending;
                }
                return match Pin::new(&mut self.io).poll_close(cx) {
                    Poll::Ready(r) => {
                        self.shared.borrow_mut().end();
                        Poll::Ready(match self.failed {
                            Some(e) => {
                                Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
                            }
                            None => r,
                        })
                    }
                    Poll::Pending => Poll::Pending,
                };
            }
            if self.shared.borrow().closed {
                return Poll::Ready(Ok(()));
            }
            if self.rstart == self.rend {
                self.rstart = 0;
                self.rend = 0;
            } else if self.rbuf.len() - self.rend < HEADER_LEN {
                self.rbuf.copy_within(self.rstart..self.rend, 0);
                self.rend -= self.rstart;
                self.rstart = 0;
            }
            let Some(room) = self.rbuf.get_mut(self.rend..) else {
                return Poll::Ready(Err(closed_err()));
            };
            match Pin::new(&mut self.io).poll_read(cx, room) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0)) => {
                    self.shared.borrow_mut().end();
                    return Poll::Ready(Ok(()));
                }
                Poll::Ready(Ok(n)) => {
                    self.rend += n;
                    if let Err(e) = self.parse() {
                        // No more frames in; the go-away goes out, then
                        // the session ends with the error.
                        self.shared.borrow_mut().end();
                        self.failed = Some(e);
                        self.goaway(GO_AWAY_PROTOCOL);
                    }
                }
                Poll::Ready(Err(e)) => {
                    self.shared.borrow_mut().end();
                    return Poll::Ready(Err(e));
                }
            }
        }
    }

    fn goaway(&mut self, code: u32) {
        let mut sh = self.shared.borrow_mut();
        sh.push(
            Header {
                kind: Kind::GoAway,
                flags: 0,
                stream: 0,
                len: code,
            },
            &[],
        );
        drop(sh);
        self.goaway_sent = true;
    }

    /// Write queued frames into the secured socket and flush it once.
    fn poll_write_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            if self.wpos == self.wbuf.len() {
                self.wbuf.clear();
                self.wpos = 0;
                let mut sh = self.shared.borrow_mut();
                if sh.out.is_empty() {
                    break;
                }
                std::mem::swap(&mut self.wbuf, &mut sh.out);
                // Closing frames of quietly dropped streams ride along.
                if !sh.lazy.is_empty() {
                    self.wbuf.extend_from_slice(&sh.lazy);
                    sh.lazy.clear();
                }
                for w in sh.blocked.drain(..) {
                    w.wake();
                }
            }
            let rest = self.wbuf.get(self.wpos..).unwrap_or(&[]);
            match Pin::new(&mut self.io).poll_write(cx, rest) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => {
                    self.wpos += n;
                    self.unflushed = true;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        if self.unflushed {
            match Pin::new(&mut self.io).poll_flush(cx) {
                Poll::Ready(Ok(())) => self.unflushed = false,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Handle every whole header and every body byte read so far.
    fn parse(&mut self) -> Result<(), FrameError> {
        let mut sh = self.shared.borrow_mut();
        loop {
            if let Some(b) = self.body {
                let avail = self.rend - self.rstart;
                if avail == 0 {
                    return Ok(());
                }
                let k = (b.remaining as usize).min(avail);
                let slot = sh.streams.get_mut(&b.stream);
                if let (true, Some(slot), Some(bytes)) =
                    (b.kept, slot, self.rbuf.get(self.rstart..self.rstart + k))
                {
                    if slot.rpos == slot.recv.len() {
                        slot.recv.clear();
                        slot.rpos = 0;
                    }
                    if slot.recv.capacity() == 0 {
                        // Finished streams' buffers come back through the
                        // thread's pool (`release`).
                        slot.recv = super::bufpool::take(k);
                    }
                    slot.recv.extend_from_slice(bytes);
                    if let Some(w) = slot.reader.take() {
                        w.wake();
                    }
                }
                self.rstart += k;
                let remaining = b.remaining - k as u32;
                if remaining > 0 {
                    self.body = Some(Body { remaining, ..b });
                    return Ok(());
                }
                self.body = None;
                if b.fin {
                    if let Some(slot) = sh.streams.get_mut(&b.stream) {
                        slot.remote_fin = true;
                        if let Some(w) = slot.reader.take() {
                            w.wake();
                        }
                    }
                }
                continue;
            }
            if self.rend - self.rstart < HEADER_LEN {
                return Ok(());
            }
            let Some(raw) = self
                .rbuf
                .get(self.rstart..self.rstart + HEADER_LEN)
                .and_then(|b| <&[u8; HEADER_LEN]>::try_from(b).ok())
            else {
                return Ok(());
            };
            let h = Header::decode(raw)?;
            self.rstart += HEADER_LEN;
            on_header(&mut sh, &h, &mut self.body);
        }
    }
}

/// A ping (answered) or a go-away (the session ends).
fn on_session_frame(sh: &mut Shared, h: &Header) {
    if h.kind == Kind::GoAway {
        return sh.end();
    }
    if h.has(SYN) {
        let pong = Header {
            kind: Kind::Ping,
            flags: ACK,
            stream: 0,
            len: h.len,
        };
        sh.push(pong, &[]);
        sh.wake_driver();
    }
}

/// A stream the peer opens: queued for [`Inbound`], or refused alone
/// (reset; the session stays up) when the peer may not open it or too
/// many are open. Returns whether it was accepted.
fn accept_syn(sh: &mut Shared, h: &Header, body: &mut Option<Body>) -> bool {
    let id = h.stream;
    if !mux_frame::opened_by_peer(id, sh.client)
        || sh.inbound >= sh.max_inbound
        || sh.closed
        || sh.refusing
    {
        sh.push(Header::window_update(id, RST, 0), &[]);
        sh.wake_driver();
        if h.kind == Kind::Data && h.len > 0 {
            *body = Some(Body::dropped(id, h.len));
        }
        return false;
    }
    sh.inbound += 1;
    sh.streams.insert(id, Slot::new(First::Ack));
    sh.accepted.push_back(Stream {
        id,
        inbound: true,
        shared: None,
    });
    if let Some(w) = sh.acceptor.take() {
        w.wake();
    }
    true
}

/// Apply one frame header. A data frame's body follows through `body`.
fn on_header(sh: &mut Shared, h: &Header, body: &mut Option<Body>) {
    match h.kind {
        Kind::Ping | Kind::GoAway => return on_session_frame(sh, h),
        Kind::Data | Kind::WindowUpdate => {}
    }
    let id = h.stream;
    if h.has(SYN) && !sh.streams.contains_key(&id) && !accept_syn(sh, h, body) {
        return;
    }
    let Some(slot) = sh.streams.get_mut(&id) else {
        // A stream this side has let go of: its bytes are dropped.
        if h.kind == Kind::Data && h.len > 0 {
            *body = Some(Body::dropped(id, h.len));
        }
        return;
    };
    let mut reset_now = false;
    let mut fin_now = h.has(FIN);
    match h.kind {
        Kind::Data => {
            if h.len > 0 {
                let kept = !slot.reset && !slot.remote_fin && slot.window.on_data(h.len);
                if !kept && !slot.reset && !slot.remote_fin {
                    // More than it was granted: the stream is reset.
                    reset_now = true;
                }
                *body = Some(Body {
                    stream: id,
                    remaining: h.len,
                    kept,
                    fin: fin_now,
                });
                // The end of the stream comes after the body.
                fin_now = false;
            }
        }
        Kind::WindowUpdate => {
            slot.credit = slot.credit.saturating_add(h.len);
            if h.len > 0 {
                if let Some(w) = slot.writer.take() {
                    w.wake();
                }
            }
        }
        Kind::Ping | Kind::GoAway => {}
    }
    // ACK needs nothing: streams are usable before they are acknowledged.
    if fin_now {
        slot.remote_fin = true;
        if let Some(w) = slot.reader.take() {
            w.wake();
        }
    }
    if h.has(RST) {
        slot.reset = true;
        slot.wake_all();
    }
    if reset_now {
        slot.reset = true;
        slot.wake_all();
        sh.push(Header::window_update(id, RST, 0), &[]);
        sh.wake_driver();
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Streams still held see the end of the session.
        if let Ok(mut sh) = self.shared.try_borrow_mut() {
            sh.accepted.clear();
            sh.end();
        }
    }
}

#[cfg(test)]
mod tests;
