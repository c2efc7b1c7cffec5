//! W3C Trace Context (`traceparent`, `tracestate`): which trace a request
//! belongs to. With tracing off (the default) the router inserts no span
//! into the trace: a client's valid `traceparent` goes on to the agent and
//! the backend as it came (in its version-00 spelling), and the backend's
//! spans are children of the client's span. A request without one (or
//! with an invalid one) starts a trace here: a random trace ID and parent
//! ID, sampled, so that a backend with a parent-based sampler records it.
//! The value sent on is also the response's `traceparent` header (spec 01
//! §7) and its trace ID goes in the audit line. With the OTLP export on,
//! the router's own spans take the parent's place
//! ([`crate::logic::trace`]).
//!
//! Parsing follows the W3C recommendation's rules: lower-case hex only, the
//! version `ff` and all-zero IDs are invalid, a version 00 value is exactly
//! 55 characters, a later version may carry more fields after a dash. More
//! than one `traceparent` header is invalid. `tracestate` is kept only with
//! a valid client `traceparent` and only while it stays within what every
//! participant must propagate (512 characters, 32 list members).

/// Length of a version-00 `traceparent` value.
pub const TRACEPARENT_LEN: usize = 55;

/// Longest `tracestate` the router passes on (the W3C minimum every
/// participant should propagate).
pub const TRACESTATE_MAX: usize = 512;

/// Most list members in a `tracestate`.
pub const TRACESTATE_MEMBERS: usize = 32;

/// The sampled bit of the trace flags.
pub const SAMPLED: u8 = 0x01;

/// A parsed `traceparent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// 16-byte trace ID (never all zero).
    pub trace_id: [u8; 16],
    /// 8-byte ID of the caller's span (never all zero).
    pub parent_id: [u8; 8],
    /// Trace flags (bit 0: sampled).
    pub flags: u8,
}

/// The trace of one request as the router carries it: the `traceparent`
/// it sends on (and answers with), and whether the client's `tracestate`
/// goes with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trace {
    /// The version-00 `traceparent` value, ASCII.
    pub header: [u8; TRACEPARENT_LEN],
    /// The client's valid `traceparent` was kept (not started here).
    pub from_client: bool,
    /// The client's `tracestate` headers go on unchanged.
    pub keep_state: bool,
}

impl Trace {
    /// The trace ID, 32 lower-case hex digits.
    pub fn trace_id(&self) -> &[u8] {
        self.header.get(3..35).unwrap_or(&[])
    }

    /// The trace ID as text.
    pub fn trace_id_str(&self) -> &str {
        std::str::from_utf8(self.trace_id()).unwrap_or("")
    }
}

fn hex_val(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

fn hex_digit(n: u8) -> u8 {
    if n < 10 {
        b'0' + n
    } else {
        b'a' + (n - 10)
    }
}

/// Lower-case hex (upper case is invalid in trace context) into `out`.
fn decode_hex(s: &[u8], out: &mut [u8]) -> Option<()> {
    if s.len() != out.len() * 2 {
        return None;
    }
    for (o, pair) in out.iter_mut().zip(s.chunks_exact(2)) {
        let (hi, lo) = match pair {
            [h, l] => (hex_val(*h)?, hex_val(*l)?),
            _ => return None,
        };
        *o = (hi << 4) | lo;
    }
    Some(())
}

fn encode_hex(bytes: &[u8], out: &mut [u8]) {
    for (pair, b) in out.chunks_exact_mut(2).zip(bytes) {
        if let [h, l] = pair {
            *h = hex_digit(b >> 4);
            *l = hex_digit(b & 0x0f);
        }
    }
}

/// Parse one `traceparent` value (surrounding spaces and tabs allowed).
pub fn parse(value: &[u8]) -> Option<TraceParent> {
    let v = value.trim_ascii();
    if v.len() < TRACEPARENT_LEN {
        return None;
    }
    let mut version = [0u8; 1];
    decode_hex(v.get(0..2)?, &mut version)?;
    if version[0] == 0xff {
        return None;
    }
    // Version 00 is exactly 55 characters; a later version may go on, but
    // only after a dash.
    if version[0] == 0 && v.len() != TRACEPARENT_LEN {
        return None;
    }
    if v.len() > TRACEPARENT_LEN && v.get(TRACEPARENT_LEN) != Some(&b'-') {
        return None;
    }
    if v.get(2) != Some(&b'-') || v.get(35) != Some(&b'-') || v.get(52) != Some(&b'-') {
        return None;
    }
    let mut trace_id = [0u8; 16];
    let mut parent_id = [0u8; 8];
    let mut flags = [0u8; 1];
    decode_hex(v.get(3..35)?, &mut trace_id)?;
    decode_hex(v.get(36..52)?, &mut parent_id)?;
    decode_hex(v.get(53..55)?, &mut flags)?;
    if trace_id == [0; 16] || parent_id == [0; 8] {
        return None;
    }
    Some(TraceParent {
        trace_id,
        parent_id,
        // A later version's unknown flag bits are not ours to pass on.
        flags: if version[0] == 0 {
            flags[0]
        } else {
            flags[0] & SAMPLED
        },
    })
}

/// The version-00 spelling of `p`.
pub fn encode(p: &TraceParent) -> [u8; TRACEPARENT_LEN] {
    let mut out = [b'-'; TRACEPARENT_LEN];
    if let Some(s) = out.get_mut(0..2) {
        s.copy_from_slice(b"00");
    }
    if let Some(s) = out.get_mut(3..35) {
        encode_hex(&p.trace_id, s);
    }
    if let Some(s) = out.get_mut(36..52) {
        encode_hex(&p.parent_id, s);
    }
    if let Some(s) = out.get_mut(53..55) {
        encode_hex(&[p.flags], s);
    }
    out
}

/// A new sampled trace from 24 random bytes (16 trace ID, 8 parent ID);
/// an all-zero draw is nudged to stay valid.
pub fn start(random: [u8; 24]) -> TraceParent {
    let mut trace_id = [0u8; 16];
    let mut parent_id = [0u8; 8];
    trace_id.copy_from_slice(random.get(..16).unwrap_or(&[0; 16]));
    parent_id.copy_from_slice(random.get(16..).unwrap_or(&[0; 8]));
    if trace_id == [0; 16] {
        trace_id[15] = 1;
    }
    if parent_id == [0; 8] {
        parent_id[7] = 1;
    }
    TraceParent {
        trace_id,
        parent_id,
        flags: SAMPLED,
    }
}

/// Whether the client's `tracestate` values (in order; several headers
/// form one comma-separated list) may go on: printable ASCII, at most
/// [`TRACESTATE_MAX`] characters together and [`TRACESTATE_MEMBERS`]
/// non-empty members, each `key=value`.
pub fn tracestate_ok<'a>(values: impl Iterator<Item = &'a [u8]>) -> bool {
    let mut len = 0usize;
    let mut members = 0usize;
    for v in values {
        len += v.len() + 1;
        if len > TRACESTATE_MAX + 1 {
            return false;
        }
        for m in v.split(|b| *b == b',') {
            let m = m.trim_ascii();
            if m.is_empty() {
                continue;
            }
            members += 1;
            let Some(eq) = m.iter().position(|b| *b == b'=') else {
                return false;
            };
            if eq == 0 || members > TRACESTATE_MEMBERS {
                return false;
            }
            if !m.iter().all(|b| (0x20..=0x7e).contains(b)) {
                return false;
            }
        }
    }
    true
}

/// The trace of a request whose `traceparent` header values are
/// `parents` and `tracestate` values `states`; `random` is used when a
/// trace starts here.
pub fn resolve<'a>(
    mut parents: impl Iterator<Item = &'a [u8]>,
    states: impl Iterator<Item = &'a [u8]>,
    random: [u8; 24],
) -> Trace {
    let client = match (parents.next(), parents.next()) {
        (Some(v), None) => parse(v),
        _ => None,
    };
    match client {
        Some(p) => Trace {
            header: encode(&p),
            from_client: true,
            keep_state: tracestate_ok(states),
        },
        None => Trace {
            header: encode(&start(random)),
            from_client: false,
            keep_state: false,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn r(parents: &[&str], states: &[&str]) -> Trace {
        resolve(
            parents.iter().map(|s| s.as_bytes()),
            states.iter().map(|s| s.as_bytes()),
            [7; 24],
        )
    }

    #[test]
    fn valid_version_00_is_kept_verbatim() {
        let t = r(&[GOOD], &["congo=t61rcWkgMzE"]);
        assert_eq!(&t.header[..], GOOD.as_bytes());
        assert!(t.from_client && t.keep_state);
        assert_eq!(t.trace_id_str(), "4bf92f3577b34da6a3ce929d0e0e4736");
        // Spaces around the value are optional whitespace.
        assert_eq!(
            &r(&[&format!("  {GOOD}\t")], &[]).header[..],
            GOOD.as_bytes()
        );
    }

    #[test]
    fn invalid_values_start_a_new_trace() {
        let bad = [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
        ];
        for b in bad {
            assert_eq!(parse(b.as_bytes()), None, "{b:?}");
            let t = r(&[b], &["congo=t61rcWkgMzE"]);
            assert!(!t.from_client && !t.keep_state, "{b:?}");
            // The started trace: sampled, the random IDs.
            assert_eq!(
                std::str::from_utf8(&t.header).expect("ascii"),
                "00-07070707070707070707070707070707-0707070707070707-01"
            );
        }
        // Two traceparent headers: invalid, a new trace.
        assert!(!r(&[GOOD, GOOD], &[]).from_client);
        // None: a new trace.
        assert!(!r(&[], &[]).from_client);
    }

    #[test]
    fn later_versions_are_read_as_00() {
        let v = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-ff-what-the-future-holds";
        let t = r(&[v], &[]);
        assert!(t.from_client);
        // Only the sampled bit of an unknown version's flags goes on.
        assert_eq!(
            std::str::from_utf8(&t.header).expect("ascii"),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        // A later version must continue with a dash.
        let v = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x";
        assert_eq!(parse(v.as_bytes()), None);
    }

    #[test]
    fn tracestate_limits() {
        assert!(tracestate_ok(
            ["a=1,b=2", "c=3"].iter().map(|s| s.as_bytes())
        ));
        assert!(tracestate_ok(std::iter::empty()));
        assert!(!tracestate_ok(["novalue"].iter().map(|s| s.as_bytes())));
        assert!(!tracestate_ok(["=x"].iter().map(|s| s.as_bytes())));
        let long = format!("k={}", "v".repeat(TRACESTATE_MAX));
        assert!(!tracestate_ok([long.as_str()].iter().map(|s| s.as_bytes())));
        let many: Vec<String> = (0..=TRACESTATE_MEMBERS)
            .map(|i| format!("k{i}=v"))
            .collect();
        let many = many.join(",");
        assert!(!tracestate_ok([many.as_str()].iter().map(|s| s.as_bytes())));
        assert!(!tracestate_ok(["a=\u{7f}"].iter().map(|s| s.as_bytes())));
        // With an invalid traceparent the state goes nowhere.
        assert!(!r(&["garbage"], &["a=1"]).keep_state);
        // A valid parent with a bad state keeps the parent, drops the state.
        let t = r(&[GOOD], &["novalue"]);
        assert!(t.from_client && !t.keep_state);
    }

    #[test]
    fn zero_draw_stays_valid() {
        let t = resolve(std::iter::empty(), std::iter::empty(), [0; 24]);
        assert!(parse(&t.header).is_some());
    }

    proptest! {
        #[test]
        fn encode_parse_round_trip(t in any::<[u8; 16]>(), p in any::<[u8; 8]>(), f in any::<u8>()) {
            prop_assume!(t != [0; 16] && p != [0; 8]);
            let tp = TraceParent { trace_id: t, parent_id: p, flags: f };
            prop_assert_eq!(parse(&encode(&tp)), Some(tp));
        }

        #[test]
        fn never_panics(s in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = parse(&s);
            let _ = tracestate_ok(std::iter::once(s.as_slice()));
            let t = resolve(std::iter::once(s.as_slice()), std::iter::empty(), [1; 24]);
            prop_assert!(parse(&t.header).is_some());
        }
    }
}
