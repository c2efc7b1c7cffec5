//! Strict HTTP/1.1 parsing on `httparse`, in two steps: check a complete
//! head is present (`Ok(None)` while incomplete), then parse it.
//!
//! Key types: [`RequestHead`], [`ResponseHead`], [`ChunkedDecoder`],
//! [`HeadError`]. Framing rules (ARCHITECTURE.md "HTTP/1.1"): reject both
//! Content-Length and Transfer-Encoding, any Transfer-Encoding other than
//! exactly `chunked`, duplicate or malformed Content-Length, obsolete line
//! folding, and heads over [`MAX_HEAD_BYTES`] or [`MAX_HEADERS`] (431).
//! Line ends are CRLF only: a bare LF or CR in a head, a chunk-size line or
//! a trailer is refused (a parser that accepted them would disagree with
//! the CRLFCRLF delimiting about where a message ends). HTTP/1.1 requests
//! need exactly one Host; an absolute-form target becomes origin-form.

use smallvec::SmallVec;

use super::inline_str::InlineStr;

/// Largest accepted header section, request line included.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Largest accepted number of header fields from a client.
pub const MAX_HEADERS: usize = 100;
/// Headers the router may add when it forwards a request (`X-Request-ID`),
/// so the agent, parsing what the router wrote, allows this many more.
pub const ROUTER_ADDED_HEADERS: usize = 4;

/// Why a head was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeadError {
    /// Malformed or ambiguous framing: answer 400 and close.
    Bad(&'static str),
    /// Head too large or too many headers: answer 431 and close.
    TooLarge(&'static str),
}

impl std::fmt::Display for HeadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeadError::Bad(why) => write!(f, "bad head: {why}"),
            HeadError::TooLarge(why) => write!(f, "head too large: {why}"),
        }
    }
}

/// How the message body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    /// No body.
    None,
    /// Exactly this many bytes.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Until the peer closes (responses only).
    UntilClose,
}

/// The header fields of one head, names as sent and values as bytes, all
/// in one buffer: one allocation per head instead of two per field (the
/// owned `(String, Vec<u8>)` pairs cost a proxied request ~30 allocations
/// across router and agent). The field table lives inline up to
/// [`INLINE_FIELDS`] fields.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers {
    /// Every field's name then value, back to back.
    raw: Vec<u8>,
    /// Per field: start of the name, end of the name (= start of the
    /// value), end of the value; offsets into `raw`.
    fields: SmallVec<[[u32; 3]; INLINE_FIELDS]>,
}

/// Fields kept in a [`Headers`] without a second allocation (requests
/// and responses of the API clients and engines seen carry 5-15).
pub const INLINE_FIELDS: usize = 16;

impl Headers {
    /// Room for `fields` fields of `bytes` bytes together.
    pub fn with_capacity(fields: usize, bytes: usize) -> Self {
        Headers {
            raw: Vec::with_capacity(bytes),
            fields: SmallVec::with_capacity(fields),
        }
    }

    /// Headers from pairs (tests, simulators).
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Self {
        let mut h = Headers::default();
        for (n, v) in pairs {
            h.push(n, v);
        }
        h
    }

    /// Append a field. A head never nears 4 GiB (the parsers cap it at
    /// 64 KiB); offsets saturate rather than wrap if one ever did.
    pub fn push(&mut self, name: &str, value: &[u8]) {
        let off = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        let start = off(self.raw.len());
        self.raw.extend_from_slice(name.as_bytes());
        let split = off(self.raw.len());
        self.raw.extend_from_slice(value);
        self.fields.push([start, split, off(self.raw.len())]);
    }

    /// Number of fields.
    pub fn len(&self) -> usize {
        self.fields.len()
    }

    /// No fields.
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }

    /// A field's name and value bytes.
    fn raw_field(&self, f: &[u32; 3]) -> (&[u8], &[u8]) {
        let [a, b, c] = f.map(|x| x as usize);
        (
            self.raw.get(a..b).unwrap_or(&[]),
            self.raw.get(b..c).unwrap_or(&[]),
        )
    }

    fn field(&self, f: &[u32; 3]) -> (&str, &[u8]) {
        let (name, value) = self.raw_field(f);
        // Names only ever come from `push(&str)`: valid UTF-8.
        (std::str::from_utf8(name).unwrap_or(""), value)
    }

    /// Every field in order, names as bytes: for the parsers' own checks,
    /// which compare names and need no UTF-8 check of each.
    fn iter_bytes(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.fields.iter().map(|f| self.raw_field(f))
    }

    /// Every field in order, as `(name, value)`.
    pub fn iter(&self) -> HeaderIter<'_> {
        HeaderIter {
            headers: self,
            next: 0,
        }
    }

    /// The value of `f` when its name is `name` (case-insensitive),
    /// compared as bytes: lookups run many times per request and need no
    /// UTF-8 check of every name they pass.
    fn value_if_named<'a>(&'a self, f: &[u32; 3], name: &str) -> Option<&'a [u8]> {
        let (n, value) = self.raw_field(f);
        n.eq_ignore_ascii_case(name.as_bytes()).then_some(value)
    }

    /// Values of the fields named `name`, in order.
    fn values_named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.fields
            .iter()
            .filter_map(move |f| self.value_if_named(f, name))
    }

    /// First value with this (case-insensitive) name.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.fields
            .iter()
            .find_map(|f| self.value_if_named(f, name))
    }

    /// Every value with this (case-insensitive) name, in order.
    pub fn get_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.values_named(name)
    }

    /// Headers built from httparse's parsed fields.
    fn from_parsed(parsed: &[httparse::Header<'_>]) -> Self {
        let bytes = parsed.iter().map(|h| h.name.len() + h.value.len()).sum();
        let mut h = Headers::with_capacity(parsed.len(), bytes);
        for f in parsed {
            h.push(f.name, f.value);
        }
        h
    }
}

/// The fields of a [`Headers`], in order.
pub struct HeaderIter<'a> {
    headers: &'a Headers,
    next: usize,
}

impl<'a> Iterator for HeaderIter<'a> {
    type Item = (&'a str, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let f = self.headers.fields.get(self.next)?;
        self.next += 1;
        Some(self.headers.field(f))
    }
}

impl<'a> IntoIterator for &'a Headers {
    type Item = (&'a str, &'a [u8]);
    type IntoIter = HeaderIter<'a>;

    fn into_iter(self) -> HeaderIter<'a> {
        self.iter()
    }
}

/// A parsed request head; header names are kept as sent, values as bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    /// Method, e.g. `POST` (the common ones without an allocation).
    pub method: std::borrow::Cow<'static, str>,
    /// Request target in origin form (inline: no allocation for the
    /// usual targets).
    pub path: InlineStr,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor_version: u8,
    /// All header fields in order.
    pub headers: Headers,
    /// Body framing.
    pub framing: BodyFraming,
    /// Whether the connection may be reused after this exchange.
    pub keep_alive: bool,
    /// `Expect: 100-continue` was sent.
    pub expect_continue: bool,
}

impl RequestHead {
    /// First header value with this (case-insensitive) name.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.get(name)
    }

    /// Every value of this (case-insensitive) header name, in order.
    pub fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.headers.get_all(name)
    }

    /// Path without the query string.
    pub fn path_only(&self) -> &str {
        match self.path.split_once('?') {
            Some((p, _)) => p,
            None => self.path.as_str(),
        }
    }
}

/// A parsed response head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    /// Status code.
    pub status: u16,
    /// All header fields in order.
    pub headers: Headers,
    /// Body framing.
    pub framing: BodyFraming,
}

impl ResponseHead {
    /// First header value with this (case-insensitive) name.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.get(name)
    }

    /// Whether the body is a server-sent event stream.
    pub fn is_event_stream(&self) -> bool {
        self.header("content-type")
            .map(|v| contains_ci(v, b"text/event-stream"))
            .unwrap_or(false)
    }
}

/// Case-insensitive substring test on bytes.
pub fn contains_ci(hay: &[u8], needle: &[u8]) -> bool {
    if needle.is_empty() {
        return true;
    }
    hay.windows(needle.len())
        .any(|w| w.eq_ignore_ascii_case(needle))
}

/// Position just past the blank line ending a head, if present.
/// What one pass over the start of a buffer found (see [`scan_head`]).
#[derive(Debug, PartialEq, Eq)]
struct HeadScan {
    /// Just past the blank line that ends the head.
    end: Option<usize>,
    /// A bare LF or CR before that end (or in all of it while incomplete).
    bare: bool,
    /// A line of the head starts with SP or HT (obsolete line folding).
    folded: bool,
}

/// One pass over the line ends only (memchr), instead of four byte by
/// byte scans of the head (its end, bare line ends, folding, then
/// httparse): they were 2.5 % of the agent's CPU per request.
fn scan_head(buf: &[u8]) -> HeadScan {
    let mut folded = false;
    for i in memchr::memchr2_iter(b'\r', b'\n', buf) {
        let next = buf.get(i + 1).copied();
        if buf.get(i) == Some(&b'\r') {
            // A CR must be followed by LF (a CR as the last byte may
            // still get its LF).
            if next.is_some_and(|n| n != b'\n') {
                return HeadScan {
                    end: None,
                    bare: true,
                    folded,
                };
            }
            continue;
        }
        if i == 0 || buf.get(i - 1) != Some(&b'\r') {
            return HeadScan {
                end: None,
                bare: true,
                folded,
            };
        }
        // A CRLF: the head ends at the second of two in a row.
        if i >= 3 && buf.get(i - 3..i - 1) == Some(b"\r\n") {
            return HeadScan {
                end: Some(i + 1),
                bare: false,
                folded,
            };
        }
        if matches!(next, Some(b' ' | b'\t')) {
            folded = true;
        }
    }
    HeadScan {
        end: None,
        bare: false,
        folded,
    }
}

/// The complete head at the start of `buf` (`None` while incomplete),
/// bounded by [`MAX_HEAD_BYTES`] whether complete or not; a bare LF or CR
/// in what is read so far is refused at once. With the head: whether a
/// line of it is folded.
fn complete_head(buf: &[u8]) -> Result<Option<(&[u8], bool)>, HeadError> {
    let scan = scan_head(buf);
    if scan.bare {
        return Err(HeadError::Bad(
            "bare LF or CR in the head (line ends must be CRLF)",
        ));
    }
    match scan.end {
        Some(end) if end <= MAX_HEAD_BYTES => Ok(buf.get(..end).map(|h| (h, scan.folded))),
        None if buf.len() <= MAX_HEAD_BYTES => Ok(None),
        _ => Err(HeadError::TooLarge("header section too large")),
    }
}

/// The method as a static string when it is a common one.
fn known_method(m: &str) -> std::borrow::Cow<'static, str> {
    const KNOWN: [&str; 7] = ["POST", "GET", "OPTIONS", "HEAD", "PUT", "DELETE", "PATCH"];
    match KNOWN.iter().find(|k| **k == m) {
        Some(k) => std::borrow::Cow::Borrowed(k),
        None => std::borrow::Cow::Owned(m.to_string()),
    }
}

/// A target in absolute form (`http://host/path`) as origin form (`/path`).
fn origin_form(target: &str) -> InlineStr {
    let scheme = |p: &str| {
        target
            .get(..p.len())
            .is_some_and(|t| t.eq_ignore_ascii_case(p))
    };
    let rest = if scheme("http://") {
        target.get(7..)
    } else if scheme("https://") {
        target.get(8..)
    } else {
        return InlineStr::from(target);
    };
    let rest = rest.unwrap_or("");
    match rest.find(['/', '?']) {
        Some(i) if rest.get(i..i + 1) == Some("/") => InlineStr::from(rest.get(i..).unwrap_or("/")),
        Some(i) => {
            let mut out = InlineStr::from("/");
            out.push_str(rest.get(i..).unwrap_or(""));
            out
        }
        None => InlineStr::from("/"),
    }
}

/// Obsolete line folding: a header line that starts with SP or HT (the
/// reference [`scan_head`] is checked against).
#[cfg(test)]
fn has_obs_fold(head: &[u8]) -> bool {
    head.windows(3).any(|w| {
        w.first() == Some(&b'\r')
            && w.get(1) == Some(&b'\n')
            && matches!(w.get(2), Some(b' ' | b'\t'))
    })
}

fn parse_content_length(v: &[u8]) -> Result<u64, HeadError> {
    let s = std::str::from_utf8(v).map_err(|_| HeadError::Bad("invalid Content-Length"))?;
    let s = s.trim_matches(|c| c == ' ' || c == '\t');
    if s.is_empty() || s.len() > 19 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(HeadError::Bad("invalid Content-Length"));
    }
    s.parse::<u64>()
        .map_err(|_| HeadError::Bad("invalid Content-Length"))
}

/// Shared framing checks for requests and responses.
fn framing_of(headers: &Headers) -> Result<Option<BodyFraming>, HeadError> {
    let mut cl: Option<u64> = None;
    let mut te_seen = false;
    for (name, value) in headers.iter_bytes() {
        if name.eq_ignore_ascii_case(b"content-length") {
            if cl.is_some() {
                return Err(HeadError::Bad("duplicate Content-Length"));
            }
            cl = Some(parse_content_length(value)?);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            if te_seen {
                return Err(HeadError::Bad("duplicate Transfer-Encoding"));
            }
            te_seen = true;
            let v = trim(value);
            if !v.eq_ignore_ascii_case(b"chunked") {
                return Err(HeadError::Bad("unsupported Transfer-Encoding"));
            }
        }
    }
    match (cl, te_seen) {
        (Some(_), true) => Err(HeadError::Bad("both Content-Length and Transfer-Encoding")),
        (Some(0), false) => Ok(Some(BodyFraming::None)),
        (Some(n), false) => Ok(Some(BodyFraming::Length(n))),
        (None, true) => Ok(Some(BodyFraming::Chunked)),
        (None, false) => Ok(None),
    }
}

fn trim(v: &[u8]) -> &[u8] {
    let start = v
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(v.len());
    let end = v
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map(|p| p + 1)
        .unwrap_or(start);
    v.get(start..end).unwrap_or(&[])
}

fn token_in(v: &[u8], token: &[u8]) -> bool {
    v.split(|b| *b == b',')
        .any(|t| trim(t).eq_ignore_ascii_case(token))
}

/// What a request-head parser returns: `Ok(None)` while incomplete, else
/// the head and the bytes it used.
pub type RequestParse = Result<Option<(RequestHead, usize)>, HeadError>;

/// Parse a request head from the start of `buf`.
///
/// `Ok(None)`: incomplete, read more. `Ok(Some((head, n)))`: the head used
/// the first `n` bytes.
pub fn parse_request_head(buf: &[u8]) -> Result<Option<(RequestHead, usize)>, HeadError> {
    parse_request_head_within(buf, MAX_HEADERS)
}

/// [`parse_request_head`] for a request the router forwarded (the agent's
/// side): the router's own headers come on top of the client's limit.
pub fn parse_forwarded_request_head(buf: &[u8]) -> Result<Option<(RequestHead, usize)>, HeadError> {
    parse_request_head_within(buf, MAX_HEADERS + ROUTER_ADDED_HEADERS)
}

fn parse_request_head_within(
    buf: &[u8],
    max_headers: usize,
) -> Result<Option<(RequestHead, usize)>, HeadError> {
    let Some((head_bytes, folded)) = complete_head(buf)? else {
        return Ok(None);
    };
    let end = head_bytes.len();
    if folded {
        return Err(HeadError::Bad("obsolete line folding"));
    }
    let mut storage = [httparse::EMPTY_HEADER; MAX_HEADERS + ROUTER_ADDED_HEADERS];
    let mut req = httparse::Request::new(&mut storage);
    match req.parse(head_bytes) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(HeadError::Bad("malformed request head")),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(HeadError::TooLarge("too many header fields"))
        }
        Err(_) => return Err(HeadError::Bad("malformed request head")),
    }
    if req.headers.len() > max_headers {
        return Err(HeadError::TooLarge("too many header fields"));
    }
    let method = known_method(req.method.unwrap_or(""));
    let path = origin_form(req.path.unwrap_or(""));
    let minor_version = req.version.unwrap_or(1);
    let headers = Headers::from_parsed(req.headers);
    let hosts = headers.get_all("host").count();
    if hosts > 1 {
        return Err(HeadError::Bad("more than one Host header"));
    }
    if hosts == 0 && minor_version >= 1 {
        return Err(HeadError::Bad("HTTP/1.1 request without a Host header"));
    }
    let framing = framing_of(&headers)?.unwrap_or(BodyFraming::None);
    let conn = headers.get("connection");
    let keep_alive = match (minor_version, conn) {
        (_, Some(v)) if token_in(v, b"close") => false,
        (0, Some(v)) => token_in(v, b"keep-alive"),
        (0, None) => false,
        _ => true,
    };
    let expect_continue = headers
        .get_all("expect")
        .any(|v| trim(v).eq_ignore_ascii_case(b"100-continue"));
    Ok(Some((
        RequestHead {
            method,
            path,
            minor_version,
            headers,
            framing,
            keep_alive,
            expect_continue,
        },
        end,
    )))
}

/// Parse a response head (agent link and backend client side).
///
/// 1xx, 204 and 304 statuses mean no body (the router never sends HEAD
/// to an agent, so a HEAD request's bodiless answer cannot occur here).
pub fn parse_response_head(buf: &[u8]) -> Result<Option<(ResponseHead, usize)>, HeadError> {
    let Some((head_bytes, _)) = complete_head(buf)? else {
        return Ok(None);
    };
    let end = head_bytes.len();
    // Room for the framing headers each hop rewrites: the limit counts the
    // end-to-end ones, so a head that passed one hop passes the next.
    let mut storage = [httparse::EMPTY_HEADER; MAX_HEADERS + 2 * ROUTER_ADDED_HEADERS];
    let mut resp = httparse::Response::new(&mut storage);
    match resp.parse(head_bytes) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(HeadError::Bad("malformed response head")),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(HeadError::TooLarge("too many header fields"))
        }
        Err(_) => return Err(HeadError::Bad("malformed response head")),
    }
    let end_to_end = resp
        .headers
        .iter()
        .filter(|h| !super::http_write::is_hop_header(h.name))
        .count();
    if end_to_end > MAX_HEADERS + ROUTER_ADDED_HEADERS {
        return Err(HeadError::TooLarge("too many header fields"));
    }
    let status = resp.code.unwrap_or(0);
    // Three digits 100-599 (httparse reads "020" as 20, which the writer
    // could not put back on a status line).
    if !(100..=599).contains(&status) {
        return Err(HeadError::Bad("invalid status code"));
    }
    let headers = Headers::from_parsed(resp.headers);
    let framing = if (100..200).contains(&status) || status == 204 || status == 304 {
        BodyFraming::None
    } else {
        framing_of(&headers)?.unwrap_or(BodyFraming::UntilClose)
    };
    Ok(Some((
        ResponseHead {
            status,
            headers,
            framing,
        },
        end,
    )))
}

pub use super::chunked::{ChunkError, ChunkedDecoder};

#[cfg(test)]
mod tests;
