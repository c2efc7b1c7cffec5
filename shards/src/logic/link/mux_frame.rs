//! The yamux wire format (version 0, as spoken by the `yamux` crate and
//! go-yamux), for the link's own multiplexer ([`crate::runtime::wire::mux`]).
//!
//! A frame is a 12-byte header (version, type, flags, stream ID, length;
//! big-endian) and, for data frames only, `length` bytes of body. For a
//! window update `length` is the credit granted, for a ping its opaque
//! value, for a go-away its error code.
//!
//! Key items: [`Header`] ([`Header::encode`], [`Header::decode`]),
//! [`RecvWindow`] (when to grant the peer more credit).

/// Header length on the wire.
pub const HEADER_LEN: usize = 12;
/// Credit each side starts a stream with (yamux's `DEFAULT_CREDIT`).
pub const INITIAL_WINDOW: u32 = 256 * 1024;
/// Largest data frame body this side sends (yamux's `split_send_size`).
pub const MAX_SEND_FRAME: usize = 16 * 1024;

/// Frame types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Stream data (the only type with a body).
    Data,
    /// Send credit for a stream.
    WindowUpdate,
    /// Liveness / round trip probe on stream 0.
    Ping,
    /// The sender ends the session.
    GoAway,
}

/// Opens a stream (the first frame of the opener).
pub const SYN: u16 = 1;
/// Acknowledges a stream (the first frame of the accepter), or a ping.
pub const ACK: u16 = 2;
/// Half-closes the sender's side.
pub const FIN: u16 = 4;
/// Resets the stream at once.
pub const RST: u16 = 8;

/// Go-away codes.
pub const GO_AWAY_NORMAL: u32 = 0;
/// The peer broke the protocol.
pub const GO_AWAY_PROTOCOL: u32 = 1;

/// One frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Frame type.
    pub kind: Kind,
    /// [`SYN`], [`ACK`], [`FIN`], [`RST`] bits.
    pub flags: u16,
    /// Stream ID (0 for the session: ping, go-away).
    pub stream: u32,
    /// Body length, credit, ping value or go-away code.
    pub len: u32,
}

/// Why bytes are not a frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameError {
    /// Only version 0 exists.
    Version(u8),
    /// Type byte above 3.
    Kind(u8),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Version(v) => write!(f, "yamux version {v} (only 0 exists)"),
            FrameError::Kind(k) => write!(f, "yamux frame type {k} (0 to 3 exist)"),
        }
    }
}

impl Header {
    /// A data frame header for `len` body bytes.
    pub fn data(stream: u32, flags: u16, len: u32) -> Self {
        Header {
            kind: Kind::Data,
            flags,
            stream,
            len,
        }
    }

    /// A window update granting `credit`.
    pub fn window_update(stream: u32, flags: u16, credit: u32) -> Self {
        Header {
            kind: Kind::WindowUpdate,
            flags,
            stream,
            len: credit,
        }
    }

    /// The 12 bytes on the wire.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let kind = match self.kind {
            Kind::Data => 0,
            Kind::WindowUpdate => 1,
            Kind::Ping => 2,
            Kind::GoAway => 3,
        };
        let f = self.flags.to_be_bytes();
        let s = self.stream.to_be_bytes();
        let l = self.len.to_be_bytes();
        [
            0, kind, f[0], f[1], s[0], s[1], s[2], s[3], l[0], l[1], l[2], l[3],
        ]
    }

    /// Parse the 12 header bytes.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, FrameError> {
        let [version, kind, f0, f1, s0, s1, s2, s3, l0, l1, l2, l3] = *b;
        if version != 0 {
            return Err(FrameError::Version(version));
        }
        let kind = match kind {
            0 => Kind::Data,
            1 => Kind::WindowUpdate,
            2 => Kind::Ping,
            3 => Kind::GoAway,
            k => return Err(FrameError::Kind(k)),
        };
        Ok(Header {
            kind,
            flags: u16::from_be_bytes([f0, f1]),
            stream: u32::from_be_bytes([s0, s1, s2, s3]),
            len: u32::from_be_bytes([l0, l1, l2, l3]),
        })
    }

    /// Whether `flag` is set.
    pub fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }
}

/// Whether `stream` is one the peer may open: the dialer (client) opens
/// odd IDs, the listener (server) even ones; 0 is the session.
pub fn opened_by_peer(stream: u32, we_are_client: bool) -> bool {
    stream != 0 && stream.is_multiple_of(2) == we_are_client
}

/// The receive side of one stream's flow control: how much the peer may
/// still send, and when to grant more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWindow {
    /// Bytes the peer may send before it must wait.
    remaining: u32,
    /// Bytes read by the application and not yet granted back.
    consumed: u32,
}

impl Default for RecvWindow {
    fn default() -> Self {
        RecvWindow {
            remaining: INITIAL_WINDOW,
            consumed: 0,
        }
    }
}

impl RecvWindow {
    /// The peer sent `len` body bytes. `false`: more than it was granted
    /// (the stream must be reset; the bytes are not kept).
    pub fn on_data(&mut self, len: u32) -> bool {
        match self.remaining.checked_sub(len) {
            Some(r) => {
                self.remaining = r;
                true
            }
            None => false,
        }
    }

    /// The application read `n` bytes. Returns the credit to grant now:
    /// only once half the window is consumed, so a stream that carries
    /// one request and one answer of less than that sends no update.
    pub fn on_consumed(&mut self, n: u32) -> Option<u32> {
        self.consumed = self.consumed.saturating_add(n);
        if self.consumed >= INITIAL_WINDOW / 2 {
            let grant = self.consumed;
            self.consumed = 0;
            self.remaining = self.remaining.saturating_add(grant);
            Some(grant)
        } else {
            None
        }
    }

    /// Bytes the peer may still send.
    pub fn remaining(&self) -> u32 {
        self.remaining
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn header_bytes_match_the_yamux_spec() {
        // go-yamux spec: version 0, type 1 (window update), flags SYN,
        // stream 3, length 0x40000.
        let h = Header::window_update(3, SYN, 0x40000);
        assert_eq!(h.encode(), [0, 1, 0, 1, 0, 0, 0, 3, 0, 4, 0, 0]);
        let h = Header::data(0x0102_0304, FIN | RST, 5);
        assert_eq!(h.encode(), [0, 0, 0, 12, 1, 2, 3, 4, 0, 0, 0, 5]);
    }

    #[test]
    fn bad_versions_and_types_are_refused() {
        let mut b = Header::data(1, 0, 0).encode();
        b[0] = 1;
        assert_eq!(Header::decode(&b), Err(FrameError::Version(1)));
        let mut b = Header::data(1, 0, 0).encode();
        b[1] = 4;
        assert_eq!(Header::decode(&b), Err(FrameError::Kind(4)));
    }

    #[test]
    fn stream_parity() {
        // We are the server (router): the agent opens odd streams.
        assert!(opened_by_peer(1, false));
        assert!(!opened_by_peer(2, false));
        assert!(opened_by_peer(2, true));
        assert!(!opened_by_peer(0, true));
        assert!(!opened_by_peer(0, false));
    }

    #[test]
    fn small_exchanges_grant_nothing_and_overruns_are_caught() {
        let mut w = RecvWindow::default();
        assert!(w.on_data(1000));
        assert_eq!(w.on_consumed(1000), None);
        assert!(w.on_data(INITIAL_WINDOW - 1000));
        assert!(!w.on_data(1), "the peer has no credit left");
        assert_eq!(
            w.on_consumed(INITIAL_WINDOW / 2),
            Some(INITIAL_WINDOW / 2 + 1000)
        );
        assert_eq!(w.remaining(), INITIAL_WINDOW / 2 + 1000);
    }

    fn kind() -> impl Strategy<Value = Kind> {
        prop_oneof![
            Just(Kind::Data),
            Just(Kind::WindowUpdate),
            Just(Kind::Ping),
            Just(Kind::GoAway)
        ]
    }

    proptest! {
        #[test]
        fn headers_round_trip(k in kind(), flags in any::<u16>(), stream in any::<u32>(), len in any::<u32>()) {
            let h = Header { kind: k, flags, stream, len };
            prop_assert_eq!(Header::decode(&h.encode()), Ok(h));
        }

        /// Whatever the read sizes, the peer can never have more than the
        /// initial window plus what was granted outstanding, and a reader
        /// that consumes everything keeps it able to send.
        #[test]
        fn the_window_never_overflows_and_never_starves(chunks in proptest::collection::vec(1u32..70_000, 1..200)) {
            let mut w = RecvWindow::default();
            let mut granted: u64 = 0;
            let mut sent: u64 = 0;
            for c in chunks {
                let c = c.min(w.remaining());
                if c == 0 { prop_assert!(false, "the window starved"); }
                prop_assert!(w.on_data(c));
                sent += u64::from(c);
                if let Some(g) = w.on_consumed(c) { granted += u64::from(g); }
                prop_assert_eq!(u64::from(w.remaining()), u64::from(INITIAL_WINDOW) + granted - sent);
                prop_assert!(w.remaining() <= INITIAL_WINDOW);
            }
        }
    }
}
