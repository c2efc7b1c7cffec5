//! The agent link stack, without a libp2p `Swarm`:
//! monoio TCP ([`super::link_socket::LinkSocket`]: completion-based
//! reads, writes gathered and sent once per driver wake) -> thread-bound `Send` wrapper ->
//! optional pre-shared-key private network (`libp2p-pnet`) -> `noise`
//! (authenticates both PeerIds) -> `yamux` -> streams negotiated with
//! `multistream-select` (`V1Lazy`).
//!
//! Key items: [`accept`] (router side, after the preamble), [`dial`]
//! (agent side, sends the preamble), [`spawn_driver`] and [`LinkHandle`]
//! (the task that owns a yamux connection, keeps a spare outbound stream
//! and opens more on request), [`accept_protocol`] for the control stream
//! (request streams, on both sides, are [`super::http_stream`]: their
//! multistream-select lines go out with their first bytes),
//! [`write_frame`] for the control stream (frames are read through
//! [`super::conn::Conn::read_frame`]).

use std::cell::{Cell, RefCell};
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::rc::Rc;
use std::task::Poll;

use futures::channel::{mpsc, oneshot};
use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use libp2p_core::upgrade::{InboundConnectionUpgrade, OutboundConnectionUpgrade};
use libp2p_identity::{Keypair, PeerId};
use libp2p_pnet::{PnetConfig, PreSharedKey};
use monoio::io::AsyncWriteRentExt;

use super::io::{BoxIo, Prefixed, ThreadBound};
use super::link_socket::{Flusher, LinkSocket};
use crate::logic::control::{self, ControlMsg};
use crate::logic::preamble;

/// Protocol of request streams (one HTTP/1.1 exchange per stream).
pub const HTTP_PROTOCOL: &str = "/http/1.1";
/// Protocol of the single control stream.
pub const CONTROL_PROTOCOL: &str = "/hivenet/control/1.0.0";

/// A negotiated stream.
pub type LinkStream = multistream_select::Negotiated<yamux::Stream>;

/// Why a link could not be set up.
#[derive(Debug)]
pub enum LinkError {
    /// Socket error.
    Io(io::Error),
    /// Private-network handshake failed.
    Pnet(String),
    /// Noise handshake failed (wrong swarm key, wrong protocol, garbage).
    Noise(String),
}

impl std::fmt::Display for LinkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LinkError::Io(e) => write!(f, "i/o: {e}"),
            LinkError::Pnet(e) => write!(f, "private network handshake: {e}"),
            LinkError::Noise(e) => {
                write!(f, "noise handshake (wrong swarm key or not an agent?): {e}")
            }
        }
    }
}

impl From<io::Error> for LinkError {
    fn from(e: io::Error) -> Self {
        LinkError::Io(e)
    }
}

/// Streams a link accepts at once. yamux terminates the whole connection
/// when an inbound stream would exceed its limit (seen at 20k req/s with an
/// agent declaring capacity 100000: every request then failed), so the
/// router also caps an agent's capacity well below it ([`MAX_AGENT_CAPACITY`]).
pub const MAX_LINK_STREAMS: usize = 4096;

/// Largest capacity the router grants one agent (slots = concurrent streams).
pub const MAX_AGENT_CAPACITY: u32 = 1024;

fn yamux_config() -> yamux::Config {
    let mut c = yamux::Config::default();
    // 4096 x 256 KiB default credit = the default 1 GiB connection window.
    c.set_max_num_streams(MAX_LINK_STREAMS);
    c
}

/// Sent by both sides right after the private-network handshake: a peer
/// with another key decrypts garbage, so a mismatch is reported at once
/// ("wrong swarm key") instead of stalling noise until its timeout.
const PSK_CHECK: &[u8; 8] = b"HVNPSK01";

async fn secure(io: BoxIo, psk: Option<PreSharedKey>) -> Result<BoxIo, LinkError> {
    match psk {
        Some(k) => {
            let mut out = PnetConfig::new(k)
                .handshake(io)
                .await
                .map_err(|e| LinkError::Pnet(e.to_string()))?;
            out.write_all(PSK_CHECK).await?;
            out.flush().await?;
            let mut got = [0u8; 8];
            out.read_exact(&mut got).await?;
            if &got != PSK_CHECK {
                return Err(LinkError::Pnet(
                    "wrong swarm key (the peer holds another pre-shared key)".into(),
                ));
            }
            Ok(Box::new(out))
        }
        None => Ok(io),
    }
}

/// A handshaken link, ready for [`spawn_driver`].
pub struct Link {
    conn: yamux::Connection<BoxIo>,
    flusher: Flusher,
}

/// Router side: finish a link whose preamble has been read. `prefix` holds
/// bytes read past the preamble.
pub async fn accept(
    stream: monoio::net::TcpStream,
    prefix: Vec<u8>,
    psk: Option<PreSharedKey>,
    keypair: &Keypair,
) -> Result<(PeerId, Link), LinkError> {
    let _ = stream.set_nodelay(true);
    let (socket, flusher) = LinkSocket::new(stream);
    let io: BoxIo = Box::new(Prefixed::new(prefix, ThreadBound::new(socket)));
    let io = secure(io, psk).await?;
    let noise = libp2p_noise::Config::new(keypair).map_err(|e| LinkError::Noise(e.to_string()))?;
    let (peer, out) = noise
        .upgrade_inbound(io, "/noise")
        .await
        .map_err(|e| LinkError::Noise(e.to_string()))?;
    let io: BoxIo = Box::new(out);
    let conn = yamux::Connection::new(io, yamux_config(), yamux::Mode::Server);
    Ok((peer, Link { conn, flusher }))
}

/// Agent side: connect, send the preamble, handshake.
pub async fn dial(
    addr: SocketAddr,
    model: &str,
    psk: Option<PreSharedKey>,
    keypair: &Keypair,
) -> Result<(PeerId, Link), LinkError> {
    let stream = monoio::net::TcpStream::connect(addr).await?;
    let _ = stream.set_nodelay(true);
    let mut stream = stream;
    let (res, _) = stream.write_all(preamble::encode(model)).await;
    res?;
    let (socket, flusher) = LinkSocket::new(stream);
    let io: BoxIo = Box::new(ThreadBound::new(socket));
    let io = secure(io, psk).await?;
    let noise = libp2p_noise::Config::new(keypair).map_err(|e| LinkError::Noise(e.to_string()))?;
    let (peer, out) = noise
        .upgrade_outbound(io, "/noise")
        .await
        .map_err(|e| LinkError::Noise(e.to_string()))?;
    let io: BoxIo = Box::new(out);
    let conn = yamux::Connection::new(io, yamux_config(), yamux::Mode::Client);
    Ok((peer, Link { conn, flusher }))
}

type OpenReply = oneshot::Sender<Result<yamux::Stream, io::Error>>;

/// What a [`LinkHandle`] asks of the link's driver.
enum Command {
    /// Open an outbound stream.
    Open(OpenReply),
    /// Close the connection now (an agent removed for silence).
    Close,
}

/// Opens streams on a link driven by [`spawn_driver`]. Dropping every
/// handle, or [`LinkHandle::close`], closes the link.
#[derive(Clone)]
pub struct LinkHandle {
    tx: mpsc::UnboundedSender<Command>,
    /// An outbound stream the driver opened ahead of need (yamux sends
    /// nothing for it until its first write). Taking it saves the round
    /// trip through the driver task per request, and with it the extra
    /// task hops that made the runtime enter the kernel once more before
    /// the request went out (issue 14).
    spare: Rc<Cell<Option<yamux::Stream>>>,
    /// Finished request streams kept until the next open on this link
    /// (see [`LinkHandle::retire`]).
    retired: Rc<RefCell<Vec<yamux::Stream>>>,
}

/// Most finished streams kept for a link before they are let go at once.
const MAX_RETIRED: usize = 64;

impl LinkHandle {
    /// Keep a finished stream until the next stream is opened on this
    /// link. Dropping it sends yamux's closing frame; sent at once, that
    /// frame reached the agent alone, after its response, and woke it
    /// for nothing (one system call and one context switch per request
    /// on the agent). Kept, it leaves with the next request. The agent
    /// does not wait for it: it has closed and forgotten the stream.
    pub fn retire(&self, s: yamux::Stream) {
        let full = {
            let mut r = self.retired.borrow_mut();
            r.push(s);
            if r.len() >= MAX_RETIRED {
                std::mem::take(&mut *r)
            } else {
                Vec::new()
            }
        };
        drop(full);
    }

    /// Open a raw yamux stream.
    pub async fn open_raw(&self) -> io::Result<yamux::Stream> {
        // Closing frames of finished streams go out with this one. The
        // list is emptied outside the borrow and its buffer kept.
        let mut gone = std::mem::take(&mut *self.retired.borrow_mut());
        gone.clear();
        {
            let mut r = self.retired.borrow_mut();
            if r.capacity() == 0 {
                *r = gone;
            }
        }
        // The driver opens the next spare when this one's first frame
        // wakes it (no command, no extra wake).
        if let Some(s) = self.spare.take() {
            return Ok(s);
        }
        let (tx, rx) = oneshot::channel();
        self.tx
            .unbounded_send(Command::Open(tx))
            .map_err(|_| io::Error::new(io::ErrorKind::ConnectionAborted, "link closed"))?;
        rx.await
            .map_err(|_| io::Error::new(io::ErrorKind::ConnectionAborted, "link closed"))?
    }

    /// Open a stream and select `protocol` lazily (0-RTT).
    pub async fn open(&self, protocol: &'static str) -> io::Result<LinkStream> {
        let s = self.open_raw().await?;
        multistream_select::dialer_select_proto(s, [protocol], multistream_select::Version::V1Lazy)
            .await
            .map(|(_, n)| n)
            .map_err(|e| io::Error::new(io::ErrorKind::ConnectionAborted, e.to_string()))
    }

    /// Close the link even while other handles exist.
    pub fn close(&self) {
        let _ = self.tx.unbounded_send(Command::Close);
    }

    /// A handle with no link behind it (every open fails): for unit tests
    /// of the state that holds handles.
    #[cfg(test)]
    pub fn detached() -> Self {
        let (tx, _rx) = mpsc::unbounded();
        LinkHandle {
            tx,
            spare: Rc::default(),
            retired: Rc::default(),
        }
    }
}

/// Spawn the task that owns `conn` on the current shard. Returns a handle
/// to open streams, the inbound streams, and a receiver that completes
/// when the connection ends.
pub fn spawn_driver(
    link: Link,
) -> (
    LinkHandle,
    mpsc::UnboundedReceiver<yamux::Stream>,
    oneshot::Receiver<()>,
) {
    let (cmd_tx, cmd_rx) = mpsc::unbounded::<Command>();
    let (in_tx, in_rx) = mpsc::unbounded();
    let (done_tx, done_rx) = oneshot::channel::<()>();
    link.flusher.defer();
    let spare: Rc<Cell<Option<yamux::Stream>>> = Rc::default();
    monoio::spawn(drive(
        link.conn,
        link.flusher,
        cmd_rx,
        in_tx,
        done_tx,
        spare.clone(),
    ));
    let handle = LinkHandle {
        tx: cmd_tx,
        spare,
        retired: Rc::default(),
    };
    (handle, in_rx, done_rx)
}

async fn drive(
    mut conn: yamux::Connection<BoxIo>,
    flusher: Flusher,
    mut cmd_rx: mpsc::UnboundedReceiver<Command>,
    in_tx: mpsc::UnboundedSender<yamux::Stream>,
    done: oneshot::Sender<()>,
    spare: Rc<Cell<Option<yamux::Stream>>>,
) {
    let mut pending: Option<OpenReply> = None;
    let mut closing = false;
    let _ = futures::future::poll_fn(|cx| {
        // A failed refill (too many streams, or the link failing) is
        // tried again on the next wake, not again in this one.
        let mut refill_failed = false;
        loop {
            let mut progressed = false;
            // Outbound opens, one at a time.
            if pending.is_none() && !closing {
                match cmd_rx.poll_next_unpin(cx) {
                    Poll::Ready(Some(Command::Open(r))) => pending = Some(r),
                    Poll::Ready(Some(Command::Close)) | Poll::Ready(None) => closing = true,
                    Poll::Pending => {}
                }
            }
            if !refill_failed && pending.is_none() && !closing && is_empty(&spare) {
                match conn.poll_new_outbound(cx) {
                    Poll::Ready(Ok(s)) => {
                        spare.set(Some(s));
                        progressed = true;
                    }
                    // The link is failing: the inbound poll below ends it.
                    Poll::Ready(Err(_)) => refill_failed = true,
                    Poll::Pending => {}
                }
            }
            if let Some(reply) = pending.take() {
                match conn.poll_new_outbound(cx) {
                    Poll::Ready(r) => {
                        let _ = reply.send(r.map_err(|e| {
                            io::Error::new(io::ErrorKind::ConnectionAborted, e.to_string())
                        }));
                        progressed = true;
                    }
                    Poll::Pending => pending = Some(reply),
                }
            }
            if closing {
                drop(spare.take());
                return match conn.poll_close(cx) {
                    Poll::Ready(_) => Poll::Ready(()),
                    Poll::Pending => Poll::Pending,
                };
            }
            // Inbound streams; this also drives all of the connection's I/O.
            match conn.poll_next_inbound(cx) {
                Poll::Ready(Some(Ok(s))) => {
                    let _ = in_tx.unbounded_send(s);
                    progressed = true;
                }
                Poll::Ready(Some(Err(_))) | Poll::Ready(None) => return Poll::Ready(()),
                Poll::Pending => {}
            }
            if !progressed {
                // Everything this wake wrote goes out in one send.
                return match flusher.poll_send(cx) {
                    Poll::Ready(Err(_)) => Poll::Ready(()),
                    _ => Poll::Pending,
                };
            }
        }
    })
    .await;
    drop(done);
}

/// Whether the spare slot is empty (a `Cell` cannot be looked into).
fn is_empty(spare: &Cell<Option<yamux::Stream>>) -> bool {
    let s = spare.take();
    let empty = s.is_none();
    spare.set(s);
    empty
}

/// Accept the protocol on an inbound stream.
pub async fn accept_protocol(
    s: yamux::Stream,
    protocols: &[&'static str],
) -> io::Result<(&'static str, LinkStream)> {
    multistream_select::listener_select_proto(s, protocols.iter().copied())
        .await
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
}

/// Write one control frame and flush.
pub async fn write_frame<W: futures::AsyncWrite + Unpin>(
    w: &mut W,
    m: &ControlMsg,
) -> io::Result<()> {
    w.write_all(&control::encode(m)).await?;
    w.flush().await
}

/// Load an Ed25519 identity from `path`, creating it (mode 0600) when absent.
pub fn load_or_create_identity(path: &Path) -> Result<Keypair, String> {
    match std::fs::read(path) {
        Ok(bytes) => Keypair::from_protobuf_encoding(&bytes).map_err(|e| {
            format!(
                "identity file {} is not a libp2p private key: {e}",
                path.display()
            )
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let kp = Keypair::generate_ed25519();
            let bytes = kp
                .to_protobuf_encoding()
                .map_err(|e| format!("cannot encode identity: {e}"))?;
            if let Some(dir) = path.parent() {
                if !dir.as_os_str().is_empty() {
                    std::fs::create_dir_all(dir)
                        .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
                }
            }
            write_private(path, &bytes)
                .map_err(|e| format!("cannot write identity {}: {e}", path.display()))?;
            Ok(kp)
        }
        Err(e) => Err(format!("cannot read identity {}: {e}", path.display())),
    }
}

fn write_private(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// Load a standard `swarm.key` file (`/key/swarm/psk/1.0.0/`, `/base16/`, 64 hex digits).
pub fn load_swarm_key(path: &Path) -> Result<PreSharedKey, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read swarm key {}: {e}", path.display()))?;
    text.trim()
        .parse::<PreSharedKey>()
        .map_err(|e| format!("swarm key {} is invalid: {e}", path.display()))
}
