//! The shard-steering preamble an agent sends before the libp2p handshake
//! (in the spirit of the PROXY protocol): `HVNP` magic, one version byte,
//! a big-endian u16 length and the model name in UTF-8.
//!
//! Bounded: at most [`MAX_PREAMBLE_MODEL`] bytes of model name.

/// Magic bytes opening a preamble.
pub const MAGIC: &[u8; 4] = b"HVNP";
/// Preamble format version.
pub const VERSION: u8 = 1;
/// Longest model name accepted in a preamble.
pub const MAX_PREAMBLE_MODEL: usize = 256;
/// Fixed header size (magic + version + length).
pub const HEADER_LEN: usize = 7;

/// Why a preamble was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PreambleError {
    /// Not our magic or version: garbage.
    Garbage,
    /// Declared length over the bound.
    TooLong(usize),
    /// Model name not UTF-8 or empty.
    BadModel,
}

impl PreambleError {
    /// A short stable name of the reason (log rate limiting, metrics).
    pub fn kind(&self) -> &'static str {
        match self {
            PreambleError::Garbage => "preamble_garbage",
            PreambleError::TooLong(_) => "preamble_too_long",
            PreambleError::BadModel => "preamble_bad_model",
        }
    }
}

impl std::fmt::Display for PreambleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PreambleError::Garbage => write!(f, "garbage preamble (bad magic or version)"),
            PreambleError::TooLong(n) => write!(
                f,
                "preamble model name of {n} bytes exceeds {MAX_PREAMBLE_MODEL}"
            ),
            PreambleError::BadModel => write!(f, "preamble model name empty or not UTF-8"),
        }
    }
}

/// Encode a preamble for `model`.
pub fn encode(model: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + model.len());
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    let len = u16::try_from(model.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(model.as_bytes());
    out
}

/// Decode from the start of `buf`: `Ok(None)` when more bytes are needed,
/// `Ok(Some((model, used)))` when complete.
pub fn decode(buf: &[u8]) -> Result<Option<(String, usize)>, PreambleError> {
    let have = buf.len().min(MAGIC.len());
    if buf.get(..have) != MAGIC.get(..have) {
        return Err(PreambleError::Garbage);
    }
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    if buf.get(4) != Some(&VERSION) {
        return Err(PreambleError::Garbage);
    }
    let len = match (buf.get(5), buf.get(6)) {
        (Some(a), Some(b)) => u16::from_be_bytes([*a, *b]) as usize,
        _ => return Ok(None),
    };
    if len > MAX_PREAMBLE_MODEL {
        return Err(PreambleError::TooLong(len));
    }
    if len == 0 {
        return Err(PreambleError::BadModel);
    }
    let Some(name) = buf.get(HEADER_LEN..HEADER_LEN + len) else {
        return Ok(None);
    };
    let model = std::str::from_utf8(name).map_err(|_| PreambleError::BadModel)?;
    Ok(Some((model.to_string(), HEADER_LEN + len)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rejects() {
        assert_eq!(decode(b"GET / HTTP/1.1"), Err(PreambleError::Garbage));
        assert_eq!(decode(b"HVNP\x02\x00\x01a"), Err(PreambleError::Garbage));
        assert_eq!(
            decode(b"HVNP\x01\x10\x00"),
            Err(PreambleError::TooLong(4096))
        );
        assert_eq!(decode(b"HVNP\x01\x00\x00"), Err(PreambleError::BadModel));
        assert_eq!(
            decode(b"HVNP\x01\x00\x02\xff\xfe"),
            Err(PreambleError::BadModel)
        );
        assert_eq!(decode(b"HV"), Ok(None));
    }

    proptest! {
        #[test]
        fn round_trip_any_split(model in "[a-zA-Z0-9/._:-]{1,200}", extra in proptest::collection::vec(any::<u8>(), 0..20), cut in 0usize..300) {
            let mut enc = encode(&model);
            let total = enc.len();
            enc.extend_from_slice(&extra);
            let cut = cut.min(enc.len());
            match decode(&enc[..cut]) {
                Ok(None) => prop_assert!(cut < total),
                Ok(Some((m, n))) => { prop_assert_eq!(m, model.clone()); prop_assert_eq!(n, total); }
                Err(e) => prop_assert!(false, "{e}"),
            }
            prop_assert_eq!(decode(&enc).expect("ok").expect("complete").0, model);
        }

        #[test]
        fn never_panics(b in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = decode(&b);
        }
    }
}
