//! A short string kept inline: request targets (`/v1/chat/completions`,
//! `/v1/messages?beta=true`) fit, so parsing a head and copying its path
//! cost no heap allocation (a `String` each cost one per request on the
//! router and on the agent). Longer ones spill to the heap.

use std::fmt;
use std::ops::Deref;

use smallvec::SmallVec;

/// Bytes kept without an allocation (a size smallvec supports without
/// its `const_generics` feature, which `--no-default-features` builds of
/// this crate do not get).
pub const INLINE_BYTES: usize = 64;

/// An owned UTF-8 string, inline up to [`INLINE_BYTES`].
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct InlineStr(SmallVec<[u8; INLINE_BYTES]>);

impl InlineStr {
    /// The text. Only ever built from `&str`, so the check cannot fail;
    /// it is kept rather than an `unsafe` unchecked view (a few bytes).
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).unwrap_or("")
    }

    /// Append text.
    pub fn push_str(&mut self, s: &str) {
        self.0.extend_from_slice(s.as_bytes());
    }

    /// Kept inline (no heap allocation).
    pub fn is_inline(&self) -> bool {
        !self.0.spilled()
    }
}

impl From<&str> for InlineStr {
    fn from(s: &str) -> Self {
        InlineStr(SmallVec::from_slice(s.as_bytes()))
    }
}

impl Deref for InlineStr {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for InlineStr {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Display for InlineStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for InlineStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl PartialEq<str> for InlineStr {
    fn eq(&self, o: &str) -> bool {
        self.0.as_slice() == o.as_bytes()
    }
}

impl PartialEq<String> for InlineStr {
    fn eq(&self, o: &String) -> bool {
        self.0.as_slice() == o.as_bytes()
    }
}

impl PartialEq<&str> for InlineStr {
    fn eq(&self, o: &&str) -> bool {
        self.0.as_slice() == o.as_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn common_targets_stay_inline_and_long_ones_spill() {
        for t in ["/v1/chat/completions", "/v1/messages?beta=true", "/"] {
            let s = InlineStr::from(t);
            assert!(s.is_inline(), "{t}");
            assert_eq!(s, t);
        }
        let long = "/v1/".to_string() + &"x".repeat(INLINE_BYTES);
        let s = InlineStr::from(long.as_str());
        assert!(!s.is_inline());
        assert_eq!(s.as_str(), long);
    }

    proptest! {
        #[test]
        fn any_text_round_trips(a in ".{0,80}", b in ".{0,80}") {
            let mut s = InlineStr::from(a.as_str());
            s.push_str(&b);
            let joined = format!("{a}{b}");
            prop_assert_eq!(s.as_str(), joined.as_str());
            prop_assert_eq!(format!("{s}"), joined.clone());
            prop_assert_eq!(format!("{s:?}"), format!("{joined:?}"));
            prop_assert_eq!(s.len(), joined.len());
        }
    }
}
