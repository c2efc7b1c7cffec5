//! The agent link stack, without a libp2p `Swarm`:
//! monoio TCP ([`socket::LinkSocket`]: completion-based
//! reads, writes gathered and sent once per driver wake) -> thread-bound `Send` wrapper ->
//! optional pre-shared-key private network (`libp2p-pnet`) -> `noise`
//! (authenticates both PeerIds) -> yamux ([`crate::runtime::wire::mux`], the wire
//! format of the `yamux` crate) -> streams negotiated with
//! `multistream-select` (`V1Lazy`).
//!
//! Key items: [`accept`] (router side, after the preamble), [`dial`]
//! (agent side, sends the preamble), [`spawn_driver`] and [`LinkHandle`]
//! (the task that owns the multiplexed connection; handles open streams
//! without it), [`accept_protocol`] for the control stream
//! (request streams, on both sides, are [`crate::runtime::wire::http_stream`]: their
//! multistream-select lines go out with their first bytes),
//! [`write_frame`] for the control stream (frames are read through
//! [`crate::runtime::wire::conn::Conn::read_frame`]).

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::rc::Rc;
use std::task::Poll;

use crate::logic::system::config_error::ConfigError;
use futures::channel::oneshot;
use futures::{AsyncReadExt, AsyncWriteExt};
use libp2p_core::upgrade::{InboundConnectionUpgrade, OutboundConnectionUpgrade};
use libp2p_identity::{Keypair, PeerId};
use libp2p_pnet::{PnetConfig, PreSharedKey};
use monoio::io::AsyncWriteRentExt;

pub mod adapter;
pub mod budget;
pub mod socket;

use self::adapter::{BoxIo, Prefixed, ThreadBound};
use self::socket::{Flusher, LinkSocket};
use crate::logic::link::control::{self, ControlMsg};
use crate::logic::link::preamble;
use crate::runtime::wire::mux;

/// Protocol of request streams (one HTTP/1.1 exchange per stream).
pub const HTTP_PROTOCOL: &str = "/http/1.1";
/// Protocol of the single control stream.
pub const CONTROL_PROTOCOL: &str = "/hivenet/control/1.0.0";

/// A negotiated stream.
pub type LinkStream = multistream_select::Negotiated<mux::Stream>;

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

/// Streams the peer may have open on a link at once; more are reset
/// one by one (the link stays up). The router also caps an agent's
/// capacity well below it ([`MAX_AGENT_CAPACITY`]).
pub const MAX_LINK_STREAMS: usize = 4096;

/// Largest capacity the router grants one agent (slots = concurrent streams).
pub const MAX_AGENT_CAPACITY: u32 = 1024;

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
    conn: mux::Connection,
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
    let conn = mux::Connection::new(io, mux::Mode::Server, MAX_LINK_STREAMS);
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
    let conn = mux::Connection::new(io, mux::Mode::Client, MAX_LINK_STREAMS);
    Ok((peer, Link { conn, flusher }))
}

/// Closes the link when the last [`LinkHandle`] goes.
struct CloseOnDrop(mux::Opener);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// Opens streams on a link driven by [`spawn_driver`]. Dropping every
/// handle, or [`LinkHandle::close`], closes the link.
#[derive(Clone)]
pub struct LinkHandle {
    opener: mux::Opener,
    _last: Rc<CloseOnDrop>,
}

impl LinkHandle {
    /// Let go of a finished stream. Its closing frame leaves with the
    /// link's next traffic instead of on its own: sent at once, it
    /// reached the agent alone, after its response, and woke it for
    /// nothing (one system call and one context switch per request on
    /// the agent). The agent does not wait for it: it has closed and
    /// forgotten the stream.
    pub fn retire(&self, s: mux::Stream) {
        s.drop_quietly();
    }

    /// Open a raw stream (no I/O: its first frame carries the open).
    pub async fn open_raw(&self) -> io::Result<mux::Stream> {
        self.opener.open()
    }

    /// Open a stream and select `protocol` lazily (0-RTT).
    pub async fn open(&self, protocol: &'static str) -> io::Result<LinkStream> {
        let s = self.opener.open()?;
        multistream_select::dialer_select_proto(s, [protocol], multistream_select::Version::V1Lazy)
            .await
            .map(|(_, n)| n)
            .map_err(|e| io::Error::new(io::ErrorKind::ConnectionAborted, e.to_string()))
    }

    /// Close the link even while other handles exist.
    pub fn close(&self) {
        self.opener.close();
    }

    /// A handle with no link behind it (every open fails): for unit tests
    /// of the state that holds handles.
    #[cfg(test)]
    pub fn detached() -> Self {
        let opener = mux::Opener::detached();
        LinkHandle {
            _last: Rc::new(CloseOnDrop(opener.clone())),
            opener,
        }
    }
}

/// Spawn the task that owns `link` on the current shard. Returns a handle
/// to open streams, the inbound streams, and a receiver that completes
/// when the connection ends.
pub fn spawn_driver(link: Link) -> (LinkHandle, mux::Inbound, oneshot::Receiver<()>) {
    let (done_tx, done_rx) = oneshot::channel::<()>();
    link.flusher.defer();
    let opener = link.conn.opener();
    let inbound = link.conn.inbound();
    monoio::spawn(drive(link.conn, link.flusher, done_tx));
    let handle = LinkHandle {
        _last: Rc::new(CloseOnDrop(opener.clone())),
        opener,
    };
    (handle, inbound, done_rx)
}

async fn drive(mut conn: mux::Connection, flusher: Flusher, done: oneshot::Sender<()>) {
    let _ = futures::future::poll_fn(|cx| match conn.poll_drive(cx) {
        Poll::Ready(r) => {
            // A go-away written on the way out still gets its send.
            let _ = flusher.poll_send(cx);
            Poll::Ready(r)
        }
        // Everything this wake wrote goes out in one send.
        Poll::Pending => match flusher.poll_send(cx) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            _ => Poll::Pending,
        },
    })
    .await;
    drop(conn);
    drop(done);
}

/// Accept the protocol on an inbound stream.
pub async fn accept_protocol(
    s: mux::Stream,
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
pub fn load_or_create_identity(path: &Path) -> Result<Keypair, ConfigError> {
    match std::fs::read(path) {
        Ok(bytes) => Keypair::from_protobuf_encoding(&bytes).map_err(|e| {
            ConfigError::from(format!(
                "identity file {} is not a libp2p private key: {e}",
                path.display()
            ))
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
        Err(e) => Err(ConfigError::from(format!(
            "cannot read identity {}: {e}",
            path.display()
        ))),
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
pub fn load_swarm_key(path: &Path) -> Result<PreSharedKey, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read swarm key {}: {e}", path.display()))?;
    text.trim()
        .parse::<PreSharedKey>()
        .map_err(|e| ConfigError::from(format!("swarm key {} is invalid: {e}", path.display())))
}
