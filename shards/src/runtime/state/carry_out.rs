//! The outbox of a router being replaced (issue 54): once the new process
//! accepts clients, connections and held requests go to it through here
//! (`runtime::front::carry` takes them out of their runtime; the upgrade
//! thread sends them over the Unix socket).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::logic::system::upgrade::{CarriedHold, CarriedStream};

/// A connection on its way to the new process.
pub struct Outgoing {
    /// The socket (this process's copy is closed once it is sent).
    pub stream: std::net::TcpStream,
    /// What was read from it and not answered.
    pub bytes: Vec<u8>,
    /// Its held request's state, when it was held.
    pub hold: Option<CarriedHold>,
    /// Its stream's state, when it was still relayed at
    /// `--upgrade-drain-timeout` (`bytes`: its request).
    pub resumed: Option<Box<CarriedStream>>,
}

/// The old process's outbox: set once the new process accepts clients.
#[derive(Default)]
pub struct CarryOut {
    outbox: Mutex<Option<std::sync::mpsc::Sender<Outgoing>>>,
    on: AtomicBool,
    /// Streams still relayed go over too (`--upgrade-drain-timeout`
    /// passed).
    streams: AtomicBool,
    /// Connections sent (idle ones, held ones, streams).
    pub sent: [AtomicU64; 3],
}

impl CarryOut {
    /// Whether connections go over now (one relaxed load per request).
    #[inline]
    pub fn on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Whether a stream that breaks now goes over (its relay was cut by
    /// [`CarryOut::carry_streams`]) instead of being continued here.
    pub fn streams(&self) -> bool {
        self.streams.load(Ordering::Acquire) && self.on()
    }

    /// `--upgrade-drain-timeout` passed: the streams still relayed are
    /// cut from their agents here and continued by the new process.
    pub fn carry_streams(&self) {
        self.streams.store(true, Ordering::Release);
    }

    /// Start carrying connections to `tx`.
    pub fn start(&self, tx: std::sync::mpsc::Sender<Outgoing>) {
        *self.lock() = Some(tx);
        self.on.store(true, Ordering::Release);
    }

    /// Stop (the new process failed before it took over).
    pub fn stop(&self) {
        self.on.store(false, Ordering::Release);
        *self.lock() = None;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<std::sync::mpsc::Sender<Outgoing>>> {
        match self.outbox.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Send `o`; `false`: the outbox is closed (the new process is gone).
    pub fn send(&self, o: Outgoing) -> bool {
        let kind = match (&o.hold, &o.resumed) {
            (_, Some(_)) => 2,
            (Some(_), None) => 1,
            (None, None) => 0,
        };
        let ok = self.lock().as_ref().is_some_and(|tx| tx.send(o).is_ok());
        if ok {
            self.sent[kind].fetch_add(1, Ordering::Relaxed);
        }
        ok
    }
}
