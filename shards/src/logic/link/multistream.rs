//! The listener's side of `multistream-select` 1.0 for one protocol, as
//! bytes: what a `V1Lazy` dialer sends before its data (the header line
//! and the protocol line, each an unsigned-varint length and the line),
//! and the confirmation the listener owes it.
//!
//! Why not the `multistream-select` crate here: its listener writes and
//! flushes the confirmation the moment it has read the dialer's lines, so
//! the agent sent it as a frame of its own, ahead of the response, and the
//! router woke once for it and once for the response (one extra system
//! call and context switch per request, issue 14). With the bytes known,
//! the agent sends the confirmation with its first response bytes. The
//! wire is the same; the router's dialer is still the crate.

/// The multistream-select 1.0 header line.
pub const HEADER: &[u8] = b"/multistream/1.0.0\n";

/// Longest line accepted (the crate's dialers send short protocol names;
/// anything longer here is not our router).
const MAX_LINE: usize = 1024;

/// What the dialer's opening bytes say so far.
#[derive(Debug, PartialEq, Eq)]
pub enum Prelude {
    /// Not all there yet: read more.
    Incomplete,
    /// Header and `protocol` read; the dialer's data starts at `consumed`.
    Selected {
        /// Bytes of the prelude, to drop before the data.
        consumed: usize,
    },
    /// Well-formed, but asks for another protocol (or for `ls`).
    Refused,
    /// Not multistream-select 1.0.
    Invalid(&'static str),
}

/// Read one length-prefixed line at the start of `buf`: the line and the
/// bytes it took, `None` when incomplete.
fn line(buf: &[u8]) -> Result<Option<(&[u8], usize)>, &'static str> {
    let mut len: usize = 0;
    let mut at = 0;
    loop {
        let Some(&b) = buf.get(at) else {
            return Ok(None);
        };
        at += 1;
        len |= usize::from(b & 0x7f) << (7 * (at - 1));
        if b & 0x80 == 0 {
            break;
        }
        if at == 2 {
            // Two varint bytes already allow 16,383: more is not a line.
            return Err("multistream line length too long");
        }
    }
    if len > MAX_LINE {
        return Err("multistream line too long");
    }
    match buf.get(at..at + len) {
        Some(l) => {
            if l.last() != Some(&b'\n') {
                return Err("multistream line without a newline");
            }
            Ok(Some((l, at + len)))
        }
        None => Ok(None),
    }
}

/// Parse a dialer's prelude for `protocol` (without its newline).
pub fn parse_prelude(buf: &[u8], protocol: &str) -> Prelude {
    let (header, first) = match line(buf) {
        Ok(Some(v)) => v,
        Ok(None) => return Prelude::Incomplete,
        Err(e) => return Prelude::Invalid(e),
    };
    if header != HEADER {
        return Prelude::Invalid("not a multistream-select 1.0 header");
    }
    let rest = buf.get(first..).unwrap_or(&[]);
    let (asked, second) = match line(rest) {
        Ok(Some(v)) => v,
        Ok(None) => return Prelude::Incomplete,
        Err(e) => return Prelude::Invalid(e),
    };
    let name = asked.get(..asked.len() - 1).unwrap_or(&[]);
    if name == protocol.as_bytes() {
        Prelude::Selected {
            consumed: first + second,
        }
    } else {
        Prelude::Refused
    }
}

/// The listener's confirmation of `protocol`: the header line, then the
/// protocol line, each with its length.
pub fn confirmation(protocol: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER.len() + protocol.len() + 4);
    push_line(&mut out, HEADER);
    let mut p = Vec::with_capacity(protocol.len() + 1);
    p.extend_from_slice(protocol.as_bytes());
    p.push(b'\n');
    push_line(&mut out, &p);
    out
}

fn push_line(out: &mut Vec<u8>, l: &[u8]) {
    let mut n = l.len();
    loop {
        let b = u8::try_from(n & 0x7f).unwrap_or(0);
        n >>= 7;
        if n == 0 {
            out.push(b);
            break;
        }
        out.push(b | 0x80);
    }
    out.extend_from_slice(l);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const P: &str = "/http/1.1";

    #[test]
    fn the_confirmation_is_what_the_crate_sends() {
        // 0x13 = 19 bytes of header line, 0x0a = 10 bytes of protocol line.
        let mut want = vec![0x13];
        want.extend_from_slice(b"/multistream/1.0.0\n");
        want.push(0x0a);
        want.extend_from_slice(b"/http/1.1\n");
        assert_eq!(confirmation(P), want);
    }

    #[test]
    fn a_dialer_prelude_selects_and_says_where_data_starts() {
        let mut b = confirmation(P);
        let n = b.len();
        b.extend_from_slice(b"POST / HTTP/1.1\r\n");
        assert_eq!(parse_prelude(&b, P), Prelude::Selected { consumed: n });
    }

    #[test]
    fn another_protocol_is_refused_and_garbage_is_invalid() {
        assert_eq!(
            parse_prelude(&confirmation("/other/1"), P),
            Prelude::Refused
        );
        assert!(matches!(
            parse_prelude(b"\x05hello", P),
            Prelude::Invalid(_)
        ));
        // A well-formed line that is not the header.
        assert!(matches!(
            parse_prelude(b"\x06/oops\n", P),
            Prelude::Invalid(_)
        ));
        // Plain HTTP: 'G' reads as a 71-byte line, which waits for more
        // bytes and then fails on its missing newline.
        let http = b"GET /v1/models HTTP/1.1\r\nHost: a\r\nAccept: */*\r\nUser-Agent: curl/8\r\nX: yyyyyyyyyyyy\r\n\r\n";
        assert_eq!(parse_prelude(&http[..20], P), Prelude::Incomplete);
        assert!(matches!(parse_prelude(http, P), Prelude::Invalid(_)));
        assert!(matches!(
            parse_prelude(&[0xff, 0xff, 0x01], P),
            Prelude::Invalid(_)
        ));
        // A protocol line without its newline.
        let mut b = confirmation(P);
        let last = b.len() - 1;
        b[last] = b'x';
        assert!(matches!(parse_prelude(&b, P), Prelude::Invalid(_)));
    }

    #[test]
    fn a_long_line_is_invalid_at_once() {
        // 2,000 bytes announced: refused before they arrive.
        assert!(matches!(
            parse_prelude(&[0xd0, 0x0f], P),
            Prelude::Invalid(_)
        ));
    }

    proptest! {
        /// Every prefix of a valid prelude is incomplete, never an error.
        #[test]
        fn prefixes_are_incomplete(cut in 0usize..30) {
            let b = confirmation(P);
            let cut = cut.min(b.len() - 1);
            prop_assert_eq!(parse_prelude(&b[..cut], P), Prelude::Incomplete);
        }

        /// Any bytes: an answer, never a panic; a selection never claims
        /// more than it was given.
        #[test]
        fn any_bytes(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Prelude::Selected { consumed } = parse_prelude(&b, P) {
                prop_assert!(consumed <= b.len());
            }
        }

        /// Lengths that need two varint bytes are read right.
        #[test]
        fn long_protocol_names(n in 120usize..400) {
            let name: String = std::iter::repeat_n('a', n).collect();
            let b = confirmation(&name);
            prop_assert_eq!(
                parse_prelude(&b, &name),
                Prelude::Selected { consumed: b.len() }
            );
        }
    }
}
