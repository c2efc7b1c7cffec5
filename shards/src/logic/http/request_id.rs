//! `X-Request-ID` (spec 01 §7): a client's value is reused only when it is
//! a UUID (canonical 36 characters, `urn:uuid:` prefix, `{...}` braces, or
//! 32 raw hex digits) and echoed verbatim; otherwise a new v4 UUID is made
//! from random bytes the caller passes in.

/// Whether `s` is a UUID in one of the accepted spellings.
pub fn valid(s: &str) -> bool {
    let s = s.strip_prefix("urn:uuid:").unwrap_or(s);
    let s = match (s.strip_prefix('{'), s.ends_with('}')) {
        (Some(inner), true) => inner.get(..inner.len().saturating_sub(1)).unwrap_or(""),
        _ => s,
    };
    match s.len() {
        32 => s.bytes().all(|b| b.is_ascii_hexdigit()),
        36 => s.bytes().enumerate().all(|(i, b)| {
            if matches!(i, 8 | 13 | 18 | 23) {
                b == b'-'
            } else {
                b.is_ascii_hexdigit()
            }
        }),
        _ => false,
    }
}

/// A lowercase hex digit of `n` (0-15).
fn nibble(n: u8) -> char {
    char::from(if n < 10 { b'0' + n } else { b'a' + (n - 10) })
}

/// Longest accepted spelling: `urn:uuid:{` + 36 + `}`.
const MAX_LEN: usize = 47;

/// A request's ID kept inline (it is copied into the pending request, the
/// audit line and the headers of every answer; as a `String` that was two
/// allocations per request). Empty until set.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct RequestId {
    text: [u8; MAX_LEN],
    len: u8,
}

impl Default for RequestId {
    fn default() -> Self {
        RequestId {
            text: [0; MAX_LEN],
            len: 0,
        }
    }
}

impl RequestId {
    /// A client's value, kept verbatim when [`valid`].
    pub fn parse(s: &str) -> Option<Self> {
        if !valid(s) {
            return None;
        }
        let mut id = RequestId::default();
        id.text.get_mut(..s.len())?.copy_from_slice(s.as_bytes());
        id.len = u8::try_from(s.len()).ok()?;
        Some(id)
    }

    /// A new version-4 UUID from 16 random bytes, lower-case canonical form.
    pub fn v4(mut b: [u8; 16]) -> Self {
        if let Some(x) = b.get_mut(6) {
            *x = (*x & 0x0f) | 0x40;
        }
        if let Some(x) = b.get_mut(8) {
            *x = (*x & 0x3f) | 0x80;
        }
        let mut id = RequestId::default();
        let mut n = 0;
        let mut put = |c: u8| {
            if let Some(slot) = id.text.get_mut(n) {
                *slot = c;
                n += 1;
            }
        };
        for (i, x) in b.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                put(b'-');
            }
            put(nibble(x >> 4) as u8);
            put(nibble(x & 0x0f) as u8);
        }
        id.len = u8::try_from(n).unwrap_or(0);
        id
    }

    /// The ID's text (empty when unset).
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(self.as_bytes()).unwrap_or("")
    }

    /// The ID's bytes (ASCII).
    pub fn as_bytes(&self) -> &[u8] {
        self.text.get(..usize::from(self.len)).unwrap_or(&[])
    }

    /// Not set.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Debug for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn inline_ids_keep_every_accepted_spelling_verbatim() {
        for s in [
            "123e4567-e89b-12d3-a456-426614174000",
            "urn:uuid:123e4567-e89b-12d3-a456-426614174000",
            "urn:uuid:{123E4567-E89B-12D3-A456-426614174000}",
            "123e4567e89b12d3a456426614174000",
        ] {
            assert_eq!(
                RequestId::parse(s).map(|id| id.to_string()),
                Some(s.to_string())
            );
        }
        assert_eq!(RequestId::parse("not-a-uuid"), None);
        assert!(RequestId::default().is_empty());
        assert_eq!(RequestId::default().as_str(), "");
    }

    #[test]
    fn spellings() {
        assert!(valid("123e4567-e89b-12d3-a456-426614174000"));
        assert!(valid("urn:uuid:123e4567-e89b-12d3-a456-426614174000"));
        assert!(valid("{123e4567-e89b-12d3-a456-426614174000}"));
        assert!(valid("123e4567e89b12d3a456426614174000"));
        assert!(!valid("not-a-uuid"));
        assert!(!valid("123e4567-e89b-12d3-a456-42661417400g"));
        assert!(!valid(""));
    }

    proptest! {
        #[test]
        fn v4_is_valid_and_versioned(b in any::<[u8; 16]>()) {
            let id = RequestId::v4(b);
            let u = id.as_bytes();
            prop_assert!(valid(id.as_str()));
            prop_assert_eq!(u.len(), 36);
            prop_assert_eq!(u[14], b'4');
            prop_assert!(matches!(u[19], b'8' | b'9' | b'a' | b'b'));
            // The random bytes, in order, around the fixed version bits.
            let hex: String = id.as_str().chars().filter(|c| *c != '-').collect();
            let mut want = b;
            want[6] = (want[6] & 0x0f) | 0x40;
            want[8] = (want[8] & 0x3f) | 0x80;
            let expect: String = want.iter().map(|x| format!("{x:02x}")).collect();
            prop_assert_eq!(hex, expect);
            prop_assert_eq!(RequestId::parse(id.as_str()), Some(id));
        }

        #[test]
        fn never_panics(s in ".{0,60}") {
            let _ = valid(&s);
            if let Some(id) = RequestId::parse(&s) {
                prop_assert_eq!(id.as_str(), s.as_str());
            }
        }
    }
}
