//! The chunked transfer coding (RFC 9112 §7.1), decoded incrementally
//! under limits: [`ChunkedDecoder`] and its [`ChunkError`].

/// Incremental `Transfer-Encoding: chunked` decoder.
///
/// Feed it bytes with [`ChunkedDecoder::decode`]; it appends payload to
/// `out` and reports how many input bytes it consumed. Trailers are read
/// and dropped.
#[derive(Debug, Clone, Default)]
pub struct ChunkedDecoder {
    state: ChunkState,
    /// Bytes of payload produced so far.
    pub total: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum ChunkState {
    /// Reading the hex size line.
    #[default]
    Size,
    /// Reading `n` payload bytes.
    Data(u64),
    /// Expecting CRLF after payload.
    DataEnd,
    /// Reading trailer lines until an empty one.
    Trailer,
    /// Done.
    Done,
}

/// Why a chunked body was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkError {
    /// Malformed framing.
    Bad,
    /// Payload over the limit.
    TooLarge,
}

impl std::fmt::Display for ChunkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChunkError::Bad => f.write_str("malformed chunked framing"),
            ChunkError::TooLarge => f.write_str("chunked body over the limit"),
        }
    }
}

/// Longest chunk-size line (with extensions) accepted.
const MAX_CHUNK_LINE: usize = 4096;

impl ChunkedDecoder {
    /// A fresh decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the terminating chunk and trailers were read.
    pub fn is_done(&self) -> bool {
        self.state == ChunkState::Done
    }

    /// Decode from `input`, appending payload to `out`; `limit` caps the
    /// total payload (0 = unlimited). Returns the bytes of `input` consumed.
    pub fn decode(
        &mut self,
        input: &[u8],
        out: &mut Vec<u8>,
        limit: u64,
    ) -> Result<usize, ChunkError> {
        let mut pos = 0usize;
        loop {
            let rest = input.get(pos..).unwrap_or(&[]);
            match self.state {
                ChunkState::Done => return Ok(pos),
                ChunkState::Size => {
                    let Some(nl) = rest.windows(2).position(|w| w == b"\r\n") else {
                        // No CRLF yet: a LF, or a CR before the last byte, is bare.
                        if rest.len() > MAX_CHUNK_LINE || has_bare_line_end(rest) {
                            return Err(ChunkError::Bad);
                        }
                        return Ok(pos);
                    };
                    let line = rest.get(..nl).unwrap_or(&[]);
                    let n = chunk_size(line)?;
                    pos += nl + 2;
                    if n == 0 {
                        self.state = ChunkState::Trailer;
                    } else {
                        if limit > 0 && self.total.saturating_add(n) > limit {
                            return Err(ChunkError::TooLarge);
                        }
                        self.state = ChunkState::Data(n);
                    }
                }
                ChunkState::Data(n) => {
                    if rest.is_empty() {
                        return Ok(pos);
                    }
                    let take = (rest.len() as u64).min(n) as usize;
                    out.extend_from_slice(rest.get(..take).unwrap_or(&[]));
                    self.total += take as u64;
                    pos += take;
                    let left = n - take as u64;
                    self.state = if left == 0 {
                        ChunkState::DataEnd
                    } else {
                        ChunkState::Data(left)
                    };
                }
                ChunkState::DataEnd => {
                    if rest.len() < 2 {
                        return Ok(pos);
                    }
                    if rest.get(..2) != Some(b"\r\n".as_slice()) {
                        return Err(ChunkError::Bad);
                    }
                    pos += 2;
                    self.state = ChunkState::Size;
                }
                ChunkState::Trailer => {
                    let Some(nl) = rest.windows(2).position(|w| w == b"\r\n") else {
                        if rest.len() > MAX_CHUNK_LINE || has_bare_line_end(rest) {
                            return Err(ChunkError::Bad);
                        }
                        return Ok(pos);
                    };
                    let line = rest.get(..nl).unwrap_or(&[]);
                    if line.iter().any(|b| *b == b'\r' || *b == b'\n') {
                        return Err(ChunkError::Bad);
                    }
                    pos += nl + 2;
                    if nl == 0 {
                        self.state = ChunkState::Done;
                    }
                }
            }
        }
    }
}

/// The size of a chunk-size line (CRLF excluded), RFC 9112 §7.1:
/// `1*HEXDIG *( BWS ";" BWS ext-name [ BWS "=" BWS ext-value ] )`, no
/// leading whitespace, no control characters but HTAB, no bare CR or LF.
fn chunk_size(line: &[u8]) -> Result<u64, ChunkError> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 || digits > 15 {
        return Err(ChunkError::Bad);
    }
    let ext = line.get(digits..).unwrap_or(&[]);
    let ext_ok = ext.is_empty()
        || (ext
            .iter()
            .all(|b| *b == b'\t' || (*b >= 0x20 && *b != 0x7f))
            && ext
                .iter()
                .find(|b| **b != b' ' && **b != b'\t')
                .is_some_and(|b| *b == b';'));
    if !ext_ok {
        return Err(ChunkError::Bad);
    }
    let s = std::str::from_utf8(line.get(..digits).unwrap_or(&[])).map_err(|_| ChunkError::Bad)?;
    u64::from_str_radix(s, 16).map_err(|_| ChunkError::Bad)
}

/// An LF not preceded by CR, or a CR not followed by LF (a CR as the last
/// byte may still get its LF).
pub(crate) fn has_bare_line_end(b: &[u8]) -> bool {
    b.iter().enumerate().any(|(i, c)| match c {
        b'\n' => i == 0 || b.get(i - 1) != Some(&b'\r'),
        b'\r' => matches!(b.get(i + 1), Some(n) if *n != b'\n'),
        _ => false,
    })
}
