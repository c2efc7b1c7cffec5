//! Replacing a running router without cutting a stream or losing a held
//! request (issue 54): the old process ([`old`]) gives the new one
//! ([`new`]) its listening sockets, its store, its agents, its held
//! requests and its client connections over a Unix socket, in the order
//! [`shards::logic::system::upgrade`] lists, and finishes its streams.
//! This module is the link both sides speak over.

pub(crate) mod new;
pub(crate) mod old;

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shards::logic::system::upgrade::{self as proto, Msg};
use shards::runtime::wire::fd_pass;

/// How long a step of the hand-over may take before it is given up (the
/// old process then serves on as before).
pub(crate) const STEP: Duration = Duration::from_secs(60);

/// A message with its payload and descriptors.
pub(crate) type Received = (Msg, Vec<u8>, Vec<OwnedFd>);

/// One end of the hand-over's socket: reads on one thread, writes from
/// any (a frame at a time).
#[derive(Clone)]
pub(crate) struct Link {
    read: Arc<UnixStream>,
    write: Arc<Mutex<UnixStream>>,
}

impl Link {
    pub(crate) fn new(sock: UnixStream) -> io::Result<Link> {
        let write = sock.try_clone()?;
        Ok(Link {
            read: Arc::new(sock),
            write: Arc::new(Mutex::new(write)),
        })
    }

    /// Send one message (with a payload and descriptors).
    pub(crate) fn send(&self, m: &Msg, payload: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        let w = match self.write.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        fd_pass::send(&w, &proto::encode(m), payload, fds)
    }

    /// Send a message without payload or descriptors.
    pub(crate) fn say(&self, m: &Msg) -> Result<(), String> {
        self.send(m, &[], &[])
            .map_err(|e| format!("upgrade link: cannot send: {e}"))
    }

    /// The next message; `Ok(None)` when the other side closed.
    pub(crate) fn recv(&self) -> Result<Option<Received>, String> {
        match fd_pass::recv(&self.read) {
            Ok(Some(f)) => Ok(Some((
                proto::decode(&f.header).map_err(|e| e.to_string())?,
                f.payload,
                f.fds,
            ))),
            Ok(None) => Ok(None),
            Err(e) => Err(format!("upgrade link: {e}")),
        }
    }

    /// Bound the wait of the next reads (`None`: no bound).
    pub(crate) fn read_timeout(&self, d: Option<Duration>) {
        let _ = self.read.set_read_timeout(d);
    }

    /// The next message, which must be `what` (by its name).
    pub(crate) fn expect(&self, what: &str) -> Result<Received, String> {
        match self.recv()? {
            Some(m) => Ok(m),
            None => Err(format!("upgrade link closed while waiting for {what}")),
        }
    }
}

/// Protocol messages the reader thread passes to the side driving the
/// hand-over.
pub(crate) type Steps = std::sync::mpsc::Receiver<Msg>;

/// Wait for the next protocol message from the reader thread.
pub(crate) fn next_step(steps: &Steps, what: &str, within: Duration) -> Result<Msg, String> {
    steps
        .recv_timeout(within)
        .map_err(|_| format!("no {what} from the other process within {within:?}"))
}

/// Tell systemd (when it started us with `Type=notify`) that this process
/// is the service's main process now and ready.
pub(crate) fn notify_systemd(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let Ok(sock) = std::os::unix::net::UnixDatagram::unbound() else {
        return;
    };
    let bytes = path.as_encoded_bytes();
    let sent = if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(name)
            .and_then(|a| sock.send_to_addr(state.as_bytes(), &a))
    } else {
        sock.send_to(state.as_bytes(), std::path::Path::new(&path))
    };
    if let Err(e) = sent {
        tracing::warn!("cannot notify systemd ({state:?}): {e}");
    }
}
